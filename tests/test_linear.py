"""Products against [out, in] weights in their stored dtype, cast a tile at a time."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flexjax.model import linear


@pytest.mark.parametrize('rows,cols', [(64, 32), (96, 1 << 15), (97, 1 << 15), (5, 7)])
def test_tile_rows_divides_or_leaves_one_short_tile(rows, cols):
  r = linear.tile_rows(rows, cols)
  assert 1 <= r <= max(1, rows // 2)  # never one tile of the whole matrix
  assert r * cols <= max(linear.TILE_ELEMENTS, cols)
  assert rows % r == 0 or r == max(1, min(rows // 2, linear.TILE_ELEMENTS // cols))


@pytest.mark.parametrize('rows,cols,lead', [(4096, 4096, (3, 1)), (97, 1 << 17, (2, 5)),
                                            (8192, 1024, (4,))])
def test_tiled_products_match_one_cast_product(rows, cols, lead):
  """float16 weights [rows = outputs, cols = inputs], float32 compute: the products of tiles of
  outputs equal casting the whole matrix first, up to float32 summation order."""
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((*lead, cols)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((rows, cols)) / np.sqrt(cols), jnp.float16)
  want = jnp.einsum('...i,oi->...o', x, w.astype(jnp.float32))
  got = jax.jit(lambda x, w: linear.dense(x, w, jnp.float32))(x, w)
  assert got.shape == (*lead, rows) and got.dtype == jnp.float32
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * float(jnp.abs(want).max()))
  assert linear.tile_rows(rows, cols) < rows  # the tiled path ran


def test_same_dtype_is_one_product():
  x = jnp.ones((2, 8), jnp.float32)
  w = jnp.arange(32, dtype=jnp.float32).reshape(4, 8)
  np.testing.assert_array_equal(linear.dense(x, w, jnp.float32), x @ w.T)
  text = jax.jit(lambda x, w: linear.dense(x, w, jnp.float32)).lower(x, w).as_text()
  assert 'while' not in text


def test_decode_temporaries_are_tiles_not_a_float32_matrix():
  """XLA's temporaries of a one-token product against a float16 matrix stay near one float32
  tile, far below the float32 copy of the matrix a whole cast would make."""
  rows, cols = 8192, 8192
  assert linear.tile_rows(rows, cols) * cols * 4 < rows * cols * 4 // 4
  x = jax.ShapeDtypeStruct((4, 1, cols), jnp.float32)
  w = jax.ShapeDtypeStruct((rows, cols), jnp.float16)
  compiled = jax.jit(lambda x, w: linear.dense(x, w, jnp.float32)).lower(x, w).compile()
  temp = compiled.memory_analysis().temp_size_in_bytes
  assert temp < rows * cols * 4 // 4, temp


@pytest.mark.parametrize('lead', [(2, linear.CAST_ALL_ROWS), (2 * linear.CAST_ALL_ROWS + 37,)])
def test_products_of_many_rows_cast_once_and_match(lead):
  """A prompt-sized product casts the matrix once (XLA keeps its float32 copy), and its values
  are those of one float32 product, whatever the row count."""
  rng = np.random.default_rng(1)
  rows, cols = 384, 256
  x = jnp.asarray(rng.standard_normal((*lead, cols)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((rows, cols)) / np.sqrt(cols), jnp.float16)
  want = jnp.einsum('...i,oi->...o', x, w.astype(jnp.float32))
  fn = jax.jit(lambda x, w: linear.dense(x, w, jnp.float32))
  got = fn(x, w)
  assert got.shape == (*lead, rows) and got.dtype == jnp.float32
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(jnp.abs(want).max()))
  temp = fn.lower(x, w).compile().memory_analysis().temp_size_in_bytes
  assert temp >= rows * cols * 4, temp


def test_row_parts_give_the_whole_tables_rows():
  """A token table kept as row parts (params.used_in_parts: split across tiers, not joined):
  every id is taken from the part holding it, exactly the whole table's rows."""
  rng = np.random.default_rng(1)
  table = jnp.asarray(rng.standard_normal((50, 16)), jnp.float16)
  parts = (table[:7], table[7:31], table[31:])
  ids = jnp.asarray([[0, 6, 7, 30, 31, 49], [49, 12, 3, 31, 7, 0]], jnp.int32)
  got = jax.jit(linear.take_rows)(parts, ids)
  np.testing.assert_array_equal(got, jnp.take(table, ids, axis=0))


def _parts(table, cuts):
  bounds = [0, *cuts, table.shape[0]]
  return tuple(table[a:b] for a, b in zip(bounds[:-1], bounds[1:]))


