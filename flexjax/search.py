"""Policy search (paper section 4.3): for each batch geometry, an LP over the nine placement
fractions (scipy HiGHS), then rounding to a realisable policy re-checked with the exact memory
plan. Pure in, pure out."""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Iterable, Iterator

import numpy as np

from flexjax import cost_model
from flexjax import plan as plan_lib
from flexjax.config import ModelConfig
from flexjax.errors import FlexjaxError
from flexjax.hardware import HardwareProfile
from flexjax.policy import Policy

GPU_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256)
NUM_GPU_BATCHES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
_AUX = ('Tp', 'Tg', 'Ep', 'Eg')
TIE = 0.03  # predicted throughputs this close are the same to the cost model
MAX_CHECKED = 6  # candidates whose real plan is made before the best of them is taken
_VARS = cost_model.FRACTIONS + _AUX
# Policy percent fields -> the LP's placement fractions (disk shares are what remains).
PERCENT_FIELDS = {'w_gpu_percent': 'wg', 'w_cpu_percent': 'wc', 'cache_gpu_percent': 'cg',
                  'cache_cpu_percent': 'cc', 'act_gpu_percent': 'hg', 'act_cpu_percent': 'hc'}


@dataclasses.dataclass(frozen=True)
class SearchResult:
  policy: Policy
  prediction: cost_model.Prediction
  planned_peak_bytes: dict[str, int]  # the execution plan's peaks of the policy
  candidates: int
  seconds: float


def solve_placement(model: cost_model.Model, budgets: dict[str, int | None], *,
                    max_block_seconds: float | None = None,
                    fixed: dict[str, float] | None = None) -> dict[str, float] | None:
  """The LP: minimise time per generated token subject to the memory budgets.

  fixed: fractions ('wg', 'cc', ...) held at a value instead of searched.
  Returns the optimal fractions, or None if no placement fits.
  """
  index = {v: i for i, v in enumerate(_VARS)}
  L, n, bls = model.num_layers, model.gen_len, model.block_size
  objective = np.zeros(len(_VARS))
  block_time = {'Tp': L, 'Ep': 1, 'Tg': (n - 1) * L, 'Eg': n - 1}
  for name, weight in block_time.items():
    objective[index[name]] = weight / bls
  # Ties (a load hidden behind compute costs nothing under overlap) go to the faster tier: a
  # cost far below the model's resolution on every byte left on the host and, twice, on disk.
  scale = 1e-9 * L * n / bls
  for kind in ('w', 'c', 'h'):
    objective[index[f'{kind}c']] += scale
    objective[index[f'{kind}d']] += 2 * scale
  rows, bounds_ub = [], []

  def add(form: cost_model.Linear, limit: float, aux: dict[str, float] | None = None) -> None:
    row = np.zeros(len(_VARS))
    for k, c in form.coef.items():
      row[index[k]] += c
    for k, c in (aux or {}).items():
      row[index[k]] += c
    rows.append(row)
    bounds_ub.append(limit - form.const)

  for terms, aux in ((model.prefill, 'Tp'), (model.decode, 'Tg'), (model.ends_prefill, 'Ep'),
                     (model.ends_decode, 'Eg')):
    if model.overlap:
      for form in terms.values():
        add(form, 0.0, {aux: -1.0})
    else:
      add(sum(terms.values(), cost_model.Linear()), 0.0, {aux: -1.0})
  for tier, forms in model.memory.items():
    if budgets.get(tier) is not None:
      for form in forms:
        add(form, float(budgets[tier]))
  if max_block_seconds is not None:
    add(cost_model.Linear(0.0, {}), max_block_seconds, dict(block_time))
  equalities = np.zeros((3, len(_VARS)))
  for r, group in enumerate((('wg', 'wc', 'wd'), ('cg', 'cc', 'cd'), ('hg', 'hc', 'hd'))):
    for v in group:
      equalities[r, index[v]] = 1.0
  bounds = [(0.0, 1.0)] * len(cost_model.FRACTIONS) + [(0.0, None)] * len(_AUX)
  for name, value in (fixed or {}).items():
    bounds[index[name]] = (value, value)
  from scipy.optimize import linprog  # here, not at the top: a process starts 0.6 s sooner
  res = linprog(objective, A_ub=np.array(rows), b_ub=np.array(bounds_ub), A_eq=equalities,
                b_eq=np.ones(3), bounds=bounds, method='highs')
  if res.status != 0:
    return None
  return {v: float(res.x[index[v]]) for v in cost_model.FRACTIONS}


