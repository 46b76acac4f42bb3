"""Numerical parity with transformers' OPTForCausalLM in fp32: a ladder from LayerNorm to logits."""

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from conftest import (PROMPTS, assert_decode_steps_match, assert_prefill_matches, hf_logits,
                      left_pad)
from flexjax.model import opt


def test_layer_norm_matches_torch():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(3, 5, 24)).astype(np.float32) * 3 + 1
  scale = rng.normal(size=24).astype(np.float32)
  bias = rng.normal(size=24).astype(np.float32)
  ours = opt.layer_norm({'scale': jnp.asarray(scale), 'bias': jnp.asarray(bias)}, jnp.asarray(x),
                        1e-5)
  ref = torch.nn.functional.layer_norm(torch.tensor(x), (24,), torch.tensor(scale),
                                       torch.tensor(bias), eps=1e-5).numpy()
  np.testing.assert_allclose(np.asarray(ours), ref, atol=1e-6, rtol=0)


def test_positions_follow_the_attention_mask():
  mask = jnp.array([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]], bool)
  np.testing.assert_array_equal(np.asarray(opt.positions_from_mask(mask)),
                                [[-1, -1, 0, 1, 2], [0, 1, 2, 3, 4]])


def test_prefill_logits_match_transformers(tiny):
  assert_prefill_matches(tiny, hf_logits)


def test_every_decode_step_logits_match_transformers(tiny):
  assert_decode_steps_match(tiny, hf_logits)


@pytest.mark.parametrize('compute_dtype', ['bfloat16', 'float16'])
def test_half_precision_compute_stays_close(pre_ln, compute_dtype):
  ids, mask = left_pad(PROMPTS)
  ref = hf_logits(pre_ln.torch_model, ids, mask)
  ours = pre_ln.engine(compute_dtype=compute_dtype).score(ids.numpy(), mask.numpy().astype(bool))
  valid = mask.numpy().astype(bool)
  err = np.abs(ours[valid] - ref[valid]).max() / np.abs(ref[valid]).max()
  assert err < 0.05, f'{compute_dtype} relative logit error {err:.4f}'
