"""Tests of tools/bench_offload.py: cases on a tiny OPT half on disk, record fields, the table."""

import json
import math

import pytest

from conftest import run_tool_cli
from flexjax.config import ModelConfig
from flexjax.policy import Policy
from tools import bench_offload

CASES = ('block', 'row_by_row', 'no_overlap')
FIELDS = (
    'tool', 'case', 'model', 'policy', 'policy_fields', 'page_cache', 'compute_dtype',
    'weight_storage_dtype', 'num_prompts', 'prompt_len', 'gen_len', 'measured_gen_len',
    'projected', 'prefill_s', 'decode_s', 'prefill_tok_s', 'decode_tok_s', 'total_tok_s',
    'peak_bytes', 'planned_peak_bytes', 'weight_loads_per_stage', 'budgets', 'commit', 'machine',
    'versions', 'timestamp', 'run_id')
PROMPT_LEN, GEN_LEN, PROJECTED_GEN_LEN = 8, 4, 2


@pytest.fixture(scope='module')
def tiny():
  return ModelConfig(name='tiny', num_layers=2, hidden_size=64, num_heads=4, ffn_dim=128,
                     vocab_size=1000, max_positions=128)


@pytest.fixture(scope='module')
def base():
  return Policy(gpu_batch_size=2, num_gpu_batches=2, w_gpu_percent=0, w_cpu_percent=50)


@pytest.fixture(scope='module', params=[None, PROJECTED_GEN_LEN], ids=['measured', 'projected'])
def run(request, tiny, base, tmp_path_factory):
  """Every case, measured in both page-cache modes and projected in the warm one (the projection
  does not depend on the mode); returns (records, projected_gen_len, offload_dir)."""
  offload_dir = tmp_path_factory.mktemp('offload')
  context = bench_offload.run_context()
  records = [bench_offload.run_case(tiny, base, case=case, page_cache=mode,
                                    prompt_len=PROMPT_LEN, gen_len=GEN_LEN,
                                    projected_gen_len=request.param, offload_dir=str(offload_dir),
                                    context=context)
             for mode in _modes(request.param) for case in CASES]
  return records, request.param, offload_dir


def _modes(projected_gen_len: int | None) -> tuple[str, ...]:
  return ('warm',) if projected_gen_len else ('warm', 'dropped')


def test_records_have_every_field_and_finite_rates(run, base):
  records, projected_gen_len, _ = run
  assert [(r['page_cache'], r['case']) for r in records] == [
      (mode, case) for mode in _modes(projected_gen_len) for case in CASES]
  for r in records:
    missing = [f for f in FIELDS if f not in r]
    assert not missing, missing
    assert r['projected'] is (projected_gen_len is not None)
    assert r['measured_gen_len'] == (projected_gen_len or GEN_LEN)
    assert (r['num_prompts'], r['prompt_len'], r['gen_len']) == (4, PROMPT_LEN, GEN_LEN)
    for field in ('prefill_s', 'decode_s', 'prefill_tok_s', 'decode_tok_s', 'total_tok_s'):
      assert math.isfinite(r[field]) and r[field] > 0, (r['case'], field, r[field])
    assert r['total_tok_s'] == pytest.approx(4 * GEN_LEN / (r['prefill_s'] + r['decode_s']))
    assert r['decode_s'] == pytest.approx(
        r['measured_decode_s'] * (GEN_LEN - 1) / (r['measured_gen_len'] - 1))
    assert r['peak_bytes']['disk'] > 0  # half the weights live on disk
    # the decode's disk stream, and the weight files' own O_DIRECT read rate beside it
    assert r['disk_weight_bytes']['decode'] > 0 and r['weight_files_read_bw'] > 0
    json.dumps(r)
  by_case = {r['case']: r for r in records if r['page_cache'] == 'warm'}
  assert by_case['block']['policy_fields']['num_gpu_batches'] == base.num_gpu_batches
  assert by_case['row_by_row']['policy_fields']['num_gpu_batches'] == 1
  assert by_case['no_overlap']['policy_fields']['overlap'] is False


def test_weights_load_once_per_block_and_token(run, base):
  records, projected_gen_len, _ = run
  measured = projected_gen_len or GEN_LEN
  for r in records:
    expected = measured * (base.num_gpu_batches if r['case'] == 'row_by_row' else 1)
    assert r['weight_loads_per_stage'] == expected, r['case']


def test_offload_dir_is_empty_afterwards(run):
  _, _, offload_dir = run
  assert list(offload_dir.iterdir()) == []


def test_render_has_a_row_per_case_and_the_ratio_to_block(run):
  records, projected_gen_len, _ = run
  lines = bench_offload.render_offload_table(records).splitlines()
  header = [c.strip() for c in lines[0].strip('|').split('|')]
  assert header[-1] == 'vs block'
  rows = [[c.strip() for c in line.strip('|').split('|')] for line in lines[2:]]
  assert [(row[4], row[5]) for row in rows] == [(r['page_cache'], r['case']) for r in records]
  for row, r in zip(rows, records):
    block = next(b for b in records if b['case'] == 'block' and b['page_cache'] == r['page_cache'])
    assert row[-1] == f'{r["total_tok_s"] / block["total_tok_s"]:.2f}x'
    assert ('projected from' in row[3]) is (projected_gen_len is not None)


def test_render_without_a_block_case_shows_a_dash(run):
  records, _, _ = run
  row = bench_offload.render_offload_table(records[1:2]).splitlines()[2]
  assert row.rstrip(' |').endswith('—')


def test_case_policies_and_unknown_case(base):
  assert bench_offload.case_policy(base, 'block') == base
  assert bench_offload.case_policy(base, 'cpu_attention').cpu_attention is True
  with pytest.raises(bench_offload.FlexjaxError, match="case='fast'"):
    bench_offload.case_policy(base, 'fast')


def _cli(argv, capsys):
  return run_tool_cli(bench_offload, argv, capsys)


@pytest.mark.parametrize('argv, message', [
    (['--gpu_mem=0.001'], '--gpu_mem allows'),
    (['--projected_gen_len=8'], 'projected_gen_len=8'),
    (['--cases=block,fast'], "case='fast'"),
    (['--page_cache=cold'], "'cold'"),
])
def test_cli_errors_are_one_line_with_status_2(argv, message, capsys, tmp_path):
  status, out = _cli(['--model=opt-125m', '--gen_len=8', f'--output={tmp_path / "o.jsonl"}',
                      f'--offload_dir={tmp_path}'] + argv, capsys)
  assert status == 2
  assert out.err.startswith('bench_offload: error: ') and out.err.count('\n') == 1
  assert message in out.err