def to_policy(x: dict[str, float], template: Policy) -> Policy:
  """Rounds fractions to a realisable policy: whole percents of weights, whole rows of cache
  and hidden states (device share rounded down, so rounding never adds device bytes)."""
  b = template.gpu_batch_size

  def rows(g: float, c: float) -> tuple[float, float]:
    device = int(np.floor(g * b + 1e-9))
    host = min(b - device, int(round((g + c) * b)) - device)
    return 100 * device / b, 100 * max(0, host) / b

  wg = float(np.floor(100 * x['wg'] + 1e-6))
  wc = float(min(100 - wg, round(100 * (x['wg'] + x['wc'])) - wg))
  cg, cc = rows(x['cg'], x['cc'])
  hg, hc = rows(x['hg'], x['hc'])
  return dataclasses.replace(template, w_gpu_percent=wg, w_cpu_percent=max(0.0, wc),
                             cache_gpu_percent=cg, cache_cpu_percent=cc, act_gpu_percent=hg,
                             act_cpu_percent=hc)


def _repair(planner: plan_lib.Planner, policy: Policy, budgets, prompt_len, gen_len,
            fixed: Iterable[str] = (), steps: int = 60, estimate: bool = True,
            head: dict[str, Any] | None = None):
  """Moves data down the tiers until the plan fits (the LP is a relaxation), never changing
  the percents named in `fixed`; the plans count the head step of `head` (search's)."""
  fixed = set(fixed)
  for _ in range(steps):
    plan = planner.plan(policy, prompt_len=prompt_len, gen_len=gen_len, estimate=estimate,
                        **(head or {})).peaks()
    over = [t for t in ('ram',) + plan_lib.TIERS
            if budgets.get(t) is not None and plan.get(t, 0) > budgets[t]]
    if not over:
      return policy, plan
    move = next((m for m in _moves_off(policy, over[0]) if not fixed & set(m)), None)
    if move is None:
      return None, plan
    policy = dataclasses.replace(policy, **move)
  return None, None


def _moves_off(policy: Policy, tier: str) -> Iterator[dict[str, float]]:
  """Changes that move data off `tier` to the next one down, most preferred first: weights in
  5% steps, then cache rows, then hidden-state rows."""
  row = 100 / policy.gpu_batch_size
  wg, wc = policy.w_gpu_percent, policy.w_cpu_percent
  if tier == 'ram':  # device and host are one memory: move to disk
    if wg > 0:
      yield {'w_gpu_percent': wg - min(5.0, wg)}
    if wc > 0:
      yield {'w_cpu_percent': wc - min(5.0, wc)}
    for kind in ('cache', 'act'):
      if policy.rows(kind)['device'] > 0:
        yield {f'{kind}_gpu_percent': getattr(policy, f'{kind}_gpu_percent') - row}
      if policy.rows(kind)['host'] > 0:
        yield {f'{kind}_cpu_percent': getattr(policy, f'{kind}_cpu_percent') - row}
    return
  if tier == 'device':
    if wg > 0:
      yield {'w_gpu_percent': wg - min(5.0, wg), 'w_cpu_percent': wc + min(5.0, wg)}
    if policy.rows('cache')['device'] > 0:
      yield {'cache_gpu_percent': policy.cache_gpu_percent - row,
             'cache_cpu_percent': policy.cache_cpu_percent + row}
    if policy.rows('act')['device'] > 0:
      yield {'act_gpu_percent': policy.act_gpu_percent - row,
             'act_cpu_percent': policy.act_cpu_percent + row}
  elif tier == 'host':
    if wc > 0:
      yield {'w_cpu_percent': wc - min(5.0, wc)}
    if policy.rows('cache')['host'] > 0:
      yield {'cache_cpu_percent': policy.cache_cpu_percent - row}
    if policy.rows('act')['host'] > 0:
      yield {'act_cpu_percent': policy.act_cpu_percent - row}


def shape_choices(kept: Policy | None, max_block_size: int) -> dict[str, Any]:
  """search's block-shape arguments: any shape up to max_block_size, or only `kept`'s (a
  resumed job's blocks are its first run's)."""
  if kept is None:
    return {'max_block_size': max_block_size}
  return {'gpu_batch_sizes': (kept.gpu_batch_size,), 'num_gpu_batches': (kept.num_gpu_batches,),
          'max_block_size': max(max_block_size, kept.block_size)}


