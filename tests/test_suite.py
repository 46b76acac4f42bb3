"""tools/suite.py: suite files, tiny cases end to end, records, tables, the plot."""

import json
import math
from pathlib import Path

import pytest

from conftest import run_tool_cli
from flexjax.errors import FlexjaxError
from tools import suite

TINY = {'name': 'tiny', 'num_layers': 2, 'hidden_size': 64, 'num_heads': 4, 'ffn_dim': 128,
        'vocab_size': 1000, 'max_positions': 128}
FIELDS = ('tool', 'suite', 'case', 'system', 'system_version', 'model', 'label', 'budget',
          'tables', 'prompt_len', 'gen_len', 'measured_gen_len', 'projected', 'page_cache',
          'num_prompts', 'policy', 'policy_fields', 'budgets', 'prefill_s', 'decode_s',
          'measured_decode_s', 'prefill_tok_s', 'decode_tok_s', 'total_tok_s', 'latency_s',
          'peak_bytes', 'planned_peak_bytes', 'host_peak_rss_bytes', 'breakdown', 'predicted',
          'disk_weight_bytes',
          'status', 'commit', 'machine', 'versions', 'run_id', 'timestamp', 'spec')
HAND = {'gpu_batch_size': 2, 'num_gpu_batches': 2, 'w_gpu_percent': 0, 'w_cpu_percent': 50,
        'cache_gpu_percent': 50, 'cache_cpu_percent': 50, 'act_gpu_percent': 100,
        'act_cpu_percent': 0}


def write_suite(tmp_path, cases, **defaults):
  path = tmp_path / 'suite.json'
  path.write_text(json.dumps({'name': 'test', 'defaults': {
      'model': TINY, 'prompt_len': 8, 'gen_len': 4, 'page_cache': 'warm', **defaults},
      'cases': cases}))
  return str(path)


def case(**kw):
  name = kw.pop('name', 'c')
  return suite.check_case({**suite.DEFAULTS, 'model': TINY, 'prompt_len': 8, 'gen_len': 4,
                           'page_cache': 'warm', 'name': name, **kw})


@pytest.fixture(scope='module')
def context():
  return {'suite': 'test', 'commit': 'abc', 'machine': {}, 'versions': {}, 'run_id': 'r1'}


# ---- suite files ---------------------------------------------------------------------------------
def test_load_suite_applies_defaults_then_case_keys(tmp_path):
  path = write_suite(tmp_path, [{'name': 'a', 'system': 'flexjax', 'policy': HAND},
                                {'name': 'b', 'system': 'accelerate', 'batch_size': 3,
                                 'gen_len': 6}], cpu_mem=1)
  name, cases = suite.load_suite(path)
  assert name == 'test'
  assert [c['name'] for c in cases] == ['a', 'b']
  assert cases[0]['cpu_mem'] == 1 and cases[0]['gen_len'] == 4 and cases[0]['policy'] == HAND
  assert cases[1]['gen_len'] == 6 and cases[1]['batch_size'] == 3
  assert 'policy' not in cases[1] and 'batch_size' not in cases[0]  # other systems' keys dropped


@pytest.mark.parametrize('bad, message', [
    ({'name': 'x', 'system': 'vllm'}, "system='vllm'"),
    ({'name': 'x', 'system': 'flexjax', 'batch_size': 4}, "unknown keys ['batch_size']"),
    ({'name': 'x', 'system': 'flexjax', 'model': 'opt-7b'}, 'opt-7b'),
    ({'name': 'x', 'system': 'flexjax', 'tables': ['table9']}, "['table9']"),
    ({'name': 'x', 'system': 'flexjax', 'page_cache': 'cold'}, "page_cache='cold'"),
    ({'name': 'x', 'system': 'flexjax', 'policy': {'gpu_batch': 2}}, "['gpu_batch']"),
    ({'name': 'x', 'system': 'flexjax', 'policy': 'fast'}, "policy='fast'"),
    ({'name': 'x', 'system': 'flexgen', 'policy': 'auto'}, 'from:'),
    ({'system': 'flexjax'}, 'no "name"'),
])
def test_bad_cases_get_one_line_errors_naming_the_value(tmp_path, bad, message):
  with pytest.raises(FlexjaxError, match=None) as e:
    suite.load_suite(write_suite(tmp_path, [bad]))
  assert message in str(e.value) and '\n' not in str(e.value)


def test_repeated_names_and_bad_files_are_refused(tmp_path):
  with pytest.raises(FlexjaxError, match='repeat'):
    suite.load_suite(write_suite(tmp_path, [{'name': 'a', 'system': 'flexjax'}] * 2))
  with pytest.raises(FlexjaxError, match='does not exist'):
    suite.load_suite(str(tmp_path / 'missing.json'))
  (tmp_path / 'broken.json').write_text('{"cases": [')
  with pytest.raises(FlexjaxError, match='not valid JSON'):
    suite.load_suite(str(tmp_path / 'broken.json'))


