"""Memory tiers behind one interface: device (jax arrays), host (numpy), disk (files under a run
folder), each with a byte budget and current/peak accounting; and arrays split across tiers.
"""

from __future__ import annotations

import mmap
import os
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any

import jax
import numpy as np

from flexjax.errors import FlexjaxError

TIERS = ('device', 'host', 'disk')


class TierAccount:
  """Bytes in use on one tier; reserving past the budget is an error, never a silent spill."""

  def __init__(self, name: str, budget: int | None):
    self.name = name
    self.budget = budget
    self.current = 0
    self.peak = 0
    self._lock = threading.Lock()

  def reserve(self, nbytes: int) -> None:
    with self._lock:
      if self.budget is not None and self.current + nbytes > self.budget:
        raise FlexjaxError(
            f'{self.name} budget exceeded: {self.current + nbytes:,} bytes needed, budget '
            f'{self.budget:,}; raise the {self.name} budget or move data to another tier')
      self.current += nbytes
      self.peak = max(self.peak, self.current)

  def release(self, nbytes: int) -> None:
    with self._lock:
      self.current -= nbytes


class DiskArray:
  """A fixed-shape array in a file; reads return fresh host copies (optionally dropping the pages
  from the OS page cache afterwards, so later reads really hit the disk).

  The file is mapped only for the duration of one access: the kernel cannot drop pages that a
  process still maps, so a persistent mapping would keep every page ever read resident.
  """

  def __init__(self, path: Path, shape: tuple[int, ...], dtype: np.dtype, drop_page_cache: bool):
    self.path = path
    self.shape = shape
    self.dtype = np.dtype(dtype)
    self.nbytes = int(np.prod(shape)) * self.dtype.itemsize
    self._drop = drop_page_cache
    self._open = True
    with open(path, 'wb') as f:
      f.truncate(self.nbytes)

  def write(self, index: Any, value: np.ndarray) -> None:
    if not self.nbytes or not self._open:
      return
    with open(self.path, 'r+b') as f, mmap.mmap(f.fileno(), self.nbytes) as mapping:
      view = np.frombuffer(mapping, self.dtype).reshape(self.shape)
      view[index] = value
      del view  # the mapping closes (unmaps) only once no array refers to it
      if self._drop:
        mapping.flush()  # dirty pages must reach the disk before they can be dropped
    if self._drop:
      self._advise_dontneed()

  def read(self, index: Any = ...) -> np.ndarray:
    if not self.nbytes or not self._open:
      return np.zeros(self.shape, self.dtype)[index]
    with open(self.path, 'rb') as f, mmap.mmap(f.fileno(), self.nbytes,
                                              access=mmap.ACCESS_READ) as mapping:
      view = np.frombuffer(mapping, self.dtype).reshape(self.shape)
      out = np.array(view[index], copy=True)
      del view
    if self._drop:
      self._advise_dontneed()
    return out

  def _advise_dontneed(self) -> None:
    fd = os.open(self.path, os.O_RDONLY)
    try:
      os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
      os.close(fd)

  def close(self) -> None:
    self._open = False


class Storage:
  """Owns the tiers of one run: budgets, accounting, the device and the offload folder.

  The offload folder is created for the run and removed by close() (use as a context manager),
  on normal exit, on exceptions and on Ctrl-C alike.
  """

  def __init__(self, device: jax.Device, budgets: dict[str, int | None] | None = None, *,
               offload_dir: str | os.PathLike | None = None, drop_page_cache: bool = False):
    budgets = budgets or {}
    self.device = device
    self.accounts = {tier: TierAccount(tier, budgets.get(tier)) for tier in TIERS}
    self.drop_page_cache = drop_page_cache
    self._offload_parent = Path(offload_dir) if offload_dir else None
    self._run_dir: Path | None = None
    self._files = 0
    self._lock = threading.Lock()

  def __enter__(self) -> 'Storage':
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def close(self) -> None:
    if self._run_dir is not None:
      shutil.rmtree(self._run_dir, ignore_errors=True)
      self._run_dir = None

  @property
  def run_dir(self) -> Path:
    """The run's offload folder, created on first use."""
    with self._lock:
      if self._run_dir is None:
        parent = self._offload_parent or Path(tempfile.gettempdir())
        parent.mkdir(parents=True, exist_ok=True)
        self._run_dir = Path(tempfile.mkdtemp(prefix='flexjax-offload-', dir=parent))
      return self._run_dir

  def peaks(self) -> dict[str, int]:
    return {tier: account.peak for tier, account in self.accounts.items()}

  # ---- allocation -------------------------------------------------------------------------------
  def host_array(self, shape, dtype) -> np.ndarray:
    dtype = np.dtype(dtype)
    self.accounts['host'].reserve(int(np.prod(shape)) * dtype.itemsize)
    return np.zeros(shape, dtype)

  def disk_array(self, shape, dtype) -> DiskArray:
    dtype = np.dtype(dtype)
    self.accounts['disk'].reserve(int(np.prod(shape)) * dtype.itemsize)
    with self._lock:
      self._files += 1
      number = self._files
    return DiskArray(self.run_dir / f'{number:06d}.bin', tuple(shape), dtype,
                     self.drop_page_cache)

  def free(self, tier: str, nbytes: int) -> None:
    self.accounts[tier].release(nbytes)

  # ---- movement ---------------------------------------------------------------------------------
  def to_device(self, array: np.ndarray, *, private: bool) -> jax.Array:
    """Moves host data to the device.

    private=False when the host array may change later (caches): on the CPU backend
    jax.device_put can alias an aligned numpy buffer, so such data is copied first.
    """
    if not private and self.device.platform == 'cpu':
      array = np.array(array, copy=True)
    return jax.device_put(array, self.device)


