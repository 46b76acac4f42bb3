"""One layer's attention and decode step, and the head step, timed on the jax device: what a
model's decode and prefill cost per layer at a given batch and context, apart from any data
movement.

  python -m tools.layer_bench --model=opt-1.3b --rows=1,8,16 --positions=40,544 \
      --prompt_lens=512 [--output=layer.jsonl]

Per rows x positions: `decode_attention` (attention.attend_decode: one new token per sequence
over its cache) with the bytes of cache it reads per second, and `decode_layer` (the jitted
decode step of one layer, weights stored float16 and cast in the step, cache on the device).
Per rows x prompt length: `prefill_attention` (attention.prefill_attend, causal, in chunks)
and `prefill_layer` (the prefill step of one layer as a run calls it, oneDNN's products on a CPU
from linear.LIBRARY_ROWS rows, weights stored float16, no cache kept), each with its FLOP rate.
Per rows: `head` (the head step of a greedy decode: final norm, LM head over the vocabulary,
the next token; the token table stored float16), with its FLOP rate.
Each time is the best of --repeats runs after a compiling run.
"""

from __future__ import annotations

import functools
import json
import math
from typing import Any, Callable

import numpy as np

from tools.benchlib import report_error, run_tool


def best_ms(fn: Callable[[], Any], repeats: int) -> float:
  from flexjax.hardware import best_seconds
  fn()  # compile
  return best_seconds(fn, repeats) * 1e3


def measure(cfg, *, rows: list[int], positions: list[int], prompt_lens: list[int],
            programs: list, repeats: int = 5) -> list[dict[str, Any]]:
  """Records of every timed case (see the module doc). The steps are appended to `programs`,
  which the caller frees after its later work (flexjax.model.linear.library_options: a oneDNN
  program freed right after its run can abort)."""
  import jax

  from flexjax.cost_model import layer_matmul_params
  from flexjax.model import attention
  from flexjax.model import params as params_lib
  from flexjax.steps import Geometry, one_layer

  device = jax.devices()[0]
  rng = np.random.default_rng(0)
  put = lambda shape, dtype=np.float32: jax.device_put(
      rng.standard_normal(shape).astype(dtype), device)
  steps, layer = one_layer(cfg, device=device)
  programs.append(steps)
  table = params_lib.dummy_stage(cfg, 'tokens', np.float16, 0) if cfg.head_uses_tokens else {}
  head = jax.device_put({**params_lib.dummy_stage(cfg, 'head', np.float16, 0), **table}, device)
  attend = jax.jit(functools.partial(attention.attend_decode, cfg=cfg))
  prefill = jax.jit(functools.partial(attention.prefill_attend, cfg=cfg))
  mm_flops = 2 * layer_matmul_params(cfg)
  out = []
  for b in rows:
    x = put((b, 1, cfg.hidden_size))
    counters = jax.device_put(np.zeros((b, 2), np.uint32), device)
    ms = best_ms(lambda: jax.block_until_ready(steps.head_step(head, x, counters,
                                                               temperature=0.0, top_p=1.0)),
                 repeats)
    out.append({'case': 'head', 'rows': b, 'positions': 1, 'ms': ms,
                'gflop_s': 2 * b * math.prod(cfg.tokens_shape()) / ms / 1e6})
    for t in positions:
      q, k, v = put((b, cfg.q_dim)), put((b, cfg.kv_dim)), put((b, cfg.kv_dim))
      caches = [put((b, t, cfg.kv_dim)), put((b, t, cfg.kv_dim))]
      mask = jax.device_put(np.ones((b, t), bool), device)
      slot = jax.device_put(np.int32(t - 1), device)
      ms = best_ms(lambda: attend(q, k, v, *caches, mask).block_until_ready(), repeats)
      out.append({'case': 'decode_attention', 'rows': b, 'positions': t, 'ms': ms,
                  'cache_gb_s': 2 * b * t * cfg.kv_dim * 4 / ms / 1e6})

      def step():  # the caches are donated: keep the returned ones
        y, new, _ = steps.decode_layer(layer, x, tuple(caches), mask, slot, None, device_rows=b,
                                       keep=None)
        caches[:] = new
        y.block_until_ready()

      out.append({'case': 'decode_layer', 'rows': b, 'positions': t,
                  'ms': best_ms(step, repeats)})
    for s in prompt_lens:
      q, k, v = put((b, s, cfg.q_dim)), put((b, s, cfg.kv_dim)), put((b, s, cfg.kv_dim))
      mask = jax.device_put(np.ones((b, s), bool), device)
      attention_flops = 4 * b * cfg.q_dim * s * (s + 1) / 2  # causal
      ms = best_ms(lambda: prefill(q, k, v, mask).block_until_ready(), repeats)
      out.append({'case': 'prefill_attention', 'rows': b, 'positions': s, 'ms': ms,
                  'gflop_s': attention_flops / ms / 1e6})
      x = put((b, s, cfg.hidden_size))
      ms = best_ms(lambda: jax.block_until_ready(steps.prefill_step(Geometry.prompt(b, s), layer,
                                                                    x, None, mask)),
                   repeats)
      out.append({'case': 'prefill_layer', 'rows': b, 'positions': s, 'ms': ms,
                  'gflop_s': (b * s * mm_flops + attention_flops) / ms / 1e6})
  return [{'model': cfg.name, 'device': f'{device.platform}:{device.device_kind}', **r}
          for r in out]


def define_flags(fv) -> None:
  from absl import flags
  f = dict(flag_values=fv)
  flags.DEFINE_string('model', 'opt-1.3b', 'Model preset whose layer shapes to time.', **f)
  flags.DEFINE_list('rows', ['1', '8', '16'], 'Sequences per step.', **f)
  flags.DEFINE_list('positions', ['40', '544'], 'Cached positions of the decode cases.', **f)
  flags.DEFINE_list('prompt_lens', ['512'], 'Prompt lengths of the prefill attention case.', **f)
  flags.DEFINE_integer('repeats', 5, 'Timed runs per case (the best is kept).', lower_bound=1,
                       **f)
  flags.DEFINE_string('output', None, 'Also append the records to this JSONL file.', **f)


def run_cli(fv) -> int:
  from flexjax import config as config_lib
  from flexjax.errors import FlexjaxError
  try:
    cfg = config_lib.preset(fv.model)
    numbers = {}
    for name in ('rows', 'positions', 'prompt_lens'):
      try:
        numbers[name] = [int(v) for v in getattr(fv, name)]
      except ValueError:
        raise FlexjaxError(f'--{name}={",".join(getattr(fv, name))} must be integers, '
                           'e.g. 1,8,16') from None
      if any(n <= 0 for n in numbers[name]):
        raise FlexjaxError(f'--{name}={",".join(getattr(fv, name))} must be positive')
    programs: list = []  # freed as the tool returns, after its output
    records = measure(cfg, repeats=fv.repeats, programs=programs, **numbers)
  except FlexjaxError as e:
    return report_error('layer_bench', e)
  for r in records:
    extra = f'  cache read {r["cache_gb_s"]:.1f} GB/s' if 'cache_gb_s' in r else ''
    extra += f'  {r["gflop_s"]:.1f} GFLOP/s' if 'gflop_s' in r else ''
    print(f'{r["model"]} {r["case"]:18s} rows={r["rows"]:<4d} positions={r["positions"]:<6d} '
          f'{r["ms"]:9.2f} ms{extra}')
  if fv.output:
    with open(fv.output, 'a') as f:
      for r in records:
        f.write(json.dumps(r) + '\n')
  return 0


if __name__ == '__main__':
  run_tool(define_flags, run_cli)
