"""Pure OPT layer math: (params, inputs, kv) -> (outputs, new kv). Jitted one layer at a time.

Parameters arrive in their storage dtype. Vectors are cast to the compute dtype on entry,
quantized tensors dequantized; matrices are cast at their products, a tile at a time
(model/linear.py), and embeddings row by row as they are looked up. Kernels are [in, out]. Shapes are marked as [batch, seq, hidden]; the KV cache of one layer is
[batch, time, hidden] for K and for V (heads merged, head-major inside the hidden axis).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from flexjax.config import ModelConfig
from flexjax.model import linear
from flexjax.quant import Packed, QuantConfig, dequantize, unpack

Params = dict


def _cast(tree: Params, dtype) -> Params:
  """Vectors in the compute dtype and quantized tensors dequantized into it, here, right before
  use; other matrices stay as stored (cast where they are used)."""
  return jax.tree_util.tree_map(
      lambda a: (unpack(a, dtype) if isinstance(a, Packed)
                 else a.astype(dtype) if a.ndim < 2 else a), tree,
      is_leaf=lambda a: isinstance(a, Packed))


def load_cache(cache: jax.Array, dtype, cfg: ModelConfig, quant: QuantConfig | None) -> jax.Array:
  """A cache array in the compute dtype: [b, t, hidden], dequantized from byte rows if needed."""
  if quant is None:
    return cache.astype(dtype)
  return dequantize(cache, cfg.hidden_size, quant, dtype)


def layer_norm(p: Params, x: jax.Array, eps: float) -> jax.Array:
  """LayerNorm over the last axis, statistics in float32; p may be empty (no affine)."""
  x32 = x.astype(jnp.float32)
  mean = x32.mean(-1, keepdims=True)
  var = jnp.square(x32 - mean).mean(-1, keepdims=True)
  y = (x32 - mean) * jax.lax.rsqrt(var + eps)
  if p:
    y = y * p['scale'].astype(jnp.float32) + p['bias'].astype(jnp.float32)
  return y.astype(x.dtype)


def dense(p: Params, x: jax.Array) -> jax.Array:
  y = linear.dense(x, p['kernel'], x.dtype)
  return y + p['bias'] if 'bias' in p else y


def positions_from_mask(mask: jax.Array) -> jax.Array:
  """OPT's positions of left-padded rows: running count of real tokens minus one ([b, s] int32)."""
  m = mask.astype(jnp.int32)
  return jnp.cumsum(m, axis=1) * m - 1


def embed(params: Params, tokens: jax.Array, positions: jax.Array, *, cfg: ModelConfig,
          compute_dtype) -> jax.Array:
  """Token + learned position embedding. tokens, positions: [b, s] -> [b, s, hidden]."""
  p = _cast(params, compute_dtype)
  x = jnp.take(p['tokens'], tokens, axis=0).astype(compute_dtype)  # [b, s, embed_dim]
  if cfg.has_projection:
    x = dense(p['project_in'], x)
  return x + jnp.take(p['positions'], positions + 2, axis=0).astype(compute_dtype)


def head(params: Params, x: jax.Array, *, cfg: ModelConfig, compute_dtype) -> jax.Array:
  """Final LayerNorm, project_out and the tied LM head. [b, s, hidden] -> [b, s, vocab] float32."""
  p = _cast(params, compute_dtype)
  x = x.astype(compute_dtype)
  if cfg.has_final_layer_norm:
    x = layer_norm(p.get('final_ln', {}), x, cfg.layer_norm_eps)
  if cfg.has_projection:
    x = dense(p['project_out'], x)
  return linear.dense_transposed(x, p['tokens'], compute_dtype).astype(jnp.float32)


def _split_heads(x: jax.Array, cfg: ModelConfig) -> jax.Array:
  return x.reshape(*x.shape[:-1], cfg.num_heads, cfg.head_dim)  # [..., heads, head_dim]


def _qkv(p: Params, x: jax.Array, cfg: ModelConfig):
  q = dense(p['q'], x) * (cfg.head_dim ** -0.5)
  return q, dense(p['k'], x), dense(p['v'], x)


def _masked_softmax(scores: jax.Array, mask: jax.Array) -> jax.Array:
  """Softmax in float32 over the last axis; masked entries get probability 0 (rows never NaN)."""
  return _masked_softmax_axis(scores, mask, axis=-1)


def _masked_softmax_axis(scores: jax.Array, mask: jax.Array, axis: int) -> jax.Array:
  scores = jnp.where(mask, scores.astype(jnp.float32), jnp.finfo(jnp.float32).min)
  return jax.nn.softmax(scores, axis=axis)


