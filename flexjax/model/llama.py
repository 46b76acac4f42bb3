"""Pure LLaMA-family layer math (RMSNorm, rotary positions, SwiGLU, grouped-query attention), with
the interface of model/opt.py: (params, inputs, kv) -> (outputs, new kv), jitted a layer at a time.

Parameters arrive in their storage dtype and are cast as in opt.py (vectors on entry, matrices at
their products through model/linear.py, packed ones dequantized). Matrices are [out, in]. The KV
cache of one layer holds only the KV heads: [batch, time, kv_heads * head_dim] for K (rotated,
as HF caches it) and for V; attention over it is model/attention.py's. Positions of left-padded
rows count real tokens only: a prompt's positions are the running count of its real tokens minus
one, a new token's the number of real tokens in the cache.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from flexjax.config import ModelConfig
from flexjax.model import attention, linear
from flexjax.model.opt import positions_from_mask

Params = dict


def rms_norm(scale: jax.Array, x: jax.Array, eps: float) -> jax.Array:
  """RMSNorm over the last axis, statistics in float32, scaled in x's dtype (as HF does)."""
  x32 = x.astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.square(x32).mean(-1, keepdims=True) + eps)
  return y.astype(x.dtype) * scale.astype(x.dtype)


# ---- rotary position embedding ------------------------------------------------------------------
def inverse_frequencies(cfg: ModelConfig) -> np.ndarray:
  """Rotary frequencies [head_dim / 2] float32 of the config's rope type (default, 'linear',
  'llama3'), computed from the static config."""
  d = cfg.head_dim
  inv = (1.0 / cfg.rope_theta ** (np.arange(0, d, 2, dtype=np.float32) / d)).astype(np.float32)
  scaling = dict(cfg.rope_scaling or ())
  kind = scaling.get('rope_type')
  if kind == 'linear':
    return (inv / np.float32(scaling['factor'])).astype(np.float32)
  if kind == 'llama3':
    return _llama3_frequencies(inv, scaling)
  return inv


def _llama3_frequencies(inv: np.ndarray, s: dict) -> np.ndarray:
  """Llama 3's scaling: long wavelengths divided by `factor`, short ones kept, a smooth blend
  between (wavelength bounds: original context / low_freq_factor, / high_freq_factor)."""
  factor, context = s['factor'], s['original_max_position_embeddings']
  low_wavelen, high_wavelen = context / s['low_freq_factor'], context / s['high_freq_factor']
  wavelen = 2 * math.pi / inv
  scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
  smooth = (context / wavelen - s['low_freq_factor']) / (s['high_freq_factor']
                                                        - s['low_freq_factor'])
  blended = (1 - smooth) * scaled / factor + smooth * scaled
  medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
  return np.where(medium, blended, scaled).astype(np.float32)


# Angles of at most this many (position, dim) entries are a table built as the step is traced.
ROTARY_TABLE_ENTRIES = 1 << 20


def _angles(positions, cfg: ModelConfig, xp=jnp):
  """Rotary angles of `positions` in float32, [..., head_dim] (each frequency twice, as the
  rotate-half convention pairs dims i and i + d/2); xp: numpy or jax.numpy."""
  angles = positions.astype(np.float32)[..., None] * inverse_frequencies(cfg)  # [..., d/2]
  return xp.concatenate([angles, angles], axis=-1)


def rotary_table(cfg: ModelConfig, length: int) -> np.ndarray:
  """cos and sin of the rotary angles of positions 0 .. length - 1: [2, length, head_dim]
  float32."""
  angles = _angles(np.arange(length), cfg, np)
  return np.stack([np.cos(angles), np.sin(angles)]).astype(np.float32)


def rotary(positions: jax.Array, cfg: ModelConfig,
           length: int | None = None) -> tuple[jax.Array, jax.Array]:
  """cos and sin of the rotary angles of `positions` [...] int32 (each below `length` where
  given), float32 [..., 1, head_dim] to broadcast over heads.

  Where `length` is given and the table is small (ROTARY_TABLE_ENTRIES), they are looked up in
  rotary_table, a constant of the step; else computed in the step. XLA:CPU fuses a computed cos
  and sin into the rotation and computes them again for every head (a SmolLM2 prompt step of
  32 x 128: 11 of its ~145 ms in q's rotation, 1-2 ms in k's, under 1 with the table). A
  position outside [0, length) (padding's -1) takes the nearest row: nothing reads a padding
  position's result."""
  if length is not None and length * cfg.head_dim <= ROTARY_TABLE_ENTRIES:
    cos, sin = (jnp.take(t, positions, axis=0, mode='clip') for t in rotary_table(cfg, length))
  else:
    angles = _angles(positions, cfg)
    cos, sin = jnp.cos(angles), jnp.sin(angles)
  return cos[..., None, :], sin[..., None, :]


def rotate(x: jax.Array, positions: jax.Array, cfg: ModelConfig,
           length: int | None = None) -> jax.Array:
  """Rotary embedding, rotate-half convention. x: [..., heads, head_dim]; positions: x's
  leading shape [...] int32, each below `length` where given (rotary). Angles in float32, the
  result in x's dtype."""
  return _rotated(x, *rotary(positions, cfg, length))


