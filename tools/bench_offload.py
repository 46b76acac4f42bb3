"""Offloading benchmark (the paper's ablation): block vs row-by-row order, overlap, page cache.

  python -m tools.bench_offload --model=opt-1.3b --prompt_len=64 --gen_len=8 \
      --cases=block,row_by_row,no_overlap --gpu_batch_size=8 --num_gpu_batches=4 \
      --w_gpu_percent=0 --w_cpu_percent=30 --cache_gpu_percent=100 --cache_cpu_percent=0 \
      --gpu_mem=4 --cpu_mem=1 --page_cache=warm,dropped --offload_dir=/tmp/fj \
      --output=bench_results/offload.jsonl [--projected_gen_len=3]
  python -m tools.bench_offload --render=bench_results/offload.jsonl

Every case runs the same gpu_batch_size x num_gpu_batches prompts on dummy float16 weights, with
one engine per case and page-cache mode: an untimed warm-up (compile) of the first block, then the
timed run. Cases derive from the policy of the flags ("base"):
  block             the base policy: each layer's weights are loaded once per block.
  row_by_row        num_gpu_batches=1, the same prompts as consecutive one-batch blocks (the
                    DeepSpeed/Accelerate order): weights are loaded once per GPU batch.
  no_overlap        overlap=False: loads and stores run between computations.
  cpu_attention     cpu_attention=True; no_cpu_attention: cpu_attention=False.
Page cache: "warm" leaves offloaded files in the OS page cache, "dropped" drops them after each
access so disk reads really hit the disk. Throughputs follow the FlexGen paper (see tools/bench.py);
with --projected_gen_len=K only K tokens are generated and decode time is extrapolated to gen_len
as decode_s * (gen_len-1) / (K-1), recorded with "projected": true.
"""

from __future__ import annotations

import dataclasses
import gc
from typing import Any, Callable, Sequence

from absl import flags

from flexjax import config as config_lib
from flexjax.errors import FlexjaxError
from flexjax.model.params import layer_name
from flexjax.policy import Policy
from flexjax import flags as flags_lib
from tools.benchlib import (fmt_number, git_commit, host_peak_rss, jsonl_appender, machine_info,
                            new_run_id, read_records, report_error, reset_peak_rss, run_tool,
                            throughputs, timestamp, versions)


def define_flags(fv: flags.FlagValues) -> None:
  """Defines the tool's flags on `fv` (called by the entry point only, so importing is free)."""
  f = dict(flag_values=fv)
  flags.DEFINE_string('model', 'opt-1.3b', f'Model preset: {", ".join(config_lib.PRESETS)}.', **f)
  flags.DEFINE_enum('compute_dtype', 'float32', list(config_lib.DTYPES),
                    'Dtype of the layer math (weights are stored as float16).', **f)
  flags.DEFINE_integer('prompt_len', 64, 'Tokens per prompt (all prompts equal, BOS included).',
                       **f)
  flags.DEFINE_integer('gen_len', 8, 'New tokens per prompt (>= 2).', **f)
  flags.DEFINE_integer('projected_gen_len', None, 'Generate only this many tokens (2 <= K < '
                       'gen_len) and extrapolate decode time to --gen_len.', **f)
  flags.DEFINE_list('cases', ['block', 'row_by_row', 'no_overlap'],
                    'Cases: block, row_by_row, no_overlap, cpu_attention, no_cpu_attention.', **f)
  flags.DEFINE_list('page_cache', ['warm', 'dropped'], 'Page-cache modes: warm, dropped.', **f)
  flags_lib.define_policy_flags(fv)  # the base policy, budgets, offload folder
  flags.DEFINE_string('output', None, 'JSONL file to append one line per run to.', **f)
  flags.DEFINE_string('render', None, 'Print a markdown table of this results JSONL instead of '
                      'running.', **f)


# ---- cases ---------------------------------------------------------------------------------------
def case_policy(base: Policy, case: str) -> Policy:
  """The policy of a named case, derived from the base policy."""
  if case == 'block':
    return base
  if case == 'row_by_row':
    return dataclasses.replace(base, num_gpu_batches=1)
  if case == 'no_overlap':
    return dataclasses.replace(base, overlap=False)
  if case == 'cpu_attention':
    return dataclasses.replace(base, cpu_attention=True)
  if case == 'no_cpu_attention':
    return dataclasses.replace(base, cpu_attention=False)
  raise FlexjaxError(f'case={case!r} is unknown; use block, row_by_row, no_overlap, '
                     'cpu_attention or no_cpu_attention')


