"""Offloading policy: batch geometry, placement percentages per tier, overlap, CPU attention."""

from __future__ import annotations

import dataclasses

from flexjax.errors import FlexjaxError
from flexjax.quant import QuantConfig


PLACEMENTS = ('exact', 'flexgen')


@dataclasses.dataclass(frozen=True)
class Policy:
  """Where tensors live and how the block schedule runs (FlexGen's search space, section 4.2).

  Weights are placed per layer: a layer's tensors, in a fixed order, go to the device until
  w_gpu_percent of the layer's bytes are used, then to the host up to w_cpu_percent, the rest to
  disk; the tensor straddling a boundary is split by rows, so each share is met to a row
  (placement='exact'). placement='flexgen' follows FlexGen's rule instead: whole tensors, by
  where the middle of each falls in the cumulative element count of its FlexGen layer (input
  embedding, attention, MLP, output embedding), disk first, then CPU, then GPU. The KV cache and the hidden states are split along the batch: the first cache_gpu_percent
  of a GPU batch's rows live on the device, the next cache_cpu_percent on the host, the rest on
  disk (likewise act_*). The disk share is what remains of 100.

  A block is num_gpu_batches GPU batches of gpu_batch_size sequences; each layer's weights are
  brought to the device once per block. num_gpu_batches=1 is the row-by-row order of
  DeepSpeed/Accelerate.

  Approximations (section 5): compress_weight / compress_cache store weight matrices / the KV
  cache as compress_bits-bit integers in groups of compress_group_size (in every tier, moved
  compressed, dequantized right before use); attn_sparsity < 1 makes decode attention keep only
  that fraction of cached positions and read only their V rows.
  """

  gpu_batch_size: int = 8
  num_gpu_batches: int = 1
  w_gpu_percent: float = 100
  w_cpu_percent: float = 0
  cache_gpu_percent: float = 100
  cache_cpu_percent: float = 0
  act_gpu_percent: float = 100
  act_cpu_percent: float = 0
  overlap: bool = True
  cpu_attention: bool = False
  compress_weight: bool = False
  compress_cache: bool = False
  compress_bits: int = 4
  compress_group_size: int = 64
  attn_sparsity: float = 1.0
  placement: str = 'exact'  # 'exact' | 'flexgen'

  def __post_init__(self):
    if self.placement not in PLACEMENTS:
      raise FlexjaxError(f'placement={self.placement!r} is not known; use one of '
                         f'{", ".join(PLACEMENTS)}')
    QuantConfig(self.compress_bits, self.compress_group_size)  # validates
    if not 0 < self.attn_sparsity <= 1:
      raise FlexjaxError(f'attn_sparsity={self.attn_sparsity} must be in (0, 1]; 1 is dense '
                         'attention, 0.1 keeps the top 10% of positions')
    for name in ('gpu_batch_size', 'num_gpu_batches'):
      value = getattr(self, name)
      if not isinstance(value, int) or value <= 0:
        raise FlexjaxError(f'{name}={value!r} must be a positive integer')
    for kind in ('w', 'cache', 'act'):
      gpu, cpu = getattr(self, f'{kind}_gpu_percent'), getattr(self, f'{kind}_cpu_percent')
      for name, value in ((f'{kind}_gpu_percent', gpu), (f'{kind}_cpu_percent', cpu)):
        if not -1e-6 <= value <= 100 + 1e-6:  # percents of rows come from divisions
          raise FlexjaxError(f'{name}={value} must be between 0 and 100')
      if gpu + cpu > 100 + 1e-6:
        raise FlexjaxError(f'{kind}_gpu_percent={gpu} + {kind}_cpu_percent={cpu} exceed 100; the '
                           'disk gets the remainder, so their sum must be <= 100')

  @property
  def quant(self) -> QuantConfig:
    return QuantConfig(self.compress_bits, self.compress_group_size)

  @property
  def block_size(self) -> int:
    return self.gpu_batch_size * self.num_gpu_batches

  @property
  def w_disk_percent(self) -> float:
    return max(0.0, 100 - self.w_gpu_percent - self.w_cpu_percent)

  @property
  def cache_disk_percent(self) -> float:
    return max(0.0, 100 - self.cache_gpu_percent - self.cache_cpu_percent)

  @property
  def act_disk_percent(self) -> float:
    return max(0.0, 100 - self.act_gpu_percent - self.act_cpu_percent)

  def rows(self, kind: str) -> dict[str, int]:
    """Rows of a GPU batch per tier for 'cache' or 'act' (device, host, disk; sums to the batch)."""
    b = self.gpu_batch_size
    device = min(b, max(0, round(b * getattr(self, f'{kind}_gpu_percent') / 100)))
    host = min(b - device, max(0, round(b * (getattr(self, f'{kind}_gpu_percent')
                                             + getattr(self, f'{kind}_cpu_percent')) / 100)
                               - device))
    return {'device': device, 'host': host, 'disk': b - device - host}

  def describe(self) -> str:
    return (f'{self.gpu_batch_size}x{self.num_gpu_batches} '
            f'w={self.w_gpu_percent:g}/{self.w_cpu_percent:g}/{self.w_disk_percent:g} '
            f'cache={self.cache_gpu_percent:g}/{self.cache_cpu_percent:g}/'
            f'{self.cache_disk_percent:g} '
            f'act={self.act_gpu_percent:g}/{self.act_cpu_percent:g}/{self.act_disk_percent:g} '
            f'overlap={self.overlap} cpu_attention={self.cpu_attention}'
            + (f' compress_weight={self.compress_bits}b/g{self.compress_group_size}'
               if self.compress_weight else '')
            + (f' compress_cache={self.compress_bits}b/g{self.compress_group_size}'
               if self.compress_cache else '')
            + (f' attn_sparsity={self.attn_sparsity:g}' if self.attn_sparsity < 1 else '')
            + (f' placement={self.placement}' if self.placement != 'exact' else ''))


