"""Attention over a KV cache, shared by every model family: grouped-query attention with
cfg.kv_heads KV heads, each serving num_heads // kv_heads query heads (query head i uses KV head
i // group, as HF's repeat_kv). Multi-head attention (OPT) is the case kv_heads == num_heads.

A cache row holds one token's K (or V) of one layer: [kv_heads * head_dim], head-major, in the
cache dtype or as quantized byte rows. These functions run on whichever backend holds the cache
rows (the device, or the CPU backend next to a host cache). Queries arrive scaled.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from flexjax.config import ModelConfig
from flexjax.quant import Packed, QuantConfig, dequantize, unpack

Params = dict


def cast_params(tree: Params, dtype) -> Params:
  """Vectors in the compute dtype and quantized tensors dequantized into it, here, right before
  use; other matrices stay as stored (cast where they are used, model/linear.py)."""
  return jax.tree_util.tree_map(
      lambda a: (unpack(a, dtype) if isinstance(a, Packed)
                 else a.astype(dtype) if a.ndim < 2 else a), tree,
      is_leaf=lambda a: isinstance(a, Packed))


def load_cache(cache: jax.Array, dtype, cfg: ModelConfig, quant: QuantConfig | None) -> jax.Array:
  """A cache array in `dtype`: [b, t, kv_dim], dequantized from byte rows if quant is given."""
  if quant is None:
    return cache.astype(dtype)
  return dequantize(cache, cfg.kv_dim, quant, dtype)


def masked_softmax(scores: jax.Array, mask: jax.Array, axis: int) -> jax.Array:
  """Softmax in float32 along `axis`; masked entries get probability 0 (rows never NaN)."""
  scores = jnp.where(mask, scores.astype(jnp.float32), jnp.finfo(jnp.float32).min)
  return jax.nn.softmax(scores, axis=axis)


def heads(x: jax.Array, n: int, cfg: ModelConfig) -> jax.Array:
  """[..., n * head_dim] -> [..., n, head_dim]."""
  return x.reshape(*x.shape[:-1], n, cfg.head_dim)


def groups(q: jax.Array, cfg: ModelConfig) -> jax.Array:
  """Queries [..., q_dim] -> [..., kv_heads, group, head_dim]."""
  return q.reshape(*q.shape[:-1], cfg.kv_heads, cfg.num_heads // cfg.kv_heads, cfg.head_dim)


PREFILL_ITEMS = 4  # (sequence, KV head) items per call of prefill attention's loop


def prefill_attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array,
                   cfg: ModelConfig, chunk: int | None = None, dtype=None) -> jax.Array:
  """Causal attention of whole prompts over themselves, `chunk` query positions at a time (each
  chunk attends only to the positions up to its last: about half the work of the full square).

  The work goes one (sequence, KV head) item at a time, PREFILL_ITEMS items per call: an
  item's scores stay in the core's caches through the softmax and the product with the values,
  where scores of every sequence and head at once go through memory (XLA:CPU, opt-1.3b, 8
  prompts of 512: 267 -> 181 ms per layer, of which 54 ms are the transposes to head-major).

  Args:
    q: [b, s, q_dim] (scaled); k, v: [b, s, kv_dim] in q's dtype.
    mask: [b, s] bool, True for real tokens (prompts are left-padded).
    chunk: query positions per chunk (default: prefill_chunk(s)).
    dtype: what it computes in (default q's; see prefill_dtype).
  Returns:
    [b, s, q_dim] attention output (before the output projection), in q's dtype. A padding
    position (no real token at or before it) gets some average of values: nothing reads it.
  """
  b, s = q.shape[:2]
  out_dtype = q.dtype
  q, k, v = (a.astype(dtype or out_dtype) for a in (q, k, v))
  kv, g, d = cfg.kv_heads, cfg.num_heads // cfg.kv_heads, cfg.head_dim
  chunk = chunk or prefill_chunk(s)
  # Head-major once per layer: an item's products read contiguous [positions, head_dim] blocks.
  qi = groups(q, cfg).transpose(0, 2, 3, 1, 4).reshape(b * kv, g, s, d)
  ki = heads(k, kv, cfg).transpose(0, 2, 1, 3).reshape(b * kv, s, d)
  vi = heads(v, kv, cfg).transpose(0, 2, 1, 3).reshape(b * kv, s, d)
  mi = jnp.broadcast_to(mask[:, None], (b, kv, s)).reshape(b * kv, s)

  def item(args):
    q1, k1, v1, m1 = args  # [g, s, d], [s, d], [s, d], [s]
    outs = []
    for start in range(0, s, chunk):
      end = min(s, start + chunk)
      causal = jnp.arange(start, end)[:, None] >= jnp.arange(end)[None, :]  # [q, t]
      allowed = (causal & m1[None, :end])[None]  # [1, q, t]
      scores = jnp.einsum('gqd,td->gqt', q1[:, start:end], k1[:end])
      probs = masked_softmax(scores, allowed, axis=-1).astype(q.dtype)
      outs.append(jnp.einsum('gqt,td->gqd', probs, v1[:end]))
    return outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=1)  # [g, s, d]

  out = jax.lax.map(item, (qi, ki, vi, mi), batch_size=min(PREFILL_ITEMS, b * kv))
  return out.reshape(b, kv, g, s, d).transpose(0, 3, 1, 2, 4).reshape(b, s, -1).astype(out_dtype)


def prefill_dtype(dtype, platform: str):
  """The dtype prompt attention computes in: float32 on a CPU backend, else `dtype`. XLA:CPU
  computes 16-bit arithmetic and transposes by converting around every operation: an opt-1.3b
  bfloat16 prompt step of 32 x 128 attended in 207 ms against 93 ms converting q, k and v to
  float32 first (the whole layer step 693 -> 558 ms)."""
  return jnp.float32 if platform == 'cpu' else dtype


def prefill_chunk(s: int) -> int:
  """Query positions per chunk of a prompt of s: 64 below 512 positions, 128 from 512, more for
  long prompts to keep the program at <= 16 chunks. On XLA:CPU (2 cores, float32, chunks of
  32-512 timed): opt-1.3b 32 x 128 64 is the fastest (116 ms; 128: 140); 16 x 256 64 and 128
  within 2%; 16 x 512 128 (314-331 ms against 403 for 64 and 394 for 256); 8 x 1024 128-256
  (468 against 593 for 64); 2 x 2048 128-256 (389-394; 512: 421)."""
  return max(-(-s // 16), 128 if s >= 512 else 64)


def decode_scores(q: jax.Array, k_new: jax.Array, k_cache: jax.Array, cfg: ModelConfig,
                  standalone: bool = False):
  """Scores of one new query per sequence over its cache and itself: [b, t + 1, num_heads], the
  new token last. q [b, q_dim]; k_new [b, kv_dim]; k_cache [b, t, kv_dim], all in q's dtype.
  standalone: the attention is a program of its own (CPU attention), not part of a layer step,
  so q is already one of its inputs (else _computed_once).

  With one query per sequence these are matrix-vector products: XLA:CPU runs them fastest as
  products summed by halving the head axis (10x a batched matmul or a reduce over it), with a
  group of queries per KV head too (the group axis broadcast) now that the query is computed
  once: a decode layer step against batched products (einsum) at 16 rows x 544 positions,
  SmolLM2 (3 queries per KV head) 2.70 against 4.27 ms, llama-3-8b (4) 64.3 against 86.1,
  mistral-7b 65.2 against 89.5; 64 x 544 SmolLM2 10.1 against 27.2; no slower at any size
  measured (1-64 rows, 160 and 544 positions)."""
  if not standalone:
    q = _computed_once(q, cfg)
  qg = groups(q, cfg)  # [b, kv, g, d]
  kc = heads(k_cache, cfg.kv_heads, cfg)  # [b, t, kv, d]
  kn = heads(k_new, cfg.kv_heads, cfg)  # [b, kv, d]
  past = sum_last(qg[:, None] * kc[:, :, :, None])  # [b, t, kv, g]
  new = sum_last(qg * kn[:, :, None])[:, None]
  scores = jnp.concatenate([past, new], axis=1)  # [b, t + 1, kv, g]
  return scores.reshape(*scores.shape[:2], cfg.num_heads)


def _computed_once(q: jax.Array, cfg: ModelConfig) -> jax.Array:
  """q [b, q_dim] as it is, through a product with the identity of each head: XLA keeps a
  product's operand apart, where inside a layer step it folded the ops that make q (the
  product's transposed output, the bias, the rotation's sines and cosines, the scaling) into
  the scores, computing them again for every cached position (16 rows x 544 positions: a
  llama-2-7b decode layer step 172 -> 69 ms, opt-1.3b 27 -> 21 ms). Exact: each output is one
  value times one plus zeros (HIGHEST: no reduced-precision products on a GPU); a subnormal
  value may come back as zero, as the scores' own arithmetic flushes it."""
  eye = jnp.eye(cfg.head_dim, dtype=q.dtype)
  return jnp.einsum('bhd,de->bhe', heads(q, cfg.num_heads, cfg), eye,
                    precision=jax.lax.Precision.HIGHEST).reshape(q.shape)


