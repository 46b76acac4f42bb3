"""Pure LLaMA-family layer math (RMSNorm, rotary positions, SwiGLU, grouped-query attention), with
the interface of model/opt.py: (params, inputs, kv) -> (outputs, new kv), jitted a layer at a time.

Parameters arrive in their storage dtype and are cast as in opt.py (vectors on entry, matrices at
their products through model/linear.py, packed ones dequantized). Kernels are [in, out]. The KV
cache of one layer holds only the KV heads: [batch, time, kv_heads * head_dim] for K (rotated,
as HF caches it) and for V. Positions of left-padded rows count real tokens only: a prompt's
positions are the running count of its real tokens minus one, a new token's the number of real
tokens in the cache.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from flexjax.config import ModelConfig
from flexjax.model import linear
from flexjax.model.opt import positions_from_mask
from flexjax.quant import Packed, QuantConfig, dequantize, unpack

Params = dict


def _cast(tree: Params, dtype) -> Params:
  """Vectors in the compute dtype, packed tensors dequantized; other matrices stay as stored."""
  return jax.tree_util.tree_map(
      lambda a: (unpack(a, dtype) if isinstance(a, Packed)
                 else a.astype(dtype) if a.ndim < 2 else a), tree,
      is_leaf=lambda a: isinstance(a, Packed))


def load_cache(cache: jax.Array, dtype, cfg: ModelConfig, quant: QuantConfig | None) -> jax.Array:
  """A cache array in the compute dtype: [b, t, kv_dim], dequantized from byte rows if needed."""
  if quant is None:
    return cache.astype(dtype)
  return dequantize(cache, cfg.kv_dim, quant, dtype)


def rms_norm(scale: jax.Array, x: jax.Array, eps: float) -> jax.Array:
  """RMSNorm over the last axis, statistics in float32, scaled in x's dtype (as HF does)."""
  x32 = x.astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.square(x32).mean(-1, keepdims=True) + eps)
  return y.astype(x.dtype) * scale.astype(x.dtype)


def dense(p: Params, x: jax.Array) -> jax.Array:
  return linear.dense(x, p['kernel'], x.dtype)


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


def rotate(x: jax.Array, positions: jax.Array, cfg: ModelConfig) -> jax.Array:
  """Rotary embedding, rotate-half convention. x: [..., heads, head_dim]; positions: x's
  leading shape [...] int32. Angles in float32, the result in x's dtype."""
  angles = positions.astype(jnp.float32)[..., None] * inverse_frequencies(cfg)  # [..., d/2]
  angles = jnp.concatenate([angles, angles], axis=-1)[..., None, :]  # [..., 1, d]
  cos, sin = jnp.cos(angles), jnp.sin(angles)
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  rotated = jnp.concatenate([-x2, x1], axis=-1)
  return (x.astype(jnp.float32) * cos + rotated * sin).astype(x.dtype)


# ---- stages -------------------------------------------------------------------------------------
def embed(params: Params, tokens: jax.Array, positions: jax.Array, *, cfg: ModelConfig,
          compute_dtype) -> jax.Array:
  """Token embedding. tokens: [b, s] -> [b, s, hidden] (positions act in the layers)."""
  del positions, cfg
  p = _cast(params, compute_dtype)
  return jnp.take(p['tokens'], tokens, axis=0).astype(compute_dtype)


def head(params: Params, x: jax.Array, *, cfg: ModelConfig, compute_dtype) -> jax.Array:
  """Final RMSNorm and the LM head (lm_head, or the tied token embedding).
  [b, s, hidden] -> [b, s, vocab] float32."""
  p = _cast(params, compute_dtype)
  x = rms_norm(p['final_norm']['scale'], x.astype(compute_dtype), cfg.rms_norm_eps)
  w = p['tokens'] if cfg.tie_word_embeddings else p['lm_head']  # [vocab, hidden]
  return linear.dense_transposed(x, w, compute_dtype).astype(jnp.float32)


def _heads(x: jax.Array, n: int, cfg: ModelConfig) -> jax.Array:
  return x.reshape(*x.shape[:-1], n, cfg.head_dim)  # [..., n, head_dim]


def _groups(q: jax.Array, cfg: ModelConfig) -> jax.Array:
  """[..., heads * head_dim] -> [..., kv_heads, group, head_dim] (query head i uses KV head
  i // group, as HF's repeat_kv)."""
  g = cfg.num_heads // cfg.kv_heads
  return q.reshape(*q.shape[:-1], cfg.kv_heads, g, cfg.head_dim)


