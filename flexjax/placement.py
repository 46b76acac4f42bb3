"""Placement: reads every stage's weights from their source once and puts each tensor on the
tier the plan's weight layout names (device, host RAM or a disk file)."""

from __future__ import annotations

import jax
import numpy as np

from flexjax import plan as plan_lib
from flexjax import quant as quant_lib
from flexjax.model import params as params_lib
from flexjax.policy import Policy
from flexjax.steps import Steps
from flexjax.storage import Storage
from flexjax.weights import WeightSource

# A placed tensor: (tier, value) where value is a device array, a host array, a DiskArray, or a
# quant.Packed around one of them.
Placed = dict[plan_lib.Path, tuple]


def place_weights(source: WeightSource, policy: Policy, sizes: plan_lib.Itemsizes,
                  storage: Storage, steps: Steps) -> list[Placed]:
  """Every compute stage's tensors on their tiers, in model order."""
  cfg = source.config
  tokens = params_lib.flatten(source.read('tokens'))  # read once, used by two stages
  return [_place_stage(source, stage, tokens, policy, sizes, storage, steps)
          for stage in plan_lib.stage_names(cfg)]


def _place_stage(source, stage: str, tokens: dict, policy: Policy, sizes, storage: Storage,
                 steps: Steps) -> Placed:
  host = params_lib.flatten(source.read(stage))
  if stage in ('embed', 'head'):
    host.update(tokens)
  placed = {}
  for slot in plan_lib.stage_layout(source.config, policy, sizes, stage):
    array = np.asarray(host.pop(slot.path))
    if slot.packed:  # quantized once, on the CPU backend; kept and moved as byte rows
      array = np.asarray(steps.quantize(jax.device_put(array, steps.cpu)))
    if slot.tier == 'device':
      storage.reserve('device', slot.resident, 'weights.resident')
      value = jax.device_put(array, storage.device)
      if not slot.packed:
        value = steps.cast(value)
      value.block_until_ready()  # the host copy is dropped next
    elif slot.tier == 'host':
      value = storage.host_array(array.shape, array.dtype, 'weights.host')
      value[...] = array
    else:
      value = storage.disk_array(array.shape, array.dtype, 'weights.disk')
      value.write(..., array)
    placed[slot.path] = (slot.tier, quant_lib.Packed(value, slot.shape[-1], policy.quant)
                         if slot.packed else value)
  return placed
