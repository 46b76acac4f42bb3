"""The zig-zag block schedule, written once: the order in which (token, stage, GPU batch) run."""

from __future__ import annotations

import dataclasses
from typing import Iterator


@dataclasses.dataclass(frozen=True)
class Step:
  token: int  # 0: prefill (the whole prompt); t > 0: decode of the t-th new token's input
  stage: int  # 0: input embedding; 1..L: decoder layers; L+1: LM head and sampling
  batch: int  # GPU batch within the block


def block_schedule(gen_len: int, num_stages: int, num_gpu_batches: int) -> Iterator[Step]:
  """Steps of one block: for each token, each stage, each GPU batch (FlexGen's Algorithm 1).

  A stage's weights serve all GPU batches of the block before the next stage's are needed, so
  they are brought to the device once per (token, stage). With num_gpu_batches=1 this is the
  row-by-row order of DeepSpeed/Accelerate.
  """
  for token in range(gen_len):
    for stage in range(num_stages):
      for batch in range(num_gpu_batches):
        yield Step(token, stage, batch)
