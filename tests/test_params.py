"""Dummy weights (model/params.dummy_stage): deterministic, independent of the threads that
fill them, at the stated scale, and every value written."""

import dataclasses
import hashlib
import tracemalloc

import numpy as np
import pytest

from flexjax.config import np_dtype, preset
from flexjax.model import params
from flexjax.weights import DummyWeights


@pytest.fixture(scope='module')
def cfg():
  # fc1 and fc2 span three chunks of values, the last one short
  return dataclasses.replace(preset('opt-125m'), hidden_size=1024, ffn_dim=2100, num_heads=8)


def test_values_depend_on_seed_stage_and_tensor_not_on_threads(cfg):
  one = params.flatten(params.dummy_stage(cfg, 'layer_001', np.float16, 3, workers=1))
  two = params.flatten(params.dummy_stage(cfg, 'layer_001', np.float16, 3, workers=2))
  assert one.keys() == two.keys()
  for path in one:
    np.testing.assert_array_equal(one[path], two[path])
  other_seed = params.flatten(params.dummy_stage(cfg, 'layer_001', np.float16, 4))
  other_stage = params.flatten(params.dummy_stage(cfg, 'layer_002', np.float16, 3))
  matrix = next(path for path, a in one.items() if a.ndim == 2)
  assert not np.array_equal(one[matrix], other_seed[matrix])
  assert not np.array_equal(one[matrix], other_stage[matrix])
  # two tensors of the same shape differ too
  same_shape = [path for path, a in one.items() if a.shape == one[matrix].shape]
  assert len(same_shape) >= 2 and not np.array_equal(one[same_shape[0]], one[same_shape[1]])


@pytest.mark.parametrize('dtype', ['float32', 'float16', 'bfloat16'])
def test_every_value_is_written_at_the_stated_scale(cfg, dtype):
  tree = params.flatten(params.dummy_stage(cfg, 'layer_000', np_dtype(dtype), 0))
  assert all(a.dtype == np_dtype(dtype) for a in tree.values())
  shapes = params.flatten(cfg.layer_shapes())
  assert {path: a.shape for path, a in tree.items()} == {p: tuple(s) for p, s in shapes.items()}
  for path, a in tree.items():
    values = a.astype(np.float32)
    if path[-1] == 'scale':
      assert (values == 1).all()
      continue
    half_width = 0.02 * np.sqrt(3.0)
    assert np.abs(values).max() <= half_width * 1.01
    if values.size >= 10_000:  # uniform, std 0.02: no chunk left unwritten (zeros) or repeated
      assert abs(values.std() - 0.02) < 0.002 and abs(values.mean()) < 0.002
      assert np.count_nonzero(values == 0) < values.size // 1000
      flat = values.reshape(-1)
      if flat.size > 2 * params.DUMMY_CHUNK:
        chunk = params.DUMMY_CHUNK
        assert not np.array_equal(flat[:chunk], flat[chunk:2 * chunk])


def test_a_chunk_is_one_stream_drawn_through_small_temporaries(cfg):
  """Each chunk's values are one uniform draw from its own generator (as cached layouts were
  written), drawn a piece at a time: the fill's temporaries stay at a few pieces per worker, not
  a whole chunk's float32 draw (which a worker thread's malloc arena kept after the fill)."""
  tracemalloc.start()
  try:
    tree = params.flatten(params.dummy_stage(cfg, 'layer_000', np.float16, 5, workers=2))
    _, peak = tracemalloc.get_traced_memory()
  finally:
    tracemalloc.stop()
  out_bytes = sum(a.nbytes for a in tree.values())
  assert peak - out_bytes <= 2 * 2 * params.DUMMY_PIECE * 4 + 2**20  # 2 workers, 2 pieces
  assert params.DUMMY_CHUNK * 4 > 2 * 2 * params.DUMMY_PIECE * 4 + 2**20  # a chunk would not fit
  path = ('fc1', 'weight')
  name = hashlib.sha256('/'.join(('layer_000', *path)).encode()).digest()[:16]
  half_width = np.float32(0.02 * np.sqrt(3.0))
  flat = tree[path].reshape(-1)
  for chunk in range(-(-flat.size // params.DUMMY_CHUNK)):
    rng = np.random.default_rng([5, int.from_bytes(name, 'little'), chunk])
    part = flat[chunk * params.DUMMY_CHUNK:(chunk + 1) * params.DUMMY_CHUNK]
    whole = rng.random(part.size, dtype=np.float32) * (2 * half_width) - half_width
    np.testing.assert_array_equal(part, whole.astype(np.float16))


def test_the_fingerprint_names_the_values():
  # a streaming layout of dummy weights is reused only for the same values
  assert DummyWeights(preset('opt-125m'), 'float16').fingerprint() == DummyWeights(
      preset('opt-125m'), 'float16').fingerprint()
  assert DummyWeights(preset('opt-125m'), 'float16', seed=1).fingerprint() != DummyWeights(
      preset('opt-125m'), 'float16').fingerprint()
