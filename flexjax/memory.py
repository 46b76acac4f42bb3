"""Weight placement per stage and the peak bytes per tier that a policy needs (exact, up front)."""

from __future__ import annotations

import dataclasses
import math

from flexjax.config import ModelConfig
from flexjax.model import params as params_lib
from flexjax.policy import Policy, assign_weight_tiers

Path = tuple[str, ...]


def stage_names(cfg: ModelConfig) -> list[str]:
  """Compute stages in model order: input embedding, decoder layers, output head."""
  return ['embed'] + [params_lib.layer_name(i) for i in range(cfg.num_layers)] + ['head']


def stage_shapes(cfg: ModelConfig, stage: str) -> dict[Path, tuple[int, ...]]:
  """Flat shapes of a compute stage; the tied token embedding belongs to embed and head alike."""
  if stage in ('embed', 'head'):
    shapes = {'tokens': cfg.tokens_shape(), **params_lib.stage_shapes(cfg, stage)}
  else:
    shapes = params_lib.stage_shapes(cfg, stage)
  return params_lib.flatten(shapes)


@dataclasses.dataclass(frozen=True)
class Itemsizes:
  storage: int  # weights on host and disk
  compute: int  # weights on the device, hidden states
  cache: int


def compressed(policy: Policy, shape: tuple[int, ...]) -> bool:
  """Whether a weight is stored quantized: matrices are, biases and LayerNorms are not."""
  return policy.compress_weight and len(shape) >= 2


def tensor_bytes(policy: Policy, sizes: Itemsizes, shape: tuple[int, ...]) -> tuple[int, int]:
  """(bytes stored on host/disk or resident on the device, bytes once loaded to the device) of
  one weight tensor. Quantized tensors stay quantized where they are stored (the device
  included, dequantized inside each layer step) and are moved quantized; a loaded one is
  dequantized once per load, so the GPU batches of a block do not each pay for it."""
  if compressed(policy, shape):
    return _count(shape[:-1]) * policy.quant.row_bytes(shape[-1]), _count(shape) * sizes.compute
  return _count(shape) * sizes.storage, _count(shape) * sizes.compute


def cache_row_bytes(cfg: ModelConfig, policy: Policy, sizes: Itemsizes) -> int:
  """Bytes of one token's K (or V) in one layer."""
  if policy.compress_cache:
    return policy.quant.row_bytes(cfg.hidden_size)
  return cfg.hidden_size * sizes.cache


def sparse_keep(policy: Policy, cache_len: int) -> int:
  """Cached positions kept per decode step by sparse attention."""
  return max(1, math.ceil(policy.attn_sparsity * cache_len))


def place_stage(cfg: ModelConfig, stage: str, policy: Policy) -> dict[Path, str]:
  """Tier of every tensor of a stage (tensors in sorted order, split by cumulative stored size)."""
  shapes = stage_shapes(cfg, stage)
  paths = sorted(shapes)
  unit = Itemsizes(1, 1, 1)
  sizes = [tensor_bytes(policy, unit, shapes[p])[0] for p in paths]
  return dict(zip(paths, assign_weight_tiers(sizes, policy.w_gpu_percent, policy.w_cpu_percent)))


@dataclasses.dataclass(frozen=True)
class WeightBytes:
  device: int  # resident on the device (compute dtype)
  host: int  # storage dtype
  disk: int
  loaded_max_device: int  # the largest stage's non-resident tensors, once loaded (compute dtype)
  largest_disk_tensor: int  # staged in host RAM one tensor at a time while loading


def distinct_stages(cfg: ModelConfig) -> dict[str, int]:
  """Stages with distinct shapes and how many times each occurs (all decoder layers alike)."""
  return {'embed': 1, params_lib.layer_name(0): cfg.num_layers, 'head': 1}


def weight_bytes(cfg: ModelConfig, policy: Policy, sizes: Itemsizes) -> WeightBytes:
  totals = {'device': 0, 'host': 0, 'disk': 0}
  loaded_max, disk_max = 0, 0
  for stage, count in distinct_stages(cfg).items():
    shapes = stage_shapes(cfg, stage)
    loaded = 0
    for path, tier in place_stage(cfg, stage, policy).items():
      stored, on_device = tensor_bytes(policy, sizes, shapes[path])
      resident = stored if compressed(policy, shapes[path]) else on_device
      totals[tier] += count * (resident if tier == 'device' else stored)
      if tier != 'device':
        loaded += on_device
      if tier == 'disk':
        disk_max = max(disk_max, stored)
    loaded_max = max(loaded_max, loaded)
  return WeightBytes(totals['device'], totals['host'], totals['disk'], loaded_max, disk_max)


def peak_bytes(cfg: ModelConfig, policy: Policy, sizes: Itemsizes, *, prompt_len: int,
               gen_len: int) -> dict[str, int]:
  """Peak bytes per tier of a generation run, mirroring what the engine reserves.

  Device: resident weights; loaded weights of the stage in use and (with overlap) of the next;
  the device rows of every KV cache; the device rows of every GPU batch's hidden states; and the
  larger of the prefill working set (a GPU batch's fresh K/V before write-back) and the decode
  working set (offloaded cache rows brought to the device for attention, unless attention runs on
  the CPU), doubled by overlap where a load for the next batch runs during compute.
  Host and disk: their shares of weights, caches and hidden states, plus host staging of disk
  reads. XLA's own temporaries are not counted.
  """
  w = weight_bytes(cfg, policy, sizes)
  b, g, h, L = policy.gpu_batch_size, policy.num_gpu_batches, cfg.hidden_size, cfg.num_layers
  s, t = prompt_len, prompt_len + gen_len - 1
  buffers = 2 if policy.overlap else 1  # stages of weights on the device at once
  # loaded step inputs alive at once: the step computing, the next one loading and, under
  # overlap, the previous one until its outputs exist (its bytes are returned after that)
  inflight = 3 if policy.overlap else 1
  cache_rows, act_rows = policy.rows('cache'), policy.rows('act')
  row = cache_row_bytes(cfg, policy, sizes)
  kv_row = 2 * t * row  # K and V of one sequence, one layer
  # offloaded rows brought where attention runs: all of K, and all of V or only the kept rows
  kv_read = t * row + (sparse_keep(policy, t) if policy.attn_sparsity < 1 else t) * row
  act_row = s * h * sizes.compute
  offloaded_cache = cache_rows['host'] + cache_rows['disk']
  offloaded_act = act_rows['host'] + act_rows['disk']

  prefill_working = buffers * b * 2 * s * h * sizes.cache
  decode_working = 0 if policy.cpu_attention else inflight * offloaded_cache * kv_read
  device = (w.device + buffers * w.loaded_max_device
            + L * g * cache_rows['device'] * kv_row
            + g * act_rows['device'] * act_row
            + inflight * offloaded_act * act_row
            + max(prefill_working, decode_working))
  host_staging = (w.largest_disk_tensor
                  + inflight * cache_rows['disk'] * kv_read
                  + inflight * act_rows['disk'] * act_row)
  host = (w.host + L * g * cache_rows['host'] * kv_row + g * act_rows['host'] * act_row
          + host_staging)
  disk = w.disk + L * g * cache_rows['disk'] * kv_row + g * act_rows['disk'] * act_row
  return {'device': device, 'host': host, 'disk': disk}


def _count(shape: tuple[int, ...]) -> int:
  n = 1
  for d in shape:
    n *= d
  return n