def test_output_files_that_cannot_be_written_are_refused_as_flags_are_parsed(tmp_path):
  import subprocess
  import sys
  from pathlib import Path
  from absl import flags
  from tools import benchlib
  blocker = tmp_path / 'file'
  blocker.write_text('')
  for value, says in ((tmp_path, 'a folder; give a file'),
                      (blocker / 'r.jsonl', "its folder '.*' is a file"),
                      (blocker / 'sub' / 'r.jsonl', "its folder '.*' cannot be written")):
    with pytest.raises(flags.ValidationError, match=says):
      benchlib.writable_file(str(value))
  assert benchlib.writable_file(str(tmp_path / 'new' / 'r.jsonl')) and benchlib.writable_file(None)
  assert sorted(p.name for p in tmp_path.iterdir()) == ['file']  # the check made nothing
  # the suite's command line: refused before it measures the machine or runs a case
  proc = subprocess.run([sys.executable, '-m', 'tools.suite', '--suite=configs/bench/cpu.json',
                         '--only=frontier-flexjax-4', f'--output={blocker / "r.jsonl"}'],
                        capture_output=True, text=True, timeout=60,
                        cwd=Path(__file__).resolve().parent.parent)
  assert proc.returncode != 0 and 'is a file; give a folder' in proc.stderr and not proc.stdout
  # an output naming another flag's file (the suite's own, the results a plot reads): one line,
  # the file as it was
  results = tmp_path / 'results.jsonl'
  results.write_text('{}\n')
  suite_file = Path(__file__).resolve().parent.parent / 'configs' / 'bench' / 'cpu.json'
  shipped = suite_file.read_bytes()
  for args, says in ((['--suite=configs/bench/cpu.json', '--output=configs/bench/cpu.json'],
                      'flag --output=configs/bench/cpu.json: names the file --suite gives'),
                     ([f'--plot={results}', f'--plot_output={tmp_path / "." / "results.jsonl"}'],
                      'names the file --plot gives; the tool would write over it')):
    proc = subprocess.run([sys.executable, '-m', 'tools.suite', *args], capture_output=True,
                          text=True, timeout=60, cwd=Path(__file__).resolve().parent.parent)
    assert proc.returncode == 2 and proc.stderr.count('\n') == 1 and says in proc.stderr, (
        proc.stderr)
  assert results.read_text() == '{}\n' and suite_file.read_bytes() == shipped


def test_a_results_files_errors_name_the_flag_that_gave_it(tmp_path, capsys):
  """--plot's missing file and --output's broken earlier results are refused in one line that
  names the flag given, before any case runs."""
  broken = tmp_path / 'broken.jsonl'
  broken.write_text('{"case": 1}\nnot json\n')
  suite_file = Path(__file__).resolve().parent.parent / 'configs' / 'bench' / 'cpu.json'
  for argv, says in (
      ([f'--plot={tmp_path / "none.jsonl"}', f'--plot_output={tmp_path / "f.png"}'],
       f"--plot='{tmp_path / 'none.jsonl'}' does not exist"),
      ([f'--suite={suite_file}', '--only=frontier-flexjax-4', f'--output={broken}'],
       f"--output='{broken}' line 2 is not JSON")):
    status, text = run_tool_cli(suite, argv, capsys)
    assert status == 2 and text.err.count('\n') == 1 and says in text.err, text.err
  assert broken.read_text() == '{"case": 1}\nnot json\n'


def test_shipped_suites_load():
  from pathlib import Path
  files = sorted(Path(__file__).resolve().parent.parent.glob('configs/bench/*.json'))
  assert files
  for path in files:
    _, cases = suite.load_suite(str(path))
    assert cases


# ---- running cases -------------------------------------------------------------------------------
@pytest.fixture(scope='module')
def flexjax_records(context, tmp_path_factory):
  offload = str(tmp_path_factory.mktemp('offload'))
  runs = {}
  for projected in (None, 2):
    for overlap in (True, False):
      runs[projected, overlap] = suite.run_case(
          case(system='flexjax', policy={**HAND, 'overlap': overlap}, projected_gen_len=projected,
               offload_dir=offload, cpu_mem=1, tables=['peers'], budget='1 GiB',
               hw_profile='configs/hw/cpu-2core.json'), context)
  return runs


