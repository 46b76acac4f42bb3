"""Benchmark tool: flexjax vs transformers throughput on dummy weights, a JSON line per run.

  python -m tools.bench --models=opt-125m,opt-1.3b --batch_sizes=1,8,32 --prompt_len=128 \
      --gen_len=32 --dtypes=float32,bfloat16 --engines=flexjax,transformers \
      --output=bench_results/foundation.jsonl
  python -m tools.bench --render=bench_results/foundation.jsonl

Throughputs follow the FlexGen paper: prefill tok/s = batch·prompt_len / prefill_s, decode tok/s =
batch·(gen_len-1) / decode_s, total tok/s = batch·gen_len / (prefill_s + decode_s).
"""

from __future__ import annotations

import functools
import gc
import os
import sys
import time
from typing import Any, Callable, Iterator, Sequence

from absl import app, flags

from flexjax import config as config_lib
from flexjax.errors import FlexjaxError, flags_parser
from tools.benchlib import (check_output_flags, fmt_number, git_commit, host_peak_rss, jsonl_appender, machine_info,
                            meminfo_bytes, new_run_id, read_records, reset_peak_rss, throughputs,
                            timestamp, versions)

_MODELS = flags.DEFINE_list('models', ['opt-125m'], 'OPT presets to benchmark.')
_BATCH_SIZES = flags.DEFINE_list('batch_sizes', ['1', '8', '32'], 'Batch sizes (prompts per run).')
_PROMPT_LEN = flags.DEFINE_integer('prompt_len', 128, 'Tokens per prompt (all prompts equal).')
_GEN_LEN = flags.DEFINE_integer('gen_len', 32, 'New tokens per prompt (>= 2).')
_DTYPES = flags.DEFINE_list('dtypes', ['float32'], 'Compute dtypes: float32, float16, bfloat16.')
_ENGINES = flags.DEFINE_list('engines', ['flexjax', 'transformers'], 'Engines to compare.')
_OUTPUT = flags.DEFINE_string('output', None, 'JSONL file to append one line per run to.')
_REPEATS = flags.DEFINE_integer('repeats', 1, 'Timed runs per case (after one warm-up run).')
_TORCH_THREADS = flags.DEFINE_integer('torch_threads', None,
                                      'torch intra-op threads (default: os.cpu_count()).')
_RENDER = flags.DEFINE_string('render', None,
                              'Print a markdown table of this results JSONL instead of running.')


# ---- sizes ---------------------------------------------------------------------------------------
def check_fits(cfg: config_lib.ModelConfig, dtype: str, have: int | None, where: str) -> None:
  """Refuses a model whose weights in `dtype` exceed the `have` free bytes of `where`."""
  need = cfg.model_weight_bytes(config_lib.np_dtype(dtype).itemsize)
  if have is not None and need > have:
    raise FlexjaxError(f'{cfg.name} in {dtype} needs {need / 2**30:.1f} GiB of weights but '
                       f'{where} has {have / 2**30:.1f} GiB free; drop it from --models or '
                       '--dtypes')


# ---- flexjax -------------------------------------------------------------------------------------
def build_flexjax(cfg: config_lib.ModelConfig, dtype: str):
  """An Engine on float16 dummy weights, computing in `dtype` on the first jax device."""
  import jax
  from flexjax.engine import Engine
  from flexjax.run import device_memory_bytes
  from flexjax.weights import DummyWeights
  device = jax.devices()[0]
  check_fits(cfg, dtype, device_memory_bytes(device), f'{device.platform} device')
  return Engine(DummyWeights(cfg, dtype='float16'), compute_dtype=dtype, device=device)


def run_flexjax(engine, *, batch_size: int, prompt_len: int, gen_len: int,
                repeats: int = 1) -> list[dict[str, Any]]:
  """One warm-up (compile) run, then `repeats` timed runs of one batch. Returns their timings."""
  from flexjax.engine import GenerationConfig
  from flexjax.memwatch import MemoryWatch
  from flexjax.run import synthetic_prompts
  prompts = synthetic_prompts(engine.config, num=batch_size, length=prompt_len, seed=0)
  from flexjax.policy import Policy
  gen = GenerationConfig(gen_len=gen_len, stop_at_eos=False)
  policy = Policy(gpu_batch_size=batch_size)
  timings = []
  for _ in range(repeats):
    reset_peak_rss()
    watch = MemoryWatch.start(engine.device)
    result = engine.generate(prompts, gen, policy=policy)
    peaks = watch.peaks()
    memory = {'device_peak_bytes': peaks['device']} if 'device' in peaks else {}
    memory['host_peak_rss_bytes'] = host_peak_rss()
    timings.append(dict(prefill_s=result.prefill_s, decode_s=result.decode_s, **memory))
  return timings


