"""The mover: how bytes move between tiers. Worker threads, weight loads, reads of offloaded
hidden and KV rows, write-back of results; every byte it holds is drawn from a plan buffer."""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import math
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

from flexjax import diskio
from flexjax import plan as plan_lib
from flexjax import quant as quant_lib
from flexjax import stream as stream_lib
from flexjax.model import params as params_lib
from flexjax.placement import Placed
from flexjax.policy import Policy
from flexjax.steps import Steps
from flexjax.storage import SplitArray, Storage

BREAKDOWN_PARTS = ('compute', 'weight_read', 'cache_read', 'cache_write', 'hidden_read',
                   'hidden_write')
# Staging buffers are made in multiples of this many bytes (at most the largest stage's size).
STAGING_STEP = 1 << 20


class Clock:
  """Seconds per phase and part of the work of a run without overlap (the paper's Table 8).

  Each part waits for its results before it stops, so time is charged where the work happens;
  a part nested in another (a cache write inside a step's computation) is charged to itself only.
  Disabled, it costs nothing and adds no waits.
  """

  def __init__(self, enabled: bool):
    self.enabled = enabled
    self.phase = 'prefill'
    self.seconds = {phase: dict.fromkeys(BREAKDOWN_PARTS, 0.0) for phase in ('prefill', 'decode')}
    self._nested: list[float] = []  # per open part: seconds of the parts nested in it

  @contextlib.contextmanager
  def part(self, name: str):
    if not self.enabled:
      yield
      return
    self._nested.append(0.0)
    start = time.perf_counter()
    try:
      yield
    finally:
      elapsed = time.perf_counter() - start
      self.seconds[self.phase][name] += elapsed - self._nested.pop()
      if self._nested:
        self._nested[-1] += elapsed

  def ready(self, tree):
    """Waits for the arrays of `tree` when enabled; returns it."""
    if self.enabled:
      jax.block_until_ready(tree)
    return tree


@dataclasses.dataclass
class _StageRead:
  """A stage's disk-tier tensors being read into a staging buffer: slot -> (view, chunk
  futures)."""

  nbytes: int
  parts: dict
  buffer: np.ndarray


@dataclasses.dataclass(frozen=True)
class Loaded:
  """A stage's weights on the device, and what they hold until freed: device bytes, and on a
  CPU backend the host buffers the device arrays are (its staging buffer and the buffer its
  split tensors were joined into; empty elsewhere), each with the pool it goes back to."""

  params: dict
  nbytes: int
  buffers: tuple = ()  # ((BufferPool, buffer), ...)


class BufferPool:
  """Aligned host buffers reused from stage to stage, by size: a stage's disk reads (staging)
  or, on a CPU backend, its tensors split across tiers joined into one array each. A fresh
  buffer is faulted in and zeroed by the kernel on first touch, which costs as much CPU as the
  read or copy that fills it (on a 2-core VM: 3 GB/s into fresh buffers, 5 GB/s into reused
  ones; diskio.aligned_buffer backs every page as it makes one). A buffer is reused once
  every array using it is ready: nothing (a GPU copies it while loading) or the outputs of the
  steps that used the stage's weights (a CPU backend computes on it). Buffers in use are
  bounded by the schedule; with a `limit` the free ones kept beside them are too (the oldest go
  back to the kernel first)."""

  def __init__(self, limit: int | None = None):
    self.limit = limit  # bytes of buffers kept (in use or free); free ones are dropped beyond it
    self._held = 0
    self._free: collections.OrderedDict = collections.OrderedDict()  # id -> free buffer
    self._waiting: collections.deque = collections.deque()  # (buffer, arrays to be ready)
    self._lock = threading.Lock()

  def take(self, nbytes: int) -> np.ndarray:
    with self._lock:
      while self._waiting and all(a.is_ready() for a in self._waiting[0][1]):
        buffer = self._waiting.popleft()[0]
        self._free[id(buffer)] = buffer
      for key, buffer in self._free.items():
        if buffer.nbytes == nbytes:
          return self._free.pop(key)
      while self._free and self.limit is not None and self._held + nbytes > self.limit:
        self._held -= self._free.popitem(last=False)[1].nbytes  # oldest first, to the kernel
      self._held += nbytes
    return diskio.aligned_buffer(nbytes)

  @property
  def held(self) -> int:
    """Bytes of the buffers allocated and kept (in use or free)."""
    return self._held

  def give_back(self, buffer: np.ndarray, after=()) -> None:
    with self._lock:
      self._waiting.append((buffer, [a for a in jax.tree.leaves(after)
                                     if isinstance(a, jax.Array)]))