def _rotated(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  rotated = jnp.concatenate([-x2, x1], axis=-1)
  return (x.astype(jnp.float32) * cos + rotated * sin).astype(x.dtype)


# ---- stages -------------------------------------------------------------------------------------
def embed(params: Params, tokens: jax.Array, positions: jax.Array, *, cfg: ModelConfig,
          compute_dtype) -> jax.Array:
  """Token embedding. tokens: [b, s] -> [b, s, hidden] (positions act in the layers)."""
  del positions, cfg
  p = attention.cast_params(params, compute_dtype)
  return linear.take_rows(p['tokens'], tokens).astype(compute_dtype)


def head(params: Params, x: jax.Array, *, cfg: ModelConfig, compute_dtype) -> jax.Array:
  """Final RMSNorm and the LM head (lm_head, or the tied token embedding).
  [b, s, hidden] -> [b, s, vocab] float32."""
  p = attention.cast_params(params, compute_dtype)
  x = rms_norm(p['final_norm']['scale'], x.astype(compute_dtype), cfg.rms_norm_eps)
  w = p['tokens'] if cfg.tie_word_embeddings else p['lm_head']  # [vocab, hidden]
  return linear.dense(x, w, compute_dtype).astype(jnp.float32)


def _qkv(p: Params, x: jax.Array, positions: jax.Array, cfg: ModelConfig, length: int):
  """Rotated, scaled q [..., q_dim] and rotated k, v [..., kv_dim]; positions: x's leading
  shape, each below `length` (their cos and sin found once for q and k)."""
  cos, sin = rotary(positions, cfg, length)
  q = _rotated(attention.heads(linear.layer(p['q'], x), cfg.num_heads, cfg), cos, sin)
  k = _rotated(attention.heads(linear.layer(p['k'], x), cfg.kv_heads, cfg), cos, sin)
  q = q.reshape(*x.shape[:-1], cfg.q_dim) * (cfg.head_dim ** -0.5)
  return q, k.reshape(*x.shape[:-1], cfg.kv_dim), linear.layer(p['v'], x)


def _mlp_block(p: Params, x: jax.Array, cfg: ModelConfig) -> jax.Array:
  """Residual SwiGLU MLP: x + down(silu(gate(h)) * up(h)), h = RMSNorm(x)."""
  h = rms_norm(p['mlp_norm']['scale'], x, cfg.rms_norm_eps)
  gated = jax.nn.silu(linear.layer(p['gate'], h)) * linear.layer(p['up'], h)
  return x + linear.layer(p['down'], gated)


def decoder_prefill(params: Params, x: jax.Array, mask: jax.Array, *, cfg: ModelConfig,
                    compute_dtype, cache_dtype, attend_dtype=None):
  """One decoder layer over whole prompts.

  Args:
    x: [b, s, hidden] hidden states.
    mask: [b, s] bool, True for real tokens (prompts are left-padded).
    attend_dtype: what the attention computes in (attention.prefill_dtype; default
      compute_dtype).
  Returns:
    (y [b, s, hidden], (k, v)) with k, v: [b, s, kv_dim] in cache_dtype.
  """
  p = attention.cast_params(params, compute_dtype)
  x = x.astype(compute_dtype)
  h = rms_norm(p['attn_norm']['scale'], x, cfg.rms_norm_eps)
  q, k, v = _qkv(p, h, positions_from_mask(mask), cfg, mask.shape[1])
  # Attend to K/V as the cache will hold them, so prefill and decode read the same values.
  k, v = k.astype(cache_dtype), v.astype(cache_dtype)
  attn = attention.prefill_attend(q, k.astype(compute_dtype), v.astype(compute_dtype), mask,
                                  cfg, dtype=attend_dtype)
  x = x + linear.layer(p['o'], attn)
  return _mlp_block(p, x, cfg), (k, v)


def decode_positions(cache_mask: jax.Array) -> jax.Array:
  """The new token's position per row: the real tokens in its cache. [b, t] -> [b] int32."""
  return cache_mask.astype(jnp.int32).sum(axis=1)


def decode_qkv(params: Params, x: jax.Array, cache_mask: jax.Array, *, cfg: ModelConfig,
               compute_dtype, cache_dtype):
  """First part of a decode step: the new token's q, k, v.

  Args:
    x: [b, 1, hidden] hidden state of the new token; cache_mask: [b, t] bool (its position).
  Returns:
    q [b, q_dim] (rotated, scaled), k, v [b, kv_dim] in cache_dtype (what the cache will hold).
  """
  p = attention.cast_params(params, compute_dtype)
  h = rms_norm(p['attn_norm']['scale'], x.astype(compute_dtype)[:, 0], cfg.rms_norm_eps)
  q, k, v = _qkv(p, h, decode_positions(cache_mask), cfg, cache_mask.shape[1] + 1)
  return q, k.astype(cache_dtype), v.astype(cache_dtype)


def decode_out(params: Params, x: jax.Array, attn: jax.Array, *, cfg: ModelConfig,
               compute_dtype) -> jax.Array:
  """Last part of a decode step: output projection, residual, MLP. attn [b, q_dim] ->
  [b, 1, hidden]."""
  p = attention.cast_params(params, compute_dtype)
  x = x.astype(compute_dtype)[:, 0] + linear.layer(p['o'], attn.astype(compute_dtype))
  return _mlp_block(p, x, cfg)[:, None]


def decoder_decode(params: Params, x: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
                   cache_mask: jax.Array, *, cfg: ModelConfig, compute_dtype, cache_dtype):
  """One decoder layer for one new token per sequence (the three parts above, fused).

  Args:
    x: [b, 1, hidden]; k_cache, v_cache: [b, t, kv_dim]; cache_mask: [b, t] bool.
  Returns:
    (y [b, 1, hidden], (k_new, v_new)) with k_new, v_new: [b, 1, kv_dim] in cache_dtype.
  """
  q, k, v = decode_qkv(params, x, cache_mask, cfg=cfg, compute_dtype=compute_dtype,
                       cache_dtype=cache_dtype)
  attn = attention.decode_attend(q, k, v, k_cache, v_cache, cache_mask, cfg=cfg)
  y = decode_out(params, x, attn, cfg=cfg, compute_dtype=compute_dtype)
  return y, (k[:, None], v[:, None])