def test_flexjax_case_record_has_every_field(flexjax_records):
  for (projected, overlap), r in flexjax_records.items():
    missing = [f for f in FIELDS if f not in r]
    assert not missing, missing
    assert r['status'] == 'ok' and r['system'] == 'flexjax' and r['model'] == 'tiny'
    assert r['projected'] is (projected is not None)
    assert r['measured_gen_len'] == (projected or 4)
    assert r['num_prompts'] == 4 and r['policy_fields']['overlap'] is overlap
    for field in ('prefill_tok_s', 'decode_tok_s', 'total_tok_s', 'latency_s'):
      assert math.isfinite(r[field]) and r[field] > 0
    assert r['latency_s'] == pytest.approx(r['prefill_s'] + r['decode_s'])
    assert r['total_tok_s'] == pytest.approx(4 * 4 / r['latency_s'])
    assert r['decode_s'] == pytest.approx(r['measured_decode_s'] * 3 / ((projected or 4) - 1))
    assert r['budgets'] == {'device': None, 'host': 2**30, 'disk': None}
    assert r['peak_bytes']['disk'] > 0  # half of every layer's weights
    assert r['predicted']['total_tok_s'] > 0
    json.dumps(r)  # a JSON line


def test_breakdown_only_without_overlap_and_it_adds_up(flexjax_records):
  for (_, overlap), r in flexjax_records.items():
    if overlap:
      assert r['breakdown'] is None
      continue
    for phase, measured in (('prefill', r['prefill_s']), ('decode', r['measured_decode_s'])):
      parts = r['breakdown'][phase]
      assert parts['total'] == pytest.approx(measured)
      assert all(parts[p] >= 0 for p in suite.BREAKDOWN_PARTS)
      assert sum(parts[p] for p in suite.BREAKDOWN_PARTS) <= parts['total'] * 1.001
      assert parts['compute'] > 0 and parts['weight_read'] > 0
    assert r['breakdown']['decode']['cache_read'] > 0  # half of every batch's cache is on host
    assert r['breakdown']['prefill']['cache_read'] == 0


@pytest.mark.slow  # a search and a run (~1 min); README's suite dry run plans a searched case
def test_auto_policy_holds_fixed_fields(context, tmp_path):
  r = suite.run_case(case(system='flexjax', policy='auto', hw_profile='configs/hw/cpu-2core.json',
                          fixed={'w_gpu_percent': 0, 'overlap': False}, max_block_size=4,
                          cpu_mem=1, offload_dir=str(tmp_path)), context)
  assert r['status'] == 'ok'
  assert r['policy_fields']['w_gpu_percent'] == 0 and r['policy_fields']['overlap'] is False
  assert r['num_prompts'] <= 4


def test_an_infeasible_case_is_recorded(context):
  r = suite.run_case(case(system='flexjax', hw_profile='configs/hw/cpu-2core.json',
                          gpu_mem=0.0001, disk_mem=0), context)
  assert r['status'] == 'infeasible' and r['error'].startswith('no policy fits')


def test_suite_runs_cases_in_processes_and_records_failures(tmp_path):
  path = write_suite(tmp_path, [
      {'name': 'first', 'system': 'flexjax', 'policy': HAND, 'tables': ['peers']},
      {'name': 'peer', 'system': 'flexgen', 'policy': 'from:nowhere'},
  ], offload_dir=str(tmp_path))
  name, cases = suite.load_suite(path)
  emitted = []
  records = suite.run_suite(name, cases, emitted.append, isolate=True, log=lambda _: None)
  assert emitted == records
  assert [r['status'] for r in records] == ['ok', 'failed']
  assert records[0]['suite'] == 'test' and records[0]['run_id'] == records[1]['run_id']
  assert 'nowhere' in records[1]['error']
  assert list(tmp_path.glob('flexjax-*')) == []  # offload folders removed


def test_flexgen_case_takes_the_policy_flexjax_ran():
  done = [{'case': 'fj', 'status': 'ok', 'policy_fields': dict(HAND)}]
  peer = case(name='fg', system='flexgen', policy='from:fj')
  assert suite.resolve(peer, done)['policy'] == HAND
  with pytest.raises(FlexjaxError, match="'fj'"):
    suite.resolve(peer, [{**done[0], 'status': 'failed'}])


# ---- tables and plot -----------------------------------------------------------------------------
def record(system, tok_s, *, model='opt-1.3b', budget='1 GiB', tables=('peers',), label='',
           latency=10.0, n=8, projected=False, status='ok', case_name=None):
  return {'case': case_name or f'{system}-{tok_s}', 'system': system, 'model': model,
          'prompt_len': 512, 'gen_len': 32, 'budget': budget, 'tables': list(tables),
          'label': label, 'status': status, 'total_tok_s': tok_s, 'latency_s': latency,
          'num_prompts': n, 'policy': f'{n}x1 hand', 'projected': projected,
          'measured_gen_len': 4 if projected else 32}