def nbytes_of(shape, dtype) -> int:
  return int(np.prod(shape)) * np.dtype(dtype).itemsize


class SplitArray:
  """A [batch, time, ...] array whose rows are split across tiers.

  Rows [0, d) live on the device, [d, d+h) on the host, the rest on disk. Writes and reads name a
  time range (axis 1). The device part is written on the caller's thread (jax dispatch is async);
  the host and disk parts by write_offloaded(), which the engine runs on its write-back thread.
  A read first waits for the last offloaded write (`pending`).
  """

  def __init__(self, storage: Storage, shape: tuple[int, ...], dtype, rows: dict[str, int], *,
               preallocate_device: bool):
    self.storage = storage
    self.shape = tuple(shape)
    self.dtype = np.dtype(dtype)
    self.rows = rows
    d, h = rows['device'], rows['host']
    self.slices = {'device': slice(0, d), 'host': slice(d, d + h), 'disk': slice(d + h, shape[0])}
    tail = self.shape[1:]
    self.device_bytes = nbytes_of((d, *tail), self.dtype)
    storage.accounts['device'].reserve(self.device_bytes)
    self.device: jax.Array | None = (
        jax.device_put(np.zeros((d, *tail), self.dtype), storage.device)
        if d and preallocate_device else None)
    self.host = storage.host_array((h, *tail), self.dtype) if h else None
    self.disk = storage.disk_array((rows['disk'], *tail), self.dtype) if rows['disk'] else None
    self.pending = None  # concurrent.futures.Future of the last offloaded write

  @property
  def offloaded_rows(self) -> int:
    return self.rows['host'] + self.rows['disk']

  def wait(self) -> None:
    if self.pending is not None:
      self.pending.result()

  def write_offloaded(self, value: jax.Array, start: int) -> None:
    """Writes rows d: of value [batch, n, ...] into time [start, start+n) of host and disk."""
    if not self.offloaded_rows:
      return
    d = self.rows['device']
    host_value = np.asarray(value[d:])  # device -> host
    n = host_value.shape[1]
    h = self.rows['host']
    if self.host is not None:
      self.host[:, start:start + n] = host_value[:h]
    if self.disk is not None:
      self.disk.write((slice(None), slice(start, start + n)), host_value[h:])

  def read_offloaded(self, length: int) -> np.ndarray | None:
    """Host copy of the offloaded rows' time range [0, length) (host rows are not copied when
    there are no disk rows: callers must finish with it before the next write)."""
    self.wait()
    parts = []
    if self.host is not None:
      parts.append(self.host[:, :length])
    if self.disk is not None:
      parts.append(self.disk.read((slice(None), slice(0, length))))
    if not parts:
      return None
    return parts[0] if len(parts) == 1 else np.concatenate(parts)

  def read_offloaded_rows(self, positions: np.ndarray) -> np.ndarray:
    """The offloaded rows' entries at time positions [offloaded rows, keep] -> [rows, keep, ...]
    (a gather: only those entries are read from the disk)."""
    self.wait()
    h = self.rows['host']
    parts = []
    if self.host is not None:
      parts.append(np.take_along_axis(self.host, positions[:h, :, None], axis=1))
    if self.disk is not None:
      rows = np.arange(self.rows['disk'])[:, None]
      parts.append(self.disk.read((rows, positions[h:])))
    return parts[0] if len(parts) == 1 else np.concatenate(parts)

  def close(self) -> None:
    self.storage.free('device', self.device_bytes)
    self.device = None
    if self.host is not None:
      self.storage.free('host', self.host.nbytes)
      self.host = None
    if self.disk is not None:
      self.storage.free('disk', self.disk.nbytes)
      self.disk.close()
      self.disk = None