def run_context() -> dict[str, Any]:
  """Fields shared by every record of one benchmark invocation."""
  return {'commit': git_commit(), 'machine': machine_info(), 'versions': versions(),
          'run_id': new_run_id()}


def check_lengths(cfg: config_lib.ModelConfig, *, prompt_len: int, gen_len: int,
                  projected_gen_len: int | None) -> None:
  if prompt_len < 1:
    raise FlexjaxError(f'prompt_len={prompt_len} must be positive')
  if gen_len < 2:
    raise FlexjaxError(f'gen_len={gen_len} must be >= 2 (decode needs a second token)')
  if projected_gen_len is not None and not 2 <= projected_gen_len < gen_len:
    raise FlexjaxError(f'projected_gen_len={projected_gen_len} must be in [2, gen_len={gen_len}); '
                       'drop it to measure the whole generation')
  if prompt_len + gen_len - 1 > cfg.max_positions:
    raise FlexjaxError(f'prompt_len={prompt_len} plus gen_len={gen_len} needs '
                       f'{prompt_len + gen_len - 1} positions but {cfg.name} has '
                       f'{cfg.max_positions}; shorten one')


def _check_projection_fits(engine, policy: Policy, budgets: dict[str, int | None], *,
                           prompt_len: int, gen_len: int) -> None:
  """A projected run stands for the full one only if the full one fits the budgets too."""
  from flexjax.engine import GenerationConfig
  try:
    engine.plan(prompt_len, GenerationConfig(gen_len=gen_len), policy=policy).check(budgets)
  except FlexjaxError as e:
    raise FlexjaxError(f'the full gen_len={gen_len} run does not fit ({e}); a projection from a '
                       'shorter run would be invalid: raise the budget or lower gen_len') from None


def dummy_planner(cfg: config_lib.ModelConfig, compute_dtype: str):
  """The planner of run_case's engine (dummy float16 weights on this process's first device):
  a search planning with it chooses a policy that the plan the run enforces admits (a planner
  for item sizes alone compiles on the CPU, whose XLA memory is not a GPU's)."""
  import jax

  from flexjax import plan as plan_lib
  return plan_lib.Planner.for_device(cfg, jax.local_devices()[0], storage_dtype='float16',
                                     compute_dtype=compute_dtype)


def run_case(cfg: config_lib.ModelConfig, base: Policy, *, case: str, page_cache: str,
             prompt_len: int, gen_len: int, projected_gen_len: int | None = None,
             compute_dtype: str = 'float32', offload_dir: str | None = None,
             budgets: dict[str, int | None] | None = None,
             context: dict[str, Any] | None = None, profile=None,
             planner=None) -> dict[str, Any]:
  """Runs one case in one page-cache mode on a fresh engine. Returns its record.

  Args:
    cfg: the model's shapes (dummy float16 weights are made from it).
    base: the policy the cases derive from; base.block_size prompts are generated in every case.
    case: see case_policy.
    page_cache: 'warm' or 'dropped' (offloaded files dropped from the page cache after access).
    projected_gen_len: generate this many tokens and extrapolate decode time to gen_len.
    budgets: bytes per tier ('device', 'host', 'disk'); None or a missing key: unlimited.
    context: run_context() of the invocation (default: a new one).
    profile: a HardwareProfile: the record then carries the cost model's prediction.
    planner: dummy_planner(cfg, compute_dtype) to reuse (default: the engine's own).
  """
  from flexjax.engine import Engine, GenerationConfig
  from flexjax.run import synthetic_prompts
  from flexjax.weights import DummyWeights
  if page_cache not in ('warm', 'dropped'):
    raise FlexjaxError(f'page_cache={page_cache!r} is unknown; use warm or dropped')
  check_lengths(cfg, prompt_len=prompt_len, gen_len=gen_len, projected_gen_len=projected_gen_len)
  policy = case_policy(base, case)
  budgets = dict(budgets or {})
  measured_gen_len = projected_gen_len or gen_len
  prompts = synthetic_prompts(cfg, num=base.block_size, length=prompt_len, seed=0)
  gen = GenerationConfig(gen_len=measured_gen_len, stop_at_eos=False)
  with Engine(DummyWeights(cfg, dtype='float16'), policy=policy, compute_dtype=compute_dtype,
              budgets=budgets, offload_dir=offload_dir, planner=planner,
              drop_page_cache=(page_cache == 'dropped')) as engine:
    if projected_gen_len is not None:
      _check_projection_fits(engine, policy, budgets, prompt_len=prompt_len, gen_len=gen_len)
    reset_peak_rss()
    result = engine.generate(prompts, gen)
    rss = host_peak_rss()
    device = f'{engine.device.platform}:{engine.device.device_kind}'
    files_bw = None
    if engine.layout is not None and result.disk_weight_bytes.get('decode'):
      from tools import roofline  # the disk as this run's own weight files read, now
      files_bw = roofline.files_read_bandwidth(engine.layout.files())
    predicted = _prediction(cfg, policy, profile, engine.sizes, prompt_len, gen_len)
  del engine
  gc.collect()
  return make_record(cfg=cfg, base=base, policy=policy, case=case, page_cache=page_cache,
                     compute_dtype=compute_dtype, prompt_len=prompt_len, gen_len=gen_len,
                     result=result, extra={'device': device, 'host_peak_rss_bytes': rss,
                                           'weight_files_read_bw': files_bw,
                                           'budgets': budgets, 'predicted': predicted,
                                           **(context or run_context())})


