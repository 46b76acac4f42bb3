"""Device memory in use and its peak after each phase of an Engine's run, against the plan.

  python -m tools.phase_memory --model=opt-125m --rows=8 --prompt_len=128 --gen_len=8
  python -m tools.phase_memory --cache_on_host --json

Runs the library's path (an Engine over dummy weights, then generate) in this process and
reads the backend's memory_stats() after each phase: the Engine built (weights placed), its
steps compiled (Planner.compile_run, as generate's warm-up does; here after the placement),
the generation. With the RSS (current and peak) beside each line. Where the backend reports no
memory_stats (a CPU), the device columns read 0 and only the RSS says anything. Prints the
plan's peak per tier and phase too: a line whose peak exceeds the plan's device peak names the
phase where the plan failed to bound the allocator. On a GPU, run it once with and once without
XLA_PYTHON_CLIENT_PREALLOCATE=false to see what the allocator's growth regions add.
"""

from __future__ import annotations

import json
from typing import Any

from tools.benchlib import report_error, run_tool


def measure(model: str, *, rows: int, prompt_len: int, gen_len: int,
            cache_on_host: bool) -> dict[str, Any]:
  """{'phases': [{phase, in_use, peak, rss, rss_peak}], 'plan': {tier: {phase: bytes}},
  'planned_device_peak': bytes, 'device': name} for one run."""
  import jax

  from flexjax import memwatch
  from flexjax.config import preset
  from flexjax.engine import Engine, GenerationConfig
  from flexjax.policy import Policy
  from flexjax.run import synthetic_prompts
  from flexjax.weights import DummyWeights

  device = jax.local_devices()[0]
  phases = []

  def mark(phase: str) -> None:
    stats = device.memory_stats() or {}
    rss, rss_peak = memwatch.rss_and_peak()  # one reading: the peak is the kernel's beside it
    phases.append({'phase': phase, 'in_use': int(stats.get('bytes_in_use', 0)),
                   'peak': int(stats.get('peak_bytes_in_use', 0)),
                   'rss': rss, 'rss_peak': rss_peak})

  cfg = preset(model)
  fields = {'gpu_batch_size': rows}
  if cache_on_host:
    fields.update(cache_gpu_percent=0, cache_cpu_percent=100)
  policy = Policy(**fields)
  gen = GenerationConfig(gen_len=gen_len)
  mark('start')
  with Engine(DummyWeights(cfg, 'float16'), policy=policy, device=device) as engine:
    mark('placed')
    plan = engine.plan(prompt_len, gen)
    engine.planner.compile_run(policy, prompt_len=prompt_len, gen_len=gen_len)
    mark('compiled')
    engine.generate(synthetic_prompts(cfg, rows, prompt_len, seed=0), gen)
    mark('generated')
  return {'device': f'{device.platform}:{device.device_kind}', 'phases': phases,
          'plan': plan.by_phase(), 'planned_device_peak': plan.peaks()['device']}


def define_flags(fv) -> None:
  from absl import flags
  f = dict(flag_values=fv)
  flags.DEFINE_string('model', 'opt-125m', 'Model preset (dummy weights, stored float16).', **f)
  flags.DEFINE_integer('rows', 8, 'Sequences (one GPU batch).', lower_bound=1, **f)
  flags.DEFINE_integer('prompt_len', 128, 'Prompt length.', lower_bound=1, **f)
  flags.DEFINE_integer('gen_len', 8, 'New tokens.', lower_bound=1, **f)
  flags.DEFINE_bool('cache_on_host', False, 'Keep the KV cache in host memory.', **f)
  flags.DEFINE_bool('json', False, 'Print the record as one JSON line as well.', **f)


def run_cli(fv) -> int:
  from flexjax.errors import FlexjaxError
  try:
    got = measure(fv.model, rows=fv.rows, prompt_len=fv.prompt_len, gen_len=fv.gen_len,
                  cache_on_host=fv.cache_on_host)
  except FlexjaxError as e:
    return report_error('phase_memory', e)
  if fv.json:
    print(json.dumps(got))
  mib = lambda v: f'{v / 2**20:9.2f}'  # noqa: E731
  print(f'{fv.model} {fv.rows} x {fv.prompt_len} + {fv.gen_len} on {got["device"]} (MiB)')
  print(f'{"phase":>10} {"in use":>9} {"peak":>9} {"rss":>9} {"rss peak":>9}')
  for p in got['phases']:
    print(f'{p["phase"]:>10} {mib(p["in_use"])} {mib(p["peak"])} {mib(p["rss"])} '
          f'{mib(p["rss_peak"])}')
  print(f'planned device peak {mib(got["planned_device_peak"])}; by phase: '
        + ', '.join(f'{phase} {mib(v).strip()}' for phase, v in got['plan']['device'].items()))
  return 0


if __name__ == '__main__':
  run_tool(define_flags, run_cli)