def _mlp_block(p: Params, x: jax.Array, cfg: ModelConfig) -> jax.Array:
  ln = p.get('mlp_ln', {})
  h = layer_norm(ln, x, cfg.layer_norm_eps) if cfg.do_layer_norm_before else x
  h = dense(p['fc2'], jax.nn.relu(dense(p['fc1'], h)))
  x = x + h
  return x if cfg.do_layer_norm_before else layer_norm(ln, x, cfg.layer_norm_eps)


def decoder_prefill(params: Params, x: jax.Array, mask: jax.Array, *, cfg: ModelConfig,
                    compute_dtype, cache_dtype):
  """One decoder layer over whole prompts.

  Args:
    x: [b, s, hidden] hidden states.
    mask: [b, s] bool, True for real tokens (prompts are left-padded).
  Returns:
    (y [b, s, hidden], (k, v)) with k, v: [b, s, hidden] in cache_dtype.
  """
  p = _cast(params, compute_dtype)
  x = x.astype(compute_dtype)
  ln = p.get('attn_ln', {})
  h = layer_norm(ln, x, cfg.layer_norm_eps) if cfg.do_layer_norm_before else x
  q, k, v = _qkv(p, h, cfg)
  # Attend to K/V as the cache will hold them, so prefill and decode read the same values.
  k, v = k.astype(cache_dtype), v.astype(cache_dtype)
  s = x.shape[1]
  causal = jnp.tril(jnp.ones((s, s), bool))
  allowed = causal[None, None] & mask[:, None, None, :]  # [b, 1, q, t]
  kc, vc = (_split_heads(a.astype(compute_dtype), cfg) for a in (k, v))
  scores = jnp.einsum('bqnd,btnd->bnqt', _split_heads(q, cfg), kc)
  probs = _masked_softmax(scores, allowed).astype(compute_dtype)
  attn = jnp.einsum('bnqt,btnd->bqnd', probs, vc).reshape(x.shape)
  x = x + dense(p['o'], attn)
  if not cfg.do_layer_norm_before:
    x = layer_norm(ln, x, cfg.layer_norm_eps)
  return _mlp_block(p, x, cfg), (k, v)


def attend_decode(q: jax.Array, k_new: jax.Array, v_new: jax.Array, k_cache: jax.Array,
                  v_cache: jax.Array, cache_mask: jax.Array, *, cfg: ModelConfig) -> jax.Array:
  """Attention of one new token over the cached positions plus itself.

  The cache is never concatenated with the new entry (no copy of the cache): the scores of the
  new key are appended to the cached scores, and its value is added to the weighted sum.

  Args:
    q, k_new, v_new: [b, hidden] projections of the new token (q already scaled).
    k_cache, v_cache: [b, t, hidden] cached keys and values.
    cache_mask: [b, t] bool, True where the cache holds a real token.
  Returns:
    [b, hidden] attention output (before the output projection), in q's dtype.
  """
  dtype = q.dtype
  qh, kh, vh = (_split_heads(a, cfg) for a in (q, k_new, v_new))  # [b, n, d]
  kc = _split_heads(k_cache.astype(dtype), cfg)  # [b, t, n, d]
  vc = _split_heads(v_cache.astype(dtype), cfg)
  # Products and sums rather than einsums: with one query per sequence these are matrix-vector
  # products, which XLA:CPU runs 2x faster as fused multiply-reduce than as batched matmuls.
  past = jnp.sum(qh[:, None] * kc, axis=-1)  # [b, t, n]
  new = jnp.sum(qh * kh, axis=-1)[:, None]  # [b, 1, n]
  scores = jnp.concatenate([past, new], axis=1)  # [b, t + 1, n]
  allowed = jnp.concatenate([cache_mask, jnp.ones_like(cache_mask[:, :1])], axis=1)
  probs = _masked_softmax_axis(scores, allowed[:, :, None], axis=1).astype(dtype)
  out = jnp.sum(probs[:, :-1, :, None] * vc, axis=1) + probs[:, -1, :, None] * vh  # [b, n, d]
  return out.reshape(q.shape)


