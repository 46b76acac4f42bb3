"""One process's stage of a pipelined job: its budgets, its policy (given, or searched for its
layers and agreed with the other stages on one block shape), the plan check of every stage
before any stage allocates, the run, and the report (process 0)."""

from __future__ import annotations

import dataclasses

import numpy as np

from flexjax import search
from flexjax.errors import FlexjaxError
from flexjax.pipeline import Link, StageEngine, StageWeights, Topology, split_layers
from flexjax.policy import Policy

_TIERS = ('device', 'host', 'disk', 'ram')
_PERCENTS = ('w_gpu_percent', 'w_cpu_percent', 'cache_gpu_percent', 'cache_cpu_percent',
             'act_gpu_percent', 'act_cpu_percent')


class OtherStageFailed(FlexjaxError):
  """This stage stops because another one cannot run (that stage names the reason)."""


def stage_budgets(given: dict, detected: dict, processes_per_host: int) -> dict:
  """This stage's budgets: what the flags give holds per stage; what was detected (available
  RAM, free disk) is shared by the stages on this host. A device is each process's own."""
  out = dict(detected)
  for tier, value in detected.items():
    flag_tier = 'host' if tier == 'ram' else tier
    if value is not None and tier != 'device' and given.get(flag_tier) is None:
      out[tier] = value // processes_per_host
  return out


def pipeline_seconds(prefill_s, decode_s, num_batches: int) -> tuple[float, float]:
  """Predicted (prefill, decode) seconds of one block through the stages, from each stage's
  predicted seconds for the whole block (as if it ran alone).

  Prefill: the micro-batches fill and drain the pipeline, each stage taking 1/num_batches of its
  block time per micro-batch. Decode: a token of a micro-batch passes every stage before its
  next token starts, and every stage runs every micro-batch, so a token takes the longer of the
  slowest stage's block time and one micro-batch's trip through all stages.
  """
  per_batch = [t / num_batches for t in prefill_s]
  prefill = sum(per_batch) + (num_batches - 1) * max(per_batch)
  decode = max(max(decode_s), sum(decode_s) / num_batches)
  return prefill, decode


def best_shape(shapes: list[tuple[int, int]], stages: list[list[tuple[bool, float, float]]],
               gen_len: int, num_sequences: int | None = None) -> int | None:
  """Index of the block shape (gpu_batch_size, num_gpu_batches) with the highest predicted
  pipeline throughput among those every stage fits (of `num_sequences` sequences' tokens where
  the run knows how many: a last block's padding rows generate nothing); None if there is none.

  stages[p][j]: whether stage p fits shape j, and its predicted (prefill, decode) seconds of a
  block of that shape.
  """
  best, best_rate = None, 0.0
  for j, (gbs, nb) in enumerate(shapes):
    if not all(stage[j][0] for stage in stages):
      continue
    prefill, decode = pipeline_seconds([stage[j][1] for stage in stages],
                                       [stage[j][2] for stage in stages], nb)
    rate = (gbs * nb * gen_len / max(prefill + decode, 1e-9)
            * search.sequence_share(num_sequences, gbs * nb))
    if rate > best_rate:
      best, best_rate = j, rate
  return best


def agree(link: Link, process_id: int, error: FlexjaxError | None, what: str) -> None:
  """Every stage learns whether every stage succeeded; the first that did not raises its own
  error, the others an OtherStageFailed naming it."""
  failed = link.gather([int(error is not None)], process_id)[:, 0]
  if not failed.any():
    return
  first = int(np.argmax(failed))
  if process_id == first:
    raise error
  raise OtherStageFailed(f'stage {first} {what}')


def _search(rc, st, prompt_len: int, gen_len: int, num_sequences: int | None, shape=None):
  kw = {} if shape is None else dict(gpu_batch_sizes=[shape[0]], num_gpu_batches=[shape[1]])
  found = search.search(st.cfg, st.profile, st.budgets, prompt_len=prompt_len, gen_len=gen_len,
                        sizes=st.planner.sizes, planner=st.planner, template=rc.policy,
                        max_block_seconds=rc.max_block_seconds,
                        max_block_size=rc.max_block_size, num_sequences=num_sequences, **kw)
  return found.policy, found.prediction


