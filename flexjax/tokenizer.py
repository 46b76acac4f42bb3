"""Text <-> token ids with the tokenizer files carried in a checkpoint (OPT's byte-level BPE, the
llama family's tokenizer.json)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from flexjax.errors import FlexjaxError


BOS_MODES = ('always', 'as_saved')


class Tokenizer:
  """A checkpoint's tokenizer. BOS: 'always' prepends it (OPT, as it was trained); 'as_saved'
  does what transformers' tokenizer does by default (add_special_tokens=True): prepends BOS when
  tokenizer_config.json's add_bos_token says so, else as tokenizer.json's post-processor adds
  special tokens (Llama 2 and 3 prepend BOS, SmolLM2 adds none)."""

  def __init__(self, path: str | os.PathLike, *, bos_token_id: int,
               special_ids: tuple[int, ...] = (), bos: str = 'always'):
    """special_ids (BOS, EOS, pad) are left out when decoding."""
    import tokenizers

    if bos not in BOS_MODES:
      raise FlexjaxError(f'bos={bos!r} is not a BOS mode; use one of {", ".join(BOS_MODES)}')
    path = Path(path)
    self.bos_token_id = bos_token_id
    self._add_bos = _saved_add_bos(path) if bos == 'as_saved' else True
    self._template = bos == 'as_saved' and self._add_bos is None
    self._special = {bos_token_id, *special_ids}
    if (path / 'tokenizer.json').is_file():
      self._tok = tokenizers.Tokenizer.from_file(str(path / 'tokenizer.json'))
    elif (path / 'vocab.json').is_file() and (path / 'merges.txt').is_file():
      self._tok = tokenizers.ByteLevelBPETokenizer(str(path / 'vocab.json'),
                                                   str(path / 'merges.txt'))
    else:
      raise FlexjaxError(f'no tokenizer.json or vocab.json + merges.txt in {str(path)!r}; convert '
                         'the checkpoint from a directory that has them')

  @classmethod
  def for_model(cls, path: str | os.PathLike, cfg) -> 'Tokenizer':
    """The tokenizer of a checkpoint of config `cfg`, with its family's BOS handling."""
    return cls(path, bos_token_id=cfg.bos_token_id,
               special_ids=(cfg.eos_token_id, cfg.pad_token_id),
               bos='always' if cfg.family == 'opt' else 'as_saved')

  def encode(self, text: str, *, add_bos: bool = True) -> list[int]:
    """Token ids of text; add_bos=False leaves out BOS (and any special tokens)."""
    if self._template:
      return self._tok.encode(text, add_special_tokens=add_bos).ids
    ids = self._tok.encode(text, add_special_tokens=False).ids
    return [self.bos_token_id] + ids if add_bos and self._add_bos else ids

  def decode(self, ids) -> str:
    return self._tok.decode([int(i) for i in ids if int(i) not in self._special],
                            skip_special_tokens=True)


def _saved_add_bos(path: Path) -> bool | None:
  """tokenizer_config.json's add_bos_token, or None when it sets none."""
  config = path / 'tokenizer_config.json'
  if not config.is_file():
    return None
  value = json.loads(config.read_text()).get('add_bos_token')
  return None if value is None else bool(value)
