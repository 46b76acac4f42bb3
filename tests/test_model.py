"""Numerical parity with transformers' OPTForCausalLM in fp32: a ladder from LayerNorm to logits."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from conftest import (PROMPTS, assert_decode_steps_match, assert_prefill_matches, hf_logits,
                      left_pad)
from flexjax.model import opt


def prefill_attend(*args, **kwargs):
  """attention.prefill_attend compiled once per shape, as a layer step runs it (op by op,
  each jnp operation would compile alone)."""
  from flexjax.model import attention
  return jax.jit(attention.prefill_attend, static_argnames=('cfg', 'chunk', 'dtype'))(
      *args, **kwargs)


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


@pytest.mark.parametrize('kv_heads,s,chunks', [(4, 11, (1, 3, 4)), (2, 11, (1, 3, 4)),
                                               (2, 260, (None, 100)), (4, 600, (None,))])
def test_prefill_attention_in_chunks_equals_the_full_square(kv_heads, s, chunks):
  """Chunks of query positions attend only up to their last position; every real position gets
  what attention over the whole causal square gives it (padding positions are never read).
  260 positions: the default chunks (prefill_chunk: 64, the last one short) and 6 items, not a
  multiple of attention.PREFILL_ITEMS; 600: chunks of 128, the last one short."""
  from flexjax.config import ModelConfig
  cfg = ModelConfig(name='t', family='llama', num_layers=1, hidden_size=32, num_heads=4, ffn_dim=64,
                    vocab_size=100, max_positions=512, num_kv_heads=kv_heads)
  rng = np.random.default_rng(0)
  b = 3
  q = jnp.asarray(rng.standard_normal((b, s, cfg.q_dim)), jnp.float32)
  k, v = (jnp.asarray(rng.standard_normal((b, s, cfg.kv_dim)), jnp.float32) for _ in range(2))
  mask = np.ones((b, s), bool)
  mask[1, :4] = mask[2, :9] = False  # left padding
  full = prefill_attend(q, k, v, jnp.asarray(mask), cfg, chunk=s)
  scores = np.einsum('bqhd,bthd->bhqt', np.asarray(q).reshape(b, s, 4, 8),
                     np.repeat(np.asarray(k).reshape(b, s, kv_heads, 8), 4 // kv_heads, axis=2))
  allowed = np.tril(np.ones((s, s), bool))[None, None] & mask[:, None, None, :]
  probs = np.where(allowed, np.exp(scores - scores.max(-1, keepdims=True)), 0)
  probs /= np.maximum(probs.sum(-1, keepdims=True), 1e-30)  # padding rows: all zero
  want = np.einsum('bhqt,bthd->bqhd', probs, np.repeat(
      np.asarray(v).reshape(b, s, kv_heads, 8), 4 // kv_heads, axis=2)).reshape(b, s, -1)
  np.testing.assert_allclose(np.asarray(full)[mask], want[mask], rtol=1e-5, atol=1e-6)
  for chunk in chunks:
    got = prefill_attend(q, k, v, jnp.asarray(mask), cfg, chunk=chunk)
    np.testing.assert_allclose(np.asarray(got)[mask], np.asarray(full)[mask], rtol=1e-5,
                               atol=1e-5)  # float32 sums of up to 260 terms in another order


@pytest.mark.parametrize('dtype', ['bfloat16', 'float16'])
def test_prefill_attention_computes_in_the_dtype_it_is_given(dtype):
  """16-bit q, k, v attended in float32 (a CPU backend's prefill_dtype) give the float32
  result of the same values, rounded once, in the inputs' dtype."""
  from flexjax.config import ModelConfig
  from flexjax.model import attention
  cfg = ModelConfig(name='t', family='llama', num_layers=1, hidden_size=32, num_heads=4, ffn_dim=64,
                    vocab_size=100, max_positions=512, num_kv_heads=2)
  rng = np.random.default_rng(1)
  b, s = 2, 70
  q, k, v = (jnp.asarray(rng.standard_normal((b, s, n)), dtype)
             for n in (cfg.q_dim, cfg.kv_dim, cfg.kv_dim))
  mask = np.ones((b, s), bool)
  mask[1, :5] = False
  got = prefill_attend(q, k, v, jnp.asarray(mask), cfg, dtype=jnp.float32)
  assert got.dtype == jnp.dtype(dtype)
  want = prefill_attend(*(a.astype(jnp.float32) for a in (q, k, v)), jnp.asarray(mask),
                                  cfg)
  np.testing.assert_array_equal(np.asarray(got)[mask], np.asarray(want.astype(dtype))[mask])
  assert attention.prefill_dtype(jnp.bfloat16, 'cpu') == jnp.float32
  assert attention.prefill_dtype(jnp.bfloat16, 'gpu') == jnp.bfloat16


@pytest.mark.parametrize('kv_heads', [4, 2])
@pytest.mark.parametrize('t', [5, 16, 37, 64])
@pytest.mark.parametrize('standalone', [False, True])
def test_decode_attention_equals_the_reference(kv_heads, t, standalone):
  """One new token per sequence over its masked cache and itself, for position counts below,
  at and between multiples of attention.POSITION_RUN (the runs the values are summed in), in
  both forms (in a layer step; standalone on the CPU backend), float32 exactly up to rounding;
  a float16 cache and query on the CPU backend within float16's rounding of the result."""
  from flexjax.config import ModelConfig
  from flexjax.model import attention
  cfg = ModelConfig(name='t', family='llama', num_layers=1, hidden_size=32, num_heads=4, ffn_dim=64,
                    vocab_size=100, max_positions=512, num_kv_heads=kv_heads)
  rng = np.random.default_rng(t)
  b, g = 3, 4 // kv_heads
  q = rng.standard_normal((b, cfg.q_dim)).astype(np.float32)
  k_new, v_new = (rng.standard_normal((b, cfg.kv_dim)).astype(np.float32) for _ in range(2))
  kc, vc = (rng.standard_normal((b, t, cfg.kv_dim)).astype(np.float32) for _ in range(2))
  mask = np.ones((b, t), bool)
  mask[1, :3] = mask[2, t // 2:] = False
  keys = np.concatenate([kc, k_new[:, None]], axis=1).reshape(b, t + 1, kv_heads, 1, 8)
  values = np.concatenate([vc, v_new[:, None]], axis=1).reshape(b, t + 1, kv_heads, 1, 8)
  scores = (q.reshape(b, 1, kv_heads, g, 8) * keys).sum(-1)  # [b, t + 1, kv, g]
  scores = np.where(np.concatenate([mask, np.ones((b, 1), bool)], 1)[:, :, None, None],
                    scores, -np.inf)
  probs = np.exp(scores - scores.max(1, keepdims=True))
  probs /= probs.sum(1, keepdims=True)
  want = (probs[..., None] * values).sum(1).reshape(b, cfg.q_dim)
  step = jax.jit(attention.attend_decode, static_argnames=('cfg', 'standalone'))
  attend = lambda *a: np.asarray(step(  # noqa: E731
      *(jnp.asarray(x) for x in a), jnp.asarray(mask), cfg=cfg, standalone=standalone))
  np.testing.assert_allclose(attend(q, k_new, v_new, kc, vc), want, rtol=1e-5, atol=1e-6)
  if standalone:
    half = [x.astype(np.float16) for x in (q, k_new, v_new, kc, vc)]
    got = attend(*half)
    assert got.dtype == np.float16
    np.testing.assert_allclose(got.astype(np.float32), attend(*(x.astype(np.float32)
                                                               for x in half)),
                               rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16, jnp.float16])
def test_the_query_kept_apart_for_the_scores_is_unchanged(dtype):
  """attention._computed_once passes q through a product with each head's identity: every
  normal value comes back bit for bit (the largest, the smallest, signs, zero), in every compute
  dtype; a subnormal one as itself or zero, as the backend's arithmetic flushes it anyway
  (XLA:CPU: q * 1.5 gives zero too), so the scores are the same either way."""
  from flexjax.config import ModelConfig
  from flexjax.model import attention
  cfg = ModelConfig(name='t', family='opt', num_layers=1, hidden_size=64, num_heads=4, ffn_dim=64,
                    vocab_size=100, max_positions=64)
  info = jnp.finfo(dtype)
  special = np.array([float(info.max), -float(info.max), float(info.tiny), -float(info.tiny),
                      float(info.tiny) / 4, -float(info.tiny) / 2, 1.0, -1.0, 0.0], np.float32)
  q = np.random.default_rng(0).standard_normal((3, cfg.q_dim)).astype(np.float32) * 100
  q[1, :special.size] = special
  q = jnp.asarray(q).astype(dtype)
  got = jax.jit(attention._computed_once, static_argnames='cfg')(q, cfg=cfg)
  assert got.dtype == q.dtype
  got, want = (np.asarray(a.astype(jnp.float32)) for a in (got, q))
  subnormal = (want != 0) & (np.abs(want) < float(info.tiny))
  assert subnormal.sum() == 2
  np.testing.assert_array_equal(got[~subnormal], want[~subnormal])
  assert np.all((got[subnormal] == 0) | (got[subnormal] == want[subnormal]))
