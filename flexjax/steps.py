"""Layer steps: the pure model functions jitted once per run, and the XLA working memory of each,
read from the compiled function itself (the execution plan's source for it)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from flexjax import quant as quant_lib
from flexjax.config import ModelConfig, np_dtype
from flexjax.model import opt
from flexjax.policy import Policy
from flexjax.sampler import next_token


@dataclasses.dataclass(frozen=True)
class StepMemory:
  """XLA's own bytes for one call of a compiled function: temporaries and fresh outputs
  (arguments are buffers the plan already lists; outputs aliasing a donated input are not new)."""

  temp: int
  output: int

  @property
  def total(self) -> int:
    return self.temp + self.output

  def scaled(self, factor: float) -> 'StepMemory':
    return StepMemory(int(self.temp * factor), int(self.output * factor))

  @staticmethod
  def of(compiled) -> 'StepMemory':
    stats = compiled.memory_analysis()
    return StepMemory(temp=int(stats.temp_size_in_bytes),
                      output=max(0, int(stats.output_size_in_bytes - stats.alias_size_in_bytes)))


class Steps:
  """The jitted step functions of one model, policy and dtype set.

  Every function is jitted once; its shapes are static within a run (the KV cache is allocated
  at its full length), so the warm-up compile (`working_memory`) serves every later call.
  """

  def __init__(self, cfg: ModelConfig, policy: Policy, *, storage_dtype: str, compute_dtype: str,
               cache_dtype: str, device: jax.Device, cpu: jax.Device):
    self.cfg, self.policy = cfg, policy
    self.storage = np_dtype(storage_dtype)
    self.compute = np_dtype(compute_dtype)
    self.cache = np_dtype(cache_dtype)
    self.device, self.cpu = device, cpu
    kw = dict(cfg=cfg, compute_dtype=self.compute)
    cache_kw = dict(kw, cache_dtype=self.cache)
    cache_quant = policy.quant if policy.compress_cache else None
    self.embed = jax.jit(functools.partial(opt.embed, **kw))
    self.head = jax.jit(functools.partial(_head_last, **kw))
    self.prefill = jax.jit(functools.partial(opt.decoder_prefill, **cache_kw))
    self.qkv = jax.jit(functools.partial(opt.decode_qkv, **cache_kw))
    self.attend = jax.jit(functools.partial(opt.decode_attend, cfg=cfg, cache_quant=cache_quant))
    self.select = jax.jit(functools.partial(opt.decode_select, cfg=cfg, cache_quant=cache_quant),
                          static_argnames=('keep',))
    self.attend_selected = jax.jit(functools.partial(opt.decode_attend_selected, cfg=cfg,
                                                     cache_quant=cache_quant))
    self.quantize = jax.jit(functools.partial(quant_lib.quantize, config=policy.quant))
    self.out = jax.jit(functools.partial(opt.decode_out, **kw))
    self.write_kv = jax.jit(_write_kv, donate_argnums=(0,))
    self.take_rows = jax.jit(_take_rows)
    self.sample = jax.jit(next_token, static_argnames=('temperature', 'top_p'))
    self.cast = jax.jit(lambda a: a.astype(self.compute))
    self.dequantize = jax.jit(lambda p: quant_lib.unpack(p, self.compute))

  # ---- working memory ---------------------------------------------------------------------------
  def cache_entry(self) -> tuple[int, np.dtype]:
    """Last axis and dtype of a stored KV cache entry (byte rows when compressed)."""
    if self.policy.compress_cache:
      return self.policy.quant.row_bytes(self.cfg.hidden_size), np.dtype(np.uint8)
    return self.cfg.hidden_size, self.cache

  def working_memory(self, *, params: dict[str, dict], rows: int, device_rows: int,
                     prompt_len: int, total_len: int, cpu_attention: bool, temperature: float,
                     top_p: float, largest_load: tuple | None,
                     largest_tensor: tuple[int, ...] | None) -> dict[str, StepMemory]:
    """Compiles every function a run calls at its real shapes and returns XLA's bytes per step.

    Args:
      params: stage kind ('embed', 'layer', 'head') -> {path: ShapeDtypeStruct or Packed of one}
        as the step receives them once loaded.
      rows: sequences of a GPU batch; device_rows: of them, the cache rows on the device.
      largest_load: (shape, packed dim or None) of the largest tensor cast or dequantized when
        weights are loaded, or None when nothing is loaded.
      largest_tensor: shape of the largest weight matrix, quantized on the CPU backend while
        weights are placed (compress_weight), else None.
    Returns:
      {'embed', 'prefill', 'decode', 'head', 'cpu_attention', 'load', 'place'}: bytes of one
      call, where a step made of parts sums their outputs and takes their largest temporary.
    """
    cfg, b, s, t = self.cfg, rows, prompt_len, total_len
    h, cdt = cfg.hidden_size, self.compute
    spec = jax.ShapeDtypeStruct
    entry, edt = self.cache_entry()
    i32 = lambda *shape: spec(shape, np.int32)
    x_prefill, x_decode = spec((b, s, h), cdt), spec((b, 1, h), cdt)
    out = {}
    out['embed'] = _analyse(self.embed, params['embed'], i32(b, s), i32(b, s))
    logits = spec((b, cfg.vocab_size), np.float32)
    out['head'] = _combine([_analyse(self.head, params['head'], x_prefill),
                            _analyse(self.sample, logits, jax.random.key(0),
                                     temperature=temperature, top_p=top_p)])
    prefill_parts = [_analyse(self.prefill, params['layer'], x_prefill, spec((b, s), bool))]
    if self.policy.compress_cache:
      prefill_parts.append(_analyse(self.quantize, spec((b, s, h), self.cache)))
    out['prefill'] = _combine(prefill_parts)
    q = spec((b, h), cdt)
    kv = spec((b, h), self.cache)
    decode_parts = [_analyse(self.qkv, params['layer'], x_decode),
                    _analyse(self.out, params['layer'], x_decode, q)]
    if self.policy.compress_cache:
      decode_parts.append(_analyse(self.quantize, spec((b, 1, h), self.cache)))
    offloaded = b - device_rows
    for backend_rows, on_cpu in ((device_rows, False), (offloaded, cpu_attention)):
      if backend_rows and not on_cpu:
        decode_parts += self._attention(backend_rows, t, entry, edt, q.dtype)
    out['decode'] = _combine(decode_parts)
    out['cpu_attention'] = (_combine(self._attention(offloaded, t, entry, edt, q.dtype,
                                                     on=self.cpu))
                            if offloaded and cpu_attention else StepMemory(0, 0))
    out['place'] = StepMemory(0, 0)
    if largest_tensor is not None:
      out['place'] = _analyse(self.quantize, _spec(largest_tensor, self.storage, self.cpu))
    out['load'] = StepMemory(0, 0)
    if largest_load is not None:
      shape, dim = largest_load
      if dim is None:
        out['load'] = _analyse(self.cast, spec(shape, self.storage))
      else:
        out['load'] = _analyse(self.dequantize, quant_lib.Packed(spec(shape, np.uint8), dim,
                                                                 self.policy.quant))
    return out

  def _attention(self, rows: int, t: int, entry: int, edt, qdt,
                 on: jax.Device | None = None) -> list[StepMemory]:
    """Decode attention of `rows` sequences over a cache of t positions (dense or sparse), on
    the device or, with `on`, on another backend."""
    spec = lambda shape, dtype: _spec(shape, dtype, on)
    h = self.cfg.hidden_size
    q, new = spec((rows, h), qdt), spec((rows, h), self.cache)
    cache, mask = spec((rows, t, entry), edt), spec((rows, t), bool)
    if self.policy.attn_sparsity == 1:
      return [_analyse(self.attend, q, new, new, cache, cache, mask)]
    keep = max(1, int(np.ceil(self.policy.attn_sparsity * t)))
    return [_analyse(self.select, q, new, cache, mask, keep=keep),
            _analyse(self.take_rows, cache, spec((rows, keep), np.int32)),
            _analyse(self.attend_selected, spec((rows, t + 1, self.cfg.num_heads), np.float32),
                     spec((rows, keep), np.int32), spec((rows, keep, entry), edt), new)]


def _spec(shape, dtype, device: jax.Device | None = None) -> jax.ShapeDtypeStruct:
  sharding = jax.sharding.SingleDeviceSharding(device) if device is not None else None
  return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


def _analyse(fn, *args, **static) -> StepMemory:
  return StepMemory.of(fn.lower(*args, **static).compile())


def _combine(parts: list[StepMemory]) -> StepMemory:
  """Parts run one after another: their outputs add up, their temporaries do not."""
  return StepMemory(temp=max(p.temp for p in parts), output=sum(p.output for p in parts))


def _head_last(params, x, *, cfg, compute_dtype):
  """LM head of the last position only: [b, s, hidden] -> logits [b, vocab] float32."""
  return opt.head(params, x[:, -1:], cfg=cfg, compute_dtype=compute_dtype)[:, 0]


def _take_rows(cache: jax.Array, positions: jax.Array) -> jax.Array:
  """cache [b, t, ...] rows at positions [b, keep] -> [b, keep, ...]."""
  return jnp.take_along_axis(cache, positions.reshape(*positions.shape, *([1] * (cache.ndim - 2))),
                             axis=1)


def _write_kv(cache: jax.Array, new: jax.Array, slot) -> jax.Array:
  """Writes new [b, n, h] into cache [b, t, h] at time `slot` (the cache buffer is donated)."""
  return jax.lax.dynamic_update_slice_in_dim(cache, new.astype(cache.dtype), slot, axis=1)
