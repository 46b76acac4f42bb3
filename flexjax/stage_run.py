"""One process's stage of a pipelined job: its budgets, its policy (given, or searched for its
layers and agreed with the other stages on one block shape), the plan check of every stage
before any stage allocates, the run, and the report (process 0)."""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import numpy as np

from flexjax import search
from flexjax.errors import FlexjaxError
from flexjax.pipeline import Link, StageEngine, StageWeights, Topology, split_layers
from flexjax.policy import Policy

_TIERS = ('device', 'host', 'disk', 'ram')


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


def choose_policy(rc, st, link: Link, process_id: int, *, prompt_len: int, gen_len: int,
                  num_sequences: int | None = None, kept: Policy | None = None,
                  generation=None):
  """This stage's policy and prediction (for `num_sequences` sequences where the run knows
  how many: see search.search; `kept`: a resumed job's block shape and approximations, and
  `generation`, see run.choose_policy).

  Given by flags: the flags' (the same block shape everywhere). --policy=auto: every stage
  searches the best policy for its own layers within its own budgets; as micro-batches stream
  through every stage, the stages then run one block shape: of the shapes they chose, the one
  whose predicted pipeline throughput is highest among those every stage can fit, each stage
  re-solving its placement for it.
  """
  from flexjax import run as run_lib

  def chosen_for(kept: Policy | None):  # a search keeps kept's block shape where given
    return run_lib.choose_policy(rc, st.cfg, st.planner, st.budgets, st.profile, prompt_len,
                                 gen_len, num_sequences=num_sequences, kept=kept,
                                 generation=generation)

  if rc.policy_mode != 'auto':
    return chosen_for(kept)
  template = kept or rc.policy
  error, own = None, None
  try:
    own = chosen_for(kept)
  except FlexjaxError as e:
    error = e
  agree(link, process_id, error, 'has no policy within its budgets')
  chosen = link.gather([own[0].gpu_batch_size, own[0].num_gpu_batches], process_id)
  shapes = sorted({(int(g), int(n)) for g, n in chosen})
  options, row = [], []
  for shape in shapes:
    try:
      found = own if shape == (own[0].gpu_batch_size, own[0].num_gpu_batches) else chosen_for(
          dataclasses.replace(template, gpu_batch_size=shape[0], num_gpu_batches=shape[1]))
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


@dataclasses.dataclass(frozen=True)
class _StagePlan:
  """One stage's policy and its predicted block seconds (None: no prediction), as every stage
  learns them (Link.everyone)."""

  policy: Policy
  prefill_s: float | None
  decode_s: float | None


def check_config(rc, report_json: str | None = None) -> None:
  """What a pipeline run refuses, by the launcher before any stage starts and by each stage."""
  from flexjax import job as job_lib
  from flexjax import run as run_lib
  run_lib.check_paths(rc, report_json)
  if rc.input:
    job_lib.read_input(rc)


@dataclasses.dataclass
class _Stage:
  """This process's part of the pipeline: its link to the others, its setup (its layers'
  weights, budgets, planner) and where the model's layers went."""

  rc: Any
  link: Link
  process_id: int
  st: Any
  ranges: list[range]
  topology: Topology

  @property
  def cfg(self):  # the whole model's
    return self.st.source.source.config

  def engine(self, policy: Policy) -> StageEngine:
    rc, st = self.rc, self.st
    return StageEngine(st.source, self.topology, self.link, policy=policy,
                       compute_dtype=st.compute_dtype, cache_dtype=rc.cache_dtype,
                       device=st.device, budgets=st.budgets, planner=st.planner,
                       offload_dir=rc.offload_dir, drop_page_cache=rc.drop_page_cache,
                       weights_cache=rc.weights_cache, io_threads=rc.io_threads,
                       host_memory=rc.host_memory, progress=False)


