"""Offloading and approximations on a tiny grouped-query Llama: every placement reproduces the
all-device run; int4 weights and cache stay within a stated bound; sparse attention runs."""

import numpy as np
import pytest

from flexjax.policy import Policy
from test_approx import run
from test_offload import POLICIES

PLACEMENTS = ['weights_on_disk', 'cache_split_device_host', 'cpu_attention_cache_host',
              'cpu_attention_cache_split', 'everything_off_device']


@pytest.fixture(scope='module')
def reference(gqa_llama):
  return run(gqa_llama.ckpt_dir, Policy(gpu_batch_size=4))


@pytest.mark.parametrize('name', PLACEMENTS)
def test_placement_reproduces_the_all_device_run(gqa_llama, reference, tmp_path, name):
  result = run(gqa_llama.ckpt_dir, POLICIES[name], tmp_path)
  np.testing.assert_array_equal(result.tokens, reference.tokens)
  np.testing.assert_allclose(result.logits, reference.logits, atol=1e-5, rtol=0)
  for tier, peak in result.peak_bytes.items():
    assert peak <= result.planned_peak_bytes[tier], (tier, peak, result.planned_peak_bytes)


def test_int4_weights_and_cache_stay_within_the_bound_of_fp32(gqa_llama, reference):
  """Bound: max |logit error| / max |logit| over the steps whose inputs are still identical
  (0.3, as for OPT: random weights are the worst case). The cache rows are 4-bit groups of the
  KV heads' width (16 values here, one padded group of 64)."""
  kw = dict(gpu_batch_size=4, compress_weight=True, compress_cache=True)
  approx = run(gqa_llama.ckpt_dir, Policy(**kw))
  same_inputs = np.cumsum(approx.tokens != reference.tokens, axis=1) - (
      approx.tokens != reference.tokens)
  steps = same_inputs == 0
  error = (np.abs(approx.logits - reference.logits)[steps].max()
           / np.abs(reference.logits[steps]).max())
  assert 0 < error < 0.3, error


def test_sparse_attention_runs_and_keeping_everything_matches_dense(gqa_llama, reference,
                                                                    tmp_path):
  """Kept positions chosen on the device (device rows, keep-all run) and on the CPU backend
  (host rows) give the same tokens."""
  keep_all = run(gqa_llama.ckpt_dir, Policy(gpu_batch_size=4, attn_sparsity=0.999,
                                            cache_gpu_percent=50, cache_cpu_percent=50),
                 tmp_path)
  np.testing.assert_array_equal(keep_all.tokens, reference.tokens)
  np.testing.assert_allclose(keep_all.logits, reference.logits, atol=1e-5, rtol=0)
  sparse = Policy(gpu_batch_size=4, attn_sparsity=0.3, cpu_attention=True)
  on_device = run(gqa_llama.ckpt_dir, sparse)
  offloaded = run(gqa_llama.ckpt_dir, Policy(**{**sparse.__dict__, 'cache_gpu_percent': 0,
                                                'cache_cpu_percent': 100}), tmp_path)
  assert not np.array_equal(on_device.logits, reference.logits)  # sparse: not the dense run
  np.testing.assert_array_equal(offloaded.tokens, on_device.tokens)
  np.testing.assert_allclose(offloaded.logits, on_device.logits, atol=1e-5, rtol=0)
