"""Generation engine: streams stages onto the device, runs prefill and decode, samples, times."""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from flexjax.config import ModelConfig, np_dtype
from flexjax.errors import FlexjaxError
from flexjax.model import opt
from flexjax.model import params as params_lib
from flexjax.weights import WeightSource


@dataclasses.dataclass(frozen=True)
class GenerationConfig:
  """What to generate: lengths, batching and sampling."""

  gen_len: int = 32
  batch_size: int = 1
  temperature: float = 0.0  # 0: greedy
  top_p: float = 1.0
  seed: int = 0
  stop_at_eos: bool = True

  def __post_init__(self):
    if self.gen_len <= 0:
      raise FlexjaxError(f'gen_len={self.gen_len} must be a positive number of new tokens')
    if self.batch_size <= 0:
      raise FlexjaxError(f'batch_size={self.batch_size} must be positive')
    if self.temperature < 0:
      raise FlexjaxError(f'temperature={self.temperature} must be >= 0 (0 means greedy)')
    if not 0 < self.top_p <= 1:
      raise FlexjaxError(f'top_p={self.top_p} must be in (0, 1]')


@dataclasses.dataclass
class GenerationResult:
  """Generated tokens and timings. Throughputs follow the FlexGen paper's definitions."""

  tokens: np.ndarray  # [num_prompts, gen_len] int32, pad_token_id after EOS
  sequences: list[np.ndarray]  # per prompt: generated ids up to and including EOS
  num_prompts: int
  prompt_len: int  # padded prompt length
  gen_len: int
  generated_tokens: int  # rows x decode steps actually computed
  prefill_s: float
  decode_s: float
  logits: np.ndarray | None = None  # [num_prompts, gen_len, vocab] float32 when asked for

  @property
  def total_s(self) -> float:
    return self.prefill_s + self.decode_s

  @property
  def prefill_throughput(self) -> float:
    """Prompt tokens processed per second of prefill."""
    return self.num_prompts * self.prompt_len / self.prefill_s

  @property
  def decode_throughput(self) -> float:
    """Tokens generated per second after the first (which prefill produces)."""
    decoded = self.generated_tokens - self.num_prompts
    return decoded / self.decode_s if self.decode_s > 0 else float('nan')

  @property
  def total_throughput(self) -> float:
    """Generated tokens / (prefill + decode time): the paper's generation throughput."""
    return self.generated_tokens / self.total_s


def pad_prompts(prompts: Sequence[Sequence[int]], length: int, pad_id: int):
  """Left-pads prompts to `length`. Returns tokens [n, length] int32 and mask [n, length] bool."""
  tokens = np.full((len(prompts), length), pad_id, np.int32)
  mask = np.zeros((len(prompts), length), bool)
  for i, p in enumerate(prompts):
    if len(p):
      tokens[i, length - len(p):] = p
      mask[i, length - len(p):] = True
  return tokens, mask


