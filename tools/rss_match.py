"""Suite cases matched on memory: a peer run over a batch sweep, keeping the fastest run whose
measured peak RSS stays within that of a flexjax case.

A suite case {"system": "accelerate", "batch_sweep": [8, 16, 32, 64], "match": "<flexjax case>"}
runs the peer once per batch size (ascending, each in a fresh process) and stops after the first
run whose peak RSS exceeds the flexjax case's (larger batches only hold more). Its record is the
kept run's, with every sweep point, the limit and the matched flexjax run; status 'none_fit' when
no run stayed within the limit.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from flexjax.errors import FlexjaxError

SUMMARY = ('batch_size', 'status', 'prefill_tok_s', 'decode_tok_s', 'total_tok_s', 'latency_s',
           'host_peak_rss_bytes', 'projected', 'roofline_fraction', 'error')


def check_sweep(case: dict[str, Any]) -> None:
  """batch_sweep and match come together; the sweep is positive integers."""
  name, sweep, match = case['name'], case.get('batch_sweep'), case.get('match')
  if (sweep is None) != (match is None):
    raise FlexjaxError(f'case {name!r}: batch_sweep and match go together (a sweep needs the '
                       'flexjax case whose peak RSS it must stay within)')
  if sweep is None:
    return
  if not (isinstance(sweep, list) and sweep
          and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in sweep)):
    raise FlexjaxError(f'case {name!r}: batch_sweep={sweep!r} must be a non-empty list of '
                       'positive integers, e.g. [8, 16, 32, 64]')
  if not isinstance(match, str) or not match:
    raise FlexjaxError(f'case {name!r}: match={match!r} must name a flexjax case')


def matched_record(case: dict[str, Any], records: Sequence[dict[str, Any]]) -> dict[str, Any]:
  """The latest successful record of the case named by case['match'], which must have the
  same model and lengths and a measured peak RSS."""
  source = case['match']
  found = [r for r in records if r.get('case') == source and r.get('status') == 'ok']
  if not found:
    raise FlexjaxError(f'case {case["name"]!r} keeps the runs within the peak RSS of case '
                       f'{source!r}, which has no successful record in this run or in --output; '
                       f'run it first (--only={source},{case["name"]})')
  target = found[-1]
  if target.get('system') != 'flexjax':
    raise FlexjaxError(f'case {case["name"]!r}: match={source!r} names a case of system '
                       f'{target.get("system")}; name a flexjax case')
  for key in ('prompt_len', 'gen_len'):
    if target.get(key) != case[key]:
      raise FlexjaxError(f'case {case["name"]!r} has {key}={case[key]} but {source!r} ran '
                         f'{key}={target.get(key)}; give both the same')
  if not target.get('host_peak_rss_bytes'):
    raise FlexjaxError(f'the record of {source!r} has no measured peak RSS; run it again')
  return target


def select(points: Sequence[dict[str, Any]], limit: int) -> int | None:
  """Index of the highest-throughput successful point with peak RSS <= limit, or None."""
  best = None
  for i, p in enumerate(points):
    if (p.get('status') == 'ok' and p['host_peak_rss_bytes'] <= limit
        and (best is None or p['total_tok_s'] > points[best]['total_tok_s'])):
      best = i
  return best


def run_points(case: dict[str, Any], *, limit: int,
               run: Callable[[dict[str, Any]], dict[str, Any]],
               log: Callable[[str], None] = lambda _: None) -> list[dict[str, Any]]:
  """Runs the case at each batch size (ascending) until a run's peak RSS exceeds `limit`;
  run(point_case) returns a record (status 'failed' for a run that failed)."""
  points = []
  for batch in sorted(case['batch_sweep']):
    log(f'  batch {batch}')
    point = run({**case, 'batch_size': batch, 'batch_sweep': None, 'match': None})
    points.append({**point, 'batch_size': batch})
    if point.get('status') == 'ok' and point['host_peak_rss_bytes'] > limit:
      break
  return points


def sweep_record(case: dict[str, Any], head: dict[str, Any], points: Sequence[dict[str, Any]],
                 target: dict[str, Any]) -> dict[str, Any]:
  """The sweep case's record: the kept point's fields, every point in brief, the limit."""
  limit = target['host_peak_rss_bytes']
  kept = select(points, limit)
  ran = {p['batch_size'] for p in points}
  summary = [{k: p.get(k) for k in SUMMARY} | {'fits': p.get('status') == 'ok'
                                                and p['host_peak_rss_bytes'] <= limit}
             for p in points]
  summary += [{'batch_size': b, 'status': 'skipped', 'fits': False,
               'error': 'a smaller batch already exceeded the peak RSS limit'}
              for b in sorted(case['batch_sweep']) if b not in ran]
  match = {'case': target['case'], 'host_peak_rss_bytes': limit,
           'run_id': target.get('run_id'), 'timestamp': target.get('timestamp')}
  extra = {'sweep': summary, 'match': match, 'rss_limit_bytes': limit,
           'kept_batch_size': None if kept is None else points[kept]['batch_size']}
  if not any(p.get('status') == 'ok' for p in points):
    return {**head, 'status': 'failed', **extra,
            'error': f'every run of the sweep failed; the last: {points[-1].get("error")}'}
  if kept is None:
    return {**head, 'status': 'none_fit', **extra,
            'error': f'no batch size of {sorted(case["batch_sweep"])} ran within the peak RSS of '
                     f'{target["case"]!r} ({limit / 2**30:.2f} GiB)'}
  return {**points[kept], **{k: head[k] for k in ('case', 'spec', 'tables', 'label', 'budget')},
          **extra}


# ---- rendering -----------------------------------------------------------------------------------
def _gib(value: float | None) -> str:
  return '—' if value is None else f'{value / 2**30:.1f}'


def _ratio(a: dict[str, Any], b: dict[str, Any], key: str) -> str:
  return f'{a[key] / b[key]:.2f}x' if a.get(key) and b.get(key) else '—'


def _find_target(row: dict[str, Any], records: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
  match = row['match']
  same = [r for r in records if r.get('case') == match['case'] and r.get('status') == 'ok']
  exact = [r for r in same if r.get('timestamp') == match.get('timestamp')
           and r.get('run_id') == match.get('run_id')]
  return (exact or same or [None])[-1]


def _sweep_cell(row: dict[str, Any]) -> str:
  cells = []
  for p in row['sweep']:
    if p['status'] == 'ok':
      text = f'{p["batch_size"]}: {p["total_tok_s"]:.2f} @ {_gib(p["host_peak_rss_bytes"])}'
      cells.append(text + ('' if p['fits'] else ' (over)'))
    else:
      cells.append(f'{p["batch_size"]}: {p["status"]}')
  return '; '.join(cells)


def _fraction(record: dict[str, Any] | None) -> str:
  value = (record or {}).get('roofline_fraction')
  return '—' if value is None else f'{value:.2f}'


def render_matched(records: Sequence[dict[str, Any]]) -> str:
  """flexjax against the peer run kept at equal peak RSS: prefill, decode and total ratios."""
  lines = ['| model | prompt+gen | memory | flexjax block | flexjax RSS GiB | peer sweep '
           '(batch: tok/s @ RSS GiB) | kept batch | prefill ratio | decode ratio | total ratio | '
           'roofline fraction flexjax / peer |',
           '|---|---|---|---:|---:|---|---:|---:|---:|---:|---:|']
  latest = {}
  for r in records:
    if r.get('sweep') is not None:
      latest[r['case']] = r
  for row in latest.values():
    ours = _find_target(row, records)
    ok = row.get('status') == 'ok' and ours is not None
    cells = [row['model'], f'{row["prompt_len"]}+{row["gen_len"]}', row.get('budget') or '—',
             str(ours['num_prompts']) if ours else '—',
             _gib((ours or {}).get('host_peak_rss_bytes')), _sweep_cell(row),
             str(row['kept_batch_size']) if row.get('kept_batch_size') else 'none fits']
    cells += [_ratio(ours, row, k) if ok else '—'
              for k in ('prefill_tok_s', 'decode_tok_s', 'total_tok_s')]
    cells.append(f'{_fraction(ours)} / {_fraction(row if ok else None)}')
    lines.append('| ' + ' | '.join(cells) + ' |')
  return '\n'.join(lines)
