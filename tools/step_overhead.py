"""The engine's own time per decode step, apart from the work of the step.

  python -m tools.step_overhead
  python -m tools.step_overhead --layers=32 --rows=2 --json

A model of --layers decoder layers only --width wide (dummy weights, opt-125m's vocabulary),
every weight, cache entry and hidden row on the device, generates --gen_len tokens for --rows
prompts, --repeats times on one engine. Its products are too small to take time, so a decode
step's time is what the engine spends around them: dispatching each layer's step, handing work
to its threads and waiting for them. On a GPU this is what bounds the decode of a small batch
all on the device (FlexGen's opt-6.7b policy at batch 2: the weights' reads take ~4 ms of a
step). Reports the fastest repeat's milliseconds per decode step and per layer step.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from flexjax.errors import FlexjaxError
from tools.benchlib import report_error, run_tool


def measure(*, layers: int, width: int, rows: int, prompt_len: int, gen_len: int,
            repeats: int) -> dict[str, Any]:
  """{'device', 'layers', ..., 'decode_ms_per_step': [per repeat], 'best_ms_per_step',
  'best_ms_per_layer_step'}."""
  import jax

  from flexjax.config import preset
  from flexjax.engine import Engine, GenerationConfig
  from flexjax.policy import Policy
  from flexjax.run import synthetic_prompts
  from flexjax.weights import DummyWeights

  cfg = dataclasses.replace(preset('opt-125m'), name=f'opt-narrow-{layers}x{width}',
                            num_layers=layers, hidden_size=width, num_heads=2,
                            ffn_dim=4 * width)
  policy = Policy(gpu_batch_size=rows, num_gpu_batches=1, w_gpu_percent=100, w_cpu_percent=0,
                  cache_gpu_percent=100, cache_cpu_percent=0, act_gpu_percent=100,
                  act_cpu_percent=0)
  prompts = synthetic_prompts(cfg, num=rows, length=prompt_len, seed=0)
  gen = GenerationConfig(gen_len=gen_len, stop_at_eos=False)
  device = jax.local_devices()[0]
  per_step = []
  with Engine(DummyWeights(cfg, dtype='float16'), policy=policy, compute_dtype='float32') as e:
    for _ in range(repeats):
      result = e.generate(prompts, gen)
      per_step.append(1000 * result.decode_s / (gen_len - 1))
  best = min(per_step)
  return {'device': f'{device.platform}:{device.device_kind}', 'layers': layers, 'width': width,
          'rows': rows, 'prompt_len': prompt_len, 'gen_len': gen_len,
          'decode_ms_per_step': per_step, 'best_ms_per_step': best,
          'best_ms_per_layer_step': best / (layers + 2)}


def run_cli(fv) -> int:
  try:
    result = measure(layers=fv.layers, width=fv.width, rows=fv.rows, prompt_len=fv.prompt_len,
                     gen_len=fv.gen_len, repeats=fv.repeats)
  except FlexjaxError as e:
    return report_error('step_overhead', e)
  if fv.json:
    print(json.dumps(result))
  else:
    runs = ', '.join(f'{ms:.2f}' for ms in result['decode_ms_per_step'])
    print(f'{result["device"]}: {result["layers"]} layers {result["width"]} wide, '
          f'{result["rows"]} rows: {result["best_ms_per_step"]:.2f} ms per decode step '
          f'(runs: {runs}), {result["best_ms_per_layer_step"]:.3f} ms per stage step')
  return 0


def define_flags(fv) -> None:
  from absl import flags
  f = {'flag_values': fv}
  flags.DEFINE_integer('layers', 32, 'Decoder layers.', lower_bound=1, **f)
  flags.DEFINE_integer('width', 64, 'Hidden size (heads of width / 2).', lower_bound=8, **f)
  flags.DEFINE_integer('rows', 2, 'Prompts, one GPU batch.', lower_bound=1, **f)
  flags.DEFINE_integer('prompt_len', 32, 'Prompt tokens.', lower_bound=1, **f)
  flags.DEFINE_integer('gen_len', 128, 'Generated tokens (at least 2).', lower_bound=2, **f)
  flags.DEFINE_integer('repeats', 3, 'Generations on the one engine (the fastest is kept).',
                       lower_bound=1, **f)
  flags.DEFINE_bool('json', False, 'Print one JSON object instead of the line.', **f)


if __name__ == '__main__':
  run_tool(define_flags, run_cli)
