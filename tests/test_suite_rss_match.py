"""tools/rss_match.py and its suite cases: the batch sweep kept at flexjax's measured peak RSS,
its records, tables and frontier points."""

import json

import pytest

from flexjax.errors import FlexjaxError
from tools import rss_match, suite

GIB = 2**30
TINY = {'name': 'tiny', 'num_layers': 2, 'hidden_size': 64, 'num_heads': 4, 'ffn_dim': 128,
        'vocab_size': 1000, 'max_positions': 128}


def point(batch, tok_s, rss_gib, status='ok'):
  return {'batch_size': batch, 'status': status, 'total_tok_s': tok_s, 'prefill_tok_s': 2 * tok_s,
          'decode_tok_s': tok_s / 2, 'latency_s': 10.0 * batch, 'num_prompts': batch,
          'host_peak_rss_bytes': int(rss_gib * GIB), 'projected': True}


def sweep_case(**kw):
  return suite.check_case({**suite.DEFAULTS, 'name': 'acc', 'system': 'accelerate',
                           'model': TINY, 'prompt_len': 8, 'gen_len': 4, 'page_cache': 'warm',
                           'batch_sweep': [8, 16, 32, 64], 'match': 'fj', **kw})


FLEXJAX = {'case': 'fj', 'system': 'flexjax', 'status': 'ok', 'prompt_len': 8, 'gen_len': 4,
           'host_peak_rss_bytes': 6 * GIB, 'run_id': 'r0', 'timestamp': 't0', 'model': 'tiny',
           'num_prompts': 32, 'prefill_tok_s': 30.0, 'decode_tok_s': 8.0, 'total_tok_s': 6.0,
           'roofline_fraction': 0.4}


# ---- selection -----------------------------------------------------------------------------------
def test_select_keeps_the_fastest_run_within_the_limit():
  points = [point(8, 1.0, 3), point(16, 1.8, 5), point(32, 2.5, 6.5), point(64, 0, 0, 'failed')]
  assert rss_match.select(points, 6 * GIB) == 1
  assert rss_match.select(points, 7 * GIB) == 2
  assert rss_match.select(points, 5 * GIB) == 1  # equal to the limit fits
  assert rss_match.select(points, 2 * GIB) is None
  assert rss_match.select([point(8, 3.0, 1), point(16, 2.0, 2)], 6 * GIB) == 0  # not the largest


def test_run_points_stops_after_the_first_run_over_the_limit():
  ran = []

  def run(case):
    ran.append(case['batch_size'])
    assert case['batch_sweep'] is None and case['match'] is None
    return point(case['batch_size'], case['batch_size'] / 8, case['batch_size'] / 4)

  points = rss_match.run_points(sweep_case(batch_sweep=[32, 8, 16, 64]), limit=5 * GIB, run=run)
  assert ran == [8, 16, 32]  # ascending; 32 sequences took 8 GiB
  assert [p['batch_size'] for p in points] == [8, 16, 32]


def test_sweep_record_keeps_the_chosen_run_and_lists_every_point():
  case = sweep_case(tables=['peers'], budget='4 GiB')
  head = suite.record_head(case, {'run_id': 'r1'})
  points = [{**point(8, 1.0, 3), 'case': 'acc', 'spec': {}}, {**point(16, 1.8, 5), 'case': 'acc'},
            {**point(32, 2.5, 7), 'case': 'acc'}]
  r = rss_match.sweep_record(case, head, points, FLEXJAX)
  assert r['status'] == 'ok' and r['kept_batch_size'] == 16 and r['num_prompts'] == 16
  assert r['total_tok_s'] == 1.8 and r['spec'] == case and r['tables'] == ['peers']
  assert r['rss_limit_bytes'] == 6 * GIB
  assert r['match'] == {'case': 'fj', 'host_peak_rss_bytes': 6 * GIB, 'run_id': 'r0',
                        'timestamp': 't0'}
  assert [(p['batch_size'], p['status'], p['fits']) for p in r['sweep']] == [
      (8, 'ok', True), (16, 'ok', True), (32, 'ok', False), (64, 'skipped', False)]
  json.dumps(r)


def test_sweep_record_when_no_run_fits():
  case = sweep_case()
  r = rss_match.sweep_record(case, suite.record_head(case, {}), [point(8, 1.0, 7)], FLEXJAX)
  assert r['status'] == 'none_fit' and r['kept_batch_size'] is None
  assert '6.00 GiB' in r['error'] and "'fj'" in r['error']
  assert len(r['sweep']) == 4


