"""Host <-> device copies of one offloaded block, by method: where the write-back time goes.

  python -m tools.transfer_probe --mib=64
  python -m tools.transfer_probe --mib=256 --json

A prompt step that offloads its K, V and hidden rows copies them device -> host and reads the
hidden rows back the other way. This times each way the engine could make those copies, for a
block of --mib MiB of float16 rows, and checks that every method delivers the source's bytes:

  to host (the write-back, into an already touched host array as the host cache is):
    asarray         np.asarray(device array) into a fresh numpy buffer, then copied in (each
                    copy from a device array of its own: jax keeps an array's host value)
    pinned+asarray  jax.device_put to pinned_host memory (DMA), np.asarray of that (on an
                    accelerator a view of the pinned buffer), copied in by one thread
    pinned+threads  the same, copied in by the engine's copy threads (Storage.copy, on an
                    accelerator): the engine's path
  to device (the read-back of offloaded rows):
    fresh           the rows copied into a fresh aligned buffer, then jax.device_put
    reused          jax.device_put of an aligned buffer touched before (no page faults)
    via pinned      jax.device_put to pinned_host memory, then to the device

On a CPU backend device and host are one RAM (the numbers then say what page faults and copies
cost); the methods that need pinned host memory are left out where the device offers none.
"""

from __future__ import annotations

import json
from typing import Any, Callable

import numpy as np

from tools.benchlib import report_error, run_tool


def _methods(device, rows: np.ndarray, storage,
             calls: int) -> dict[str, dict[str, Callable[[], np.ndarray]]]:
  """{'to_host' | 'to_device': {name: fn}}; each fn makes one copy and returns what arrived
  (as host numpy) once it has; `calls` of each at most (the device arrays that asarray copies
  are made beforehand)."""
  import jax
  from jax.sharding import SingleDeviceSharding

  from flexjax.hardware import host_memory_kind
  from flexjax.storage import aligned_empty

  on_device = jax.device_put(rows, device).block_until_ready()
  cache = aligned_empty(rows.shape, rows.dtype)  # the host tier: touched before any write
  cache[...] = 0
  reused = aligned_empty(rows.shape, rows.dtype)
  reused[...] = rows
  pinned_kind = host_memory_kind(device, 'pinned') if _offers_pinned(device) else None

  def write(arrived: np.ndarray, threaded: bool = False) -> np.ndarray:
    if threaded:
      storage.copy(cache, arrived)
    else:
      cache[...] = arrived
    return cache

  own_arrays = iter([(on_device + 0).block_until_ready() for _ in range(calls)])
  to_host = {'asarray': lambda: write(np.asarray(next(own_arrays)))}
  to_device = {
      'fresh': lambda: _fetch(jax.device_put(_fresh_copy(rows), device)),
      'reused': lambda: _fetch(jax.device_put(reused, device)),
  }
  if pinned_kind:
    pinned = SingleDeviceSharding(device, memory_kind=pinned_kind)
    own = SingleDeviceSharding(device, memory_kind=device.default_memory().kind)
    staged = lambda: jax.device_put(on_device, pinned).block_until_ready()
    to_host['pinned+asarray'] = lambda: write(np.asarray(staged()))
    to_host['pinned+threads'] = lambda: write(np.asarray(staged()), threaded=True)
    to_device['via pinned'] = lambda: _fetch(
        jax.device_put(jax.device_put(reused, pinned), own))
  return {'to_host': to_host, 'to_device': to_device}


def _offers_pinned(device) -> bool:
  return 'pinned_host' in {memory.kind for memory in device.addressable_memories()}


def _fresh_copy(rows: np.ndarray) -> np.ndarray:
  from flexjax.storage import aligned_empty
  out = aligned_empty(rows.shape, rows.dtype)
  out[...] = rows
  return out


def _fetch(value) -> np.ndarray:
  """Waits for a device array; its bytes are compared only after the timing (_check)."""
  value.block_until_ready()
  return value


def measure(mib: int, repeats: int = 3) -> dict[str, Any]:
  """{'device', 'bytes', 'to_host': {method: GB/s}, 'to_device': {method: GB/s}} for one block
  of float16 rows [16, time, 4096] of about `mib` MiB. Raises if a method delivers other bytes."""
  import jax

  from flexjax.hardware import best_seconds
  from flexjax.storage import Storage

  device = jax.local_devices()[0]
  time_len = max(1, mib * 2**20 // (16 * 4096 * 2))
  rows = np.random.default_rng(0).standard_normal((16, time_len, 4096)).astype(np.float16)
  out: dict[str, Any] = {'device': f'{device.platform}:{device.device_kind}', 'bytes': rows.nbytes}
  with Storage(device) as storage:
    out['copy_threads'] = storage.copy_threads
    for way, methods in _methods(device, rows, storage, repeats + 1).items():
      out[way] = {}
      for name, fn in methods.items():
        arrived = np.asarray(fn())
        if not np.array_equal(arrived, rows):
          raise RuntimeError(f'{way} by {name} delivered other bytes than it was given')
        out[way][name] = rows.nbytes / best_seconds(fn, repeats) / 1e9
  return out


def render(result: dict[str, Any]) -> str:
  lines = [f'{result["device"]}, {result["bytes"] / 2**20:.0f} MiB of float16 rows '
           f'({result["copy_threads"]} copy threads):']
  for way in ('to_host', 'to_device'):
    for name, rate in result[way].items():
      lines.append(f'  {way.replace("_", " "):>9} by {name:<15} {rate:7.2f} GB/s')
  return '\n'.join(lines)


def run_cli(fv) -> int:
  try:
    result = measure(fv.mib, fv.repeats)
  except RuntimeError as e:
    return report_error('transfer_probe', e)
  print(json.dumps(result) if fv.json else render(result))
  return 0


def define_flags(fv) -> None:
  from absl import flags
  f = {'flag_values': fv}
  flags.DEFINE_integer('mib', 64, 'Size of the block of rows copied, in MiB (at least 1).',
                       lower_bound=1, **f)
  flags.DEFINE_integer('repeats', 3, 'Timed copies per method (the fastest is kept).',
                       lower_bound=1, **f)
  flags.DEFINE_bool('json', False, 'Print one JSON object instead of the table.', **f)


if __name__ == '__main__':
  run_tool(define_flags, run_cli)
