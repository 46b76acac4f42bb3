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
    self._config = _saved_config(path)
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

  @property
  def chat_template(self) -> str | None:
    """The Jinja chat template saved with the tokenizer (tokenizer_config.json), or None."""
    return self._config.get('chat_template')

  def encode_chat(self, text: str) -> list[int]:
    """Token ids of `text` sent as the user's message through the chat template, ending where
    the assistant's answer begins (the template writes any BOS and system message itself)."""
    import jinja2.sandbox

    if not self.chat_template:
      raise FlexjaxError('this checkpoint\'s tokenizer has no chat template '
                         '(tokenizer_config.json "chat_template"); drop --chat')
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    token = lambda name: _token_text(self._config.get(name))
    try:
      rendered = env.from_string(self.chat_template).render(
          messages=[{'role': 'user', 'content': text}], add_generation_prompt=True,
          bos_token=token('bos_token'), eos_token=token('eos_token'))
    except jinja2.TemplateError as e:
      raise FlexjaxError(f'the checkpoint\'s chat template does not render ({e}); drop --chat '
                         'and give prompts already formatted') from None
    return self.encode(rendered, add_bos=False)

  def decode(self, ids) -> str:
    return self._tok.decode([int(i) for i in ids if int(i) not in self._special],
                            skip_special_tokens=True)


def _saved_config(path: Path) -> dict:
  """tokenizer_config.json's fields, or none."""
  config = path / 'tokenizer_config.json'
  return json.loads(config.read_text()) if config.is_file() else {}


def _saved_add_bos(path: Path) -> bool | None:
  """tokenizer_config.json's add_bos_token, or None when it sets none."""
  value = _saved_config(path).get('add_bos_token')
  return None if value is None else bool(value)


def _token_text(value) -> str:
  """A special token's text as tokenizer_config.json gives it (a string or {"content": ...})."""
  if isinstance(value, dict):
    return value.get('content', '')
  return value or ''