def test_matched_record_errors_name_the_fix():
  case = sweep_case()
  assert rss_match.matched_record(case, [FLEXJAX, {**FLEXJAX, 'status': 'failed'}]) is FLEXJAX
  with pytest.raises(FlexjaxError, match='--only=fj,acc'):
    rss_match.matched_record(case, [{**FLEXJAX, 'status': 'failed'}])
  with pytest.raises(FlexjaxError, match='gen_len=4 but'):
    rss_match.matched_record(case, [{**FLEXJAX, 'gen_len': 8}])
  with pytest.raises(FlexjaxError, match='name a flexjax case'):
    rss_match.matched_record(case, [{**FLEXJAX, 'system': 'accelerate'}])


@pytest.mark.parametrize('keys, message', [
    ({'batch_sweep': [8, 16]}, 'go together'),
    ({'match': 'fj'}, 'go together'),
    ({'batch_sweep': [8, 0], 'match': 'fj'}, 'positive integers'),
    ({'batch_sweep': [], 'match': 'fj'}, 'positive integers'),
])
def test_bad_sweep_cases_are_refused(tmp_path, keys, message):
  path = tmp_path / 'suite.json'
  path.write_text(json.dumps({'defaults': {'model': TINY}, 'cases': [
      {'name': 'acc', 'system': 'accelerate', **keys}]}))
  with pytest.raises(FlexjaxError, match=message):
    suite.load_suite(str(path))


def test_match_must_name_a_flexjax_case_of_the_file(tmp_path):
  path = tmp_path / 'suite.json'
  path.write_text(json.dumps({'defaults': {'model': TINY}, 'cases': [
      {'name': 'other', 'system': 'accelerate'},
      {'name': 'acc', 'system': 'accelerate', 'batch_sweep': [8], 'match': 'other'}]}))
  with pytest.raises(FlexjaxError, match="match='other' names a case of system accelerate"):
    suite.load_suite(str(path))
  with pytest.raises(FlexjaxError, match='"model"'):
    suite.check_case({**suite.DEFAULTS, 'name': 'x', 'system': 'flexjax'})


def test_shipped_cpu_suite_has_the_decode_heavy_pair():
  _, cases = suite.load_suite('configs/bench/cpu.json')
  by_name = {c['name']: c for c in cases}
  sweeps = [c for c in cases if c.get('batch_sweep')]
  assert sweeps
  for c in sweeps:
    target = by_name[c['match']]
    assert target['system'] == 'flexjax' and target['fixed']['w_gpu_percent'] == 0
    assert (target['model'], target['prompt_len'], target['gen_len'], target['cpu_mem']) == (
        c['model'], c['prompt_len'], c['gen_len'], c['cpu_mem'])


# ---- in the suite --------------------------------------------------------------------------------
def fake_accelerate_run(case, context):
  """An Accelerate record whose RSS grows 1 GiB per 8 sequences and whose speed grows too."""
  b = case['batch_size']
  record = {**suite.record_head(case, context), 'status': 'ok', 'system_version': 'fake',
            'num_prompts': b, 'measured_gen_len': 4, 'projected': False, 'prefill_s': 1.0,
            'decode_s': 2.0, 'measured_decode_s': 2.0, 'host_peak_rss_bytes': b // 8 * GIB,
            'peak_bytes': {'device': 0, 'host': 1000, 'disk': 4000}, 'compute_dtype': 'float32',
            'weight_storage_dtype': 'float16', 'device': 'cpu', 'policy': f'batch {b}'}
  record.update(suite.throughputs(batch_size=b, prompt_len=8, gen_len=4, prefill_s=1.0,
                                  decode_s=2.0))
  record['latency_s'] = 3.0
  return record


def test_suite_runs_the_sweep_against_the_record_in_the_output(monkeypatch):
  from test_suite_roofline import RATES
  monkeypatch.setattr(suite, 'run_case', fake_accelerate_run)
  logs = []
  records = suite.run_suite('t', [sweep_case(tables=['peers', 'frontier'])], lambda _: None,
                            isolate=False, log=logs.append, previous=[FLEXJAX], rates=RATES)
  r = records[0]
  assert r['status'] == 'ok' and r['kept_batch_size'] == 32 and r['num_prompts'] == 32
  assert [p['batch_size'] for p in r['sweep']] == [8, 16, 32, 64]
  assert r['sweep'][-1]['fits'] is False and r['sweep'][-1]['status'] == 'ok'  # 8 GiB > 6
  assert all(p['roofline_fraction'] > 0 for p in r['sweep'])
  assert r['roofline_fraction'] == pytest.approx(r['roofline_s'] / 3.0)
  assert any('6.00 GiB' in line for line in logs)
  missing = suite.run_suite('t', [sweep_case()], lambda _: None, isolate=False,
                            log=lambda _: None)
  assert missing[0]['status'] == 'failed' and '--only=fj,acc' in missing[0]['error']


