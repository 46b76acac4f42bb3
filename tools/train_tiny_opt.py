"""Trains a small OPT on text found on this machine (the Python standard library's sources), so
the approximations' accuracy can be measured on weights better than random ones.

  python -m tools.train_tiny_opt --output=checkpoints/tiny-opt-hf --minutes=6

Writes an HF directory (config.json, model.safetensors, vocab.json, merges.txt) for
tools/convert_hf.py, plus held-out evaluation files: heldout.txt (perplexity) and
heldout_lambada.jsonl (last-word prediction). Needs the test extras (torch, transformers).
"""

import json
import random
import sys
import sysconfig
import time
from pathlib import Path

from absl import app, flags

from flexjax.errors import flags_parser

_OUTPUT = flags.DEFINE_string('output', None, 'HF directory to create.', required=True)
_MINUTES = flags.DEFINE_float('minutes', 6.0, 'Training time budget.')
_VOCAB = flags.DEFINE_integer('vocab_size', 4096, 'BPE vocabulary size.')
_HIDDEN = flags.DEFINE_integer('hidden_size', 256, 'Model width.')
_LAYERS = flags.DEFINE_integer('num_layers', 4, 'Decoder layers.')
_SEQ = flags.DEFINE_integer('seq_len', 128, 'Training sequence length.')
_BATCH = flags.DEFINE_integer('batch_size', 16, 'Sequences per step.')
_SEED = flags.DEFINE_integer('seed', 0, 'Seed.')


def corpus(seed: int) -> tuple[str, str]:
  """(training text, held-out text) from the standard library's .py files, split by file."""
  files = sorted(Path(sysconfig.get_paths()['stdlib']).glob('*.py'))
  random.Random(seed).shuffle(files)
  texts = [f.read_text(errors='ignore') for f in files]
  held = max(1, len(texts) // 20)
  return '\n'.join(texts[held:]), '\n'.join(texts[:held])


def lambada_lines(text: str, limit: int = 500) -> list[dict]:
  """Prose-like lines (comments, docstrings) of at least 8 words, as last-word examples."""
  out = []
  for line in text.splitlines():
    words = line.strip().lstrip('#').strip().split()
    if len(words) >= 8 and all(w.isalpha() for w in words[-3:]):
      out.append({'text': ' '.join(words)})
  return out[:limit]


def main(argv):
  del argv
  try:
    import torch
    import transformers
    import tokenizers
  except ImportError as e:
    print(f'train_tiny_opt: error: {e.name} is missing; pip install -e .[test]', file=sys.stderr)
    return 2
  out = Path(_OUTPUT.value)
  out.mkdir(parents=True, exist_ok=True)
  train_text, heldout = corpus(_SEED.value)
  (out / 'heldout.txt').write_text(heldout)
  (out / 'heldout_lambada.jsonl').write_text(
      ''.join(json.dumps(r) + '\n' for r in lambada_lines(heldout)))

  tok = tokenizers.ByteLevelBPETokenizer()
  tok.train_from_iterator(train_text.splitlines(), vocab_size=_VOCAB.value, min_frequency=2,
                          show_progress=False, special_tokens=['<s>', '<pad>', '</s>', '<unk>'])
  tok.save_model(str(out))
  ids = torch.tensor(tok.encode(train_text).ids, dtype=torch.long)
  print(f'{len(ids):,} training tokens, vocabulary {tok.get_vocab_size()}')

  torch.manual_seed(_SEED.value)
  config = transformers.OPTConfig(
      vocab_size=tok.get_vocab_size(), hidden_size=_HIDDEN.value, ffn_dim=4 * _HIDDEN.value,
      num_hidden_layers=_LAYERS.value, num_attention_heads=_HIDDEN.value // 64,
      max_position_embeddings=_SEQ.value * 2, word_embed_proj_dim=_HIDDEN.value,
      pad_token_id=1, bos_token_id=2, eos_token_id=2, dropout=0.0)
  model = transformers.OPTForCausalLM(config)
  optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
  bos = torch.full((_BATCH.value, 1), 2, dtype=torch.long)
  start, step = time.time(), 0
  while time.time() - start < 60 * _MINUTES.value:
    starts = torch.randint(0, len(ids) - _SEQ.value, (_BATCH.value,))
    batch = torch.cat([bos, torch.stack([ids[s:s + _SEQ.value - 1] for s in starts])], dim=1)
    loss = model(input_ids=batch, labels=batch).loss
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    step += 1
    if step % 50 == 0:
      print(f'step {step} loss {loss.item():.3f} ({time.time() - start:.0f} s)', flush=True)
  model.save_pretrained(out)
  print(f'wrote {out} after {step} steps, last loss {loss.item():.3f}')
  return 0


if __name__ == '__main__':
  app.run(main, flags_parser=flags_parser())