def _prediction(cfg, policy, profile, sizes, prompt_len, gen_len) -> dict[str, Any] | None:
  """The cost model's view of the case (one block), to set beside the measurement."""
  if profile is None:
    return None
  from flexjax import cost_model
  p = cost_model.predict(cfg, policy, profile, sizes, prompt_len=prompt_len, gen_len=gen_len)
  return {'profile': profile.name, 'prefill_s': p.prefill_s, 'decode_s': p.decode_s,
          'total_s': p.prefill_s + p.decode_s, 'total_tok_s': p.throughput,
          'peak_bytes': p.peak_bytes}


def make_record(*, cfg: config_lib.ModelConfig, base: Policy, policy: Policy, case: str,
                page_cache: str, compute_dtype: str, prompt_len: int, gen_len: int, result,
                extra: dict[str, Any]) -> dict[str, Any]:
  """One JSON line from a GenerationResult of result.gen_len tokens; when that is shorter than
  gen_len, decode time is extrapolated to gen_len and the record says "projected": true."""
  measured_gen_len = result.gen_len
  decode_s = result.decode_s * (gen_len - 1) / (measured_gen_len - 1)
  return {
      'tool': 'bench_offload', 'case': case, 'model': cfg.name,
      'policy': policy.describe(), 'policy_fields': dataclasses.asdict(policy),
      'base_policy': base.describe(), 'page_cache': page_cache,
      'compute_dtype': compute_dtype, 'weight_storage_dtype': 'float16',
      'num_prompts': result.num_prompts, 'prompt_len': prompt_len, 'gen_len': gen_len,
      'measured_gen_len': measured_gen_len, 'projected': measured_gen_len < gen_len,
      'prefill_s': result.prefill_s, 'decode_s': decode_s, 'measured_decode_s': result.decode_s,
      **throughputs(batch_size=result.num_prompts, prompt_len=prompt_len, gen_len=gen_len,
                    prefill_s=result.prefill_s, decode_s=decode_s),
      'peak_bytes': dict(result.peak_bytes), 'planned_peak_bytes': dict(result.planned_peak_bytes),
      'weight_loads_per_stage': result.weight_loads[layer_name(0)],
      'bytes_moved': dict(result.bytes_moved),
      'disk_weight_bytes': dict(result.disk_weight_bytes), 'breakdown': result.breakdown, **extra,
      'timestamp': timestamp(),
  }


# ---- rendering -----------------------------------------------------------------------------------
def _gib(peaks: dict[str, int] | None, tier: str) -> str:
  value = (peaks or {}).get(tier)
  return '—' if value is None else f'{value / 2**30:.2f}'


