"""Which layer module computes a model family: the one place that maps ModelConfig.family to it."""

from __future__ import annotations

from types import ModuleType

from flexjax.config import ModelConfig
from flexjax.errors import FlexjaxError
from flexjax.model import llama, opt


def layers(cfg: ModelConfig) -> ModuleType:
  """The module of pure layer functions (embed, head, decoder_prefill, decode_qkv, ...) of
  cfg.family: model/opt.py or model/llama.py, which share one interface."""
  modules = {'opt': opt, 'llama': llama}
  if cfg.family not in modules:
    raise FlexjaxError(f'family={cfg.family!r} has no layer functions; use one of '
                       f'{", ".join(modules)}')
  return modules[cfg.family]