def decode_qkv(params: Params, x: jax.Array, cache_mask: jax.Array, *, cfg: ModelConfig,
               compute_dtype, cache_dtype):
  """First part of a decode step: the new token's q, k, v.

  Args:
    x: [b, 1, hidden] hidden state of the new token; cache_mask: [b, t] (unused: OPT's positions
      enter with the embedding).
  Returns:
    q [b, hidden] (scaled), k, v [b, hidden] in cache_dtype (what the cache will hold).
  """
  del cache_mask
  p = _cast(params, compute_dtype)
  x = x.astype(compute_dtype)[:, 0]
  h = layer_norm(p.get('attn_ln', {}), x, cfg.layer_norm_eps) if cfg.do_layer_norm_before else x
  q, k, v = _qkv(p, h, cfg)
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
  """Sparse attention, first half: scores against every cached K, then the `keep` positions
  per sequence whose largest attention probability over the heads is highest.

  Positions are chosen per sequence (shared by the heads, unlike the paper's per-head choice), so
  only `keep` whole rows of V need to be read, which also works for a quantized cache.
  Returns (scores [b, t + 1, heads] with the new token last, masked; positions [b, keep] int32).
  """
  kc = _split_heads(load_cache(k_cache, q.dtype, cfg, cache_quant), cfg)  # [b, t, n, d]
  qh, kh = _split_heads(q, cfg), _split_heads(k.astype(q.dtype), cfg)
  past = jnp.sum(qh[:, None] * kc, axis=-1)  # [b, t, n]
  new = jnp.sum(qh * kh, axis=-1)[:, None]
  allowed = jnp.concatenate([cache_mask, jnp.ones_like(cache_mask[:, :1])], axis=1)[:, :, None]
  scores = jnp.where(allowed, jnp.concatenate([past, new], axis=1).astype(jnp.float32),
                     jnp.finfo(jnp.float32).min)
  priority = jax.nn.softmax(scores, axis=1)[:, :-1].max(axis=-1)  # [b, t]
  priority = jnp.where(cache_mask, priority, -1.0)
  _, positions = jax.lax.top_k(priority, keep)
  return scores, positions.astype(jnp.int32)


def decode_attend_selected(scores: jax.Array, positions: jax.Array, v_selected: jax.Array,
                           v: jax.Array, *, cfg: ModelConfig,
                           cache_quant: QuantConfig | None = None) -> jax.Array:
  """Sparse attention, second half: softmax over the kept positions and the new token.

  Args:
    scores: [b, t + 1, n] from decode_select; positions: [b, keep].
    v_selected: [b, keep, hidden] (or byte rows) the V rows at `positions`; v: [b, hidden] new.
  Returns:
    [b, hidden] attention output.
  """
  dtype = jnp.float32
  kept = jnp.take_along_axis(scores[:, :-1], positions[:, :, None], axis=1)  # [b, keep, n]
  probs = jax.nn.softmax(jnp.concatenate([kept, scores[:, -1:]], axis=1), axis=1).astype(dtype)
  vs = _split_heads(load_cache(v_selected, dtype, cfg, cache_quant), cfg)  # [b, keep, n, d]
  vh = _split_heads(v.astype(dtype), cfg)
  out = jnp.sum(probs[:, :-1, :, None] * vs, axis=1) + probs[:, -1, :, None] * vh
  return out.reshape(v.shape)


def decode_out(params: Params, x: jax.Array, attn: jax.Array, *, cfg: ModelConfig,
               compute_dtype) -> jax.Array:
  """Last part of a decode step: output projection, residual, MLP. -> [b, 1, hidden]."""
  p = _cast(params, compute_dtype)
  x = x.astype(compute_dtype)[:, 0]
  x = x + dense(p['o'], attn.astype(compute_dtype))
  if not cfg.do_layer_norm_before:
    x = layer_norm(p.get('attn_ln', {}), x, cfg.layer_norm_eps)
  return _mlp_block(p, x, cfg)[:, None]


def decoder_decode(params: Params, x: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
                   cache_mask: jax.Array, *, cfg: ModelConfig, compute_dtype, cache_dtype):
  """One decoder layer for one new token per sequence (the three parts above, fused).

  Args:
    x: [b, 1, hidden] hidden state of the new token.
    k_cache, v_cache: [b, t, hidden]; cache_mask: [b, t] bool.
  Returns:
    (y [b, 1, hidden], (k_new, v_new)) with k_new, v_new: [b, 1, hidden] in cache_dtype.
  """
  q, k, v = decode_qkv(params, x, cache_mask, cfg=cfg, compute_dtype=compute_dtype,
                       cache_dtype=cache_dtype)
  attn = decode_attend(q, k, v, k_cache, v_cache, cache_mask, cfg=cfg)
  y = decode_out(params, x, attn, cfg=cfg, compute_dtype=compute_dtype)
  return y, (k[:, None], v[:, None])
