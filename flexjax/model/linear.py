"""Matrix products against weights kept in their storage dtype, stored [out, in].

Every weight is stored as HF and GGUF store it, [out, in], and reaches a step as stored (float16,
say). A product of few rows (a decode step) runs as products of tiles of the weight's rows
(outputs) with the transposed input, W[tile] @ x^T: each tile is cast to the compute dtype while
it is in cache, and XLA:CPU's product of a wide matrix with a few columns runs near memory speed,
where x @ W^T with few rows does not (a 4096 x 16384 float16 weight, 32 rows, on the 2-core
AVX-512 CPU: 35 ms against 53 ms for tiles of an [in, out] kernel, and torch's 43 ms for float32
weights). Each output is one tile's, so nothing sums across tiles.
The tiles' outputs are the loop's own results, stacked as it runs, not written into a
zero-filled matrix the loop carries: XLA copied such a matrix for every product sharing its
shape (six in a SmolLM2 decode layer of 32 rows, 0.3 of its 3.9 ms in tools.layer_bench; 3.3-3.7
ms without them).
A matrix of at most UNROLL_ELEMENTS weights (a narrow model's) runs its tiles unrolled, so that
XLA:CPU runs their casts and products side by side on its threads.
A product of many rows (a prompt, CAST_ALL_ROWS or more) casts the whole matrix once and is one
product x @ W^T: the cast is then a small share of the work (300-330 GFLOP/s on the AVX-512 CPU
for 4096 rows, against 200-300 for blocks of 1024 rows or tiles of W).
Where the dtypes already agree (float16 compute on a GPU, dequantized int4) it is one product.
On XLA:CPU a float32 prompt step of LIBRARY_ROWS product rows or more is compiled with oneDNN's
matrix products (library_options): its products are 10-30% faster than XLA's own from 2048
rows on, but its attention's small products slower, so that whole steps gain from 4096 rows on
(opt-1.3b prefill layer, 16 x 128: 901 against 907 ms, 16 x 512: 3908 -> 3297 ms); shorter
prompt steps keep XLA's.

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
import numpy as np

# Weights per tile of a few-row product: 16 MiB in float32, large enough that XLA:CPU's
# per-product overhead is small, and 25-35% faster than 1 Mi-weight tiles.
TILE_ELEMENTS = 1 << 22
# Weights of a matrix whose few-row product runs its tiles unrolled, no loop: 4 MiB in float32.
# The tiles' casts and products are then independent operations, which XLA:CPU runs on both
# cores at once. SmolLM2's 576-wide decode layers of 32 rows, 30 in a row with their weights
# and caches in DRAM: 126-134 -> 106-128 ms (best of 8 runs, 7 alternated pairs). XLA casts
# every tile first, all of them alive together: opt-1.3b's matrices (4-16 Mi weights) unrolled
# slowed its decode layer from 28 to 64-68 ms.
UNROLL_ELEMENTS = 1 << 20
CAST_ALL_ROWS = 1024  # rows from which a product casts the whole matrix
LIBRARY_ROWS = 4096  # rows from which a prompt step's products run in oneDNN on XLA:CPU


def tile_rows(rows: int, cols: int) -> int:
  """Rows per tile of a [rows, cols] weight: a divisor of `rows` near TILE_ELEMENTS // cols
  where one is close, else that many (the rows left over form one more, shorter product); at
  most half the rows, so that a matrix is never one tile (one tile's cast of a whole 2048 x 2048
  weight slowed an opt-1.3b decode layer of 8 rows from 20 to 38-41 ms)."""
  cap = max(1, min(rows // 2, TILE_ELEMENTS // cols))
  best = max(d for d in range(1, cap + 1) if rows % d == 0)
  return best if 2 * best >= cap else cap


def in_library(platform: str, dtype, rows: int) -> bool:
  """Whether a prompt step whose products have `rows` rows runs them in oneDNN
  (library_options): on XLA:CPU, in float32, from LIBRARY_ROWS rows."""
  return platform == 'cpu' and jnp.dtype(dtype) == jnp.float32 and rows >= LIBRARY_ROWS


def family_in_library(family: str) -> bool:
  """Whether a model family's layers run their long prompt steps' products in oneDNN (where
  in_library): OPT's. Not Llama's: XLA:CPU's oneDNN fusion corrupted the heap from a run's
  second layer on in layers with grouped-query attention (SmolLM2's, 576 wide with 3 KV heads;
  512 wide with 2 KV heads), a crash or a hang mid-run (tests/test_linear.py); they keep XLA's
  own products, whose rate the measured profile keeps apart (HardwareProfile.xla_mm_flops)."""
  return family == 'opt'


def library_options() -> dict[str, object]:
  """XLA:CPU's compiler options for programs of LIBRARY_ROWS product rows or more: matrix
  products through oneDNN (on the AVX-512 CPU, an opt-1.3b prefill layer of 8 x 512 1929 ->
  1706 ms, 32 x 512 7981 -> 6534 ms). oneDNN packs the matrix a product reads for as long as
  the product runs: flexjax/library_scratch.py counts it.

  A program compiled with them must outlive its last run by more than that run: XLA:CPU
  returns a oneDNN fusion's runtime to the program's pool after the run's results are ready,
  and a program freed in between aborts the process (`Check failed: available_.size() ==
  num_created_`; a probe that freed its program as it returned: 1 in 8 runs with two busy
  loops beside it). The engine's steps live as long as its run; the measuring probes keep
  theirs until their later parts are done (hardware.measure, tools/roofline.py)."""
  return {'xla_cpu_use_onednn': True,
          'xla_cpu_experimental_onednn_fusion_type': 'LIBRARY_FUSION_TYPE_DOT'}


def acc_dtype(dtype):
  """The dtype products in `dtype` sum in: float32 for 16-bit floats, else `dtype`."""
  return jnp.float32 if jnp.dtype(dtype).itemsize < 4 else jnp.dtype(dtype)


def _w_xt(w: jax.Array, xt: jax.Array) -> jax.Array:
  """w [r, i] @ xt [i, m]: [r, m] summed in acc_dtype(w.dtype), not rounded back."""
  return jnp.matmul(w, xt, preferred_element_type=acc_dtype(w.dtype))


def _x_wt(x: jax.Array, w: jax.Array) -> jax.Array:
  """x [m, i] against w [o, i]: [m, o] summed in acc_dtype(w.dtype), not rounded back."""
  return jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())),
                             preferred_element_type=acc_dtype(w.dtype))


def dense(x: jax.Array, w, dtype) -> jax.Array:
  """x [..., i] against w [o, i]: [..., o] in `dtype` (x @ w^T), a weight in another dtype cast
  a tile of its rows (outputs) at a time, each tile's outputs summed in acc_dtype(dtype).

  w may be a tuple of its row parts in order (params.used_in_parts: a matrix split across
  tiers). The product is then the whole matrix's, value for value: its tiles are the whole's,
  each taken from the part holding it (a tile across a boundary joined from the parts' rows,
  the only copy), so every tile's product has the whole's shape and operands; a prompt's
  product, and one in the weight's own dtype, joins the parts into the matrix it would read
  (the engine hands such a matrix over joined once per load: params.used_in_parts)."""
  x = x.astype(dtype)
  parts = w if isinstance(w, tuple) else (w,)
  outs, ins = sum(part.shape[0] for part in parts), parts[0].shape[1]
  lead = x.shape[:-1]
  flat = x.reshape(math.prod(lead), ins)
  if flat.shape[0] >= CAST_ALL_ROWS:
    whole = _rows(parts, 0, outs, dtype)
    return _x_wt(flat, whole).astype(dtype).reshape(*lead, outs)
  if parts[0].dtype == dtype:
    return _w_xt(_rows(parts, 0, outs), flat.T).T.astype(dtype).reshape(*lead, outs)
  r = tile_rows(outs, ins)
  tiles = outs // r
  xt = flat.T
  product = lambda rows: _w_xt(rows.astype(dtype), xt).astype(dtype)  # noqa: E731
  pieces = []  # (first row, [rows, m] outputs) in row order
  covered = set()  # tiles taken whole from one part
  for part, (lo, hi) in zip(parts, _part_rows(parts)):
    inside = range(-(-lo // r), min(hi // r, tiles))
    if not inside:
      continue
    covered.update(inside)

    def tile(carry, i, part=part, lo=lo):
      # sliced inside the loop: reshaping a part into tiles first would copy all of it
      # whenever a shorter tile is left over (OPT-1.3B's 50272-row token table: 196 MiB a call)
      return carry, product(jax.lax.dynamic_slice_in_dim(part, i * r - lo, r, axis=0))

    _, ys = jax.lax.scan(tile, None, jnp.arange(inside.start, inside.stop),
                         unroll=outs * ins <= UNROLL_ELEMENTS)
    pieces.append((inside.start * r, ys.reshape(len(inside) * r, -1)))
  spans = [(t * r, (t + 1) * r) for t in range(tiles) if t not in covered]
  if tiles * r < outs:
    spans.append((tiles * r, outs))
  pieces += [(start, product(_rows(parts, start, end))) for start, end in spans]
  pieces.sort(key=lambda piece: piece[0])
  out = pieces[0][1] if len(pieces) == 1 else jnp.concatenate([y for _, y in pieces])
  return out.T.reshape(*lead, outs)


def _part_rows(parts: tuple) -> list[tuple[int, int]]:
  """The [first, end) rows of the whole matrix (or table) that each of its row parts holds."""
  ends = np.cumsum([part.shape[0] for part in parts]).tolist()
  return list(zip([0] + ends[:-1], ends))


def _rows(parts: tuple, start: int, end: int, dtype=None) -> jax.Array:
  """Rows [start, end) of the matrix whose row parts are `parts`, cast to `dtype` if given."""
  pieces = []
  for part, (first, last) in zip(parts, _part_rows(parts)):
    lo, hi = max(start, first) - first, min(end, last) - first
    if lo < hi:
      piece = part if (lo, hi) == (0, part.shape[0]) else part[lo:hi]
      pieces.append(piece if dtype is None else piece.astype(dtype))
  return pieces[0] if len(pieces) == 1 else jnp.concatenate(pieces)


def take_rows(table, ids: jax.Array) -> jax.Array:
  """Rows `ids` of a table [n, d], or of a tuple of its row parts in order
  (params.used_in_parts): each id is taken from the part that holds it."""
  if not isinstance(table, tuple):
    return jnp.take(table, ids, axis=0)
  out = None
  for part, (first, _) in zip(table, _part_rows(table)):
    local = ids - first
    rows = jnp.take(part, jnp.clip(local, 0, part.shape[0] - 1), axis=0)
    inside = ((local >= 0) & (local < part.shape[0]))[..., None]
    out = rows if out is None else jnp.where(inside, rows, out)
  return out


def layer(p: dict, x: jax.Array) -> jax.Array:
  """A dense layer on x, in x's dtype: {'weight': [out, in]} and optionally 'bias': [out]."""
  y = dense(x, p['weight'], x.dtype)
  return y + p['bias'] if 'bias' in p else y