@pytest.mark.parametrize('rows,cols,cuts', [
    (4096, 1024, (1536,)),  # on a tile boundary
    (4096, 1024, (1537,)),  # inside a tile
    (4096, 1024, (100, 130)),  # a middle part shorter than a tile
    (4103, 1024, (4100,)),  # inside the leftover tile (4103 rows: 4096 in tiles, 7 left)
    (4103, 1024, (2047, 4097)),
])
@pytest.mark.parametrize('lead', [(3, 1), (2 * linear.CAST_ALL_ROWS + 5,)])
def test_a_matrix_in_row_parts_gives_the_whole_matrixs_products_bit_for_bit(rows, cols, cuts,
                                                                             lead):
  """A head's table split across tiers (params.used_in_parts) multiplies as the whole matrix:
  the same tiles, so float32 outputs equal the whole's exactly, for few rows (tiles) and for a
  prompt's many (one cast matrix), boundaries on, inside and across tiles."""
  rng = np.random.default_rng(2)
  x = jnp.asarray(rng.standard_normal((*lead, cols)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((rows, cols)) / np.sqrt(cols), jnp.float16)
  fn = jax.jit(lambda x, w: linear.dense(x, w, jnp.float32))
  want = np.asarray(fn(x, w))
  got = np.asarray(fn(x, _parts(w, cuts)))
  assert got.shape == want.shape == (*lead, rows)
  np.testing.assert_array_equal(got, want)
  w32 = w.astype(jnp.float32)  # a weight in the compute dtype: one product either way
  np.testing.assert_array_equal(np.asarray(fn(x, _parts(w32, cuts))), np.asarray(fn(x, w32)))


def test_a_matrix_in_row_parts_copies_no_more_than_the_tile_across_its_boundary():
  """The few-row product of a split table keeps the whole's temporaries: one tile across the
  boundary is joined, never the table (the join the loader made before was the whole table)."""
  rows, cols = 65536, 512
  r = linear.tile_rows(rows, cols)
  x = jax.ShapeDtypeStruct((8, cols), jnp.float32)
  parts = (jax.ShapeDtypeStruct((rows // 3, cols), jnp.float16),
           jax.ShapeDtypeStruct((rows - rows // 3, cols), jnp.float16))
  assert (rows // 3) % r  # the boundary lies inside a tile
  compiled = jax.jit(lambda x, w: linear.dense(x, w, jnp.float32)).lower(x, parts).compile()
  temp = compiled.memory_analysis().temp_size_in_bytes
  assert temp < min(rows * cols * 2 / 2, 3 * r * cols * 4), (temp, r)


def test_a_leftover_tile_does_not_copy_the_matrix():
  """A weight whose rows no tile size divides (OPT's 50272-row token table as the LM head)
  leaves one shorter tile; the whole tiles are sliced inside the loop, so the compiled step's
  temporary memory holds the float32 tiles of one loop step, not a copy of the matrix."""
  rows, cols = 65539, 512
  r = linear.tile_rows(rows, cols)
  assert rows % r != 0  # a leftover tile
  w = jax.ShapeDtypeStruct((rows, cols), jnp.float16)
  weight_bytes = rows * cols * 2
  x = jax.ShapeDtypeStruct((8, cols), jnp.float32)
  compiled = jax.jit(lambda x, w: linear.dense(x, w, jnp.float32)).lower(x, w).compile()
  temp = compiled.memory_analysis().temp_size_in_bytes
  assert temp < min(weight_bytes / 2, 1.5 * r * cols * 4), (temp, weight_bytes)


@pytest.mark.parametrize('stored', ['float16', 'bfloat16'])
def test_bfloat16_products_sum_in_float32_and_round_once(stored):
  """Products in bfloat16 (weights cast tile by tile, or already bfloat16) sum in float32 and
  round once: every output is within half a bfloat16 step of the float32 sum of the same values,
  plus slack for the summation order (a sum rounded to bfloat16 as it goes drifts by hundreds
  of steps over 4096 terms). Steps are taken at no less than 2^-6, where sums of terms near 1
  cancel."""
  rng = np.random.default_rng(0)
  rows, cols = 8192, 4096  # 8 tiles of 1024 outputs, 4096 inputs each
  x = jnp.asarray(rng.standard_normal((8, cols)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((rows, cols)) / 64, stored)
  want = np.asarray(x, np.float32) @ np.asarray(w.astype(jnp.bfloat16), np.float32).T
  got = np.asarray(jax.jit(lambda x, w: linear.dense(x, w, jnp.bfloat16))(x, w), np.float32)
  step = 2.0 ** (np.floor(np.log2(np.maximum(np.abs(want), 2.0 ** -6))) - 7)  # bfloat16 spacing
  assert np.all(np.abs(got - want) <= 0.55 * step), np.max(np.abs(got - want) / step)


def test_long_prompt_steps_run_their_products_in_onednn_and_match_xlas():
  """On a CPU backend a prefill step of linear.LIBRARY_ROWS product rows or more is compiled
  with oneDNN's products (shorter ones keep XLA's), and gives XLA's results up to float32
  summation order."""
  import dataclasses

  from flexjax.config import ModelConfig
  from flexjax.steps import Geometry, one_layer

  cfg = ModelConfig(name='wide', num_layers=1, hidden_size=256, num_heads=4, ffn_dim=1024,
                    vocab_size=100, max_positions=1024)
  steps, layer = one_layer(cfg, device=jax.devices('cpu')[0])
  geom = Geometry.prompt(8, 512, total_len=515)
  assert 8 * 512 >= linear.LIBRARY_ROWS > 512
  assert steps.uses_library(geom) and not steps.uses_library(dataclasses.replace(geom, rows=1))
  rng = np.random.default_rng(2)
  x = jnp.asarray(rng.standard_normal((8, 512, cfg.hidden_size)), jnp.float32)
  mask = jnp.asarray(np.arange(512)[None, :] >= np.array([[0], [7], [100], [511]] * 2))
  got = steps.prefill_step(geom, layer, x, None, mask)[0]
  want = steps.prefill_layer(layer, x, None, mask, device_rows=0)[0]
  text = steps.prefill_layer_library.lower(layer, x, None, mask, device_rows=0).compile().as_text()
  assert '__onednn_fusion' in text
  assert '__onednn_fusion' not in steps.prefill_layer.lower(layer, x, None, mask,
                                                            device_rows=0).compile().as_text()
  real = np.asarray(mask)
  np.testing.assert_allclose(np.asarray(got)[real], np.asarray(want)[real], rtol=1e-5,
                             atol=1e-5 * float(jnp.abs(want).max()))


_LLAMA_LONG_PROMPT = '''
import dataclasses, sys
import numpy as np
from flexjax.config import preset
from flexjax.engine import Engine, GenerationConfig
from flexjax.policy import Policy
from flexjax.weights import DummyWeights
cfg = dataclasses.replace(preset('smollm2-135m'), num_layers=2)  # its vocabulary too
prompts = [[1] + [10 + (7 * i + j) % 900 for j in range(511)] for i in range(8)]
out = []
for rows in (8, 4):  # 8 x 512 product rows: oneDNN's for OPT; 4 x 512: XLA's own for both
  with Engine(DummyWeights(cfg, 'float32'), policy=Policy(gpu_batch_size=rows)) as engine:
    assert not engine.planner.steps(engine.policy).library
    out.append(engine.generate(prompts, GenerationConfig(gen_len=3), return_logits=True))
np.testing.assert_array_equal(out[0].tokens, out[1].tokens)
np.testing.assert_allclose(out[0].logits, out[1].logits, atol=1e-4, rtol=0)
print('same')
'''


def test_a_long_llama_prompt_step_keeps_xlas_products_and_runs_every_layer():
  """A SmolLM2-shaped Llama (grouped-query attention) prefilled 8 x 512 rows on two layers,
  in a process of its own: with XLA:CPU's oneDNN fusion its programs corrupted the heap (a
  crash or a hang from the second layer on); its steps keep XLA's own products and give the
  tokens of the same prompts in two blocks of four."""
  import os
  import subprocess
  import sys
  done = subprocess.run([sys.executable, '-c', _LLAMA_LONG_PROMPT], capture_output=True,
                        text=True, timeout=300, env=dict(os.environ, JAX_PLATFORMS='cpu'))
  assert done.returncode == 0 and done.stdout.strip().endswith('same'), done.stderr[-3000:]


@pytest.mark.parametrize('cuts', [(), (288,), (301,)])
def test_a_small_matrixs_tiles_run_unrolled_as_the_same_products(cuts):
  """A matrix of at most UNROLL_ELEMENTS weights (SmolLM2's 576 x 576) runs its tiles without a
  loop; each tile's outputs are still that tile's own product, bit for bit, whole or in row
  parts (a boundary on or inside a tile)."""
  rows, cols = 576, 576
  assert rows * cols <= linear.UNROLL_ELEMENTS
  r = linear.tile_rows(rows, cols)
  rng = np.random.default_rng(3)
  x = jnp.asarray(rng.standard_normal((32, 1, cols)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((rows, cols)) / np.sqrt(cols), jnp.float16)
  fn = jax.jit(lambda x, w: linear.dense(x, w, jnp.float32))
  w_in = _parts(w, cuts) if cuts else w
  assert ' while(' not in fn.lower(x, w_in).compile().as_text()  # no loop instruction
  got = np.asarray(fn(x, w_in))
  tile = jax.jit(lambda x, w: (w.astype(jnp.float32) @ x.reshape(-1, cols).T).T)
  want = np.concatenate([np.asarray(tile(x, w[t:t + r])) for t in range(0, rows, r)], axis=1)
  np.testing.assert_array_equal(got.reshape(32, rows), want)