# ---- transformers --------------------------------------------------------------------------------
def _import_torch():
  try:
    import torch
    import transformers
  except ImportError as e:
    raise FlexjaxError(f'--engines=transformers needs torch and transformers ({e.name} is '
                       'missing); install them with pip install -e .[test]') from None
  return torch, transformers


def build_transformers(cfg: config_lib.ModelConfig, dtype: str, *, threads: int):
  """A randomly initialised OPTForCausalLM of `cfg`'s shapes in `dtype`, on the CPU, eval mode."""
  torch, transformers = _import_torch()
  check_fits(cfg, dtype, meminfo_bytes('MemAvailable'), 'host RAM')
  torch.set_num_threads(threads)
  hf_config = transformers.OPTConfig(
      hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_heads, ffn_dim=cfg.ffn_dim,
      num_hidden_layers=cfg.num_layers, vocab_size=cfg.vocab_size,
      max_position_embeddings=cfg.max_positions, word_embed_proj_dim=cfg.embed_dim,
      do_layer_norm_before=cfg.do_layer_norm_before,
      _remove_final_layer_norm=not cfg.final_layer_norm, enable_bias=cfg.enable_bias,
      layer_norm_elementwise_affine=cfg.layer_norm_affine, pad_token_id=cfg.pad_token_id,
      bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id)
  previous = torch.get_default_dtype()
  torch.set_default_dtype(getattr(torch, dtype))  # build in the target dtype: no fp32 copy first
  try:
    model = transformers.OPTForCausalLM(hf_config)
  finally:
    torch.set_default_dtype(previous)
  return model.eval()


def transformers_greedy(model, input_ids, *, gen_len: int):
  """Greedy generation with the KV cache, timed: prefill makes token 1, decode the other gen_len-1.

  Args:
    model: an OPTForCausalLM.
    input_ids: [batch, prompt_len] int64 torch tensor, no padding.
  Returns:
    (tokens [batch, gen_len] int64 torch tensor, prefill_s, decode_s).
  """
  import torch
  with torch.inference_mode():
    mask = torch.ones_like(input_ids)
    start = time.perf_counter()
    out = model(input_ids=input_ids, attention_mask=mask, use_cache=True, logits_to_keep=1)
    token = out.logits[:, -1].argmax(dim=-1, keepdim=True)  # [batch, 1]
    prefill_s = time.perf_counter() - start
    tokens = [token]
    start = time.perf_counter()
    for _ in range(gen_len - 1):
      mask = torch.cat([mask, torch.ones_like(token)], dim=1)
      out = model(input_ids=token, attention_mask=mask, past_key_values=out.past_key_values,
                  use_cache=True)
      token = out.logits[:, -1].argmax(dim=-1, keepdim=True)
      tokens.append(token)
    decode_s = time.perf_counter() - start
  return torch.cat(tokens, dim=1), prefill_s, decode_s


def run_transformers(model, cfg: config_lib.ModelConfig, *, batch_size: int, prompt_len: int,
                     gen_len: int, repeats: int = 1) -> list[dict[str, Any]]:
  """One warm-up run (prefill and one decode step), then `repeats` timed runs. Returns timings."""
  import torch
  from flexjax.run import synthetic_prompts
  prompts = synthetic_prompts(cfg, num=batch_size, length=prompt_len, seed=0)
  input_ids = torch.tensor(prompts, dtype=torch.long)  # [batch, prompt_len]
  transformers_greedy(model, input_ids, gen_len=2)
  timings = []
  for _ in range(repeats):
    reset_peak_rss()
    _, prefill_s, decode_s = transformers_greedy(model, input_ids, gen_len=gen_len)
    timings.append(dict(prefill_s=prefill_s, decode_s=decode_s,
                        host_peak_rss_bytes=host_peak_rss()))
  return timings