def _start(rc, num_processes: int, process_id: int, processes_per_host: int) -> _Stage:
  from flexjax import run as run_lib
  check_config(rc)
  link = Link(num_processes)
  ranges: list[range] = []
  topology: list[Topology] = []

  def wrap(source):
    ranges.extend(split_layers(source.config, num_processes))
    topology.append(Topology(num_processes, process_id, ranges[process_id]))
    return StageWeights(source, topology[0].layers)

  st = run_lib.setup(rc, wrap=wrap)
  st.budgets = stage_budgets(rc.budgets or {}, st.budgets, processes_per_host)
  return _Stage(rc, link, process_id, st, ranges, topology[0])


def _plan(stage: _Stage, *, prompt_len: int, gen_len: int, num_sequences: int | None,
          policy: Policy | None = None, final: bool = False, generation=None):
  """This stage's policy (final: a resumed job's own; else chosen, keeping `policy`'s block
  shape and approximations where given) and prediction, its report head, and every stage's
  policy row; unless a dry run, every stage fits or none goes on. generation: see
  run.plan_report."""
  from flexjax import run as run_lib
  rc, st, p = stage.rc, stage.st, stage.process_id
  prediction = None
  if not final:
    policy, prediction = choose_policy(rc, st, stage.link, p, prompt_len=prompt_len,
                                       gen_len=gen_len, num_sequences=num_sequences, kept=policy,
                                       generation=generation)
  head, problem = run_lib.plan_report(rc, st, policy, prediction, prompt_len=prompt_len,
                                      gen_len=gen_len, generation=generation)
  mine = {'policy': dataclasses.asdict(policy),
          'prefill_s': prediction.prefill_s if prediction else None,
          'decode_s': prediction.decode_s if prediction else None}
  plans = [_StagePlan(Policy(**d.pop('policy')), **d) for d in stage.link.everyone(mine, p)]
  if not rc.dry_run:  # every stage's fit is known before any raises
    error = None if problem is None else FlexjaxError(
        f'stage {p} ({_holds(stage.ranges, p)}): {problem}')
    agree(stage.link, p, error, "does not fit its budgets; no stage allocated anything")
  return policy, head, problem, plans


def _stage_report(stage: _Stage, report: dict, *, policy: Policy, problem,
                  plans: list[_StagePlan], gen_len: int, ran: bool) -> dict | None:
  """Every stage's layers, policy and planned and measured peaks, on process 0 (None
  elsewhere), added to `report`; with the pipeline's predicted throughput."""
  rc, st = stage.rc, stage.st
  measured = st.watch.peaks()
  mine = [int(problem is None)]
  mine += [report.get(f'planned_{tier}_peak_bytes', -1) for tier in _TIERS]
  mine += [measured['rss'], measured.get('device', -1)]
  every = stage.link.gather([v + 1 for v in mine], stage.process_id) - 1  # -1: none
  if stage.process_id:
    return None
  report['model'] = stage.cfg.name
  report['pipeline_stages'] = stage.link.n
  if rc.dry_run:
    report['fits'] = bool(every[:, 0].all())
    report.pop('does_not_fit', None)
  if all(plan.decode_s is not None for plan in plans):  # every stage has a prediction
    pre, dec = pipeline_seconds([plan.prefill_s for plan in plans],
                                [plan.decode_s for plan in plans], policy.num_gpu_batches)
    report['predicted_total_tok_s'] = round(policy.block_size * gen_len / (pre + dec), 3)
    report['predicted_block_s'] = round(pre + dec, 3)
  for q, row in enumerate(every):
    entry = {'holds': _holds(stage.ranges, q), 'policy': plans[q].policy.describe()}
    if rc.dry_run:
      entry['fits'] = bool(row[0])
    entry.update({f'planned_{tier}_peak_bytes': int(v)
                  for tier, v in zip(_TIERS, row[1:5]) if v >= 0})
    if ran:
      if st.device.platform == 'cpu':
        entry['measured_ram_peak_bytes'] = int(row[5])
      else:
        entry['measured_host_peak_bytes'] = int(row[5])
        entry['measured_device_peak_bytes'] = int(row[6])
    report[f'stage{q}'] = entry
  return report


