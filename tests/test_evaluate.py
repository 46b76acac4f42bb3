"""The accuracy tool's numbers equal transformers' on the same tiny model and text."""

import math

import numpy as np
import pytest
import torch

from flexjax import evaluate
from flexjax.checkpoint import Checkpoint
from flexjax.engine import Engine
from flexjax.policy import Policy
from flexjax.tokenizer import Tokenizer
from tools.accuracy import evaluate as evaluate_variant

TEXT = ('Paris is the capital city of France. The quick brown fox jumps over the lazy dog. '
        'flexjax streams weights layer by layer. ') * 4


def tokenizer(tiny):
  cfg = Checkpoint(tiny.ckpt_dir).config
  return Tokenizer(Checkpoint(tiny.ckpt_dir).tokenizer_path, bos_token_id=cfg.bos_token_id,
                   special_ids=(cfg.eos_token_id, cfg.pad_token_id))


def hf_perplexity(model, ids, window, context):
  nll, count = 0.0, 0
  for i in range(0, len(ids), window):
    chunk = ids[i:i + window]
    if len(chunk) <= context:
      continue
    with torch.no_grad():
      logp = torch.log_softmax(model(torch.tensor([chunk])).logits[0].double(), -1).numpy()
    for t in range(context, len(chunk)):
      nll -= logp[t - 1, chunk[t]]
      count += 1
  return math.exp(nll / count), count


def test_perplexity_equals_transformers(pre_ln):
  ids = tokenizer(pre_ln).encode(TEXT)
  with Engine(Checkpoint(pre_ln.ckpt_dir), policy=Policy(gpu_batch_size=2)) as engine:
    ours = evaluate.perplexity(engine, ids, window=48, context=16)
  want, count = hf_perplexity(pre_ln.torch_model, ids, 48, 16)
  assert ours.tokens == count
  assert ours.value == pytest.approx(want, rel=1e-4)


def test_lambada_accuracy_equals_a_direct_check(pre_ln):
  tok = tokenizer(pre_ln)
  texts = ['Paris is the capital city of France.', 'The quick brown fox jumps over the lazy dog',
           'flexjax streams weights layer by layer', 'the lazy dog jumps over the quick fox']
  with Engine(Checkpoint(pre_ln.ckpt_dir), policy=Policy(gpu_batch_size=4)) as engine:
    ours = evaluate.lambada_accuracy(engine, tok, texts)
  hits = []
  for text in texts:
    context, _, word = text.rpartition(' ')
    prompt, target = tok.encode(context), tok.encode(' ' + word, add_bos=False)
    with torch.no_grad():
      logits = pre_ln.torch_model(torch.tensor([prompt + target])).logits[0].numpy()
    predicted = logits[len(prompt) - 1:len(prompt) - 1 + len(target)].argmax(-1)
    hits.append(bool((predicted == np.asarray(target)).all()))
  assert ours == sum(hits) / len(hits)


def test_approximate_variants_score_through_the_decode_path(pre_ln):
  kw = dict(text=TEXT, lambada=None, window=48, context=8, batch_size=4, compute_dtype='float32')
  fp = evaluate_variant(str(pre_ln.ckpt_dir), 'fp', **kw)
  cache_only = evaluate_variant(str(pre_ln.ckpt_dir), 'sparse', **kw)
  int4 = evaluate_variant(str(pre_ln.ckpt_dir), 'int4', **kw)
  assert fp['scored_tokens'] == int4['scored_tokens'] > 0
  assert math.isfinite(int4['perplexity'])
  assert cache_only['perplexity'] != fp['perplexity']  # sparse attention changed decode steps
  assert int4['perplexity'] != fp['perplexity']