def render_offload_table(records: Sequence[dict[str, Any]]) -> str:
  """A markdown table: a row per run × page-cache mode × case, with the total tok/s ratio to the
  block case of the same run, model, page-cache mode and lengths ("vs block")."""
  def group(r):
    return (r.get('run_id', ''), r['model'], r.get('base_policy', ''), r['prompt_len'],
            r['gen_len'], r['page_cache'])
  blocks = {group(r): r['total_tok_s'] for r in records if r['case'] == 'block'}
  first_seen: dict[Any, int] = {}
  for r in records:
    first_seen.setdefault(group(r), len(first_seen))
    first_seen.setdefault(('case', r['case']), len(first_seen))
  rows = sorted(records, key=lambda r: (first_seen[group(r)], first_seen[('case', r['case'])]))
  lines = [
      '| run | model | base policy | prompt+gen | page cache | case | total tok/s | '
      'prefill tok/s | decode tok/s | device peak GiB | host peak GiB | disk peak GiB | '
      'vs block |',
      '|' + '---|' * 6 + '---:|' * 7,
  ]
  for r in rows:
    lengths = f'{r["prompt_len"]}+{r["gen_len"]}'
    if r.get('projected'):
      lengths += f' (projected from {r["measured_gen_len"]})'
    block = blocks.get(group(r))
    ratio = f'{r["total_tok_s"] / block:.2f}x' if block else '—'
    cells = [r.get('run_id', '')[:15], r['model'], r.get('base_policy', ''), lengths,
             r['page_cache'], r['case'], fmt_number(r['total_tok_s']),
             fmt_number(r['prefill_tok_s']), fmt_number(r['decode_tok_s']),
             _gib(r.get('peak_bytes'), 'device'), _gib(r.get('peak_bytes'), 'host'),
             _gib(r.get('peak_bytes'), 'disk'), ratio]
    lines.append('| ' + ' | '.join(cells) + ' |')
  return '\n'.join(lines)


# ---- command line --------------------------------------------------------------------------------
def settings_from_flags(fv: flags.FlagValues) -> dict[str, Any]:
  """Validates the flags into run_all's arguments; raises FlexjaxError naming the bad value."""
  if not fv.output:
    raise FlexjaxError('--output is required to run; e.g. --output=bench_results/offload.jsonl '
                       '(or pass --render=FILE to print a table)')
  cfg = config_lib.preset(fv.model)
  base = flags_lib.policy_from_flags(fv)
  for case in fv.cases:
    case_policy(base, case)  # raises on an unknown case before anything runs
  for mode in fv.page_cache:
    if mode not in ('warm', 'dropped'):
      raise FlexjaxError(f'--page_cache has {mode!r}; choose from warm, dropped')
  check_lengths(cfg, prompt_len=fv.prompt_len, gen_len=fv.gen_len,
                projected_gen_len=fv.projected_gen_len)
  return dict(cfg=cfg, base=base, cases=list(fv.cases), page_cache_modes=list(fv.page_cache),
              prompt_len=fv.prompt_len, gen_len=fv.gen_len,
              projected_gen_len=fv.projected_gen_len, compute_dtype=fv.compute_dtype,
              offload_dir=fv.offload_dir, budgets=flags_lib.budgets_from_flags(fv),
              profile=_profile(fv))


def _profile(fv: flags.FlagValues):
  if not fv.hw_profile:
    return None
  from flexjax.hardware import HardwareProfile, t4_profile
  return t4_profile() if fv.hw_profile == 'paper-t4' else HardwareProfile.load(fv.hw_profile)


def run_all(emit: Callable[[dict[str, Any]], None], *, cfg: config_lib.ModelConfig,
            base: Policy, cases: Sequence[str], page_cache_modes: Sequence[str],
            **case_kw) -> None:
  """Runs every page-cache mode × case (one engine each), passing records to emit."""
  context = run_context()
  for mode in page_cache_modes:
    for case in cases:
      emit(run_case(cfg, base, case=case, page_cache=mode, context=context, **case_kw))


def run_cli(fv: flags.FlagValues) -> int:
  """The tool on parsed flags: renders or runs; one-line errors, exit status 2."""
  try:
    if fv.render:
      print(render_offload_table(read_records(fv.render)))
      return 0
    settings = settings_from_flags(fv)
    with jsonl_appender(fv.output) as emit:
      run_all(emit, **settings)
  except FlexjaxError as e:
    return report_error('bench_offload', e)
  return 0


if __name__ == '__main__':
  run_tool(define_flags, run_cli)