class CacheStaging:
  """Host buffers a decode step's offloaded KV rows are read into, reused from step to step
  (within a block every read has one shape). Positions past the written ones must read as
  zeros: a fresh buffer is zeroed there, faulted in by the kernel as it goes, which on a CPU
  busy computing took longer than the disk read it precedes (opt-6.7b, 48 rows x 127 positions:
  60 ms or more per buffer); a reused one holds zeros past its last read's positions, so a read
  clears only what a longer earlier one left there (nothing while positions grow). Buffers in
  use are bounded by the schedule (the plan's 'cache.staging'); free ones are reused first."""

  def __init__(self):
    self._pool = BufferPool()
    self._zeros: dict[tuple[int, tuple, np.dtype], int] = {}  # (address, shape, dtype) -> from
    self._lock = threading.Lock()

  def take(self, shape: tuple[int, ...], dtype) -> tuple[np.ndarray, int | None]:
    """A buffer of `shape` and the position (axis 1) from which it holds zeros (None: nothing
    is known, e.g. a fresh one)."""
    shape, dtype = tuple(shape), np.dtype(dtype)
    buffer = self._pool.take(math.prod(shape) * dtype.itemsize).view(dtype).reshape(shape)
    with self._lock:
      return buffer, self._zeros.pop((buffer.ctypes.data, shape, dtype), None)

  def give_back(self, buffer: np.ndarray, zeros_from: int) -> None:
    """`buffer` is free again; positions `zeros_from` on hold zeros."""
    with self._lock:
      self._zeros[(buffer.ctypes.data, buffer.shape, buffer.dtype)] = zeros_from
    self._pool.give_back(buffer.reshape(-1).view(np.uint8))


def value_bytes(value):
  return value.data if isinstance(value, quant_lib.Packed) else value


class _Inline:
  """Runs submitted work at once on the caller's thread (the no-overlap executor)."""

  def submit(self, fn, *args):
    future = concurrent.futures.Future()
    future.set_result(fn(*args))
    return future

  def shutdown(self, wait=True, cancel_futures=False):
    del wait, cancel_futures