def choose_policy(rc, st, link: Link, process_id: int, *, prompt_len: int, gen_len: int,
                  num_sequences: int | None = None):
  """This stage's policy and prediction (for `num_sequences` sequences where the run knows
  how many: see search.search).

  Given by flags: the flags' (the same block shape everywhere). --policy=auto: every stage
  searches the best policy for its own layers within its own budgets; as micro-batches stream
  through every stage, the stages then run one block shape: of the shapes they chose, the one
  whose predicted pipeline throughput is highest among those every stage can fit, each stage
  re-solving its placement for it.
  """
  from flexjax import run as run_lib
  if rc.policy_mode != 'auto':
    return run_lib.choose_policy(rc, st.cfg, st.planner, st.budgets, st.profile, prompt_len,
                                 gen_len, num_sequences=num_sequences)
  error, own = None, None
  try:
    own = _search(rc, st, prompt_len, gen_len, num_sequences)
  except FlexjaxError as e:
    error = e
  agree(link, process_id, error, 'has no policy within its budgets')
  chosen = link.gather([own[0].gpu_batch_size, own[0].num_gpu_batches], process_id)
  shapes = sorted({(int(g), int(n)) for g, n in chosen})
  options, row = [], []
  for shape in shapes:
    try:
      found = own if shape == (own[0].gpu_batch_size, own[0].num_gpu_batches) else _search(
          rc, st, prompt_len, gen_len, num_sequences, shape)
    except FlexjaxError:
      found = None
    options.append(found)
    row += [0, 0, 0] if found is None else [1, round(found[1].prefill_s * 1e6),
                                            round(found[1].decode_s * 1e6)]
  every = link.gather(row, process_id).reshape(-1, len(shapes), 3)
  best = best_shape(shapes, [[(bool(f), pre / 1e6, dec / 1e6) for f, pre, dec in stage]
                             for stage in every], gen_len, num_sequences)
  if best is None:
    raise FlexjaxError(f'no block shape fits every stage: the stages chose {shapes} '
                       '(gpu_batch_size, num_gpu_batches) and each fails on some stage; give '
                       'more memory per stage or more stages')
  return options[best]


def _policy_row(policy: Policy, prediction) -> list[int]:
  """A policy's placement and geometry, and its predicted block seconds, as non-negative ints."""
  times = [0, 0] if prediction is None else [round(prediction.prefill_s * 1e6) + 1,
                                             round(prediction.decode_s * 1e6) + 1]
  return ([policy.gpu_batch_size, policy.num_gpu_batches, int(policy.cpu_attention)]
          + [round(getattr(policy, name) * 1000) for name in _PERCENTS] + times)


def _policy_of(template: Policy, row) -> Policy:
  return dataclasses.replace(template, gpu_batch_size=int(row[0]), num_gpu_batches=int(row[1]),
                             cpu_attention=bool(row[2]),
                             **{name: row[3 + i] / 1000 for i, name in enumerate(_PERCENTS)})


def check_config(rc) -> None:
  """What a pipeline run refuses, by the launcher before any stage starts and by each stage."""
  from flexjax import run as run_lib
  run_lib.check_paths(rc)
  if rc.input:
    raise FlexjaxError('--input jobs do not run in a pipeline; give --prompt_file, or run the '
                       'job with python -m flexjax.main')