def split_by_share(sizes: list[int], rows: list[int], w_gpu_percent: float,
                   w_cpu_percent: float) -> list[list[tuple[str, int, int]]]:
  """Per tensor of a layer (in order), its (tier, first row, end row) parts: the first
  w_gpu_percent of the layer's bytes on the device, the next w_cpu_percent on the host, the rest
  on disk; a tensor straddling a boundary is cut at the row nearest to it.

  E.g. sizes [4, 4] of 4 rows each with 25% on the device: [[('device', 0, 2), ('host', 2, 4)],
  [('host', 0, 4)]] when w_cpu_percent=75.
  """
  total = sum(sizes)
  bounds = [total * w_gpu_percent / 100, total * (w_gpu_percent + w_cpu_percent) / 100, total]
  out, start = [], 0
  for size, count in zip(sizes, rows):
    cuts = [0] + [min(count, max(0, round((b - start) * count / size))) if size else count
                  for b in bounds[:2]] + [count]
    parts = [(tier, lo, hi) for tier, lo, hi in zip(('device', 'host', 'disk'), cuts, cuts[1:])
             if hi > lo]
    out.append(parts or [('device', 0, count)])
    start += size
  return out


def share_order(sizes: list[int], w_gpu_percent: float, w_cpu_percent: float) -> list[int]:
  """An order of a layer's tensors (indices into `sizes`) for split_by_share in which the tier
  boundaries fall inside small tensors: for the device and then the host, the tensors left that
  fit wholly below its boundary, largest first, then the smallest tensor left (the one the
  boundary cuts); the rest (disk) after. The tensor a boundary cuts is joined from its parts at
  every load, so a small one costs little: opt-1.3b at 53% on the host cuts a 2048 x 2048
  matrix (8 MiB in float16) where the alphabetical order cut fc2 (32 MiB).

  E.g. sizes [8, 2, 3] with 50% on the host: [2, 1, 0]: 3 and 2 whole on the host, then 8 cut
  (1.5 of it on the host, the rest on disk).
  """
  total = sum(sizes)
  left = sorted(range(len(sizes)), key=lambda i: (-sizes[i], i))
  order, filled = [], 0
  for bound in (total * w_gpu_percent / 100, total * (w_gpu_percent + w_cpu_percent) / 100):
    for i in list(left):
      if filled + sizes[i] <= bound:
        order.append(i)
        left.remove(i)
        filled += sizes[i]
    if filled < bound and left:
      cut = min(left, key=lambda i: (sizes[i], i))
      order.append(cut)
      left.remove(cut)
      filled += sizes[cut]
  return order + left


def flexgen_tiers(sizes: list[int], w_gpu_percent: float, w_cpu_percent: float) -> list[str]:
  """FlexGen's rule for one of its layers: each tensor whole, on the tier where the middle of its
  elements falls in the cumulative count, tiers in the order disk, CPU, GPU.

  E.g. sizes [4, 1, 1, 4] with 50% on disk and 50% on the GPU: the first two (midpoints at 20%
  and 45%) on disk, the last two on the GPU.
  """
  total = sum(sizes)
  disk = 100 - w_gpu_percent - w_cpu_percent
  tiers, start = [], 0
  for size in sizes:
    middle = 100 * (start + size / 2) / total if total else 0
    tiers.append('disk' if middle < disk else 'host' if middle < disk + w_cpu_percent
                 else 'device')
    start += size
  return tiers