def _qkv(p: Params, x: jax.Array, positions: jax.Array, cfg: ModelConfig):
  """Rotated, scaled q [..., q_dim] and rotated k, v [..., kv_dim]; positions: x's leading shape."""
  q = rotate(_heads(dense(p['q'], x), cfg.num_heads, cfg), positions, cfg)
  k = rotate(_heads(dense(p['k'], x), cfg.kv_heads, cfg), positions, cfg)
  q = q.reshape(*x.shape[:-1], cfg.q_dim) * (cfg.head_dim ** -0.5)
  return q, k.reshape(*x.shape[:-1], cfg.kv_dim), dense(p['v'], x)


def _mlp_block(p: Params, x: jax.Array, cfg: ModelConfig) -> jax.Array:
  """Residual SwiGLU MLP: x + down(silu(gate(h)) * up(h)), h = RMSNorm(x)."""
  h = rms_norm(p['mlp_norm']['scale'], x, cfg.rms_norm_eps)
  return x + dense(p['down'], jax.nn.silu(dense(p['gate'], h)) * dense(p['up'], h))


def _masked_softmax(scores: jax.Array, mask: jax.Array, axis: int) -> jax.Array:
  """Softmax in float32; masked entries get probability 0 (rows never NaN)."""
  scores = jnp.where(mask, scores.astype(jnp.float32), jnp.finfo(jnp.float32).min)
  return jax.nn.softmax(scores, axis=axis)


def decoder_prefill(params: Params, x: jax.Array, mask: jax.Array, *, cfg: ModelConfig,
                    compute_dtype, cache_dtype):
  """One decoder layer over whole prompts.

  Args:
    x: [b, s, hidden] hidden states.
    mask: [b, s] bool, True for real tokens (prompts are left-padded).
  Returns:
    (y [b, s, hidden], (k, v)) with k, v: [b, s, kv_dim] in cache_dtype.
  """
  p = _cast(params, compute_dtype)
  x = x.astype(compute_dtype)
  h = rms_norm(p['attn_norm']['scale'], x, cfg.rms_norm_eps)
  q, k, v = _qkv(p, h, positions_from_mask(mask), cfg)
  # Attend to K/V as the cache will hold them, so prefill and decode read the same values.
  k, v = k.astype(cache_dtype), v.astype(cache_dtype)
  s = x.shape[1]
  causal = jnp.tril(jnp.ones((s, s), bool))
  allowed = (causal[None] & mask[:, None, :])[:, None, None]  # [b, 1, 1, q, t]
  kc, vc = (_heads(a.astype(compute_dtype), cfg.kv_heads, cfg) for a in (k, v))  # [b, t, kv, d]
  scores = jnp.einsum('bqkgd,btkd->bkgqt', _groups(q, cfg), kc)
  probs = _masked_softmax(scores, allowed, axis=-1).astype(compute_dtype)
  attn = jnp.einsum('bkgqt,btkd->bqkgd', probs, vc).reshape(*x.shape[:-1], cfg.q_dim)
  x = x + dense(p['o'], attn)
  return _mlp_block(p, x, cfg), (k, v)


def _decode_scores(q: jax.Array, k_new: jax.Array, k_cache: jax.Array, cfg: ModelConfig):
  """Scores of one new query over the cache and itself: [b, t + 1, heads] (new token last).
  q [b, q_dim]; k_new [b, kv_dim]; k_cache [b, t, kv_dim], all in q's dtype."""
  qg = _groups(q, cfg)  # [b, kv, g, d]
  kc = _heads(k_cache, cfg.kv_heads, cfg)  # [b, t, kv, d]
  # Products and sums rather than einsums: matrix-vector products, faster on XLA:CPU (opt.py).
  past = jnp.sum(qg[:, None] * kc[:, :, :, None], axis=-1)  # [b, t, kv, g]
  new = jnp.sum(qg * _heads(k_new, cfg.kv_heads, cfg)[:, :, None], axis=-1)[:, None]
  scores = jnp.concatenate([past, new], axis=1)  # [b, t + 1, kv, g]
  return scores.reshape(*scores.shape[:2], cfg.num_heads)


def _weighted_values(probs: jax.Array, v_rows: jax.Array, v_new: jax.Array, cfg: ModelConfig):
  """probs [b, t + 1, heads] over v_rows [b, t, kv_dim] and the new v [b, kv_dim] -> [b, q_dim]."""
  g = cfg.num_heads // cfg.kv_heads
  pg = probs.reshape(*probs.shape[:2], cfg.kv_heads, g)[..., None]  # [b, t + 1, kv, g, 1]
  vc = _heads(v_rows, cfg.kv_heads, cfg)[:, :, :, None]  # [b, t, kv, 1, d]
  out = jnp.sum(pg[:, :-1] * vc, axis=1) + pg[:, -1] * _heads(v_new, cfg.kv_heads, cfg)[:, :, None]
  return out.reshape(out.shape[0], cfg.q_dim)


