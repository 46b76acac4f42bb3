"""Tests of tools/bench.py: both runners on a tiny OPT, record fields, the markdown table."""

import json
import math

import pytest

from flexjax.config import ModelConfig
from tools import bench

REQUIRED_FIELDS = (
    'engine', 'model', 'compute_dtype', 'weight_storage_dtype', 'batch_size', 'prompt_len',
    'gen_len', 'prefill_s', 'decode_s', 'prefill_tok_s', 'decode_tok_s', 'total_tok_s',
    'host_peak_rss_bytes', 'commit', 'machine', 'versions', 'projected', 'timestamp')


@pytest.fixture(scope='module')
def tiny():
  return ModelConfig(name='tiny', num_layers=2, hidden_size=64, num_heads=4, ffn_dim=128,
                     vocab_size=1000, max_positions=128)


@pytest.fixture(scope='module')
def records(tiny):
  context = bench.run_context(torch_threads=1)
  out = []
  for engine in ('flexjax', 'transformers'):
    out += list(bench.bench_model(engine, tiny, dtype='float32', batch_sizes=[2], prompt_len=8,
                                  gen_len=4, repeats=1, torch_threads=1, context=context))
  return out


def test_records_have_every_field_and_finite_rates(records):
  assert [r['engine'] for r in records] == ['flexjax', 'transformers']
  for r in records:
    missing = [f for f in REQUIRED_FIELDS if f not in r]
    assert not missing, missing
    assert (r['model'], r['batch_size'], r['prompt_len'], r['gen_len']) == ('tiny', 2, 8, 4)
    assert r['projected'] is False
    assert r['host_peak_rss_bytes'] > 0
    for field in ('prefill_s', 'decode_s', 'prefill_tok_s', 'decode_tok_s', 'total_tok_s'):
      assert math.isfinite(r[field]) and r[field] > 0, (r['engine'], field, r[field])
    assert r['total_tok_s'] == pytest.approx(2 * 4 / (r['prefill_s'] + r['decode_s']))
    assert r['decode_tok_s'] == pytest.approx(2 * 3 / r['decode_s'])
    json.dumps(r)  # serialisable as one JSON line
  assert records[0]['weight_storage_dtype'] == 'float16'
  assert records[1]['weight_storage_dtype'] == 'float32'


def test_manual_greedy_loop_matches_generate(tiny):
  torch = pytest.importorskip('torch')
  torch.manual_seed(0)
  model = bench.build_transformers(tiny, 'float32', threads=1)
  ids = torch.randint(4, tiny.vocab_size, (2, 8))
  ids[:, 0] = tiny.bos_token_id
  tokens, prefill_s, decode_s = bench.transformers_greedy(model, ids, gen_len=6)
  expected = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6,
                            min_new_tokens=6, do_sample=False)[:, ids.shape[1]:]
  assert torch.equal(tokens, expected)
  assert prefill_s > 0 and decode_s > 0


def test_render_table_has_a_row_with_the_ratio(records):
  table = bench.render_table(records)
  lines = table.splitlines()
  assert 'ratio flexjax/transformers' in lines[0]
  rows = [line for line in lines[2:] if line.startswith('| tiny | float32 | 2 |')]
  assert len(rows) == 1
  cells = [c.strip() for c in rows[0].strip('|').split('|')]
  fx, tf = records[0]['total_tok_s'], records[1]['total_tok_s']
  assert cells[6] == f'{fx / tf:.2f}x'


def test_render_table_without_a_transformers_run_shows_a_dash(records):
  row = bench.render_table(records[:1]).splitlines()[2]
  assert row.split('|')[7].strip() == '—'


def test_render_table_takes_the_latest_run_and_median_repeat():
  def rec(run_id, total):
    return dict(engine='flexjax', model='m', compute_dtype='float32', batch_size=1, prompt_len=8,
                gen_len=4, prefill_tok_s=1.0, decode_tok_s=1.0, total_tok_s=total, run_id=run_id)
  table = bench.render_table([rec('a', 100.0), rec('b', 1.0), rec('b', 3.0), rec('b', 2.0)])
  assert table.splitlines()[2].split('|')[5].strip() == '2.0'


def test_throughputs_follow_the_paper():
  rates = bench.throughputs(batch_size=4, prompt_len=128, gen_len=33, prefill_s=2.0, decode_s=8.0)
  assert rates == {'prefill_tok_s': 256.0, 'decode_tok_s': 16.0, 'total_tok_s': 13.2}