class Mover:
  """Moves weights, hidden states and KV rows for one run of the block schedule.

  With overlap, three threads: 'weights' loads the next stage, 'load' the next step's offloaded
  inputs, 'store' writes offloaded results back. Loaded inputs carry a 'held' list of
  (tier, bytes, pool) returned by release() once the step that used them has run, and a
  'staged' list of (cache staging buffer, positions read into it) given back to the pool then.
  """

  def __init__(self, storage: Storage, steps: Steps, stages: list[Placed], policy: Policy, *,
               reader: diskio.Reader, row_reader: diskio.Reader, clock: Clock, stats: dict,
               stage_names: list[str], device_is_host: bool, prompt_ids: int,
               read_ahead: bool = False, host_in_place: bool = False):
    """reader: the stages' disk reads; row_reader: token rows (token_rows); prompt_ids: ids a
    prompt step of the block looks up (GPU batch x prompt length); host_in_place: the steps
    take host-tier tensors as placed (plan.used_in_place)."""
    self.storage, self.steps, self.stages = storage, steps, stages
    self.policy, self.clock, self.stats = policy, clock, stats
    self.stage_names = stage_names
    self.device_is_host = device_is_host
    self.reader, self.row_reader = reader, row_reader
    self.reads_ahead = read_ahead  # the plan holds a second staging buffer for it
    # per stage, the slots a load brings to the device: every one off the device but a part
    # whose rows the steps read as they need them (plan.gathers_rows, token_rows) and, on a CPU
    # backend, a host-tier one the steps take as it lies (plan.used_in_place)
    self.loads = [{slot for slot, _ in stage if slot.tier != 'device'
                   and not plan_lib.gathers_rows(stage_names[i], slot, prompt_ids)
                   and not plan_lib.used_in_place(slot, host_in_place)}
                  for i, stage in enumerate(stages)]
    # On a CPU backend a stage's unpacked disk tensors become device arrays over its staging
    # buffer (no copy), which then stays with the loaded weights until the steps that used them
    # have run. A stage with packed disk tensors (dequantized into arrays of their own) copies
    # its few unpacked ones instead, and its buffer goes back once the stage is loaded, as on
    # an accelerator: the plan counts the staging buffers of the stage loading and the one read
    # ahead, and those of the two stages computing would be beside them (job_mixed_lengths: four
    # buffers of 21.6 MiB against the plan's two).
    self.keeps_staging = [device_is_host and not any(slot.packed for slot in loads
                                                     if slot.tier == 'disk')
                          for loads in self.loads]
    self.staging_bytes = max((sum(t.padded for _, t in self._disk_reads(i))
                              for i in range(len(stages))), default=0)
    # Each stage's disk tensors are read into a buffer of their own size, rounded up to
    # STAGING_STEP so that stages of nearly one size share buffers (every page of one is backed
    # as it is made: diskio.aligned_buffer). The plan counts a staging buffer of the largest
    # stage's size per stage read (and read ahead) and, on a CPU backend, per stage loaded: the
    # pool keeps no more than those.
    kept = plan_lib.stages_loaded(policy.overlap) if any(self.keeps_staging) else 0
    self.staging = BufferPool(((2 if read_ahead else 1) + kept) * self.staging_bytes)
    # On a CPU backend the arrays split tensors are joined into, kept within the plan's joins
    # of the stages loaded at once.
    self.joins = BufferPool(plan_lib.stages_loaded(policy.overlap) * max(
        (plan_lib.stage_join_bytes(slot for slot, _ in stage) for stage in stages), default=0))
    self.cache_staging = CacheStaging()
    self._reads: dict[int, _StageRead | None] = {}  # stage -> its disk reads under way
    self._reads_lock = threading.Lock()
    self.workers: dict = {}
    self._pending_stores: collections.deque = collections.deque()  # per step: write futures

  def start(self) -> None:
    if self.policy.overlap:
      self.workers = {name: concurrent.futures.ThreadPoolExecutor(1, f'flexjax-{name}')
                      for name in ('load', 'weights', 'store')}
    else:
      self.workers = {name: _Inline() for name in ('load', 'weights', 'store')}

  def stop(self) -> None:
    """Finishes the write-backs under way (they hold results), then stops the threads."""
    concurrent.futures.wait([f for step in self._pending_stores for f in step])
    for worker in self.workers.values():
      worker.shutdown(wait=True, cancel_futures=True)
    self.workers = {}
    with self._reads_lock:
      for read in self._reads.values():
        self._finish_read(read)
      self._reads = {}
    self._pending_stores.clear()
    self.stats['staging_bytes'] = max(self.stats['staging_bytes'], self.staging.held)

  # ---- weights ----------------------------------------------------------------------------------
  def read_ahead(self, index: int) -> None:
    """Starts the disk reads of a stage's weights now (the stage after the one loading next),
    so the disk stays busy while stages are cast and computed; nothing when the plan has no
    room for it."""
    if not self.reads_ahead:
      return
    with self._reads_lock:
      if index not in self._reads:
        self._reads[index] = self._start_reads(index)

  def _disk_reads(self, index: int) -> list:
    """(slot, StreamTensor) of the disk-tier tensors a load of the stage reads."""
    return [(slot, value_bytes(value)) for slot, value in self.stages[index]
            if slot.tier == 'disk' and slot in self.loads[index]]

  def _start_reads(self, index: int) -> '_StageRead | None':
    """The stage's disk-tier tensors read into one aligned staging buffer by the I/O threads."""
    tensors = self._disk_reads(index)
    if not tensors:
      return None
    nbytes = sum(t.padded for _, t in tensors)
    self.storage.reserve('host', nbytes, 'weights.staging')
    buffer = self.staging.take(min(self.staging_bytes, diskio.align_up(nbytes, STAGING_STEP)))
    parts, offset = {}, 0
    for slot, t in tensors:
      part = buffer[offset:offset + t.padded]
      parts[slot] = (t.view(part), self.reader.read(t.file, t.start, part))
      offset += t.padded
    return _StageRead(nbytes, parts, buffer)

  def _finish_read(self, read: '_StageRead | None', *, keep: bool = False) -> None:
    """Waits for a stage's reads; its buffer goes back unless `keep` (the device arrays of a
    CPU backend are that buffer: it goes back with the weights, see free_weights)."""
    if read is not None:
      for _, futures in read.parts.values():
        concurrent.futures.wait(futures)
      self.storage.free('host', read.nbytes, 'weights.staging')
      if not keep:
        self.staging.give_back(read.buffer)

  def loads_weights(self, index: int) -> bool:
    """Whether a stage has weights off the device to bring (else load_weights only looks its
    resident ones up, with nothing to wait for)."""
    return bool(self.loads[index])

  def load_weights(self, index: int, after=None):
    """Brings a stage's weights to the device once `after` (the previous stage's last outputs)
    exist, so at most two stages' loaded weights are alive; its disk reads start before that
    wait. A tensor split across tiers is joined on the device unless its step takes it in
    parts (TensorSlot.in_parts)."""
    with self._reads_lock:
      read = self._reads.pop(index) if index in self._reads else self._start_reads(index)
    parts: dict = {}  # path -> [(slot, device value)] in row order
    loaded = 0
    done = False
    buffers = []
    try:
      if after is not None:
        jax.block_until_ready(after)
      for slot, value in self.stages[index]:
        if slot in self.loads[index]:
          loaded += self._reserve_loaded(slot.loaded + slot.join)
          value = self._load_tensor(slot, value, read, keeps=self.keeps_staging[index])
        parts.setdefault(slot.path, []).append((slot, value))
      tree = self._join_all(parts, buffers)
      done = True
    except BaseException:
      self.storage.free('device', loaded, 'weights.loaded')
      raise
    finally:
      self._finish_read(read, keep=done and self.keeps_staging[index])
    self.stats['weight_loads'][self.stage_names[index]] += 1
    if read is not None and self.keeps_staging[index]:
      buffers.append((self.staging, read.buffer))
    return Loaded(params_lib.unflatten(tree), loaded, tuple(buffers))

  def token_rows(self, params: dict, ids: np.ndarray) -> tuple[dict, np.ndarray]:
    """The embedding step's parameters and ids [b, s], with every part of its token table
    (an array or its row parts) left on disk to be gathered (plan.gathers_rows: a stream
    tensor) replaced by the rows the ids look up there, read now, [b * s, dim] on the device
    (zeros where an id lies in another part), and the ids renumbered to index the new parts.
    Unchanged without such parts."""
    table = params['tokens']
    parts = table if isinstance(table, tuple) else (table,)
    if not any(isinstance(p, stream_lib.StreamTensor) for p in parts):
      return params, ids
    flat = ids.reshape(-1)
    new_parts, new_ids = [], np.zeros_like(flat)
    first = new_first = 0
    for part in parts:
      rows = part.shape[0]
      inside = (flat >= first) & (flat < first + rows)
      if isinstance(part, stream_lib.StreamTensor):
        with self.clock.part('weight_read'):
          looked_up, nbytes = part.gather(np.where(inside, flat - first, -1), self.row_reader)
        self.stats['bytes_moved']['weights_disk'] += nbytes
        self.stats['disk_weights_by_phase'][self.clock.phase] += nbytes
        new_ids[inside] = new_first + np.flatnonzero(inside)
        part, rows_now = jax.device_put(looked_up, self.storage.device), len(flat)
      else:
        new_ids[inside] = flat[inside] - first + new_first
        rows_now = rows
      new_parts.append(part)
      first += rows
      new_first += rows_now
    return {**params, 'tokens': tuple(new_parts)}, new_ids.reshape(ids.shape)

  def _reserve_loaded(self, nbytes: int) -> int:
    self.storage.reserve('device', nbytes, 'weights.loaded')
    return nbytes

  def _join_all(self, parts: dict, buffers: list) -> dict:
    """path -> the stage's tensors, each from its parts (see _join). On a CPU backend the joined
    ones are laid out in one aligned host buffer from the join pool, appended to `buffers`."""
    values = {path: [v for _, v in pieces] for path, pieces in parts.items()}
    values = {path: [self.steps.dequantize(v) if isinstance(v, quant_lib.Packed) else v
                     for v in vs] if len(vs) > 1 else vs for path, vs in values.items()}
    in_parts = {path for path, pieces in parts.items() if pieces[0][0].in_parts}
    joined = [path for path, vs in values.items() if len(vs) > 1 and path not in in_parts]
    into = {}
    if self.device_is_host and joined:
      sizes = [diskio.align_up(sum(v.nbytes for v in values[path])) for path in joined]
      buffer = self.joins.take(sum(sizes))
      buffers.append((self.joins, buffer))
      offsets = np.cumsum([0] + sizes)
      into = {path: buffer[offsets[i]:offsets[i + 1]] for i, path in enumerate(joined)}
    return {path: tuple(vs) if path in in_parts else self._join(vs, into.get(path))
            for path, vs in values.items()}

  def _join(self, values: list, into: np.ndarray | None = None) -> object:
    """A tensor from its parts (rows on different tiers, packed ones already dequantized). On a
    CPU backend `into` is the aligned host memory the joined tensor is copied into."""
    if len(values) == 1:
      return values[0]
    if self.device_is_host:
      # One RAM: the parts' rows copied into an aligned host array, which becomes the device
      # array without a copy (XLA:CPU's concatenate ran 3x slower than this copy).
      rows = sum(v.shape[0] for v in values)
      shape, dtype = (rows, *values[0].shape[1:]), values[0].dtype
      whole = into[:math.prod(shape) * dtype.itemsize].view(dtype).reshape(shape)
      start = 0
      for v in values:
        np.copyto(whole[start:start + v.shape[0]], np.asarray(v))
        start += v.shape[0]
      return jax.device_put(whole, self.storage.device)
    return jnp.concatenate(values, axis=0).block_until_ready()

  def _load_tensor(self, slot, value, read: '_StageRead | None', *,
                   keeps: bool) -> jax.Array:
    """One non-resident tensor (or part) to the device as stored (packed ones dequantized
    there; the steps cast the rest a tile at a time); waits for it, so only one tensor is in
    flight. On a CPU backend an aligned host array becomes a device array without a copy: an
    unpacked one read from disk is that staging buffer where the stage `keeps` it
    (keeps_staging), else a copy out of it, so that the buffer can go back."""
    packed = isinstance(value, quant_lib.Packed)
    stored = value.data if packed else value
    if slot.tier == 'disk':
      host, futures = read.parts[slot]
      diskio.wait(futures)
      if self.device_is_host and not keeps and not packed:
        host = np.array(host, copy=True)
      self.stats['bytes_moved']['weights_disk'] += stored.nbytes
      self.stats['disk_weights_by_phase'][self.clock.phase] += stored.nbytes
    else:
      host = stored
    self.storage.reserve('device', stored.nbytes, 'weights.transfer')
    try:
      # pinned host memory is a jax array: it moves by DMA to the device's own memory
      out = jax.device_put(host, self.storage.device if isinstance(host, np.ndarray)
                           else self.storage.device_memory)
      if packed:
        out = self.steps.dequantize(quant_lib.Packed(out, value.dim, value.config))
      out = out.block_until_ready()
      del host
    finally:
      self.storage.free('device', stored.nbytes, 'weights.transfer')
    self.stats['bytes_moved']['weights'] += stored.nbytes
    return out

  def free_weights(self, loaded: Loaded, after=()) -> None:
    """Frees a stage's loaded weights; the host buffers its device arrays are (CPU backend)
    are reused once `after` (the outputs of every step that used them) is ready."""
    self.storage.free('device', loaded.nbytes, 'weights.loaded')
    for pool, buffer in loaded.buffers:
      pool.give_back(buffer, after)

  # ---- inputs -----------------------------------------------------------------------------------
  def loads_nothing(self, step, batch) -> bool:
    """Whether a step's inputs are all on the device already (no offloaded hidden or cache
    rows to bring): load_inputs then only looks them up, which the executor does on its own
    thread rather than hand to the load thread and wait for it."""
    return not ((step.stage > 0 and batch.hidden.offloaded_rows)
                or self._offloaded_caches(step, batch))

  @staticmethod
  def _offloaded_caches(step, batch):
    """The (K, V) caches of a decode step's layer when they have rows off the device, else
    None (a prompt step reads no cache)."""
    layer = step.stage - 1
    if step.token > 0 and 0 <= layer < len(batch.caches):
      caches = batch.caches[layer]
      return caches if caches[0].offloaded_rows else None
    return None

  def load_inputs(self, step, batch) -> dict:
    """Brings a step's offloaded hidden rows and (decode) offloaded cache rows to where the
    computation needs them. Runs on the load thread under overlap."""
    out = {'held': [], 'staged': []}
    if step.stage > 0:
      with self.clock.part('hidden_read'):
        out['hidden'] = self.clock.ready(self._read_hidden(
            batch.hidden, 1 if step.token else batch.tokens.shape[1], out['held']))
    caches = self._offloaded_caches(step, batch)
    if caches is not None:  # sparse attention reads V later, only the rows it keeps
      k_cache, v_cache = caches
      dense = self.policy.attn_sparsity == 1
      written = batch.tokens.shape[1] + step.token - 1  # positions cached before this token
      with self.clock.part('cache_read'):
        out['cache'] = self.clock.ready((
            self._read_cache(k_cache, 'k_cache', written, out['held'], out['staged']),
            self._read_cache(v_cache, 'v_cache', written, out['held'], out['staged'])
            if dense else None))
    return out

  def _hold(self, held: list, tier: str, nbytes: int, pool: str) -> None:
    self.storage.reserve(tier, nbytes, pool)
    held.append((tier, nbytes, pool))

  def _read_hidden(self, hidden: SplitArray, length: int, held: list) -> jax.Array:
    if not hidden.offloaded_rows:
      hidden.wait()
      return hidden.device
    rows_bytes = hidden.offloaded_rows * length * hidden.shape[2] * hidden.dtype.itemsize
    self._hold(held, 'host', rows_bytes, 'hidden.staging')
    if self.device_is_host or hidden.rows['disk']:
      rows = hidden.read_offloaded(length)  # fresh and private: the CPU backend takes it as is
    else:  # an accelerator copies from the host rows themselves, next overwritten only by the
      # write-back of the step that reads this copy
      hidden.wait()  # the last write-back of these rows has landed
      rows = hidden.host[:, :length]
    joined = hidden.rows['device'] > 0
    device_bytes = rows_bytes + (hidden.shape[0] * length * hidden.shape[2]
                                 * hidden.dtype.itemsize if joined else 0)
    self._hold(held, 'device', device_bytes, 'hidden.loaded')
    loaded = jax.device_put(rows, self.storage.device)
    if joined:
      return jnp.concatenate([hidden.device, loaded])
    return loaded

  def _read_cache(self, cache: SplitArray, name: str, written: int, held: list, staged: list):
    """Offloaded cache rows [rows, t, entry]: on the CPU backend (CPU attention) or the device.
    The CPU backend reads host rows where they lie (plan.cache_read_in_place); the rest are
    read into a copy, their first `written` positions only (the others are zeros: not yet
    written, and masked)."""
    if plan_lib.cache_read_in_place(self.policy, self.device_is_host, cache.rows['disk']):
      cache.wait()
      rows = cache.host
      self.stats['bytes_moved'][name] += rows.nbytes
    else:
      nbytes = cache.offloaded_rows * cache.shape[1] * cache.shape[2] * cache.dtype.itemsize
      self._hold(held, 'host', nbytes, 'cache.staging')
      buffer, zeros_from = self.cache_staging.take(
          (cache.offloaded_rows, *cache.shape[1:]), cache.dtype)
      rows = cache.read_offloaded(written, padded_to=cache.shape[1], out=buffer,
                                  zeros_from=zeros_from)
      staged.append((buffer, written))  # back to the pool once the step has run
      self.stats['bytes_moved'][name] += nbytes * written // cache.shape[1]
    if self.policy.cpu_attention:
      return jax.device_put(rows, self.steps.cpu)
    if not self.device_is_host:  # rows read in place only get here on a CPU device
      self._hold(held, 'device', rows.nbytes, 'cache.loaded')
    return jax.device_put(rows, self.storage.device)

  def gather_v(self, v_cache: SplitArray, positions: jax.Array, backend) -> jax.Array:
    """Reads only the kept V rows of the offloaded part of a cache (host gather, disk reads)."""
    positions = np.asarray(positions)
    with self.clock.part('cache_read'):
      rows = v_cache.read_offloaded_rows(positions)
      self.stats['bytes_moved']['v_cache'] += rows.nbytes
      return self.clock.ready(jax.device_put(rows, backend))

  def release(self, inputs: dict) -> None:
    """Returns the bytes a step's loaded inputs held (once)."""
    for tier, nbytes, pool in inputs.pop('held', []):
      self.storage.free(tier, nbytes, pool)
    for buffer, zeros_from in inputs.pop('staged', []):
      self.cache_staging.give_back(buffer, zeros_from)

  def release_when_ready(self, inputs: dict, outputs) -> concurrent.futures.Future | None:
    """Returns the inputs' bytes once `outputs` exist (on the store thread); None where they
    hold none (inputs on the device)."""
    if not inputs.get('held') and not inputs.get('staged'):
      return None

    def wait_and_release():
      jax.block_until_ready(outputs)
      self.release(inputs)
    return self.workers['store'].submit(wait_and_release)

  # ---- outputs ----------------------------------------------------------------------------------
  def begin_step_stores(self) -> None:
    """Starts a step's write-backs: waits for those of older steps, so the offloaded rows of at
    most two steps (one without overlap) wait to be written (the plan's 'store.pending')."""
    keep = 1 if self.policy.overlap else 0
    while len(self._pending_stores) > keep:
      for future in self._pending_stores.popleft():
        future.result()
    self._pending_stores.append([])

  def store_cache_rows(self, cache: SplitArray, rows: jax.Array, slot: int) -> None:
    """Writes the offloaded rows' new entries [offloaded rows, n, entry] (a step's output) to
    their host and disk tiers at time `slot`, on the store thread."""
    with self.clock.part('cache_write'):
      cache.wait()
      cache.pending = self.workers['store'].submit(cache.write_offloaded_rows,
                                                   self.storage.to_host(rows), slot)
      self._pending_stores[-1].append(cache.pending)

  def store_hidden(self, hidden: SplitArray, value: jax.Array) -> None:
    d = hidden.rows['device']
    hidden.wait()
    value = self.clock.ready(value)  # computed: the write starts here
    with self.clock.part('hidden_write'):
      hidden.device = self.clock.ready(value if d == value.shape[0] else
                                       (value[:d] if d else None))
      if hidden.offloaded_rows:
        hidden.pending = self.workers['store'].submit(
            hidden.write_offloaded_rows, self.storage.to_host(value[d:] if d else value), 0)
        self._pending_stores[-1].append(hidden.pending)