def sum_last(x: jax.Array) -> jax.Array:
  """x summed over its last axis by adding halves: [..., n] -> [...]."""
  return halving_sum(x, x.ndim - 1)


def halving_sum(x: jax.Array, axis: int) -> jax.Array:
  """x summed over `axis` by adding its halves until one entry is left (an odd one out is added
  to the first): the shape without that axis."""
  while x.shape[axis] > 1:
    n = x.shape[axis]
    h = n // 2
    half = (jax.lax.slice_in_dim(x, 0, h, axis=axis)
            + jax.lax.slice_in_dim(x, h, 2 * h, axis=axis))
    if n % 2:
      first = (jax.lax.slice_in_dim(half, 0, 1, axis=axis)
               + jax.lax.slice_in_dim(x, n - 1, n, axis=axis))
      half = jnp.concatenate([first, jax.lax.slice_in_dim(half, 1, h, axis=axis)], axis=axis)
    x = half
  return jnp.squeeze(x, axis)


POSITION_RUN = 16


def sum_positions(x: jax.Array, axis: int) -> jax.Array:
  """x summed over its positions `axis`: each run of POSITION_RUN positions summed by halving,
  then the runs' sums (and the positions past the last whole run) added up.

  XLA:CPU's speed here hangs on the form of the sum (measured, opt-1.3b, 16 sequences, 528
  positions, values stored float32 / float16 / bfloat16): a plain sum over the positions takes
  3.6 / 21 / 24 ms, this form 3.3 / 1.8 / 1.7 ms (runs of 8 positions 3.0 / 2.2 / 2.1, of 32
  21 ms: the plain sum's slow form again); one sequence at 544 positions 8.5 ms summed plainly,
  0.27 ms so."""
  n = x.shape[axis]
  whole = n // POSITION_RUN * POSITION_RUN
  if not whole:
    return jnp.sum(x, axis=axis)
  runs = jax.lax.slice_in_dim(x, 0, whole, axis=axis)
  runs = runs.reshape(*x.shape[:axis], whole // POSITION_RUN, POSITION_RUN, *x.shape[axis + 1:])
  out = jnp.sum(halving_sum(runs, axis + 1), axis=axis)
  if whole < n:
    out = out + jnp.sum(jax.lax.slice_in_dim(x, whole, n, axis=axis), axis=axis)
  return out


def weighted_values(probs: jax.Array, v_rows: jax.Array, v_new: jax.Array, cfg: ModelConfig):
  """probs [b, t + 1, num_heads] over v_rows [b, t, kv_dim] and the new v [b, kv_dim]
  -> [b, q_dim]: products summed over the positions (sum_positions), a group of queries per KV
  head as a broadcast axis."""
  b, g = probs.shape[0], cfg.num_heads // cfg.kv_heads
  vc = heads(v_rows, cfg.kv_heads, cfg)  # [b, t, kv, d]
  vn = heads(v_new, cfg.kv_heads, cfg)  # [b, kv, d]
  if g == 1:
    past = sum_positions(probs[:, :-1, :, None] * vc, axis=1)  # [b, kv, d]
    return (past + probs[:, -1, :, None] * vn).reshape(b, cfg.q_dim)
  pg = probs.reshape(*probs.shape[:2], cfg.kv_heads, g)[..., None]  # [b, t + 1, kv, g, 1]
  out = sum_positions(pg[:, :-1] * vc[:, :, :, None], axis=1) + pg[:, -1] * vn[:, :, None]
  return out.reshape(b, cfg.q_dim)


def _with_new(cache_mask: jax.Array) -> jax.Array:
  """[b, t] -> [b, t + 1]: the cache's mask and the new token, always allowed."""
  return jnp.concatenate([cache_mask, jnp.ones_like(cache_mask[:, :1])], axis=1)


def attend_decode(q, k_new, v_new, k_cache, v_cache, cache_mask, *, cfg: ModelConfig,
                  standalone: bool = False):
  """Attention of one new token over the cached positions plus itself. The cache is never
  concatenated with the new entry (no copy of the cache): the new key's scores are appended to
  the cached ones and its value added to the weighted sum. q [b, q_dim]; k_new, v_new
  [b, kv_dim]; caches [b, t, kv_dim]; cache_mask [b, t] bool. Returns [b, q_dim] in q's dtype.
  standalone: the attention is a program of its own on the CPU backend (CPU attention); it
  computes in `attend_dtype`."""
  dtype = attend_dtype(q.dtype, standalone)
  scores = decode_scores(q.astype(dtype), k_new.astype(dtype), k_cache.astype(dtype), cfg,
                         standalone)
  probs = masked_softmax(scores, _with_new(cache_mask)[:, :, None], axis=1).astype(dtype)
  return weighted_values(probs, v_cache.astype(dtype), v_new.astype(dtype),
                         cfg).astype(q.dtype)


def attend_dtype(dtype, standalone: bool):
  """The dtype decode attention computes in: the query's, or float32 where the attention is a
  program of its own on the CPU backend. XLA:CPU computes float16 and bfloat16 arithmetic by
  converting around every operation; converting the stored rows once as they are read is
  2.4x faster there (opt-1.3b, 16 x 528, cache float16: 15.6 against 6.4 ms; float32 cache
  8.2 ms). Not so inside a layer step on a CPU device, whose products and attention XLA:CPU
  fuses otherwise: an opt-1.3b bfloat16 decode layer of 16 x 528 took 83 ms attending in
  float32 against 38 ms in bfloat16."""
  return jnp.float32 if standalone else dtype


def decode_attend(q: jax.Array, k: jax.Array, v: jax.Array, k_cache: jax.Array,
                  v_cache: jax.Array, cache_mask: jax.Array, *, cfg: ModelConfig,
                  cache_quant: QuantConfig | None = None, standalone: bool = False) -> jax.Array:
  """Middle part of a decode step: dense attention over stored cache rows (byte rows when
  cache_quant is given); standalone as attend_decode's."""
  dtype = attend_dtype(q.dtype, standalone)
  kc = load_cache(k_cache, dtype, cfg, cache_quant)
  vc = load_cache(v_cache, dtype, cfg, cache_quant)
  return attend_decode(q, k, v, kc, vc, cache_mask, cfg=cfg, standalone=standalone)


def decode_select(q: jax.Array, k: jax.Array, k_cache: jax.Array, cache_mask: jax.Array, *,
                  cfg: ModelConfig, keep: int, cache_quant: QuantConfig | None = None):
  """Sparse attention, first half: scores against every cached K, then the `keep` positions
  per sequence whose largest attention probability over the heads is highest.

  Positions are chosen per sequence (shared by the heads, unlike the paper's per-head choice), so
  only `keep` whole rows of V need to be read, which also works for a quantized cache.
  Returns (scores [b, t + 1, num_heads] float32, new token last, masked; positions [b, keep]).
  """
  kc = load_cache(k_cache, q.dtype, cfg, cache_quant)
  allowed = _with_new(cache_mask)[:, :, None]
  scores = jnp.where(allowed, decode_scores(q, k.astype(q.dtype), kc, cfg).astype(jnp.float32),
                     jnp.finfo(jnp.float32).min)
  priority = jax.nn.softmax(scores, axis=1)[:, :-1].max(axis=-1)  # [b, t]
  priority = jnp.where(cache_mask, priority, -1.0)
  _, positions = jax.lax.top_k(priority, keep)
  return scores, positions.astype(jnp.int32)


def decode_attend_selected(scores: jax.Array, positions: jax.Array, v_selected: jax.Array,
                           v: jax.Array, *, cfg: ModelConfig,
                           cache_quant: QuantConfig | None = None) -> jax.Array:
  """Sparse attention, second half: softmax over the kept positions and the new token.
  scores [b, t + 1, num_heads] from decode_select; positions [b, keep]; v_selected
  [b, keep, kv_dim] (or byte rows), the V rows at `positions`; v [b, kv_dim] the new token's.
  Returns [b, q_dim] float32."""
  kept = jnp.take_along_axis(scores[:, :-1], positions[:, :, None], axis=1)  # [b, keep, n]
  probs = jax.nn.softmax(jnp.concatenate([kept, scores[:, -1:]], axis=1), axis=1)
  vs = load_cache(v_selected, jnp.float32, cfg, cache_quant)
  return weighted_values(probs, vs, v.astype(jnp.float32), cfg)
