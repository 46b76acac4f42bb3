"""Sampling: the next token from logits (greedy, temperature, top-p) and trimming at EOS."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def next_token(logits: jax.Array, keys: jax.Array, *, temperature: float, top_p: float):
  """Greedy (temperature 0) or temperature + nucleus sampling, each row with its own key (so a
  row's sample does not depend on the rows batched with it). logits: [b, vocab], keys: [b]
  -> [b] int32."""
  if temperature == 0:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  logits = logits / temperature
  if top_p < 1:
    sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    # keep the smallest prefix whose mass reaches top_p (the first token is always kept)
    before = jnp.cumsum(probs, axis=-1) - probs
    cutoff_index = jnp.sum(before < top_p, axis=-1, keepdims=True) - 1
    cutoff = jnp.take_along_axis(sorted_logits, cutoff_index, axis=-1)
    logits = jnp.where(logits < cutoff, -jnp.inf, logits)
  draw = jax.vmap(lambda key, row: jax.random.categorical(key, row))
  return draw(keys, logits).astype(jnp.int32)


def trim(row: np.ndarray, eos_id: int, stop_at_eos: bool) -> np.ndarray:
  """Generated ids up to and including the first EOS (all of them without stop_at_eos)."""
  if stop_at_eos:
    hits = np.flatnonzero(row == eos_id)
    if hits.size:
      return row[:hits[0] + 1]
  return row
