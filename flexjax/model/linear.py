"""Matrix products against weights kept in their storage dtype.

Weights reach a step as stored (float16, say) and are cast to the compute dtype at the product,
a tile of rows at a time: the float32 copy of a tile stays in cache, so a CPU backend computing
in float32 reads two bytes per weight from memory instead of writing and re-reading a float32
copy of the whole matrix (on this path a decode step runs faster than with float32 weights).
Where the dtypes already agree (float16 compute on a GPU, dequantized int4) it is one product.
A product of many rows (a prompt) instead casts the whole matrix once and multiplies it by
blocks of CAST_ALL_ROWS rows: the cast is then a small share of the work, and products with a
deep contracted axis run faster than the sums of thin tiles (about 190 against 150-170 GFLOP/s
on the 2-core CPU for 4096 rows).

Products in a 16-bit compute dtype sum in float32 and round once at the end (`acc_dtype`):
fewer rounding errors, and XLA:CPU runs bfloat16 products that way 3-10x faster than products
that round to bfloat16 (on a CPU with AMX: 4096 rows 510 -> 170 ms, 8 rows 23 -> 2.6 ms for a
2048 x 8192 weight), float16 ones at the same speed.

Every placement hands the steps the same dtypes, so every placement runs the same products.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

TILE_ELEMENTS = 1 << 20  # weights per cast tile (4 MiB in float32): a core's cache, not memory
CAST_ALL_ROWS = 1024  # rows from which a product casts the whole matrix, and its row blocks
# Tiles per step of the tile loop: two let XLA:CPU overlap one tile's cast with the other's
# product (5-20% faster 4-32-row products against float16 weights than one); many more merge
# the casts into one of the whole matrix (3x slower).
SCAN_UNROLL = 2


def tile_rows(rows: int, cols: int) -> int:
  """Rows per tile of a [rows, cols] weight: a divisor of `rows` near TILE_ELEMENTS // cols
  where one is close, else that many (the rows left over form one more, shorter product)."""
  cap = max(1, min(rows, TILE_ELEMENTS // cols))
  best = max(d for d in range(1, cap + 1) if rows % d == 0)
  return best if 2 * best >= cap else cap


def _tiling(x: jax.Array, w: jax.Array):
  """x's leading shape, x as [m, last], and w's row tiles: rows per tile, whole tiles, rows
  they cover (the rest form one shorter product)."""
  lead = x.shape[:-1]
  r = tile_rows(*w.shape)
  tiles = w.shape[0] // r
  return lead, x.reshape(math.prod(lead), x.shape[-1]), r, tiles, tiles * r


def acc_dtype(dtype):
  """The dtype products in `dtype` sum in: float32 for 16-bit floats, else `dtype`."""
  return jnp.float32 if jnp.dtype(dtype).itemsize < 4 else jnp.dtype(dtype)


def _mm(a: jax.Array, b: jax.Array) -> jax.Array:
  """a @ b summed in acc_dtype(a.dtype), not rounded back."""
  return jnp.matmul(a, b, preferred_element_type=acc_dtype(a.dtype))


def _einsum(spec: str, x: jax.Array, w: jax.Array, dtype) -> jax.Array:
  """One product of x and w, both in `dtype`, summed in acc_dtype(dtype), rounded to `dtype`."""
  return jnp.einsum(spec, x, w, preferred_element_type=acc_dtype(dtype)).astype(dtype)


def dense(x: jax.Array, w: jax.Array, dtype) -> jax.Array:
  """x [..., i] @ w [i, o] in `dtype`, w cast a tile of its rows at a time (products summed
  over the tiles of the contracted axis, in acc_dtype(dtype))."""
  x = x.astype(dtype)
  if w.dtype == dtype:
    return _einsum('...i,io->...o', x, w, dtype)
  rows, cols = w.shape
  lead, flat, r, tiles, main = _tiling(x, w)
  if flat.shape[0] >= CAST_ALL_ROWS:
    return _row_blocks(flat, w.astype(dtype)).astype(dtype).reshape(*lead, cols)

  def add_tile(total, i):
    x_tile = jax.lax.dynamic_slice_in_dim(flat, i * r, r, axis=1)
    return total + _mm(x_tile, _row_tile(w, i, r).astype(dtype)), None

  total, _ = jax.lax.scan(add_tile, jnp.zeros((flat.shape[0], cols), acc_dtype(dtype)),
                          jnp.arange(tiles), unroll=SCAN_UNROLL)
  if main < rows:
    total = total + _mm(flat[:, main:], w[main:].astype(dtype))
  return total.astype(dtype).reshape(*lead, cols)


def _row_tile(w: jax.Array, i: jax.Array, r: int) -> jax.Array:
  """Rows [i * r, (i + 1) * r) of w, sliced inside the loop: reshaping w[:whole tiles] into
  tiles would copy the whole matrix first whenever a shorter tile is left over (OPT's
  50272-row token table as the LM head: 196 MiB copied per call for OPT-1.3B)."""
  return jax.lax.dynamic_slice_in_dim(w, i * r, r, axis=0)


def _row_blocks(flat: jax.Array, w: jax.Array) -> jax.Array:
  """flat [m, i] @ w [i, o] as products of CAST_ALL_ROWS rows (the last one shorter), in
  acc_dtype(w.dtype)."""
  m, n = flat.shape[0], CAST_ALL_ROWS
  whole = m // n * n
  out = jax.lax.map(lambda block: _mm(block, w), flat[:whole].reshape(m // n, n, -1))
  out = out.reshape(whole, w.shape[1])
  return out if whole == m else jnp.concatenate([out, _mm(flat[whole:], w)], axis=0)


def take_rows(table, ids: jax.Array) -> jax.Array:
  """Rows `ids` of a table [n, d], or of a tuple of its row parts in order
  (params.used_in_parts): each id is taken from the part that holds it."""
  if not isinstance(table, tuple):
    return jnp.take(table, ids, axis=0)
  out, first = None, 0
  for part in table:
    local = ids - first
    rows = jnp.take(part, jnp.clip(local, 0, part.shape[0] - 1), axis=0)
    inside = ((local >= 0) & (local < part.shape[0]))[..., None]
    out = rows if out is None else jnp.where(inside, rows, out)
    first += part.shape[0]
  return out


def layer(p: dict, x: jax.Array) -> jax.Array:
  """A dense layer on x, in x's dtype: {'kernel': [in, out]} or {'weight': [out, in]}, and
  optionally 'bias': [out]."""
  y = dense(x, p['kernel'], x.dtype) if 'kernel' in p else dense_transposed(x, p['weight'], x.dtype)
  return y + p['bias'] if 'bias' in p else y


def dense_transposed(x: jax.Array, w: jax.Array, dtype) -> jax.Array:
  """x [..., i] against w [o, i] (a tied embedding as the LM head): [..., o] in `dtype`, w cast
  a tile of its rows (outputs) at a time."""
  x = x.astype(dtype)
  if w.dtype == dtype:
    return _einsum('...i,oi->...o', x, w, dtype)
  outs, cols = w.shape
  lead, flat, r, tiles, main = _tiling(x, w)
  parts = jax.lax.map(lambda i: _mm(flat, _row_tile(w, i, r).astype(dtype).T).astype(dtype),
                      jnp.arange(tiles))  # [tiles, m, r]
  y = parts.transpose(1, 0, 2).reshape(flat.shape[0], main)
  if main < outs:
    y = jnp.concatenate([y, _mm(flat, w[main:].astype(dtype).T).astype(dtype)], axis=1)
  return y.reshape(*lead, outs)
