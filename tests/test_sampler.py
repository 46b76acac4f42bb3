"""The next token: first_max is jnp.argmax, ties and every vocabulary size included (a NaN counts
as +inf), and
a sample is the token jax.random.categorical draws from the same key."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flexjax import sampler


@pytest.mark.parametrize('n', [1, 7, 256, 1024, 1025, 3000, 50272])
def test_first_max_is_argmax(n):
  rng = np.random.default_rng(n)
  x = rng.standard_normal((5, n)).astype(np.float32)
  x[1] = 0.0  # all tied: the first index
  x[2, n // 2:] = 10.0  # ties in several chunks: the first of them
  x[3] = -np.inf
  got = np.asarray(jax.jit(sampler.first_max)(jnp.asarray(x)))
  np.testing.assert_array_equal(got, np.asarray(jnp.argmax(jnp.asarray(x), axis=-1)))
  assert got.dtype == np.int32
  if n > 3:  # NaNs and +infs: the first of them
    x[4, 1], x[4, n - 1], x[0, n - 2], x[0, n - 1] = np.inf, np.nan, np.nan, np.inf
    got = np.asarray(jax.jit(sampler.first_max)(jnp.asarray(x)))
    assert got[4] == 1 and got[0] == n - 2


def test_greedy_takes_the_largest_logit():
  logits = jnp.asarray(np.random.default_rng(0).standard_normal((4, 3000)), jnp.float32)
  keys = jax.vmap(jax.random.key)(jnp.arange(4, dtype=jnp.uint32))
  got = sampler.next_token(logits, keys, temperature=0.0, top_p=1.0)
  np.testing.assert_array_equal(np.asarray(got), np.argmax(np.asarray(logits), axis=-1))


@pytest.mark.parametrize('top_p', [1.0, 0.9])
def test_a_sample_is_the_token_categorical_draws(top_p):
  """Each row's token is jax.random.categorical's with the row's key, over the logits that
  temperature and top_p leave (sampled through first_max instead of argmax)."""
  rng = np.random.default_rng(1)
  logits = jnp.asarray(rng.standard_normal((64, 2000)) * 3, jnp.float32)
  keys = jax.vmap(jax.random.key)(jnp.arange(64, dtype=jnp.uint32))
  got = np.asarray(sampler.next_token(logits, keys, temperature=0.7, top_p=top_p))
  scaled = logits / 0.7
  if top_p < 1:
    order = np.argsort(-np.asarray(scaled), axis=-1, kind='stable')
    probs = np.take_along_axis(np.asarray(jax.nn.softmax(scaled, axis=-1)), order, axis=-1)
    kept = np.cumsum(probs, axis=-1) - probs < top_p
    cutoff = np.take_along_axis(np.take_along_axis(np.asarray(scaled), order, axis=-1),
                                kept.sum(axis=-1, keepdims=True) - 1, axis=-1)
    scaled = jnp.where(scaled < cutoff, -jnp.inf, scaled)
  want = np.asarray(jax.vmap(jax.random.categorical)(keys, scaled))
  np.testing.assert_array_equal(got, want)
  assert len(set(got.tolist())) > 10  # samples, not one greedy token