def attend_decode(q, k_new, v_new, k_cache, v_cache, cache_mask, *, cfg: ModelConfig):
  """Attention of one new token over the cached positions plus itself (the cache is never
  concatenated with the new entry). q [b, q_dim]; k_new, v_new [b, kv_dim]; caches
  [b, t, kv_dim]; cache_mask [b, t] bool. Returns [b, q_dim] in q's dtype."""
  dtype = q.dtype
  scores = _decode_scores(q, k_new, k_cache.astype(dtype), cfg)
  allowed = jnp.concatenate([cache_mask, jnp.ones_like(cache_mask[:, :1])], axis=1)
  probs = _masked_softmax(scores, allowed[:, :, None], axis=1).astype(dtype)
  return _weighted_values(probs, v_cache.astype(dtype), v_new, cfg)


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
  p = _cast(params, compute_dtype)
  h = rms_norm(p['attn_norm']['scale'], x.astype(compute_dtype)[:, 0], cfg.rms_norm_eps)
  q, k, v = _qkv(p, h, decode_positions(cache_mask), cfg)
  return q, k.astype(cache_dtype), v.astype(cache_dtype)


def decode_attend(q: jax.Array, k: jax.Array, v: jax.Array, k_cache: jax.Array,
                  v_cache: jax.Array, cache_mask: jax.Array, *, cfg: ModelConfig,
                  cache_quant: QuantConfig | None = None) -> jax.Array:
  """Middle part of a decode step: attention, on whichever backend holds the cache rows."""
  kc = load_cache(k_cache, q.dtype, cfg, cache_quant)
  vc = load_cache(v_cache, q.dtype, cfg, cache_quant)
  return attend_decode(q, k.astype(q.dtype), v.astype(q.dtype), kc, vc, cache_mask, cfg=cfg)


def decode_select(q: jax.Array, k: jax.Array, k_cache: jax.Array, cache_mask: jax.Array, *,
                  cfg: ModelConfig, keep: int, cache_quant: QuantConfig | None = None):
  """Sparse attention, first half (as opt.decode_select): scores against every cached K, then
  the `keep` positions per sequence whose largest probability over the heads is highest.
  Returns (scores [b, t + 1, heads], new token last, masked; positions [b, keep] int32)."""
  kc = load_cache(k_cache, q.dtype, cfg, cache_quant)
  allowed = jnp.concatenate([cache_mask, jnp.ones_like(cache_mask[:, :1])], axis=1)[:, :, None]
  scores = jnp.where(allowed, _decode_scores(q, k.astype(q.dtype), kc, cfg).astype(jnp.float32),
                     jnp.finfo(jnp.float32).min)
  priority = jax.nn.softmax(scores, axis=1)[:, :-1].max(axis=-1)  # [b, t]
  priority = jnp.where(cache_mask, priority, -1.0)
  _, positions = jax.lax.top_k(priority, keep)
  return scores, positions.astype(jnp.int32)


def decode_attend_selected(scores: jax.Array, positions: jax.Array, v_selected: jax.Array,
                           v: jax.Array, *, cfg: ModelConfig,
                           cache_quant: QuantConfig | None = None) -> jax.Array:
  """Sparse attention, second half: softmax over the kept positions and the new token.
  scores [b, t + 1, heads]; positions [b, keep]; v_selected [b, keep, kv_dim] (or byte rows);
  v [b, kv_dim]. Returns [b, q_dim] float32."""
  kept = jnp.take_along_axis(scores[:, :-1], positions[:, :, None], axis=1)  # [b, keep, n]
  probs = jax.nn.softmax(jnp.concatenate([kept, scores[:, -1:]], axis=1), axis=1)
  vs = load_cache(v_selected, jnp.float32, cfg, cache_quant)
  return _weighted_values(probs, vs, v.astype(jnp.float32), cfg)


def decode_out(params: Params, x: jax.Array, attn: jax.Array, *, cfg: ModelConfig,
               compute_dtype) -> jax.Array:
  """Last part of a decode step: output projection, residual, MLP. attn [b, q_dim] ->
  [b, 1, hidden]."""
  p = _cast(params, compute_dtype)
  x = x.astype(compute_dtype)[:, 0] + dense(p['o'], attn.astype(compute_dtype))
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
  attn = decode_attend(q, k, v, k_cache, v_cache, cache_mask, cfg=cfg)
  y = decode_out(params, x, attn, cfg=cfg, compute_dtype=compute_dtype)
  return y, (k[:, None], v[:, None])