# ---- tables and plot -----------------------------------------------------------------------------
def sweep_row(status='ok'):
  points = [point(8, 1.0, 3), point(16, 1.5, 5), point(32, 2.0, 7)]
  row = {'case': 'acc', 'system': 'accelerate', 'model': 'tiny', 'prompt_len': 8, 'gen_len': 4,
         'budget': '4 GiB', 'tables': ['peers', 'frontier'], 'label': '', 'status': status,
         'match': {'case': 'fj', 'run_id': 'r0', 'timestamp': 't0'},
         'sweep': [{**p, 'fits': p['host_peak_rss_bytes'] <= 6 * GIB} for p in points]
         + [{'batch_size': 64, 'status': 'skipped', 'fits': False}]}
  if status == 'ok':
    row.update({k: v for k, v in points[1].items() if k != 'batch_size'},
               kept_batch_size=16, roofline_fraction=0.25, policy='batch 16')
  else:
    row['kept_batch_size'] = None
  return row


def test_matched_table_has_prefill_decode_and_total_ratios():
  fj = {**FLEXJAX, 'tables': ['peers']}
  table = rss_match.render_matched([fj, sweep_row()])
  lines = table.splitlines()
  assert len(lines) == 3
  assert lines[2] == ('| tiny | 8+4 | 4 GiB | 32 | 6.0 | 8: 1.00 @ 3.0; 16: 1.50 @ 5.0; '
                      '32: 2.00 @ 7.0 (over); 64: skipped | 16 | 10.00x | 10.67x | 4.00x | '
                      '0.40 / 0.25 |')
  none = rss_match.render_matched([fj, sweep_row('none_fit')]).splitlines()[2]
  assert '| none fits | — | — | — | 0.40 / — |' in none


def test_peers_table_shows_roofline_fractions_and_the_matched_batch():
  fj = {**FLEXJAX, 'tables': ['peers'], 'budget': '4 GiB', 'policy': '32x1'}
  lines = suite.render_peers([fj, sweep_row()]).splitlines()
  assert 'roofline fraction flexjax / Accelerate / FlexGen' in lines[0]
  assert lines[2].endswith(
      '| 16 (of [8, 16, 32, 64], RSS-matched) | 6.0 / 5.0 | 0.40 / 0.25 / — |')
  assert '| 4.00x |' in lines[2]
  assert 'none fits' in suite.render_peers([fj, sweep_row('none_fit')])


def test_frontier_and_plot_take_every_sweep_point(tmp_path):
  pytest.importorskip('matplotlib')
  fj = {**FLEXJAX, 'tables': ['frontier'], 'latency_s': 100.0}
  rows = [fj, sweep_row(), {**sweep_row('none_fit'), 'case': 'acc2'},
          {'case': 'x', 'system': 'flexjax', 'status': 'failed', 'tables': ['frontier']}]
  front = suite.frontier(rows)
  assert front['accelerate'] == [(80, 1.0), (160, 1.5), (320, 2.0)]
  assert front['flexjax'] == [(100.0, 6.0)]
  assert suite.render_frontier(rows).count('acc (batch 16)') == 1
  out = tmp_path / 'frontier.png'
  suite.plot_frontier(rows, str(out))
  assert out.read_bytes()[:4] == b'\x89PNG'


def test_render_all_has_the_matched_and_roofline_tables():
  from test_suite_roofline import RATES
  fj = {**FLEXJAX, 'tables': ['peers'], 'policy': '32x1', 'rates': RATES,
        'roofline': {p: {'roofline_s': 1.0, 'measured_s': 4.0, 'fraction': 0.25,
                         'bound': 'disk_read'} for p in ('prefill', 'decode')}
        | {'total': {'roofline_s': 2.0, 'measured_s': 8.0, 'fraction': 0.25}}}
  text = suite.render_all([fj, sweep_row()])
  assert '### Flexjax vs Accelerate at equal measured peak RSS' in text
  assert '### Roofline' in text
  assert '| fj | flexjax | 32 | 1.0 / 4.0 (disk read) | 1.0 / 4.0 (disk read) | 2.0 / 8.0 | ' \
         '0.25 / 0.25 / 0.25 |' in text
  assert 'Rates of run r0' in text and 'disk read: 0.00 GB/s (o_direct=True' in text