def run_stage(rc, num_processes: int, process_id: int, processes_per_host: int = 1
              ) -> dict | None:
  """Runs this process's stage of a generation job, or of a batch job (--input: see
  job.run_job_at) (jax.distributed is initialized). Returns the report on process 0 (every
  stage's layers, policy, planned and measured peaks), None elsewhere."""
  from flexjax import run as run_lib
  stage = _start(rc, num_processes, process_id, processes_per_host)
  if rc.input:
    from flexjax import job as job_lib
    return job_lib.run_job_at(_JobStage(stage), job_lib.read_input(rc))
  st, cfg = stage.st, stage.cfg
  given = run_lib.run_prompts(rc, cfg, st.tokenizer)
  gen_len = rc.generation.gen_len
  policy, head, problem, plans = _plan(stage, prompt_len=given.length, gen_len=gen_len,
                                       num_sequences=given.count)
  result = engine = None
  if not rc.dry_run:
    prompts, texts = given.for_policy(cfg, policy, seed=rc.generation.seed)
    with stage.engine(policy) as engine:
      result = engine.generate(prompts, rc.generation)
  report = dict(head)
  if result is not None and not process_id:
    if rc.output:
      run_lib.write_outputs(rc.output, prompts, texts, result, st.tokenizer)
    report.update(run_lib.report(rc, engine, result, st.watch.peaks()))
  return _stage_report(stage, report, policy=policy, problem=problem, plans=plans,
                       gen_len=gen_len, ran=result is not None)


@dataclasses.dataclass
class _JobStage:
  """This stage's part of a batch job (job.Place): stage 0 owns the output and its progress
  file, read on resume and handed to the others; stage 0's bar shows on the launcher's terminal
  (its stdout is the launcher's, its stderr a log the launcher reads)."""

  of: _Stage
  gen_len: int = 0
  problem: Any = None
  plans: list[_StagePlan] = dataclasses.field(default_factory=list)

  def __post_init__(self):  # job.Place's fields
    self.rc, self.st, self.source = self.of.rc, self.of.st, self.of.st.source.source
    self.stages, self.stage = self.of.link.n, self.of.process_id
    self.owns_output = self.stage == 0
    self.progress_stream = sys.stdout if self.owns_output else None

  def same_job(self, job: str) -> None:
    jobs = self.of.link.everyone(job, self.stage)
    self.agree(None if job == jobs[0] else FlexjaxError(
        f'stage {self.stage} reads another job (its --input or flags differ from stage 0\'s); '
        'give every stage the same input file and flags'), 'reads another job')

  def agree(self, error: FlexjaxError | None, what: str) -> None:
    agree(self.of.link, self.stage, error, what)

  def from_owner(self, value):
    return self.of.link.everyone(value, self.stage)[0]

  def plan(self, policy, *, final, prompt_len, gen_len, num_sequences, generation):
    policy, head, self.problem, self.plans = _plan(
        self.of, prompt_len=prompt_len, gen_len=gen_len, num_sequences=num_sequences,
        policy=policy, final=final, generation=generation)
    self.gen_len = gen_len
    return policy, head

  def policies(self, policy: Policy) -> list[Policy]:
    return [plan.policy for plan in self.plans] or [policy] * self.stages

  def engine(self, policy: Policy) -> StageEngine:
    return self.of.engine(policy)

  def report(self, report: dict, *, ran: bool) -> dict | None:
    if not self.plans:  # a job of bad rows only: no stage planned anything
      return None if self.stage else report
    return _stage_report(self.of, report, policy=self.plans[self.stage].policy,
                         problem=self.problem, plans=self.plans, gen_len=self.gen_len, ran=ran)


def _holds(ranges: list[range], q: int) -> str:
  parts = (['embed'] if q == 0 else []) + [f'layers {ranges[q].start}-{ranges[q].stop - 1}'] + (
      ['head'] if q == len(ranges) - 1 else [])
  return ' + '.join(parts)