def search(cfg: ModelConfig, hw: HardwareProfile, budgets: dict[str, int | None], *,
           prompt_len: int, gen_len: int, sizes: plan_lib.Itemsizes,
           planner: plan_lib.Planner | None = None,
           template: Policy = Policy(), gpu_batch_sizes: Iterable[int] = GPU_BATCH_SIZES,
           num_gpu_batches: Iterable[int] = NUM_GPU_BATCHES, max_block_size: int = 4096,
           cpu_attention: Iterable[bool] = (False, True),
           max_block_seconds: float | None = None,
           fixed_percents: Iterable[str] = (),
           num_sequences: int | None = None,
           head: dict[str, Any] | None = None) -> SearchResult:
  """The policy with the highest predicted throughput that fits the budgets.

  head: the planner's keywords for the run's head step (GenerationConfig.head_args: sampling
  and log-probabilities); every plan the search checks counts that step (default: greedy).

  num_sequences: how many sequences the run has, where known (a job's rows, a prompt file's
  prompts). Blocks are then ranked by the throughput of those sequences' tokens (the padding
  rows of a last, part-filled block generate nothing), and no block is screened past the
  smallest one that holds them all (a larger one only pads more).

  The template's approximations (compression, sparsity) and overlap are kept; batch geometry,
  CPU attention and placement are searched, except the percents named in fixed_percents
  (PERCENT_FIELDS), which keep the template's values. Candidates are screened with the
  execution plan's XLA bytes estimated; the best is re-checked with its steps compiled at their
  real shapes (the plan the run will enforce), falling back to the next best if it fails.
  """
  if planner is None:
    planner = plan_lib.Planner.for_sizes(cfg, sizes, device_is_host=hw.copies_share_compute)
  fixed_percents = tuple(fixed_percents)
  unknown = sorted(set(fixed_percents) - set(PERCENT_FIELDS))
  if unknown:
    raise FlexjaxError(f'fixed_percents {unknown} are not placement percents; use '
                       f'{", ".join(PERCENT_FIELDS)}')
  fixed = {PERCENT_FIELDS[name]: getattr(template, name) / 100 for name in fixed_percents}
  start = time.perf_counter()
  gpu_batch_sizes, num_gpu_batches = tuple(gpu_batch_sizes), tuple(num_gpu_batches)
  if num_sequences is not None:
    if num_sequences < 1:
      raise FlexjaxError(f'num_sequences={num_sequences}: a run has one sequence or more')
    holding = [b * g for b in gpu_batch_sizes for g in num_gpu_batches
               if num_sequences <= b * g <= max_block_size]
    max_block_size = min(holding, default=max_block_size)
  grid = dict(gpu_batch_sizes=gpu_batch_sizes, num_gpu_batches=num_gpu_batches,
              max_block_size=max_block_size)
  cpu_attention = tuple(cpu_attention)
  passes = [cpu_attention]
  if hw.copies_share_compute and set(cpu_attention) == {False, True}:
    # Where the device is the host, CPU attention runs on the device's cores at its rate (the
    # cost model predicts the same time for both) and its screened bytes are at least device
    # attention's (Planner.xla takes the larger of both steps): its candidates can win only
    # where device attention's fit nowhere, so they are screened (and their steps compiled)
    # only then.
    passes = [(False,), (True,)]
  tried = 0
  for values in passes:
    found, tries = _screen(cfg, hw, budgets, sizes=sizes, planner=planner, template=template,
                           prompt_len=prompt_len, gen_len=gen_len, fixed=fixed,
                           fixed_percents=fixed_percents, cpu_attention=values,
                           max_block_seconds=max_block_seconds, head=head or {}, **grid)
    tried += tries
    best = _check(cfg, hw, budgets, sizes, planner, found, prompt_len=prompt_len,
                  gen_len=gen_len, fixed_percents=fixed_percents, num_sequences=num_sequences,
                  head=head or {})
    if best is not None:
      planner.release_compiled()
      return dataclasses.replace(best, candidates=tried, seconds=time.perf_counter() - start)
  raise FlexjaxError(_shortfall(planner, template, budgets, prompt_len, gen_len, head or {}))


def _screen(cfg, hw, budgets, *, sizes, planner, template, prompt_len, gen_len, fixed,
            fixed_percents, gpu_batch_sizes, num_gpu_batches, max_block_size, cpu_attention,
            max_block_seconds, head) -> tuple[list[SearchResult], int]:
  """Every batch geometry's LP, rounded and repaired against the plan with XLA's bytes
  estimated: the candidates that fit, and how many geometries were tried."""
  found: list[SearchResult] = []
  tried = 0
  for gbs in gpu_batch_sizes:
    for g in num_gpu_batches:
      if gbs * g > max_block_size:
        continue
      for cpu_att in cpu_attention:
        candidate = dataclasses.replace(template, gpu_batch_size=gbs, num_gpu_batches=g,
                                        cpu_attention=cpu_att)
        model = cost_model.build(cfg, candidate, hw, sizes, prompt_len=prompt_len,
                                 gen_len=gen_len, planner=planner)
        tried += 1
        x = solve_placement(model, budgets, max_block_seconds=max_block_seconds, fixed=fixed)
        if x is None:
          continue
        policy, plan = _repair(planner, to_policy(x, candidate), budgets, prompt_len,
                               gen_len, fixed=fixed_percents, head=head)
        if policy is None:
          continue
        prediction = model.predict(cost_model.fractions(policy, cfg))
        if max_block_seconds is not None and (prediction.prefill_s + prediction.decode_s
                                              > max_block_seconds):
          continue
        found.append(SearchResult(policy, prediction, plan, 0, 0.0))
  return found, tried


