"""Accuracy of a model under a policy: perplexity of a text, LAMBADA-style last-word accuracy.

Both score through the engine's decode path (teacher forcing), so KV cache compression and
sparse attention affect them exactly as they affect generation.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np

from flexjax.engine import Engine, GenerationConfig
from flexjax.errors import FlexjaxError
from flexjax.tokenizer import Tokenizer


@dataclasses.dataclass(frozen=True)
class Perplexity:
  nll_sum: float
  tokens: int

  @property
  def value(self) -> float:
    return math.exp(self.nll_sum / self.tokens)


def score_continuations(engine: Engine, prompts: Sequence[Sequence[int]],
                        continuations: Sequence[Sequence[int]]):
  """Log-probabilities and greedy hits of each continuation given its prompt, in one
  generate() call. The head step scores the forced tokens (and gives its own most likely
  one): no [prompts, gen_len, vocab] logits leave the device.

  Returns per example (log-probs [len] float32, argmax-equals-target [len]).
  """
  gen_len = max(len(c) for c in continuations)
  forced = np.full((len(prompts), gen_len), engine.config.pad_token_id, np.int32)
  for i, c in enumerate(continuations):
    forced[i, :len(c)] = c
  result = engine.generate(prompts, GenerationConfig(gen_len=gen_len, stop_at_eos=False,
                                                    top_logprobs=1), forced_tokens=forced)
  return [(result.token_logprobs[i, :len(c)], result.top_ids[i, :len(c), 0] == np.asarray(c))
          for i, c in enumerate(continuations)]


def perplexity(engine: Engine, ids: Sequence[int], *, window: int, context: int) -> Perplexity:
  """Perplexity of a token stream cut into windows of `window` tokens; in each window the first
  `context` tokens are the prompt and the rest are scored one decode step at a time."""
  if not 0 < context < window:
    raise FlexjaxError(f'context={context} must be between 1 and window={window} - 1')
  if window > engine.config.max_positions:
    raise FlexjaxError(f'window={window} exceeds the {engine.config.max_positions} positions of '
                       f'{engine.config.name}')
  chunks = [list(ids[i:i + window]) for i in range(0, len(ids), window)]
  chunks = [c for c in chunks if len(c) > context]
  if not chunks:
    raise FlexjaxError(f'the text has {len(ids)} tokens, fewer than context={context} + 1')
  nll, count = 0.0, 0
  for length in sorted({len(c) for c in chunks}):  # equal lengths share one run
    group = [c for c in chunks if len(c) == length]
    for logp, _ in score_continuations(engine, [c[:context] for c in group],
                                       [c[context:] for c in group]):
      nll -= float(logp.sum())
      count += len(logp)
  return Perplexity(nll, count)


def lambada_accuracy(engine: Engine, tokenizer: Tokenizer, texts: Sequence[str]) -> float:
  """Fraction of texts whose last word the model predicts exactly (greedy, every token)."""
  prompts, targets = [], []
  for text in texts:
    context, _, word = text.rstrip().rpartition(' ')
    if not context or not word:
      raise FlexjaxError(f'LAMBADA text {text[:60]!r} has no context before its last word')
    prompts.append(tokenizer.encode(context))
    targets.append(tokenizer.encode(' ' + word, add_bos=False))
  hits = [bool(ok.all()) for _, ok in score_continuations(engine, prompts, targets)]
  return sum(hits) / len(hits)
