"""tools/products_bound.py: the products it times are the roofline's FLOPs less attention; the
bound's arithmetic; the tool on a real suite record of a tiny model."""

import json
import math

import pytest

from conftest import ROOFLINE_RATES, run_tool_cli
from flexjax.config import ModelConfig
from flexjax.policy import Policy
from tools import products_bound, roofline, suite

OPT = ModelConfig(name='tiny-opt', num_layers=3, hidden_size=64, num_heads=4, ffn_dim=96,
                  vocab_size=100, max_positions=64)
LLAMA = ModelConfig(name='tiny-gqa', family='llama', num_layers=2, hidden_size=64, num_heads=4,
                    num_kv_heads=2, ffn_dim=160, vocab_size=120, max_positions=64)
# The made-up machine at speeds whose roofline is of the order of the tiny model's measured
# products (milliseconds): either may be the larger
RATES = {**ROOFLINE_RATES, 'matmul_flops': {'float32': {'jax': 6e8, 'torch': 1e9}},
         'host_device_bw': 1e9, 'disk_read_bw': 1e8, 'disk_write_bw': 5e7}


@pytest.mark.parametrize('cfg', [OPT, LLAMA], ids=lambda c: c.name)
def test_the_timed_products_are_the_roofline_flops_less_attention(cfg):
  """Per phase, the rows and counts of the products the tool times add up to the FLOPs
  tools.roofline.work charges, less its attention terms (worked out here from its formula)."""
  policy = Policy(gpu_batch_size=3, num_gpu_batches=2)
  s, n, batch = 5, 4, 6
  work = roofline.work(cfg, batch=batch, prompt_len=s, gen_len=n, weight_bytes={},
                       kv_rows={'device': batch, 'host': 0, 'disk': 0}, kv_token_bytes=4)
  steps = n - 1
  attention = {'prefill': batch * cfg.num_layers * 4 * cfg.q_dim * s * (s + 1) / 2,
               'decode': batch * cfg.num_layers * 4 * cfg.q_dim
               * (steps * s + steps * (steps + 1) / 2)}
  phases = products_bound.phase_products(cfg, policy, prompt_len=s, gen_len=n)
  assert phases['prefill']['layer_rows'] == 3 * 5 and phases['decode']['layer_rows'] == 3
  for phase in ('prefill', 'decode'):
    assert products_bound.products_flops(cfg, phases[phase]) == pytest.approx(
        work[phase].flops - attention[phase])


def test_the_bound_is_the_roofline_over_the_least_time_each_phase_can_take():
  bound = products_bound.bound_of({'prefill': 2.0, 'decode': 1.0},
                                  {'prefill': 4.0, 'decode': 0.5})
  # prefill's products take twice its roofline; decode's less than its roofline (the roofline
  # is then the least time): (2 + 1) / (4 + 1)
  assert bound == pytest.approx({'prefill': 0.5, 'decode': 1.0, 'total': 0.6})


def test_distinct_layer_copies_outgrow_the_cache_within_the_models_layers():
  assert products_bound.distinct_layers(OPT, 2) == 3  # tiny layers: every one of the model's
  big = ModelConfig(name='big', num_layers=40, hidden_size=4096, num_heads=32, ffn_dim=16384,
                    vocab_size=100, max_positions=64)
  per_layer = 2 * (4 * 4096**2 + 2 * 4096 * 16384)  # 384 MiB in float16
  assert per_layer > products_bound.MIN_DISTINCT_BYTES
  assert products_bound.distinct_layers(big, 2) == 1
  assert products_bound.distinct_layers(big, 2) * per_layer >= products_bound.MIN_DISTINCT_BYTES


def _cli(argv, capsys):
  return run_tool_cli(products_bound, argv, capsys)


def test_a_suite_records_bound_and_one_line_refusals(tmp_path, capsys):
  """A real suite record of a tiny model: each phase's products are timed in both frameworks,
  the least is taken, and the bound is the record's roofline (at the given rates) over it, never
  above 1; the record's own fraction is its roofline over its measured times."""
  case = suite.check_case({**suite.DEFAULTS, 'name': 'tiny-fj', 'system': 'flexjax',
                           'model': LLAMA.to_dict(), 'prompt_len': 8, 'gen_len': 3,
                           'page_cache': 'warm', 'offload_dir': str(tmp_path), 'policy': {
                               'gpu_batch_size': 2, 'num_gpu_batches': 2, 'w_gpu_percent': 0,
                               'w_cpu_percent': 50}})
  records = suite.run_suite('t', [case], lambda _: None, isolate=False, log=lambda _: None,
                            rates=RATES)
  assert records[0]['status'] == 'ok'
  path = tmp_path / 'suite.jsonl'
  path.write_text(json.dumps(records[0]) + '\n'
                  + json.dumps({**records[0], 'case': 'peer', 'system': 'accelerate'}) + '\n')
  rates = tmp_path / 'rates.json'
  rates.write_text(json.dumps(RATES))
  out = tmp_path / 'bound.jsonl'
  status, text = _cli([f'--records={path}', f'--rates={rates}', '--repeats=1',
                       f'--output={out}'], capsys)
  assert status == 0, text.err
  (line,) = [json.loads(t) for t in out.read_text().splitlines()]
  assert line['case'] == 'tiny-fj' and line['rows'] == {'prefill': 16, 'decode': 2}
  expected = roofline.of_record(records[0], RATES)
  for phase in ('prefill', 'decode'):
    timed = {fw: line['products_s'][fw][phase] for fw in products_bound.FRAMEWORKS}
    assert all(0 < t < math.inf for t in timed.values())
    assert line['least_products_s'][phase] == min(timed.values())
    assert line['roofline_s'][phase] == pytest.approx(expected[phase]['roofline_s'])
    assert line['fraction'][phase] == pytest.approx(expected[phase]['fraction'])
    assert line['bound'][phase] == pytest.approx(
        expected[phase]['roofline_s'] / max(expected[phase]['roofline_s'], min(timed.values())))
    assert 0 < line['bound'][phase] <= 1
    assert line['products_share_of_matmul_rate'][phase] == pytest.approx(
        line['products_flops'][phase] / min(timed.values()) / 1e9)  # RATES: torch's 1 GFLOP/s
  assert 'tiny-fj' in text.out and 'bound' in text.out

  for argv, message in (
      ([f'--records={path}', '--only=nope'], "--only=nope: no successful flexjax record"),
      ([], '--records is required'),
      ([f'--records={tmp_path / "none.jsonl"}'], 'none.jsonl\' does not exist'),
      ([f'--records={rates}'], 'holds no successful flexjax record'),
      ([f'--records={path}', '--only=peer'], '--only=peer: no successful flexjax record'),
      ([f'--records={path}', f'--rates={tmp_path / "none.json"}'], 'could not be read as JSON')):
    status, text = _cli(argv, capsys)
    assert status == 2 and text.err.count('\n') == 1 and message in text.err, (argv, text.err)