class Engine:
  """Runs an OPT model whose weights all live on one device.

  Weights are read in the source's storage dtype, moved to the device as stored, and cast there
  to the compute dtype once, at load. (Casting per step instead made opt-125m decode 2.8x slower
  on the CPU backend: XLA:CPU does not fuse the fp16->fp32 cast into its matmuls.)

  Args:
    weights: where stages are read from (a Checkpoint or DummyWeights).
    compute_dtype: dtype of the layer math (float32 is fastest and exact on the CPU backend).
    cache_dtype: dtype of the KV cache (default: compute_dtype).
    device: a jax device (default: the first one).
  """

  def __init__(self, weights: WeightSource, *, compute_dtype: str = 'float32', cache_dtype: str | None = None,
               device: jax.Device | None = None):
    self._source = weights
    self.config: ModelConfig = weights.config
    self.weight_dtype = weights.dtype
    self.compute_dtype = compute_dtype
    self.cache_dtype = cache_dtype or compute_dtype
    self.device = device or jax.devices()[0]
    cfg = self.config
    self._np_compute_dtype = np_dtype(compute_dtype)
    kw = dict(cfg=cfg, compute_dtype=np_dtype(compute_dtype))
    cache_kw = dict(kw, cache_dtype=np_dtype(self.cache_dtype))
    self._embed = jax.jit(functools.partial(opt.embed, **kw))
    self._head = jax.jit(functools.partial(opt.head, **kw))
    self._prefill = jax.jit(functools.partial(opt.decoder_prefill, **cache_kw))
    self._decode = jax.jit(functools.partial(opt.decoder_decode, **cache_kw))
    self._write_kv = jax.jit(_write_kv, donate_argnums=(0,))
    self._new_cache = jax.jit(_new_cache, static_argnums=(1,))
    self._sample = jax.jit(_next_token, static_argnames=('temperature', 'top_p'))

    tokens = self._load('tokens')['tokens']
    self._in_params = dict(self._load('embed'), tokens=tokens)
    self._out_params = dict(self._load('head'), tokens=tokens)
    self._layers = [self._load(params_lib.layer_name(i)) for i in range(cfg.num_layers)]

  def _load(self, stage: str):
    """Reads one stage from the source, moves it to the device and casts it there."""
    host = self._source.read(stage)
    return jax.tree_util.tree_map(
        lambda a: jax.device_put(a, self.device).astype(self._np_compute_dtype), host)

  # ---- forward pieces ---------------------------------------------------------------------------
  def _prefill_batch(self, tokens: jax.Array, mask: jax.Array, cache_len: int):
    """Prompt pass. Returns hidden [b, s, h] after all layers and per-layer (k, v) caches."""
    x = self._embed(self._in_params, tokens, opt.positions_from_mask(mask))
    caches = []
    for layer in self._layers:
      x, (k, v) = self._prefill(layer, x, mask)
      caches.append((self._new_cache(k, cache_len), self._new_cache(v, cache_len)))
    return x, caches

  def _decode_step(self, token: jax.Array, position: jax.Array, caches, cache_mask: jax.Array,
                   slot: int):
    """One new token per row. token, position: [b, 1]. Writes K/V into `slot` of each cache."""
    x = self._embed(self._in_params, token, position)
    new_caches = []
    for layer, (k_cache, v_cache) in zip(self._layers, caches):
      x, (k, v) = self._decode(layer, x, k_cache, v_cache, cache_mask)
      new_caches.append((self._write_kv(k_cache, k, slot), self._write_kv(v_cache, v, slot)))
    return x, new_caches

  def score(self, tokens: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray:
    """Logits of every position of left-padded sequences: [b, s] -> [b, s, vocab] float32."""
    tokens = np.asarray(tokens, np.int32)
    mask = np.ones(tokens.shape, bool) if mask is None else np.asarray(mask, bool)
    self._check_length(tokens.shape[1])
    x, _ = self._prefill_batch(self._put(tokens), self._put(mask), cache_len=tokens.shape[1])
    return np.asarray(self._head(self._out_params, x))

  # ---- generation -------------------------------------------------------------------------------
  def generate(self, prompts: Sequence[Sequence[int]], gen: GenerationConfig, *,
               warmup: bool = False, return_logits: bool = False) -> GenerationResult:
    """Generates `gen.gen_len` tokens for each prompt (token ids, BOS included).

    Prompts are left-padded to the longest one and processed `gen.batch_size` at a time.
    """
    if not prompts:
      raise FlexjaxError('no prompts given; pass at least one prompt')
    prompt_len = max(len(p) for p in prompts)
    if prompt_len == 0:
      raise FlexjaxError('all prompts are empty; each prompt needs at least one token')
    self._check_length(prompt_len + gen.gen_len - 1)
    tokens, mask = pad_prompts(prompts, prompt_len, self.config.pad_token_id)
    n = len(prompts)
    b = gen.batch_size
    padded_n = -(-n // b) * b
    tokens = np.concatenate([tokens, np.full((padded_n - n, prompt_len), self.config.pad_token_id,
                                             np.int32)])
    mask = np.concatenate([mask, np.zeros((padded_n - n, prompt_len), bool)])
    if warmup:  # compile every shape on the first batch, untimed
      self._run_batch(tokens[:b], mask[:b], gen, batch_index=0, max_steps=2, return_logits=False)

    out_tokens, out_logits, prefill_s, decode_s, steps_run = [], [], 0.0, 0.0, 0
    for i in range(0, padded_n, b):
      res = self._run_batch(tokens[i:i + b], mask[i:i + b], gen, batch_index=i // b,
                            max_steps=gen.gen_len, return_logits=return_logits)
      out_tokens.append(res['tokens'])
      out_logits.append(res['logits'])
      prefill_s += res['prefill_s']
      decode_s += res['decode_s']
      steps_run += res['steps'] * min(b, n - i)
    all_tokens = np.concatenate(out_tokens)[:n]
    return GenerationResult(
        tokens=all_tokens,
        sequences=[_trim(row, self.config.eos_token_id, gen.stop_at_eos) for row in all_tokens],
        num_prompts=n, prompt_len=prompt_len, gen_len=gen.gen_len, generated_tokens=steps_run,
        prefill_s=prefill_s, decode_s=decode_s,
        logits=np.concatenate(out_logits)[:n] if return_logits else None)

  def _run_batch(self, tokens: np.ndarray, mask: np.ndarray, gen: GenerationConfig, *,
                 batch_index: int, max_steps: int, return_logits: bool) -> dict:
    cfg = self.config
    b, s = tokens.shape
    cache_len = s + gen.gen_len - 1
    key = jax.random.fold_in(jax.random.key(gen.seed), batch_index)
    sample = functools.partial(self._sample, temperature=gen.temperature, top_p=gen.top_p)
    out = np.full((b, gen.gen_len), cfg.pad_token_id, np.int32)
    logits_out = np.zeros((b, gen.gen_len, cfg.vocab_size), np.float32) if return_logits else None
    finished = np.zeros(b, bool)

    start = time.perf_counter()
    x, caches = self._prefill_batch(self._put(tokens), self._put(mask), cache_len)
    logits = self._head(self._out_params, x[:, -1:])[:, 0]
    token = np.asarray(sample(logits, jax.random.fold_in(key, 0)))
    prefill_s = time.perf_counter() - start

    cache_mask = np.zeros((b, cache_len), bool)
    cache_mask[:, :s] = mask
    next_position = mask.sum(axis=1).astype(np.int32)  # position of the first generated token
    steps = 0
    start = time.perf_counter()
    for step in range(max_steps):
      token = np.where(finished, cfg.pad_token_id, token)
      out[:, step] = token
      if return_logits:
        logits_out[:, step] = np.asarray(logits)
      steps = step + 1
      if gen.stop_at_eos:
        finished |= token == cfg.eos_token_id
        if finished.all():
          break
      if step + 1 == max_steps:
        break
      x, caches = self._decode_step(self._put(token[:, None]),
                                    self._put((next_position + step)[:, None]), caches,
                                    self._put(cache_mask), slot=s + step)
      cache_mask[:, s + step] = True
      logits = self._head(self._out_params, x)[:, 0]
      token = np.asarray(sample(logits, jax.random.fold_in(key, step + 1)))
    decode_s = time.perf_counter() - start
    return dict(tokens=out, logits=logits_out, prefill_s=prefill_s, decode_s=decode_s,
                steps=steps)

  # ---- helpers ----------------------------------------------------------------------------------
  def _put(self, array: np.ndarray) -> jax.Array:
    """Places a small per-step input on the device.

    On the CPU backend device_put may alias an aligned numpy buffer instead of copying it, and
    dispatch is asynchronous: a caller that later mutates its array (the cache mask grows every
    step) would change an input of a computation still in flight. So inputs are copied first.
    """
    return jax.device_put(np.array(array, copy=True), self.device)

  def _check_length(self, total: int) -> None:
    if total > self.config.max_positions:
      raise FlexjaxError(
          f'prompt plus generated tokens need {total} positions but {self.config.name} has '
          f'{self.config.max_positions}; shorten the prompts or --gen_len')


def _write_kv(cache: jax.Array, new: jax.Array, slot) -> jax.Array:
  """Writes new [b, n, h] into cache [b, t, h] at time `slot` (the cache buffer is donated)."""
  return jax.lax.dynamic_update_slice_in_dim(cache, new.astype(cache.dtype), slot, axis=1)


def _new_cache(prompt_kv: jax.Array, cache_len: int) -> jax.Array:
  """A [b, cache_len, h] cache holding the prompt's [b, s, h] K or V in its first s slots."""
  return jnp.pad(prompt_kv, ((0, 0), (0, cache_len - prompt_kv.shape[1]), (0, 0)))


def _next_token(logits: jax.Array, key: jax.Array, *, temperature: float, top_p: float):
  """Greedy (temperature 0) or temperature + nucleus sampling. logits: [b, vocab] -> [b] int32."""
  if temperature == 0:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  logits = logits / temperature
  if top_p < 1:
    sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    # keep the smallest prefix whose mass reaches top_p (the first token is always kept)
    before = jnp.cumsum(probs, axis=-1) - probs
    cutoff_index = jnp.sum(before < top_p, axis=-1, keepdims=True) - 1
    cutoff = jnp.take_along_axis(sorted_logits, cutoff_index, axis=-1)
    logits = jnp.where(logits < cutoff, -jnp.inf, logits)
  return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def _trim(row: np.ndarray, eos_id: int, stop_at_eos: bool) -> np.ndarray:
  if stop_at_eos:
    hits = np.flatnonzero(row == eos_id)
    if hits.size:
      return row[:hits[0] + 1]
  return row
