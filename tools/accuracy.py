"""Accuracy tool: perplexity on a plain-text file and LAMBADA-style last-word accuracy on a JSONL
file, for a converted checkpoint, with and without the approximations (the paper's Table 5).

  python -m tools.accuracy --checkpoint=checkpoints/opt-1.3b --text_file=wiki.test.raw \
      --lambada_file=lambada_test.jsonl --variants=fp,int4,int4_sparse
"""

import json
import sys
from pathlib import Path

from absl import app, flags

from flexjax.errors import FlexjaxError, flags_parser

_CHECKPOINT = flags.DEFINE_string('checkpoint', None, 'Converted flexjax checkpoint.',
                                  required=True)
_TEXT = flags.DEFINE_string('text_file', None, 'Plain text for perplexity (e.g. WikiText-2 raw).')
_LAMBADA = flags.DEFINE_string('lambada_file', None, 'JSONL with a "text" field per line.')
_VARIANTS = flags.DEFINE_list('variants', ['fp', 'int4', 'int4_sparse'],
                              'fp: no approximation; int4: weights and KV cache 4-bit, groups of '
                              '64; int4_sparse: int4 plus attention sparsity 0.1; sparse; '
                              'int4_weights, int4_cache: one of the two; int4_weights_g32: '
                              'weights in groups of 32 (a GGUF\'s Q4_1 blocks as converted).')
_WINDOW = flags.DEFINE_integer('window', 512, 'Tokens per perplexity window.')
_CONTEXT = flags.DEFINE_integer('context', 256, 'Prompt tokens of each window (the rest are '
                                'scored through decode steps).')
_BATCH = flags.DEFINE_integer('gpu_batch_size', 8, 'Sequences per GPU batch.')
_LIMIT = flags.DEFINE_integer('max_examples', None, 'Use at most this many LAMBADA lines.')
_COMPUTE = flags.DEFINE_string('compute_dtype', 'float32', 'Compute dtype.')

VARIANTS = {
    'fp': {},
    'int4': dict(compress_weight=True, compress_cache=True),
    'int4_sparse': dict(compress_weight=True, compress_cache=True, attn_sparsity=0.1),
    'sparse': dict(attn_sparsity=0.1),
    'int4_weights': dict(compress_weight=True),
    # 4-bit weights in groups of 32: a converted GGUF's Q4_1 blocks, kept as the file has them
    'int4_weights_g32': dict(compress_weight=True, compress_group_size=32),
    'int4_cache': dict(compress_cache=True),
}


def evaluate(checkpoint: str, variant: str, *, text: str | None, lambada: list[str] | None,
             window: int, context: int, batch_size: int, compute_dtype: str) -> dict:
  """One variant's perplexity and/or LAMBADA accuracy."""
  from flexjax import evaluate as ev
  from flexjax.checkpoint import Checkpoint
  from flexjax.engine import Engine
  from flexjax.policy import Policy
  from flexjax.tokenizer import Tokenizer

  if variant not in VARIANTS:
    raise FlexjaxError(f'unknown variant {variant!r}; choose from {", ".join(VARIANTS)}')
  ckpt = Checkpoint(checkpoint)
  if ckpt.tokenizer_path is None:
    raise FlexjaxError(f'checkpoint {checkpoint!r} has no tokenizer files; convert it from a '
                       'directory that has them')
  cfg = ckpt.config
  tok = Tokenizer.for_model(ckpt.tokenizer_path, cfg)
  record = {'checkpoint': checkpoint, 'variant': variant, **VARIANTS[variant]}
  with Engine(ckpt, policy=Policy(gpu_batch_size=batch_size, **VARIANTS[variant]),
              compute_dtype=compute_dtype) as engine:
    if text is not None:
      ppl = ev.perplexity(engine, tok.encode(text), window=window, context=context)
      record.update(perplexity=ppl.value, scored_tokens=ppl.tokens)
    if lambada is not None:
      record.update(lambada_accuracy=ev.lambada_accuracy(engine, tok, lambada),
                    lambada_examples=len(lambada))
  return record


def main(argv):
  del argv
  try:
    text = Path(_TEXT.value).read_text() if _TEXT.value else None
    lambada = None
    if _LAMBADA.value:
      lines = [json.loads(line) for line in Path(_LAMBADA.value).read_text().splitlines()
               if line.strip()]
      lambada = [line['text'] for line in lines][:_LIMIT.value]
    if text is None and lambada is None:
      raise FlexjaxError('give --text_file and/or --lambada_file')
    for variant in _VARIANTS.value:
      print(json.dumps(evaluate(_CHECKPOINT.value, variant, text=text, lambada=lambada,
                                window=_WINDOW.value, context=_CONTEXT.value,
                                batch_size=_BATCH.value, compute_dtype=_COMPUTE.value)))
  except (FlexjaxError, OSError, json.JSONDecodeError, KeyError) as e:
    print(f'accuracy: error: {e}', file=sys.stderr)
    return 2
  return 0


if __name__ == '__main__':
  app.run(main, flags_parser=flags_parser())
