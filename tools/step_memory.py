"""One prefill layer step's memory as the kernel reports it, against what the plan counts.

  python -m tools.step_memory --model=opt-1.3b --rows=32 --prompt_len=128 --dtype=bfloat16
  python -m tools.step_memory --model=opt-6.7b --rows=8 --prompt_len=512 --dtype=float32

Compiles the prefill step of one layer as a run calls it (weights stored float16, no cache
kept; oneDNN's products for float32 steps of linear.LIBRARY_ROWS rows or more on a CPU
backend), runs it once, then measures the peak RSS a second run adds (the kernel's peak mark
reset first; memory freed by the first run handed back). Prints that against XLA's own bytes
(memory analysis: temporaries and outputs) and the bytes of XLA:CPU's library fusions that
steps.StepMemory adds (flexjax/library_scratch.py). Run it in a fresh process per case: a
process that has run larger programs reuses their freed memory and reads low. --model_json
takes a dict of ModelConfig fields instead of a preset.
"""

from __future__ import annotations

import gc
import json
from typing import Any

from tools.benchlib import report_error, run_tool


def measure(cfg, *, rows: int, prompt_len: int, dtype: str, programs: list) -> dict[str, Any]:
  """{'rss', 'xla', 'library', 'counted', 'onednn'} in bytes for one prefill layer step; the
  compiled step is appended to `programs`, which the caller frees after its later work
  (flexjax.model.linear.library_options: a oneDNN program freed right after its run can abort)."""
  import jax
  import numpy as np

  from flexjax import memwatch
  from flexjax.library_scratch import scratch_bytes
  from flexjax.steps import Geometry, StepMemory, one_layer

  device = jax.devices('cpu')[0]
  steps, layer = one_layer(cfg, compute_dtype=dtype, device=device)
  onednn = steps.uses_library(Geometry.prompt(rows, prompt_len))
  x = jax.device_put(np.random.default_rng(0).standard_normal(
      (rows, prompt_len, cfg.hidden_size)).astype(dtype), device)
  mask = jax.device_put(np.ones((rows, prompt_len), bool), device)
  fn = steps.prefill_layer_library if onednn else steps.prefill_layer
  compiled = fn.lower(layer, x, None, mask, device_rows=0).compile()
  programs.append(compiled)
  stats = compiled.memory_analysis()
  jax.block_until_ready(compiled(layer, x, None, mask))
  gc.collect()
  memwatch.return_free_memory()
  watch = memwatch.MemoryWatch.start(device)
  jax.block_until_ready(compiled(layer, x, None, mask))
  return {'rss': watch.peaks()['rss'],
          'xla': int(stats.temp_size_in_bytes + stats.output_size_in_bytes),
          'library': scratch_bytes(compiled.as_text()),
          'counted': StepMemory.of(compiled).total, 'onednn': onednn}


def define_flags(fv) -> None:
  from absl import flags
  f = dict(flag_values=fv)
  flags.DEFINE_string('model', 'opt-1.3b', 'Model preset whose layer to run.', **f)
  flags.DEFINE_string('model_json', None, 'A dict of ModelConfig fields instead of --model.', **f)
  flags.DEFINE_integer('rows', 32, 'Sequences in the step.', lower_bound=1, **f)
  flags.DEFINE_integer('prompt_len', 128, 'Prompt length.', lower_bound=1, **f)
  flags.DEFINE_enum('dtype', 'float32', ['float32', 'bfloat16', 'float16'],
                    'Compute dtype of the step.', **f)


def run_cli(fv) -> int:
  from flexjax import config as config_lib
  from flexjax.errors import FlexjaxError
  try:
    if fv.model_json:
      try:
        cfg = config_lib.ModelConfig(**json.loads(fv.model_json))
      except (TypeError, ValueError) as e:
        raise FlexjaxError(f'--model_json={fv.model_json} is not a dict of ModelConfig fields '
                           f'({e})') from None
    else:
      cfg = config_lib.preset(fv.model)
    programs: list = []  # freed as the tool returns, after its output
    got = measure(cfg, rows=fv.rows, prompt_len=fv.prompt_len, dtype=fv.dtype,
                  programs=programs)
  except FlexjaxError as e:
    return report_error('step_memory', e)
  mib = lambda v: f'{v / 2**20:.1f} MiB'  # noqa: E731
  print(json.dumps(got))
  print(f'{cfg.name} prefill layer {fv.rows} x {fv.prompt_len} {fv.dtype}'
        f'{" (oneDNN)" if got["onednn"] else ""}: peak RSS added {mib(got["rss"])}; '
        f'XLA\'s bytes {mib(got["xla"])}, library fusions {mib(got["library"])}, counted '
        f'{mib(got["counted"])}')
  return 0


if __name__ == '__main__':
  run_tool(define_flags, run_cli)