# ---- records -------------------------------------------------------------------------------------
def run_context(torch_threads: int) -> dict[str, Any]:
  """Fields shared by every record of one benchmark invocation."""
  return {'commit': git_commit(), 'machine': machine_info(), 'versions': versions(),
          'torch_threads': torch_threads, 'run_id': new_run_id()}


def make_record(*, engine: str, cfg: config_lib.ModelConfig, dtype: str, batch_size: int,
                prompt_len: int, gen_len: int, timing: dict[str, Any], repeat: int,
                context: dict[str, Any]) -> dict[str, Any]:
  """One JSON line: the case, its timings and throughputs, and where and when it ran."""
  import jax
  device = f'{jax.devices()[0].platform}:{jax.devices()[0].device_kind}'
  rates = throughputs(batch_size=batch_size, prompt_len=prompt_len, gen_len=gen_len,
                      prefill_s=timing['prefill_s'], decode_s=timing['decode_s'])
  return {
      'engine': engine, 'model': cfg.name, 'compute_dtype': dtype,
      'weight_storage_dtype': 'float16' if engine == 'flexjax' else dtype,
      'device': device if engine == 'flexjax' else 'cpu',
      'batch_size': batch_size, 'prompt_len': prompt_len, 'gen_len': gen_len, 'repeat': repeat,
      **timing, **rates, **context, 'projected': False,
      'timestamp': timestamp(),
  }


def bench_model(engine: str, cfg: config_lib.ModelConfig, *, dtype: str,
                batch_sizes: Sequence[int], prompt_len: int, gen_len: int, repeats: int,
                torch_threads: int, context: dict[str, Any]) -> Iterator[dict[str, Any]]:
  """Builds one model once, yields a record per (batch size, repeat), then frees the model."""
  if engine == 'flexjax':
    model = build_flexjax(cfg, dtype)
    run = functools.partial(run_flexjax, model)
  elif engine == 'transformers':
    model = build_transformers(cfg, dtype, threads=torch_threads)
    run = functools.partial(run_transformers, model, cfg)
  else:
    raise FlexjaxError(f'engine={engine!r} is unknown; use flexjax or transformers')
  try:
    for b in batch_sizes:
      timings = run(batch_size=b, prompt_len=prompt_len, gen_len=gen_len, repeats=repeats)
      for repeat, timing in enumerate(timings):
        yield make_record(engine=engine, cfg=cfg, dtype=dtype, batch_size=b,
                          prompt_len=prompt_len, gen_len=gen_len, timing=timing, repeat=repeat,
                          context=context)
  finally:
    del run, model
    gc.collect()


