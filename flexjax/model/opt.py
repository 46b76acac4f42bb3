"""Pure OPT layer math: (params, inputs, kv) -> (outputs, new kv). Jitted one layer at a time.

Parameters arrive in their storage dtype. Vectors are cast to the compute dtype on entry,
quantized tensors dequantized; matrices are cast at their products, a tile at a time
(model/linear.py), and embeddings row by row as they are looked up. Kernels are [in, out].
Shapes are marked as [batch, seq, hidden]; the KV cache of one layer is [batch, time, hidden] for
K and for V (heads merged, head-major inside the hidden axis). Attention over the cache is
model/attention.py's, with as many KV heads as query heads.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from flexjax.config import ModelConfig
from flexjax.model import attention, linear

Params = dict


def layer_norm(p: Params, x: jax.Array, eps: float) -> jax.Array:
  """LayerNorm over the last axis, statistics in float32; p may be empty (no affine)."""
  x32 = x.astype(jnp.float32)
  mean = x32.mean(-1, keepdims=True)
  var = jnp.square(x32 - mean).mean(-1, keepdims=True)
  y = (x32 - mean) * jax.lax.rsqrt(var + eps)
  if p:
    y = y * p['scale'].astype(jnp.float32) + p['bias'].astype(jnp.float32)
  return y.astype(x.dtype)


def positions_from_mask(mask: jax.Array) -> jax.Array:
  """OPT's positions of left-padded rows: running count of real tokens minus one ([b, s] int32)."""
  m = mask.astype(jnp.int32)
  return jnp.cumsum(m, axis=1) * m - 1


def embed(params: Params, tokens: jax.Array, positions: jax.Array, *, cfg: ModelConfig,
          compute_dtype) -> jax.Array:
  """Token + learned position embedding. tokens, positions: [b, s] -> [b, s, hidden]."""
  p = attention.cast_params(params, compute_dtype)
  x = linear.take_rows(p['tokens'], tokens).astype(compute_dtype)  # [b, s, embed_dim]
  if cfg.has_projection:
    x = linear.layer(p['project_in'], x)
  return x + jnp.take(p['positions'], positions + 2, axis=0).astype(compute_dtype)


def head(params: Params, x: jax.Array, *, cfg: ModelConfig, compute_dtype) -> jax.Array:
  """Final LayerNorm, project_out and the tied LM head. [b, s, hidden] -> [b, s, vocab] float32."""
  p = attention.cast_params(params, compute_dtype)
  x = x.astype(compute_dtype)
  if cfg.has_final_layer_norm:
    x = layer_norm(p.get('final_ln', {}), x, cfg.layer_norm_eps)
  if cfg.has_projection:
    x = linear.layer(p['project_out'], x)
  return linear.dense(x, p['tokens'], compute_dtype).astype(jnp.float32)


def _qkv(p: Params, x: jax.Array, cfg: ModelConfig):
  q = linear.layer(p['q'], x) * (cfg.head_dim ** -0.5)
  return q, linear.layer(p['k'], x), linear.layer(p['v'], x)


def _mlp_block(p: Params, x: jax.Array, cfg: ModelConfig) -> jax.Array:
  ln = p.get('mlp_ln', {})
  h = layer_norm(ln, x, cfg.layer_norm_eps) if cfg.do_layer_norm_before else x
  h = linear.layer(p['fc2'], jax.nn.relu(linear.layer(p['fc1'], h)))
  x = x + h
  return x if cfg.do_layer_norm_before else layer_norm(ln, x, cfg.layer_norm_eps)


def decoder_prefill(params: Params, x: jax.Array, mask: jax.Array, *, cfg: ModelConfig,
                    compute_dtype, cache_dtype, attend_dtype=None):
  """One decoder layer over whole prompts.

  Args:
    x: [b, s, hidden] hidden states.
    mask: [b, s] bool, True for real tokens (prompts are left-padded).
    attend_dtype: what the attention computes in (attention.prefill_dtype; default
      compute_dtype).
  Returns:
    (y [b, s, hidden], (k, v)) with k, v: [b, s, hidden] in cache_dtype.
  """
  p = attention.cast_params(params, compute_dtype)
  x = x.astype(compute_dtype)
  ln = p.get('attn_ln', {})
  h = layer_norm(ln, x, cfg.layer_norm_eps) if cfg.do_layer_norm_before else x
  q, k, v = _qkv(p, h, cfg)
  # Attend to K/V as the cache will hold them, so prefill and decode read the same values.
  k, v = k.astype(cache_dtype), v.astype(cache_dtype)
  attn = attention.prefill_attend(q, k.astype(compute_dtype), v.astype(compute_dtype), mask,
                                  cfg, dtype=attend_dtype)
  x = x + linear.layer(p['o'], attn)
  if not cfg.do_layer_norm_before:
    x = layer_norm(ln, x, cfg.layer_norm_eps)
  return _mlp_block(p, x, cfg), (k, v)


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
  p = attention.cast_params(params, compute_dtype)
  x = x.astype(compute_dtype)[:, 0]
  h = layer_norm(p.get('attn_ln', {}), x, cfg.layer_norm_eps) if cfg.do_layer_norm_before else x
  q, k, v = _qkv(p, h, cfg)
  return q, k.astype(cache_dtype), v.astype(cache_dtype)


def decode_out(params: Params, x: jax.Array, attn: jax.Array, *, cfg: ModelConfig,
               compute_dtype) -> jax.Array:
  """Last part of a decode step: output projection, residual, MLP. -> [b, 1, hidden]."""
  p = attention.cast_params(params, compute_dtype)
  x = x.astype(compute_dtype)[:, 0]
  x = x + linear.layer(p['o'], attn.astype(compute_dtype))
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
  attn = attention.decode_attend(q, k, v, k_cache, v_cache, cache_mask, cfg=cfg)
  y = decode_out(params, x, attn, cfg=cfg, compute_dtype=compute_dtype)
  return y, (k[:, None], v[:, None])
