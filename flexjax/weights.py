"""Where weights come from: a converted checkpoint or deterministic dummy weights."""

from __future__ import annotations

from typing import Protocol

from flexjax.config import ModelConfig, np_dtype
from flexjax.model import params as params_lib


class WeightSource(Protocol):
  """Gives one stage's parameters at a time as host numpy arrays."""

  config: ModelConfig
  dtype: str  # storage dtype name

  def read(self, stage: str) -> params_lib.HostParams:
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
