"""Memory tiers behind one interface: device (jax arrays), host (numpy), disk (files under a run
folder), each with a byte budget and current/peak accounting; and arrays split across tiers.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
from pathlib import Path
from typing import Any

import jax
import numpy as np

from flexjax import diskio, scratch
from flexjax.errors import FlexjaxError

TIERS = ('device', 'host', 'disk')
# Host copies of at least this many bytes are split among Storage.copy_threads threads.
COPY_SPLIT_BYTES = 8 << 20


def copy_threads_for(platform: str) -> int:
  """Threads that copy the offloaded rows between host buffers: one on a CPU backend (its
  cores run the steps), else half the host's cores up to eight. One thread copies host memory
  at a fraction of what the memory system moves: on an H200 machine, 256 MiB of offloaded rows
  written back through pinned memory (a DMA at ~50 GB/s) into the host cache took 7.2 GB/s in
  all with one thread copying, 15.8 with eight (tools/transfer_probe.py)."""
  if platform == 'cpu':
    return 1
  return max(1, min(8, (os.cpu_count() or 1) // 2))


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


DISK_IO_THREADS = 3  # threads reading the row ranges of the KV cache and hidden states on disk
# Threads writing them: a decode step writes one entry per row, each its own small request,
# which waits behind the weight stream's large reads in the disk's queue; in parallel they wait
# about once (18 rows of 16 KiB beside a full-speed read: 65 ms one after another, 11 at once).
DISK_WRITE_THREADS = 8


def aligned_empty(shape, dtype, alignment: int = 4096) -> np.ndarray:
  """An uninitialised array whose data starts on an `alignment`-byte boundary (the CPU backend
  then takes it without a copy, and direct I/O can read into it)."""
  dtype = np.dtype(dtype)
  nbytes = int(np.prod(shape)) * dtype.itemsize
  raw = np.empty(nbytes + alignment, np.uint8)
  offset = -raw.ctypes.data % alignment
  return raw[offset:offset + nbytes].view(dtype).reshape(shape)


class DiskArray:
  """A fixed-shape array [rows, time, ...] in a file, its entries read and written at their
  byte ranges on one handle opened for the run.

  Where an entry's bytes are a multiple of the direct-I/O block (diskio.BLOCK), the handle is
  O_DIRECT: no page cache, and a read's row ranges go to `pool`'s threads in requests of up to
  diskio.CHUNK bytes, at the disk's rate, a write's to `writers`' threads (all at once, so
  small ones wait in the disk's queue about once). Elsewhere (or where the filesystem refuses direct
  I/O) it is buffered, and with drop_page_cache each access is followed by
  posix_fadvise(DONTNEED) (a write synced first) so that later reads really hit the disk. Reads
  return fresh aligned host arrays. The file's space is reserved up front (posix_fallocate),
  so a full disk is an error here, not a signal mid-run.
  """

  def __init__(self, path: Path, shape: tuple[int, ...], dtype: np.dtype, drop_page_cache: bool,
               pool: concurrent.futures.Executor | None = None,
               writers: concurrent.futures.Executor | None = None):
    self.path = path
    self.shape = tuple(shape)
    self.dtype = np.dtype(dtype)
    self.nbytes = int(np.prod(shape)) * self.dtype.itemsize
    self._drop = drop_page_cache
    self._pool = pool
    self._writers = writers
    self._entry = int(np.prod(self.shape[2:])) * self.dtype.itemsize
    os.close(diskio.reserve_file(path, self.nbytes, what='the run\'s offloaded arrays',
                                 fix='free disk space there or point --offload_dir elsewhere'))
    self._file: diskio.DiskFile | None = diskio.DiskFile(
        path, writable=True, direct=self._entry % diskio.BLOCK == 0)

  @property
  def direct(self) -> bool:
    """Whether its reads and writes bypass the page cache (O_DIRECT)."""
    return self._file is not None and self._file.direct

  def _segments(self, index: Any) -> tuple[tuple[int, ...], list[tuple[int, int]]]:
    """Shape and (byte offset, byte length) runs of `index`: `...`, or (slice rows, slice time)."""
    if index is Ellipsis:
      return self.shape, [(0, self.nbytes)]
    rows, time = (*index, slice(None))[:2]
    rows = range(*rows.indices(self.shape[0]))
    start, stop, _ = time.indices(self.shape[1])
    per_row = self.shape[1] * self._entry
    runs = [(r * per_row + start * self._entry, (stop - start) * self._entry) for r in rows]
    return (len(rows), stop - start, *self.shape[2:]), runs

  def _views(self, array: np.ndarray, runs: list[tuple[int, int]]) -> list[memoryview] | None:
    """Byte views of `array` that receive `runs` in turn: consecutive ranges of a C-contiguous
    array, or one row each of an array whose rows are contiguous (the leading time range of
    longer rows). None where neither holds, or where direct I/O needs an aligned address that
    a view lacks."""
    if array.flags.c_contiguous:
      bases = [array.ctypes.data]
      flat = memoryview(array.reshape(-1).view(np.uint8))
      starts = np.cumsum([0] + [length for _, length in runs]).tolist()
      views = [flat[a:a + length] for a, (_, length) in zip(starts, runs)]
    elif len(array) == len(runs) and all(row.flags.c_contiguous for row in array):
      bases = [row.ctypes.data for row in array]
      views = [memoryview(row.reshape(-1).view(np.uint8)) for row in array]
    else:
      return None
    if self.direct and any(base % diskio.BLOCK for base in bases):
      return None
    return views

  def _io_target(self, array: np.ndarray, runs: list[tuple[int, int]],
                 fill: bool) -> tuple[np.ndarray, list[memoryview]]:
    """`array` and its views for `runs` (see _views) where it can take part in the I/O as it
    is, else an aligned C-contiguous array of its shape (holding a copy of it when `fill`,
    for a write) and that array's views; a read copies such a stand-in back."""
    views = self._views(array, runs)
    if views is not None:
      return array, views
    stand_in = aligned_empty(array.shape, array.dtype)
    if fill:
      stand_in[...] = array
    return stand_in, self._views(stand_in, runs)

  def write(self, index: Any, value: np.ndarray) -> None:
    if not self.nbytes or self._file is None:
      return
    shape, runs = self._segments(index)
    data = np.broadcast_to(np.asarray(value, self.dtype), shape)
    _, views = self._io_target(data, runs, fill=True)
    self._transfer(self._file.write_from, self._writers, runs, views)
    if self._drop and not self.direct:
      os.fdatasync(self._file.fd)  # dirty pages must reach the disk before they can be dropped
      os.posix_fadvise(self._file.fd, 0, 0, os.POSIX_FADV_DONTNEED)

  def read(self, index: Any = ..., out: np.ndarray | None = None) -> np.ndarray:
    """A fresh array of the entries at `index` (or those entries read into `out`, an array of
    their shape, C-contiguous or with contiguous rows)."""
    if isinstance(index, tuple) and len(index) == 1 and isinstance(index[0], (int, np.integer)):
      row = int(index[0])
      return self.read((slice(row, row + 1), slice(None)))[0]
    if isinstance(index, tuple) and not isinstance(index[0], slice):
      return self._gather(*index)
    shape, runs = self._segments(index)
    target = aligned_empty(shape, self.dtype) if out is None else out
    if not self.nbytes or self._file is None:
      target[...] = 0
      return target
    into, views = self._io_target(target, runs, fill=False)
    self._transfer(self._file.read_into, self._pool, runs, views)
    if into is not target:
      target[...] = into
    self._after_read()
    return target

  @staticmethod
  def _transfer(call, pool: concurrent.futures.Executor | None, runs: list[tuple[int, int]],
                views: list[memoryview]) -> None:
    """call(view, offset) for each run (byte offset, length) into or from the first `length`
    bytes of its view, in requests of at most diskio.CHUNK bytes, on `pool`'s threads at once
    (diskio.transfer)."""
    diskio.transfer(call, diskio.requests(
        [(offset, view[:length]) for (offset, length), view in zip(runs, views)]), pool)

  def _gather(self, rows: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """Entries at (rows [n, 1], positions [n, k]) -> [n, k, ...] (one read per entry)."""
    rows, positions = np.broadcast_arrays(np.asarray(rows), np.asarray(positions))
    out = aligned_empty((*rows.shape, *self.shape[2:]), self.dtype)
    flat = memoryview(out.reshape(-1).view(np.uint8))
    for i, (r, p) in enumerate(zip(rows.reshape(-1), positions.reshape(-1))):
      offset = (int(r) * self.shape[1] + int(p)) * self._entry
      self._file.read_into(flat[i * self._entry:(i + 1) * self._entry], offset)
    self._after_read()
    return out

  def _after_read(self) -> None:
    if self._drop and not self.direct:
      os.posix_fadvise(self._file.fd, 0, 0, os.POSIX_FADV_DONTNEED)

  def close(self) -> None:
    if self._file is not None:
      self._file.close()
      self._file = None


class Storage:
  """Owns the tiers of one run: budgets, the plan's buffers, the device and the offload folder.

  Every allocation names the plan buffer it draws from (`pool`, e.g. 'cache.host'); with
  `capacities` (an ExecutionPlan's), a pool the plan does not name, or more bytes than it
  planned, is an error: the runtime allocates nothing beside the plan. Tier accounts keep the
  budgets. The offload folder is created for the run and removed by close() (use as a context
  manager), on normal exit, on exceptions and on Ctrl-C alike.
  """

  def __init__(self, device: jax.Device, budgets: dict[str, int | None] | None = None, *,
               capacities: dict[str, int] | None = None,
               offload_dir: str | os.PathLike | None = None, drop_page_cache: bool = False,
               host_memory: str | None = None, copy_threads: int | None = None):
    budgets = budgets or {}
    self.device = device
    self.copy_threads = copy_threads or copy_threads_for(device.platform)
    self.host_memory = host_memory  # jax memory kind of host-tier weights; None: numpy buffers
    self.device_memory = jax.sharding.SingleDeviceSharding(
        device, memory_kind=device.default_memory().kind)
    self.accounts = {tier: TierAccount(tier, budgets.get(tier)) for tier in TIERS}
    self._capacities = capacities
    self.pools: dict[str, TierAccount] = {}
    self.drop_page_cache = drop_page_cache
    self._offload_parent = scratch.offload_parent(offload_dir)
    self._run_dir: scratch.Claim | None = None
    self._files = 0
    self._lock = threading.Lock()
    self._disk_io: concurrent.futures.ThreadPoolExecutor | None = None  # disk arrays' reads
    self._disk_writes: concurrent.futures.ThreadPoolExecutor | None = None  # and their writes
    self._copies: concurrent.futures.ThreadPoolExecutor | None = None  # host copies (copy)

  def __enter__(self) -> 'Storage':
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def close(self) -> None:
    for pool in (self._disk_io, self._disk_writes, self._copies):
      if pool is not None:
        pool.shutdown(wait=True)
    self._disk_io = self._disk_writes = self._copies = None
    if self._run_dir is not None:
      self._run_dir.release()
      self._run_dir = None

  @property
  def run_dir(self) -> Path:
    """The run's offload folder, created on first use and owned by this process (what a
    killed run left in the same parent is removed first: flexjax.scratch)."""
    with self._lock:
      if self._run_dir is None:
        self._run_dir = scratch.claim(self._offload_parent, 'flexjax-offload-')
      return self._run_dir.path

  def peaks(self) -> dict[str, int]:
    return {tier: account.peak for tier, account in self.accounts.items()}

  def use_capacities(self, capacities: dict[str, int]) -> None:
    """Switches to another plan's buffers (a new generate() call); what is held stays."""
    with self._lock:
      self._capacities = capacities
      for name, pool in self.pools.items():
        pool.budget = capacities.get(name, 0)

  # ---- allocation -------------------------------------------------------------------------------
  def reserve(self, tier: str, nbytes: int, pool: str | None = None) -> None:
    """Takes `nbytes` of a tier from the plan buffer `pool` (default: the tier's own)."""
    pool = pool or tier
    if not nbytes:
      return
    with self._lock:
      if pool not in self.pools:
        if self._capacities is not None and pool not in self._capacities:
          raise FlexjaxError(f'internal error: the runtime allocated {nbytes:,} bytes for '
                             f'{pool!r}, a buffer the execution plan does not list')
        capacity = None if self._capacities is None else self._capacities[pool]
        self.pools[pool] = TierAccount(f'plan buffer {pool}', capacity)
    self.pools[pool].reserve(nbytes)
    try:
      self.accounts[tier].reserve(nbytes)
    except FlexjaxError:
      self.pools[pool].release(nbytes)
      raise

  def free(self, tier: str, nbytes: int, pool: str | None = None) -> None:
    if not nbytes:
      return
    self.pools[pool or tier].release(nbytes)
    self.accounts[tier].release(nbytes)

  def host_array(self, shape, dtype, pool: str | None = None) -> np.ndarray:
    dtype = np.dtype(dtype)
    self.reserve('host', int(np.prod(shape)) * dtype.itemsize, pool)
    out = aligned_empty(shape, dtype)
    out[...] = 0
    return out

  def copy(self, dst: np.ndarray, src: np.ndarray) -> None:
    """dst[...] = src (src broadcast to dst's shape), split among `copy_threads` threads by
    runs of the leading axis (of the second where there are fewer leading rows than threads)
    where it is large: numpy copies without holding the GIL."""
    axis = 0 if dst.ndim < 2 or dst.shape[0] >= self.copy_threads else 1
    parts = min(self.copy_threads, dst.shape[axis] if dst.ndim else 1)
    if parts < 2 or dst.nbytes < COPY_SPLIT_BYTES:
      np.copyto(dst, src, casting='unsafe')  # as dst[...] = src
      return
    src = np.broadcast_to(src, dst.shape)
    with self._lock:
      if self._copies is None:
        self._copies = concurrent.futures.ThreadPoolExecutor(self.copy_threads, 'flexjax-copy')
    bounds = np.linspace(0, dst.shape[axis], parts + 1).astype(int)
    cut = lambda a, i: a[(slice(None),) * axis + (slice(bounds[i], bounds[i + 1]),)]
    futures = [self._copies.submit(np.copyto, cut(dst, i), cut(src, i), casting='unsafe')
               for i in range(parts)]
    for future in futures:
      future.result()

  def to_host(self, value: jax.Array):
    """Starts copying a device array to host memory; returns what np.asarray turns into its
    bytes. On an accelerator with pinned host memory: one DMA into a pinned buffer, issued now
    (behind the step that computes `value`), whose numpy view is the bytes: jax's copy into
    pageable memory goes through a staging buffer at a fraction of the link's rate. Elsewhere
    `value` itself (on a CPU backend np.asarray views it without a copy)."""
    if (self.host_memory is None or self.device.platform == 'cpu'
        or value.devices() != {self.device}):
      return value
    pinned = jax.sharding.SingleDeviceSharding(self.device, memory_kind=self.host_memory)
    return jax.device_put(value, pinned)

  def host_weights(self, array: np.ndarray, pool: str):
    """A copy of `array` on the host tier: in the run's pinned host memory (a jax array the
    device copies by DMA) when it has one, else an aligned numpy buffer."""
    if self.host_memory is None:
      out = self.host_array(array.shape, array.dtype, pool)
      out[...] = array
      return out
    self.reserve('host', array.nbytes, pool)
    sharding = jax.sharding.SingleDeviceSharding(self.device, memory_kind=self.host_memory)
    return jax.device_put(array, sharding).block_until_ready()

  def in_place(self, array: np.ndarray):
    """A host-tier buffer as a device array over the same memory, on a CPU backend (one RAM;
    plan.used_in_place): the steps take it with no load. XLA:CPU aliases an aligned buffer
    (host_array's are); one it would copy stays the numpy buffer, which a step's call then
    copies in, as a load would have."""
    value = jax.device_put(array, self.device)
    if value.unsafe_buffer_pointer() != array.ctypes.data:
      return array
    return value

  def disk_array(self, shape, dtype, pool: str | None = None) -> DiskArray:
    dtype = np.dtype(dtype)
    self.reserve('disk', int(np.prod(shape)) * dtype.itemsize, pool)
    with self._lock:
      self._files += 1
      number = self._files
      if self._disk_io is None:
        self._disk_io = concurrent.futures.ThreadPoolExecutor(DISK_IO_THREADS, 'flexjax-disk')
        self._disk_writes = concurrent.futures.ThreadPoolExecutor(DISK_WRITE_THREADS,
                                                                  'flexjax-disk-write')
    try:
      return DiskArray(self.run_dir / f'{number:06d}.bin', tuple(shape), dtype,
                       self.drop_page_cache, self._disk_io, self._disk_writes)
    except FlexjaxError:
      self.free('disk', int(np.prod(shape)) * dtype.itemsize, pool)
      raise

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
               preallocate_device: bool, kind: str | None = None):
    self.storage = storage
    self.shape = tuple(shape)
    self.dtype = np.dtype(dtype)
    self.rows = rows
    d, h = rows['device'], rows['host']
    self.slices = {'device': slice(0, d), 'host': slice(d, d + h), 'disk': slice(d + h, shape[0])}
    tail = self.shape[1:]
    self.pools = {tier: f'{kind}.{tier}' if kind else tier for tier in TIERS}
    self.device_bytes = nbytes_of((d, *tail), self.dtype)
    storage.reserve('device', self.device_bytes, self.pools['device'])
    self.device: jax.Array | None = (
        jax.device_put(np.zeros((d, *tail), self.dtype), storage.device)
        if d and preallocate_device else None)
    self.host = self.disk = None
    try:
      if h:
        self.host = storage.host_array((h, *tail), self.dtype, self.pools['host'])
      if rows['disk']:
        self.disk = storage.disk_array((rows['disk'], *tail), self.dtype, self.pools['disk'])
    except BaseException:
      self.close()
      raise
    self.pending = None  # concurrent.futures.Future of the last offloaded write

  @property
  def offloaded_rows(self) -> int:
    return self.rows['host'] + self.rows['disk']

  def wait(self) -> None:
    if self.pending is not None:
      self.pending.result()

  def write_offloaded(self, value: jax.Array, start: int) -> None:
    """Writes rows d: of value [batch, n, ...] into time [start, start+n) of host and disk."""
    if self.offloaded_rows:
      d = self.rows['device']
      self.write_offloaded_rows(self.storage.to_host(value[d:] if d else value), start)

  def write_offloaded_rows(self, rows, start: int) -> None:
    """Writes the offloaded rows' entries [offloaded rows, n, ...] (a device array, or its copy
    started by Storage.to_host) into time [start, start+n) of host and disk."""
    host_value = np.asarray(rows)  # device -> host
    n = host_value.shape[1]
    h = self.rows['host']
    if self.host is not None:
      self.storage.copy(self.host[:, start:start + n], host_value[:h])
    if self.disk is not None:
      self.disk.write((slice(None), slice(start, start + n)), host_value[h:])

  def read_offloaded(self, length: int, padded_to: int | None = None, *,
                     out: np.ndarray | None = None, zeros_from: int | None = None
                     ) -> np.ndarray | None:
    """A host copy of the offloaded rows' time range [0, length), followed by zeros up to
    `padded_to` positions where given (a cache's positions not yet written, which its readers
    mask: not read): host rows copied, disk rows read into it. The copy is fresh (aligned,
    never written again), or `out` [offloaded rows, padded_to, ...] (aligned), of which
    positions `zeros_from` on are known to be zeros already: only [length, zeros_from) is
    cleared."""
    self.wait()
    if not self.offloaded_rows:
      return None
    h = self.rows['host']
    total = length if padded_to is None else padded_to
    shape = (self.offloaded_rows, total, *self.shape[2:])
    if out is None:
      out, zeros_from = aligned_empty(shape, self.dtype), total
    elif out.shape != shape or out.dtype != self.dtype:
      raise ValueError(f'out {out.shape} {out.dtype} is not {shape} {self.dtype}')
    out[:, length:max(length, total if zeros_from is None else zeros_from)] = 0
    if self.host is not None:
      self.storage.copy(out[:h, :length], self.host[:, :length])
    if self.disk is not None:
      self.disk.read((slice(None), slice(0, length)), out=out[h:, :length])
    return out

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
    if self.device_bytes:
      self.storage.free('device', self.device_bytes, self.pools['device'])
      self.device_bytes = 0
    self.device = None
    if self.host is not None:
      self.storage.free('host', self.host.nbytes, self.pools['host'])
      self.host = None
    if self.disk is not None:
      self.storage.free('disk', self.disk.nbytes, self.pools['disk'])
      self.disk.close()
      self.disk = None
