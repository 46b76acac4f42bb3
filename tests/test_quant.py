"""Group-wise quantization: error bound, packing round trip, odd sizes, sizes."""

import jax.numpy as jnp
import numpy as np
import pytest

from conftest import dequantize, quantize
from flexjax.errors import FlexjaxError
from flexjax.quant import QuantConfig, pack, unpack


def _group_scales(x: np.ndarray, config: QuantConfig) -> np.ndarray:
  """Each element's stored (float16) quantization step, read back from the byte rows."""
  data = np.asarray(quantize(jnp.asarray(x), config))
  groups = config.groups(x.shape[-1])
  n_packed = groups * config.group_size * config.bits // 8
  scales = data[..., n_packed + 2 * groups:].copy().view(np.float16).astype(np.float32)
  return np.repeat(scales, config.group_size, axis=-1)[..., :x.shape[-1]]


@pytest.mark.parametrize('bits', [2, 4, 8])
@pytest.mark.parametrize('shape', [(4, 256), (3, 130), (2, 5, 7), (1, 64)])
@pytest.mark.parametrize('kind', ['normal', 'outliers'])
def test_error_is_within_half_a_step(bits, shape, kind):
  rng = np.random.default_rng(bits * 100 + len(shape))
  x = rng.normal(size=shape).astype(np.float32)
  if kind == 'outliers':
    x.flat[rng.integers(0, x.size, size=max(1, x.size // 50))] *= 300
  config = QuantConfig(bits=bits, group_size=64)
  data = quantize(jnp.asarray(x), config)
  assert data.dtype == jnp.uint8 and data.shape == (*shape[:-1], config.row_bytes(shape[-1]))
  y = np.asarray(dequantize(data, shape[-1], config))
  step = _group_scales(x, config)
  tolerance = step / 2 + 1e-6 * np.abs(x).max()  # float32 rounding of q * scale + min
  assert (np.abs(y - x) <= tolerance).all(), np.abs(y - x).max()


def test_packing_round_trips_exactly():
  config = QuantConfig(bits=4, group_size=16)
  levels = np.tile(np.arange(16, dtype=np.float32), 3)[None]  # each group holds every 4-bit level
  x = levels * 0.5 - 1.0  # exactly representable: min -1, step 0.5 in every group
  y = np.asarray(dequantize(quantize(jnp.asarray(x), config), 48, config))
  np.testing.assert_array_equal(y, x)


def test_constant_groups_and_padding():
  config = QuantConfig(bits=4, group_size=64)
  x = np.full((2, 70), 3.25, np.float32)  # zero range, and 70 = 64 + 6 padded values
  np.testing.assert_array_equal(np.asarray(dequantize(quantize(jnp.asarray(x), config), 70,
                                                      config)), x)


def test_packed_weights_are_about_028_of_fp16():
  config = QuantConfig()
  w = np.random.default_rng(0).normal(size=(512, 4096)).astype(np.float16)
  p = pack(w, config)
  assert p.nbytes / w.nbytes == pytest.approx(0.28125)  # (4 + 2*16/64) / 16 bits
  assert np.asarray(unpack(p, jnp.float32)).shape == w.shape


@pytest.mark.parametrize('bits,group', [(3, 64), (4, 63), (8, 0)])
def test_bad_configs_are_refused(bits, group):
  with pytest.raises(FlexjaxError, match='compress_'):
    QuantConfig(bits=bits, group_size=group)