# ---- rendering -----------------------------------------------------------------------------------
def _pick(records: list[dict[str, Any]]) -> dict[str, Any]:
  """The latest invocation's records of one case; of its repeats, the median by total tok/s."""
  latest = max(r.get('run_id', '') for r in records)
  runs = sorted((r for r in records if r.get('run_id', '') == latest),
                key=lambda r: r['total_tok_s'])
  return runs[(len(runs) - 1) // 2]


def render_table(records: Sequence[dict[str, Any]]) -> str:
  """A markdown table: a row per model × dtype × batch (× prompt/gen lengths), both engines side
  by side with the flexjax/transformers ratio of total tok/s."""
  groups: dict[tuple, dict[str, list]] = {}
  for r in records:
    key = (r['model'], r['compute_dtype'], r['batch_size'], r['prompt_len'], r['gen_len'])
    groups.setdefault(key, {}).setdefault(r['engine'], []).append(r)
  order = {}  # models and dtypes in order of first appearance, batch sizes ascending
  for key in groups:
    order.setdefault(key[0], len(order))
    order.setdefault(('dtype', key[1]), len(order))
  rows = sorted(groups, key=lambda k: (order[k[0]], order[('dtype', k[1])], k[3], k[4], k[2]))
  lines = [
      '| model | dtype | batch | prompt+gen | flexjax total tok/s | transformers total tok/s | '
      'ratio flexjax/transformers | flexjax prefill tok/s | transformers prefill tok/s | '
      'flexjax decode tok/s | transformers decode tok/s |',
      '|' + '---|' * 3 + ':---:|' + '---:|' * 7,
  ]
  for key in rows:
    picked = {engine: _pick(rs) for engine, rs in groups[key].items()}
    get = lambda engine, field: picked[engine][field] if engine in picked else None
    fx, tf = get('flexjax', 'total_tok_s'), get('transformers', 'total_tok_s')
    ratio = f'{fx / tf:.2f}x' if fx and tf else '—'
    model, dtype, batch, prompt_len, gen_len = key
    rates = [get(engine, field) for field in ('prefill_tok_s', 'decode_tok_s')
             for engine in ('flexjax', 'transformers')]
    cells = [model, dtype, str(batch), f'{prompt_len}+{gen_len}', fmt_number(fx), fmt_number(tf),
             ratio, *map(fmt_number, rates)]
    lines.append('| ' + ' | '.join(cells) + ' |')
  return '\n'.join(lines)


# ---- command line --------------------------------------------------------------------------------
def _parse_batch_sizes(values: Sequence[str]) -> list[int]:
  sizes = []
  for v in values:
    if not v.strip().isdigit() or int(v) <= 0:
      raise FlexjaxError(f'--batch_sizes has {v!r}; give positive integers, e.g. --batch_sizes=1,8')
    sizes.append(int(v))
  return sizes


def _check_flags() -> tuple[list, list[int]]:
  for engine in _ENGINES.value:
    if engine not in ('flexjax', 'transformers'):
      raise FlexjaxError(f'--engines has {engine!r}; choose from flexjax, transformers')
  for dtype in _DTYPES.value:
    config_lib.np_dtype(dtype)  # raises naming the dtype and the choices
  if _GEN_LEN.value < 2:
    raise FlexjaxError(f'--gen_len={_GEN_LEN.value} must be >= 2 (decode needs a second token)')
  if _PROMPT_LEN.value < 1:
    raise FlexjaxError(f'--prompt_len={_PROMPT_LEN.value} must be positive')
  if _REPEATS.value < 1:
    raise FlexjaxError(f'--repeats={_REPEATS.value} must be >= 1')
  if not _OUTPUT.value:
    raise FlexjaxError('--output is required to run; e.g. --output=bench_results/bench.jsonl '
                       '(or pass --render=FILE to print a table)')
  batch_sizes = _parse_batch_sizes(_BATCH_SIZES.value)
  cfgs = [config_lib.preset(name) for name in _MODELS.value]
  for cfg in cfgs:
    needed = _PROMPT_LEN.value + _GEN_LEN.value - 1
    if needed > cfg.max_positions:
      raise FlexjaxError(f'--prompt_len={_PROMPT_LEN.value} plus --gen_len={_GEN_LEN.value} needs '
                         f'{needed} positions but {cfg.name} has {cfg.max_positions}; shorten one')
  return cfgs, batch_sizes


def run_all(emit: Callable[[dict[str, Any]], None], cfgs: list, batch_sizes: list[int]) -> None:
  """Runs every (model, dtype, engine, batch size) case of the flags (models and batch sizes as
  _check_flags gives them), passing records to emit."""
  threads = _TORCH_THREADS.value or os.cpu_count() or 1
  context = run_context(threads)
  for cfg in cfgs:
    for dtype in _DTYPES.value:
      for engine in _ENGINES.value:
        for record in bench_model(engine, cfg, dtype=dtype, batch_sizes=batch_sizes,
                                  prompt_len=_PROMPT_LEN.value, gen_len=_GEN_LEN.value,
                                  repeats=_REPEATS.value, torch_threads=threads, context=context):
          emit(record)


def main(argv):
  del argv
  try:
    if _RENDER.value:
      print(render_table(read_records(_RENDER.value)))
      return 0
    cfgs, batch_sizes = _check_flags()
    with jsonl_appender(_OUTPUT.value) as emit:
      run_all(emit, cfgs, batch_sizes)
  except FlexjaxError as e:
    print(f'bench: error: {e}', file=sys.stderr)
    return 2
  return 0


if __name__ == '__main__':
  check_output_flags(flags.FLAGS)
  app.run(main, flags_parser=flags_parser())
