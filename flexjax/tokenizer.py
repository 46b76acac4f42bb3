"""Text <-> token ids with the tokenizer files carried in a checkpoint (OPT's byte-level BPE)."""

from __future__ import annotations

import os
from pathlib import Path

from flexjax.errors import FlexjaxError


class Tokenizer:
  """OPT tokenizer: byte-level BPE; prompts start with the BOS token, as OPT was trained."""

  def __init__(self, path: str | os.PathLike, *, bos_token_id: int,
               special_ids: tuple[int, ...] = ()):
    """special_ids (BOS, EOS, pad) are left out when decoding."""
    import tokenizers

    path = Path(path)
    self.bos_token_id = bos_token_id
    self._special = {bos_token_id, *special_ids}
    if (path / 'tokenizer.json').is_file():
      self._tok = tokenizers.Tokenizer.from_file(str(path / 'tokenizer.json'))
    elif (path / 'vocab.json').is_file() and (path / 'merges.txt').is_file():
      self._tok = tokenizers.ByteLevelBPETokenizer(str(path / 'vocab.json'),
                                                   str(path / 'merges.txt'))
    else:
      raise FlexjaxError(f'no tokenizer.json or vocab.json + merges.txt in {str(path)!r}; convert '
                         'the checkpoint from a directory that has them')

  def encode(self, text: str, *, add_bos: bool = True) -> list[int]:
    ids = self._tok.encode(text, add_special_tokens=False).ids
    return [self.bos_token_id] + ids if add_bos else ids

  def decode(self, ids) -> str:
    return self._tok.decode([int(i) for i in ids if int(i) not in self._special],
                            skip_special_tokens=True)
