"""Group-wise asymmetric integer quantization in jnp, packed into byte rows (weights and KV cache).

A tensor [..., dim] is quantized along its last axis in groups of `group_size` contiguous
elements (the last group padded by repeating the row's last value). Each group keeps a minimum and
a scale in float16; values become `bits`-bit integers, packed 8 // bits per byte. One row's bytes
are [packed values | mins | scales], so a quantized tensor is a plain uint8 array [..., row_bytes]
that every tier can hold and move like any other array, and that is dequantized on the device (or
on the CPU backend, next to a host cache) right before use.

Rounding: the stored minimum is rounded down and the stored scale up to float16, so every value's
error is at most half a quantization step: |x - dequantize(quantize(x))| <= scale / 2.
"""

from __future__ import annotations

import dataclasses
import math

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from flexjax.errors import FlexjaxError


@dataclasses.dataclass(frozen=True)
class QuantConfig:
  """Bits per value and group size (the paper: 4 bits, groups of 64)."""

  bits: int = 4
  group_size: int = 64

  def __post_init__(self):
    if self.bits not in (2, 4, 8):
      raise FlexjaxError(f'compress_bits={self.bits} is not supported; use 2, 4 or 8')
    per_byte = 8 // self.bits
    if self.group_size <= 0 or self.group_size % per_byte:
      raise FlexjaxError(f'compress_group_size={self.group_size} must be a positive multiple of '
                         f'{per_byte} (values per byte at {self.bits} bits)')

  def groups(self, dim: int) -> int:
    return math.ceil(dim / self.group_size)

  def row_bytes(self, dim: int) -> int:
    """Bytes of one quantized row of `dim` values: packed values + float16 mins and scales."""
    g = self.groups(dim)
    return g * self.group_size * self.bits // 8 + 4 * g


@flax.struct.dataclass
class Packed:
  """A quantized tensor: uint8 rows [..., row_bytes] standing for [..., dim] values."""

  data: jax.Array | np.ndarray
  dim: int = flax.struct.field(pytree_node=False)
  config: QuantConfig = flax.struct.field(pytree_node=False)

  @property
  def nbytes(self) -> int:
    return int(np.prod(self.data.shape)) * self.data.dtype.itemsize


def _round_f16(x: jax.Array, up: bool) -> jax.Array:
  """float32 -> float16, rounded toward +inf (up) or -inf (down) instead of to nearest."""
  y = x.astype(jnp.float16)
  wrong = y.astype(jnp.float32) < x if up else y.astype(jnp.float32) > x
  return jnp.where(wrong, jnp.nextafter(y, jnp.float16(jnp.inf if up else -jnp.inf)), y)


def quantize(x: jax.Array, config: QuantConfig) -> jax.Array:
  """[..., dim] float -> uint8 [..., row_bytes] (see the module docstring for the layout)."""
  dim, g, bits = x.shape[-1], config.group_size, config.bits
  groups = config.groups(dim)
  x = x.astype(jnp.float32)
  pad = groups * g - dim
  if pad:
    x = jnp.concatenate([x, jnp.repeat(x[..., -1:], pad, axis=-1)], axis=-1)
  x = x.reshape(*x.shape[:-1], groups, g)
  mins = _round_f16(x.min(-1), up=False)
  levels = (1 << bits) - 1
  scales = _round_f16((x.max(-1) - mins.astype(jnp.float32)) / levels, up=True)
  safe = jnp.where(scales > 0, scales.astype(jnp.float32), 1.0)
  q = jnp.clip(jnp.round((x - mins[..., None].astype(jnp.float32)) / safe[..., None]), 0, levels)
  q = q.astype(jnp.uint8).reshape(*q.shape[:-2], groups * g // (8 // bits), 8 // bits)
  shifts = jnp.arange(8 // bits, dtype=jnp.uint8) * bits
  packed = jnp.sum(q << shifts, axis=-1, dtype=jnp.uint8)  # bit fields do not overlap
  as_bytes = lambda a: jax.lax.bitcast_convert_type(a, jnp.uint8).reshape(*a.shape[:-1], -1)
  return jnp.concatenate([packed, as_bytes(mins), as_bytes(scales)], axis=-1)


def dequantize(data: jax.Array, dim: int, config: QuantConfig, dtype=jnp.float32) -> jax.Array:
  """uint8 [..., row_bytes] -> [..., dim] in dtype."""
  g, bits = config.group_size, config.bits
  groups = config.groups(dim)
  n_packed = groups * g * bits // 8
  packed = data[..., :n_packed]
  f16 = lambda a: jax.lax.bitcast_convert_type(a.reshape(*a.shape[:-1], groups, 2), jnp.float16)
  mins = f16(data[..., n_packed:n_packed + 2 * groups]).astype(jnp.float32)
  scales = f16(data[..., n_packed + 2 * groups:]).astype(jnp.float32)
  shifts = jnp.arange(8 // bits, dtype=jnp.uint8) * bits
  q = (packed[..., None] >> shifts) & jnp.uint8((1 << bits) - 1)
  q = q.reshape(*q.shape[:-2], groups, g).astype(jnp.float32)
  x = q * scales[..., None] + mins[..., None]
  return x.reshape(*x.shape[:-2], groups * g)[..., :dim].astype(dtype)


def pack(x, config: QuantConfig) -> Packed:
  """Quantizes a weight tensor along its last axis (the inputs of an [out, in] weight)."""
  return Packed(data=quantize(jnp.asarray(x), config), dim=x.shape[-1], config=config)


def unpack(p: Packed, dtype) -> jax.Array:
  return dequantize(p.data, p.dim, p.config, dtype)