def run_stage(rc, num_processes: int, process_id: int, processes_per_host: int = 1
              ) -> dict | None:
  """Runs this process's stage of a generation job (jax.distributed is initialized). Returns
  the report on process 0 (every stage's layers, policy, planned and measured peaks), None
  elsewhere."""
  from flexjax import run as run_lib
  check_config(rc)
  link = Link(num_processes)
  ranges: list[range] = []
  topology: Topology | None = None

  def wrap(source):
    nonlocal topology
    ranges.extend(split_layers(source.config, num_processes))
    topology = Topology(num_processes, process_id, ranges[process_id])
    return StageWeights(source, topology.layers)

  st = run_lib.setup(rc, wrap=wrap)
  st.budgets = stage_budgets(rc.budgets or {}, st.budgets, processes_per_host)
  cfg = st.source.source.config  # the whole model's
  given = run_lib.run_prompts(rc, cfg, st.tokenizer)
  prompt_len = given.length
  gen_len = rc.generation.gen_len
  policy, prediction = choose_policy(
      rc, st, link, process_id, prompt_len=prompt_len, gen_len=gen_len,
      num_sequences=given.count)
  head, problem = run_lib.plan_report(rc, st, policy, prediction, prompt_len=prompt_len,
                                      gen_len=gen_len)
  rows = link.gather(_policy_row(policy, prediction), process_id)
  if not rc.dry_run:  # every stage's fit is known before any raises
    error = None if problem is None else FlexjaxError(
        f'stage {process_id} ({_holds(ranges, process_id)}): {problem}')
    agree(link, process_id, error, "does not fit its budgets; no stage allocated anything")
  result = engine = None
  if not rc.dry_run:
    prompts, texts = given.for_policy(cfg, policy, seed=rc.generation.seed)
    with StageEngine(st.source, topology, link, policy=policy,
                     compute_dtype=st.compute_dtype, cache_dtype=rc.cache_dtype,
                     device=st.device, budgets=st.budgets, planner=st.planner,
                     offload_dir=rc.offload_dir, drop_page_cache=rc.drop_page_cache,
                     weights_cache=rc.weights_cache, io_threads=rc.io_threads,
                     host_memory=rc.host_memory,
                     progress=False) as engine:
      result = engine.generate(prompts, rc.generation)
  measured = st.watch.peaks()
  mine = [int(problem is None)] + [head.get(f'planned_{tier}_peak_bytes', -1) for tier in _TIERS]
  mine += [measured['rss'], measured.get('device', -1)]
  every = link.gather([v + 1 for v in mine], process_id) - 1  # -1: none
  if process_id:
    return None
  report = dict(head)
  if result is not None:
    if rc.output:
      run_lib.write_outputs(rc.output, prompts, texts, result, st.tokenizer)
    report.update(run_lib.report(rc, engine, result, measured))
  report['model'] = cfg.name
  report['pipeline_stages'] = num_processes
  if rc.dry_run:
    report['fits'] = bool(every[:, 0].all())
    report.pop('does_not_fit', None)
  if rows[:, -1].all():  # every stage has a prediction
    pre, dec = pipeline_seconds(rows[:, -2] / 1e6, rows[:, -1] / 1e6, policy.num_gpu_batches)
    report['predicted_total_tok_s'] = round(policy.block_size * gen_len / (pre + dec), 3)
    report['predicted_block_s'] = round(pre + dec, 3)
  for q, row in enumerate(every):
    stage = {'holds': _holds(ranges, q), 'policy': _policy_of(policy, rows[q]).describe()}
    if rc.dry_run:
      stage['fits'] = bool(row[0])
    stage.update({f'planned_{tier}_peak_bytes': int(v)
                  for tier, v in zip(_TIERS, row[1:5]) if v >= 0})
    if result is not None:
      if st.device.platform == 'cpu':
        stage['measured_ram_peak_bytes'] = int(row[5])
      else:
        stage['measured_host_peak_bytes'] = int(row[5])
        stage['measured_device_peak_bytes'] = int(row[6])
    report[f'stage{q}'] = stage
  return report


def _holds(ranges: list[range], q: int) -> str:
  parts = (['embed'] if q == 0 else []) + [f'layers {ranges[q].start}-{ranges[q].stop - 1}'] + (
      ['head'] if q == len(ranges) - 1 else [])
  return ' + '.join(parts)


