"""tools/layer_bench.py: one layer's attention and decode step, and the head step, timed per
shape."""

import json
import math

import pytest

from conftest import run_tool_cli
from flexjax.config import ModelConfig
from tools import layer_bench

TINY = ModelConfig(name='tiny-layer', num_layers=1, hidden_size=64, num_heads=4, ffn_dim=128,
                   vocab_size=100, max_positions=64)


def test_every_case_is_timed_per_rows_and_positions():
  records = layer_bench.measure(TINY, rows=[1, 3], positions=[5, 9], prompt_lens=[7], programs=[],
                               repeats=1)
  cases = [(r['case'], r['rows'], r['positions']) for r in records]
  assert cases == [(case, b, t) for b in (1, 3) for case, t in (
      ('head', 1), ('decode_attention', 5), ('decode_layer', 5), ('decode_attention', 9),
      ('decode_layer', 9), ('prefill_attention', 7), ('prefill_layer', 7))]
  for r in records:
    assert r['model'] == 'tiny-layer' and math.isfinite(r['ms']) and r['ms'] > 0
    if r['case'] == 'decode_attention':  # K and V of every cached position, float32
      assert r['cache_gb_s'] == pytest.approx(
          2 * r['rows'] * r['positions'] * 64 * 4 / r['ms'] / 1e6)
    if r['case'] == 'head':  # the tied token table, 100 x 64
      assert r['gflop_s'] == pytest.approx(2 * r['rows'] * 100 * 64 / r['ms'] / 1e6)
    if r['case'] == 'prefill_layer':  # q, k, v, out: 64 x 64; fc1, fc2: 64 x 128; causal
      flops = r['rows'] * (7 * 2 * 4 * 64 * 64 + 7 * 2 * 2 * 64 * 128 + 4 * 64 * 7 * 8 / 2)
      assert r['gflop_s'] == pytest.approx(flops / r['ms'] / 1e6)


def _cli(argv, capsys):
  return run_tool_cli(layer_bench, argv, capsys)


def test_cli_writes_records_and_refuses_bad_numbers_in_one_line(capsys, tmp_path):
  out = tmp_path / 'layer.jsonl'
  status, text = _cli(['--model=opt-125m', '--rows=1', '--positions=4', '--prompt_lens=4',
                       '--repeats=1', f'--output={out}'], capsys)
  assert status == 0 and text.out.count('\n') == 5
  assert [json.loads(line)['case'] for line in out.read_text().splitlines()] == [
      'head', 'decode_attention', 'decode_layer', 'prefill_attention', 'prefill_layer']
  for argv, message in ((['--rows=a'], '--rows=a must be integers'),
                        (['--positions=0'], '--positions=0 must be positive'),
                        (['--model=opt-9b'], "unknown model 'opt-9b'")):
    status, text = _cli(argv, capsys)
    assert status == 2 and text.err.count('\n') == 1 and message in text.err, text.err