def sequence_share(num_sequences: int | None, block: int) -> float:
  """Of the rows that blocks of `block` rows run for `num_sequences` sequences, the share
  that are those sequences (a last, part-filled block's padding rows generate nothing); 1 where
  the count is not known."""
  if num_sequences is None:
    return 1.0
  return num_sequences / (-(-num_sequences // block) * block)


def useful_throughput(result: SearchResult, num_sequences: int | None) -> float:
  """The predicted throughput of the run's own sequences' tokens (sequence_share)."""
  return result.prediction.throughput * sequence_share(num_sequences, result.policy.block_size)


def _check(cfg, hw, budgets, sizes, planner, found, *, prompt_len, gen_len,
           fixed_percents, num_sequences, head) -> SearchResult | None:
  """The best screened candidate whose real plan (steps compiled at their shapes) fits. That
  plan may move data further down than the estimate did; a candidate it slows below the tie is
  kept aside while the next is checked."""
  def rate(r: SearchResult) -> float:
    return useful_throughput(r, num_sequences)

  checked: list[SearchResult] = []
  top = max(map(rate, found), default=0.0)
  for best in _ranked(found, rate)[:MAX_CHECKED]:
    policy, plan = _repair(planner, best.policy, budgets, prompt_len, gen_len,
                           fixed=fixed_percents, estimate=False, head=head)
    if policy is not None:
      prediction = cost_model.predict(cfg, policy, hw, sizes, prompt_len=prompt_len,
                                      gen_len=gen_len, planner=planner)
      checked.append(SearchResult(policy, prediction, plan, 0, 0.0))
      if rate(checked[-1]) >= (1 - TIE) * top:
        break
  if not checked:
    return None
  best = max(checked, key=rate)
  if rate(checked[-1]) >= (1 - TIE) * top:
    best = checked[-1]
  return best


def _ranked(found: list[SearchResult],
            rate=lambda r: r.prediction.throughput) -> list[SearchResult]:
  """Candidates best first by `rate` (their predicted throughput): those within TIE of the
  highest (the model's resolution; a disk-bound decode predicts the same time for any batch
  geometry) by fewest GPU batches, then largest GPU batch (fewer, larger steps: less per-step
  work the model does not see), then the rest by rate."""
  if not found:
    return []
  top = max(map(rate, found))
  near = [r for r in found if rate(r) >= (1 - TIE) * top]
  rest = [r for r in found if rate(r) < (1 - TIE) * top]
  near.sort(key=lambda r: (r.policy.num_gpu_batches, -r.policy.gpu_batch_size, -rate(r)))
  return near + sorted(rest, key=lambda r: -rate(r))


def _shortfall(planner, template, budgets, prompt_len, gen_len, head) -> str:
  """Which tier is short, and by how much, for the most economical policy (one sequence,
  everything that can leave the device on disk)."""
  smallest = dataclasses.replace(template, gpu_batch_size=1, num_gpu_batches=1, w_gpu_percent=0,
                                 w_cpu_percent=0, cache_gpu_percent=0, cache_cpu_percent=0,
                                 act_gpu_percent=0, act_cpu_percent=0, cpu_attention=True)
  plan = planner.plan(smallest, prompt_len=prompt_len, gen_len=gen_len, estimate=True,
                      **head).peaks()
  for tier in ('ram',) + plan_lib.TIERS:
    if budgets.get(tier) is not None and plan.get(tier, 0) > budgets[tier]:
      flag = dict(device='gpu', host='cpu', ram='cpu', disk='disk')[tier]
      return (f'no policy fits: even one sequence with everything offloaded needs '
              f'{plan_lib.format_bytes(plan[tier])} on the {tier}, {plan_lib.format_bytes(plan[tier] - budgets[tier])} more than '
              f'its budget of {plan_lib.format_bytes(budgets[tier])}; raise --{flag}_mem or shorten the '
              'sequences')
  return 'no policy fits the budgets and the latency limit; relax --max_block_seconds'
