"""Where weights come from: a converted checkpoint or deterministic dummy weights."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Protocol

from flexjax.config import ModelConfig, np_dtype
from flexjax.model import params as params_lib


class WeightSource(Protocol):
  """Gives one stage's parameters at a time as host numpy arrays."""

  config: ModelConfig
  dtype: str  # storage dtype name

  def read(self, stage: str) -> params_lib.HostParams:
    ...

  def stream_folder(self, cache_dir: Path) -> Path:
    """The folder holding this source's streaming layouts (stream.py), one per variant."""
    ...

  def fingerprint(self) -> str:
    """Changes whenever the weights do (a layout written for another fingerprint is stale)."""
    ...


class DummyWeights:
  """Random but deterministic weights for benchmarks, created stage by stage on demand."""

  def __init__(self, config: ModelConfig, dtype: str = 'float16', seed: int = 0):
    self.config = config
    self.dtype = dtype
    self._np_dtype = np_dtype(dtype)
    self._seed = seed

  def read(self, stage: str) -> params_lib.HostParams:
    return params_lib.dummy_stage(self.config, stage, self._np_dtype, self._seed)

  def fingerprint(self) -> str:
    text = json.dumps({'model': self.config.to_dict(), 'dtype': self.dtype, 'seed': self._seed,
                       'chunk': params_lib.DUMMY_CHUNK}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]

  def stream_folder(self, cache_dir: Path) -> Path:
    """Per shape, dtype and seed under the cache folder: written on first use, then reused."""
    return Path(cache_dir) / 'dummy' / f'{self.config.name}-{self.fingerprint()}'
