"""Placement: puts each tensor on the tier the plan's weight layout names (device, host RAM or
disk). Disk-tier tensors stay where the streaming layout (stream.py) holds them: placing them
copies nothing."""

from __future__ import annotations

import jax
import numpy as np

from flexjax import plan as plan_lib
from flexjax import quant as quant_lib
from flexjax import stream as stream_lib
from flexjax.model import params as params_lib
from flexjax.policy import Policy
from flexjax.steps import Steps
from flexjax.storage import Storage
from flexjax.weights import WeightSource

# A stage's placed tensors: (slot, value) per plan.TensorSlot (a tensor, or its rows on one tier),
# where value is a device array, a host array (numpy, or a jax array in pinned host memory), a
# stream.StreamTensor (disk), or a quant.Packed around one of them.
Placed = list[tuple[plan_lib.TensorSlot, object]]


def layout_variant(source: WeightSource, policy: Policy) -> str:
  """The streaming layout a policy reads: the stored dtype, int4-packed matrices when
  compress_weight."""
  if policy.compress_weight:
    return f'{source.dtype}-q{policy.quant.bits}g{policy.quant.group_size}'
  return source.dtype


def open_layout(source: WeightSource, policy: Policy, quantize, *, cache_dir,
                drop_page_cache: bool = False, progress: bool = False) -> stream_lib.StreamLayout:
  """The source's streaming layout for this policy, written first if missing. quantize: a
  matrix -> its packed byte rows in policy.quant's format (a matrix the source already gives as
  uint8 rows is written as it is)."""
  quant = policy.quant
  return stream_lib.ensure_layout(
      source, packs=lambda shape: plan_lib.compressed(policy, shape), pack=quantize,
      packed_shape=lambda shape: (*shape[:-1], quant.row_bytes(shape[-1])),
      variant=layout_variant(source, policy), cache_dir=cache_dir,
      drop_page_cache=drop_page_cache, progress=progress)


def cpu_quantizer(quantize, cpu: jax.Device):
  """A host matrix -> its packed byte rows, by a jitted quantize (steps.Steps.quantize, say) on
  the CPU backend."""
  return lambda array: np.asarray(quantize(jax.device_put(array, cpu)))


def place_weights(source: WeightSource, policy: Policy, sizes: plan_lib.Itemsizes,
                  storage: Storage, steps: Steps,
                  layout: stream_lib.StreamLayout | None = None, *,
                  host_in_place: bool = False) -> list[Placed]:
  """Every compute stage's tensors on their tiers, in model order. With a layout, every tensor
  is read from it (disk-tier ones are only referenced); without one, from the source (then the
  policy may put nothing on disk). host_in_place: the steps take host-tier tensors as they lie
  (plan.used_in_place)."""
  cfg = source.config
  tokens = {} if layout else params_lib.flatten(source.read('tokens'))  # read once, used twice
  placed = []
  for stage in plan_lib.stage_names(cfg):
    if layout is None:
      host = params_lib.flatten(source.read(stage))
      host.update(tokens if stage in ('embed', 'head') else {})
      fetch = host.pop
    else:
      fetch = lambda path, stage=stage: layout.tensor(stage, path)
    placed.append(_place_stage(cfg, stage, fetch, policy, sizes, storage, steps,
                               host_in_place))
  return placed


def _place_stage(cfg, stage: str, fetch, policy: Policy, sizes, storage: Storage,
                 steps: Steps, host_in_place: bool) -> Placed:
  placed, source, whole = [], None, None
  for slot in plan_lib.stage_layout(cfg, policy, sizes, stage):
    if source is None or slot.path != source[0]:  # a tensor's parts come one after another
      source, whole = (slot.path, fetch(slot.path)), None
    found = source[1]
    lo, hi = slot.rows
    if slot.tier == 'disk':
      if not isinstance(found, stream_lib.StreamTensor):
        raise ValueError('disk-tier weights need a streaming layout')
      storage.reserve('disk', slot.stored, 'weights.disk')
      value = found.rows(lo, hi)
    else:
      if whole is None:
        whole = found.read() if isinstance(found, stream_lib.StreamTensor) else np.asarray(found)
        if slot.packed and whole.dtype != np.uint8:  # quantized once, on the CPU backend
          whole = cpu_quantizer(steps.quantize, steps.cpu)(whole)
      array = whole[lo:hi]
      if slot.tier == 'device':
        storage.reserve('device', slot.resident, 'weights.resident')
        if hi - lo < len(whole):  # a CPU backend may alias the array: keep only these rows
          array = np.array(array, copy=True)
        value = jax.device_put(array, storage.device).block_until_ready()  # as stored
      else:
        value = storage.host_weights(array, 'weights.host')
        if plan_lib.used_in_place(slot, host_in_place):
          value = storage.in_place(value)
    placed.append((slot, quant_lib.Packed(value, slot.shape[-1], policy.quant)
                   if slot.packed else value))
  return placed