def test_peers_table_has_each_system_and_the_ratios():
  table = suite.render_peers([
      record('flexjax', 20.0, projected=True), record('accelerate', 4.0),
      record('flexjax', 3.0, budget='2 GiB'), record('accelerate', 1.5, budget='2 GiB'),
      record('flexgen', 10.0),
  ])
  lines = table.splitlines()
  assert len(lines) == 4
  assert '| opt-1.3b | 512+32 | 1 GiB | 20.0* | 4.00 | 10.0 | 5.00x | 2.00x |' in lines[2]
  assert '| 2 GiB | 3.00 | 1.50 | — | 2.00x | — |' in lines[3]


def test_ablation_table_marks_infeasible_runs_oom():
  rows = [record('flexjax', 7.3, tables=['ablation'], label='all optimizations'),
          record('flexjax', 5.9, tables=['ablation'], label='no overlapping'),
          dict(record('flexjax', 0, tables=['ablation'], label='no disk'), status='infeasible'),
          record('flexjax', 0.6, tables=['ablation'], label='all optimizations',
                 model='opt-6.7b')]
  table = suite.render_ablation(rows)
  lines = table.splitlines()
  assert lines[0] == '| ablation | opt-1.3b 512+32, 1 GiB | opt-6.7b 512+32, 1 GiB |'
  assert lines[2].startswith('| all optimizations | 7.30 (8: 8x1 hand) | 0.60 (8: 8x1 hand) |')
  assert lines[4] == '| no disk | OOM | — |'


def test_breakdown_table_rows_add_other_time():
  r = record('flexjax', 1.0, projected=True)
  parts = dict.fromkeys(suite.BREAKDOWN_PARTS, 0.0)
  r.update(decode_s=30.0, measured_decode_s=3.0, breakdown={
      'prefill': {**parts, 'compute': 2.0, 'weight_read': 1.0, 'total': 3.5},
      'decode': {**parts, 'compute': 1.0, 'cache_read': 1.5, 'total': 3.0}})
  lines = suite.render_breakdown([r, record('flexjax', 2.0)]).splitlines()
  assert len(lines) == 4
  assert '| prefill | 3.50 | 2.00 | 1.00 | 0.00 |' in lines[2] and lines[2].endswith('| 0.50 |')
  assert 'decode (3 steps measured) | 3.00 | 1.00 | 0.00 | 1.50 |' in lines[3]


def test_frontier_keeps_points_no_other_run_beats():
  rows = [record(s, tok, latency=lat, tables=['frontier']) for s, tok, lat in (
      ('flexjax', 1.0, 10), ('flexjax', 5.0, 100), ('flexjax', 4.0, 200), ('flexjax', 9.0, 400),
      ('accelerate', 2.0, 20), ('accelerate', 1.5, 30))]
  rows.append(record('flexjax', 50.0, latency=5, tables=['peers']))  # not in the frontier table
  assert suite.frontier(rows) == {'flexjax': [(10, 1.0), (100, 5.0), (400, 9.0)],
                                  'accelerate': [(20, 2.0)]}
  table = suite.render_frontier(rows)
  assert table.count('| yes |') == 4


def test_plot_writes_a_png(tmp_path):
  pytest.importorskip('matplotlib')
  rows = [record(s, tok, latency=lat, tables=['frontier']) for s, tok, lat in (
      ('flexjax', 1.0, 10), ('flexjax', 5.0, 100), ('accelerate', 2.0, 20))]
  out = tmp_path / 'docs' / 'frontier.png'
  suite.plot_frontier(rows, str(out), title='tiny')
  assert out.read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
  assert [p.name for p in out.parent.iterdir()] == ['frontier.png']
  with pytest.raises(FlexjaxError, match='no successful runs'):
    suite.plot_frontier([record('flexjax', 1.0)], str(out))


def test_stream_table_sets_disk_reads_of_decode_against_the_same_run_probe():
  streamed = dict(record('flexjax', 1.0, projected=True), measured_decode_s=2.0,
                  disk_weight_bytes={'prefill': 10**9, 'decode': 6 * 10**9},
                  rates={'disk_read_bw': 4e9}, roofline={'decode': {'bound': 'disk_read'}})
  in_ram = dict(streamed, case='in-ram', disk_weight_bytes={'prefill': 0, 'decode': 0})
  peer = dict(streamed, system='accelerate')
  lines = suite.render_stream([streamed, in_ram, peer]).splitlines()
  assert len(lines) == 3  # header, rule, the one flexjax row that decoded from disk
  # 3 steps measured: 2 GB and 0.67 s per step; 6 GB in 2 s = 3 GB/s against a 4 GB/s probe
  assert lines[2].endswith('| 2.00 | 0.67 | 3.00 | 4.00 | 0.75 | disk read |'), lines[2]


def test_render_all_prints_the_tables_that_have_rows():
  text = suite.render_all([record('flexjax', 2.0), record('accelerate', 1.0)])
  assert '### Flexjax vs peers' in text and '### Ablation' not in text and '2.00x' in text
