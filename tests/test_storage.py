"""Memory tiers: disk arrays, arrays split across device/host/disk, budgets and the run folder."""

import threading
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flexjax.errors import FlexjaxError
from flexjax.storage import DiskArray, SplitArray, Storage, TierAccount, aligned_empty

DTYPES = [np.float32, np.float16, np.uint8]
# Row splits of a batch of 4: mixed, one tier alone, device + disk, host + disk.
SPLITS = [
    {'device': 1, 'host': 2, 'disk': 1},
    {'device': 0, 'host': 4, 'disk': 0},
    {'device': 0, 'host': 0, 'disk': 4},
    {'device': 2, 'host': 0, 'disk': 2},
    {'device': 0, 'host': 1, 'disk': 3},
]
SPLIT_IDS = ['d{device}-h{host}-k{disk}'.format(**rows) for rows in SPLITS]
TIMEOUT_S = 30  # only a guard against hanging forever; no assertion depends on it


def cpu():
  return jax.devices('cpu')[0]


def random_array(shape, dtype, seed=0) -> np.ndarray:
  """Random values of dtype, none of them zero (zeros mark entries never written)."""
  rng = np.random.default_rng(seed)
  if np.dtype(dtype).kind == 'u':
    return rng.integers(1, 256, size=shape).astype(dtype)
  values = rng.uniform(0.5, 2.0, size=shape) * rng.choice([-1, 1], size=shape)
  return values.astype(dtype)


def offloaded_of(expected: np.ndarray, rows: dict) -> np.ndarray:
  return expected[rows['device']:]


# ---- DiskArray -----------------------------------------------------------------------------------


@pytest.mark.parametrize('drop_page_cache', [False, True])
@pytest.mark.parametrize('dtype', DTYPES)
def test_disk_array_full_round_trip(tmp_path, dtype, drop_page_cache):
  shape = (3, 5, 8)
  array = DiskArray(tmp_path / 'a.bin', shape, dtype, drop_page_cache)
  assert array.nbytes == 3 * 5 * 8 * np.dtype(dtype).itemsize
  np.testing.assert_array_equal(array.read(), np.zeros(shape, dtype))  # never written: zeros
  value = random_array(shape, dtype)
  array.write(..., value)
  out = array.read()
  assert out.shape == shape and out.dtype == np.dtype(dtype)
  np.testing.assert_array_equal(out, value)


@pytest.mark.parametrize('dtype', DTYPES)
def test_disk_array_reads_are_copies(tmp_path, dtype):
  array = DiskArray(tmp_path / 'a.bin', (2, 3, 4), dtype, False)
  first = random_array((2, 3, 4), dtype, seed=1)
  array.write(..., first)
  out = array.read()
  out[:] = 0  # a caller may scribble on what it got
  array.write((slice(None), slice(0, 1)), random_array((2, 1, 4), dtype, seed=2))
  np.testing.assert_array_equal(array.read()[:, 1:], first[:, 1:])
  assert (out == 0).all()  # and a later write does not change an earlier read


@pytest.mark.parametrize('dtype', DTYPES)
def test_disk_array_partial_time_ranges(tmp_path, dtype):
  b, t, h = 3, 9, 4
  array = DiskArray(tmp_path / 'a.bin', (b, t, h), dtype, False)
  expected = np.zeros((b, t, h), dtype)
  full = random_array((b, t, h), dtype)
  for start, stop in [(0, 4), (4, 5), (7, 9), (5, 6)]:  # a prompt, then tokens, out of order
    array.write((slice(None), slice(start, stop)), full[:, start:stop])
    expected[:, start:stop] = full[:, start:stop]
    np.testing.assert_array_equal(array.read(), expected)
  for start, stop in [(0, 9), (0, 1), (2, 7), (6, 7), (8, 9), (3, 3)]:
    out = array.read((slice(None), slice(start, stop)))
    assert out.shape == (b, stop - start, h)
    np.testing.assert_array_equal(out, expected[:, start:stop])
  np.testing.assert_array_equal(array.read((1,)), expected[1])
  np.testing.assert_array_equal(array.read((slice(1, 3), slice(2, 5))), expected[1:3, 2:5])


@pytest.mark.parametrize('dtype', DTYPES)
def test_disk_array_row_gather(tmp_path, dtype):
  b, t, h, keep = 4, 10, 6, 5
  array = DiskArray(tmp_path / 'a.bin', (b, t, h), dtype, False)
  value = random_array((b, t, h), dtype)
  array.write(..., value)
  rng = np.random.default_rng(3)
  rows = np.arange(b)
  for positions in [rng.integers(0, t, size=(b, keep)),  # unsorted, with repeats
                    np.tile(np.arange(keep), (b, 1)),
                    np.zeros((b, 1), np.int64)]:
    positions = positions.astype(np.int32)
    out = array.read((rows[:, None], positions))
    assert out.shape == (b, positions.shape[1], h)
    np.testing.assert_array_equal(out,
                                  np.take_along_axis(value, positions[:, :, None], axis=1))


@pytest.mark.parametrize('shape', [(0, 5, 4), (3, 0, 4), (2, 3, 0)])
@pytest.mark.parametrize('dtype', DTYPES)
def test_disk_array_of_zero_size(tmp_path, shape, dtype):
  array = DiskArray(tmp_path / 'a.bin', shape, dtype, False)
  assert array.nbytes == 0
  array.write(..., np.zeros(shape, dtype))
  array.write((slice(None), slice(0, 0)), np.zeros((shape[0], 0, *shape[2:]), dtype))
  out = array.read()
  assert out.shape == shape and out.dtype == np.dtype(dtype)
  assert array.read((slice(None), slice(0, 0))).shape == (shape[0], 0, *shape[2:])


def o_direct_flag(fd: int) -> bool:
  """Whether the kernel holds `fd` open with O_DIRECT (its /proc fdinfo flags, octal)."""
  import os
  for line in open(f'/proc/self/fdinfo/{fd}'):
    if line.startswith('flags:'):
      return bool(int(line.split()[1], 8) & os.O_DIRECT)
  raise AssertionError('no flags line')


@pytest.mark.parametrize('with_pool', [False, True])
@pytest.mark.parametrize('dtype', DTYPES)
def test_disk_arrays_of_block_sized_entries_bypass_the_page_cache(tmp_path, dtype, with_pool):
  """Entries of 4 KiB (an opt-6.7b K or V entry is 8 or 16): direct reads and writes, row ranges
  read by the pool's threads; the same bytes as the buffered path in every access the mover
  makes (prompt and token writes, partial reads, a caller's unaligned buffer, gathers)."""
  b, t, h = 3, 7, 4096 // np.dtype(dtype).itemsize
  with ThreadPoolExecutor(3) as pool:
    array = DiskArray(tmp_path / 'a.bin', (b, t, h), dtype, True, pool if with_pool else None,
                      pool if with_pool else None)
    if array.direct:  # what the kernel says, where the filesystem takes O_DIRECT
      assert o_direct_flag(array._file.fd)
    else:
      assert 'EINVAL' in array._file.why_buffered and not o_direct_flag(array._file.fd)
    expected = np.zeros((b, t, h), dtype)
    full = random_array((b, t, h), dtype, seed=5)
    for start, stop in [(0, 4), (5, 6), (4, 5)]:
      array.write((slice(None), slice(start, stop)), full[:, start:stop])
      expected[:, start:stop] = full[:, start:stop]
    np.testing.assert_array_equal(array.read(), expected)
    for start, stop in [(0, 6), (2, 5), (6, 7)]:
      np.testing.assert_array_equal(array.read((slice(None), slice(start, stop))),
                                    expected[:, start:stop])
    unaligned = np.empty(b * 5 * h + 1, dtype)[1:].reshape(b, 5, h)
    assert array.read((slice(None), slice(0, 5)), out=unaligned) is unaligned
    np.testing.assert_array_equal(unaligned, expected[:, :5])
    positions = np.array([[3, 0], [5, 5], [1, 4]], np.int32)
    np.testing.assert_array_equal(array.read((np.arange(b)[:, None], positions)),
                                  np.take_along_axis(expected, positions[:, :, None], axis=1))
    array.close()


def test_direct_io_refused_mid_run_goes_on_buffered_on_the_same_descriptor(tmp_path,
                                                                          monkeypatch):
  """A filesystem that refuses a direct request (EINVAL) after the open: the request is retried
  buffered, the descriptor number stays the same (threads holding it go on), the bytes land."""
  import errno
  import os
  array = DiskArray(tmp_path / 'a.bin', (2, 4, 1024), np.float32, True)
  if not array.direct:
    pytest.skip('this filesystem refuses O_DIRECT at open')
  fd = array._file.fd
  refused = {'pwritev': 0, 'preadv': 0}
  real = {name: getattr(os, name) for name in refused}

  def refusing(name):
    def call(descriptor, buffers, offset):
      if o_direct_flag(descriptor):
        refused[name] += 1
        raise OSError(errno.EINVAL, 'Invalid argument')
      return real[name](descriptor, buffers, offset)
    return call

  monkeypatch.setattr(os, 'pwritev', refusing('pwritev'))
  value = random_array((2, 4, 1024), np.float32, seed=7)
  array.write(..., value)
  assert refused['pwritev'] == 1 and not array.direct and array._file.fd == fd
  assert not o_direct_flag(fd) and 'writes refused' in array._file.why_buffered
  monkeypatch.setattr(os, 'preadv', refusing('preadv'))
  np.testing.assert_array_equal(array.read(), value)
  assert refused['preadv'] == 0  # buffered now: nothing more to refuse
  array.close()


def test_a_long_row_range_is_read_in_chunks_by_the_pool(tmp_path):
  from flexjax import diskio

  class Counting(ThreadPoolExecutor):
    submitted = 0

    def submit(self, *args, **kwargs):
      Counting.submitted += 1
      return super().submit(*args, **kwargs)

  t = diskio.CHUNK // 4096 + 5  # one row's range: more than one request
  with Counting(3) as pool:
    array = DiskArray(tmp_path / 'a.bin', (2, t, 1024), np.float32, False, pool)
    value = random_array((2, t, 1024), np.float32, seed=6)
    array.write(..., value)
    np.testing.assert_array_equal(array.read((slice(None), slice(0, t))), value)
    array.close()
  assert Counting.submitted == 4  # two rows, two requests each


def test_a_token_write_sends_every_row_at_once_to_the_writers(tmp_path):
  """Decode's write of one position per row: one request per row, all on the writers' threads
  (none waits for another's turn in the disk's queue), each landing at its row."""
  started, release = [], threading.Event()

  class Gated(ThreadPoolExecutor):
    def submit(self, fn, *args):
      def gated():
        started.append(args[1])
        assert release.wait(TIMEOUT_S)
        return fn(*args)
      return super().submit(gated)

  b, t, h = 6, 5, 1024
  value = random_array((b, 1, h), np.float32, seed=9)
  with Gated(b) as writers:
    array = DiskArray(tmp_path / 'a.bin', (b, t, h), np.float32, False, None, writers)
    done = threading.Thread(target=array.write, args=((slice(None), slice(3, 4)), value))
    done.start()
    for _ in range(TIMEOUT_S * 100):  # every row's request under way before any finishes
      if len(started) == b:
        break
      threading.Event().wait(0.01)
    assert sorted(started) == [(r * t + 3) * h * 4 for r in range(b)]
    release.set()
    done.join(TIMEOUT_S)
    expected = np.zeros((b, t, h), np.float32)
    expected[:, 3:4] = value
    np.testing.assert_array_equal(array.read(), expected)
    array.close()


# ---- SplitArray ----------------------------------------------------------------------------------


def make_split(storage, rows, shape=(4, 10, 6), dtype=np.float32, preallocate_device=False):
  return SplitArray(storage, shape, dtype, rows, preallocate_device=preallocate_device)


@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('rows', SPLITS, ids=SPLIT_IDS)
def test_split_array_full_write_reads_back_the_offloaded_rows(tmp_path, rows, dtype):
  shape = (4, 10, 6)
  with Storage(cpu(), offload_dir=tmp_path) as storage:
    split = make_split(storage, rows, shape, dtype)
    assert split.offloaded_rows == rows['host'] + rows['disk']
    value = random_array(shape, dtype)
    split.write_offloaded(jnp.asarray(value), 0)
    out = split.read_offloaded(shape[1])
    assert out.shape == (split.offloaded_rows, *shape[1:]) and out.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(out, offloaded_of(value, rows))
    for length in (1, 4, 9):
      np.testing.assert_array_equal(split.read_offloaded(length),
                                    offloaded_of(value, rows)[:, :length])
    split.close()


@pytest.mark.parametrize('rows', [dict(device=1, host=5, disk=0), dict(device=0, host=2, disk=1)],
                         ids=['rows-split', 'positions-split'])
def test_large_host_copies_split_among_threads_keep_every_byte(tmp_path, rows):
  """An accelerator's host copies of offloaded rows run on several threads (Storage.copy); here
  three on the CPU backend: a prompt's rows written at a time offset and read back, by runs of
  rows (enough of them) or of positions (fewer rows than threads)."""
  shape = (6 if rows['host'] == 5 else 3, 300, 8192)  # 12-31 MiB of host rows per write
  value = random_array((shape[0], 200, shape[2]), np.float32, seed=7)
  with Storage(cpu(), offload_dir=tmp_path, copy_threads=3) as storage:
    split = make_split(storage, rows, shape)
    split.write_offloaded(jnp.asarray(value), 50)
    expected = np.zeros(shape, np.float32)
    expected[:, 50:250] = value
    np.testing.assert_array_equal(split.read_offloaded(300), offloaded_of(expected, rows))
    assert storage._copies is not None  # the copies went through the threads
    target = np.full((4, 16 << 10, 100), 7.0, np.float32)[:, ::2]  # strided, 12.5 MiB
    storage.copy(target, np.float32(1.5))  # broadcast
    assert np.all(target == 1.5)
    split.close()


@pytest.mark.parametrize('dtype', [np.float32, np.uint8])
@pytest.mark.parametrize('rows', SPLITS, ids=SPLIT_IDS)
def test_split_array_token_by_token_writes(tmp_path, rows, dtype):
  """Decode's pattern: a prompt of s tokens at time 0, then one token at a time at s, s+1, ..."""
  b, s, gen, h = 4, 5, 4, 3
  t = s + gen
  full = random_array((b, t, h), dtype, seed=4)
  expected = np.zeros((b, t, h), dtype)
  with Storage(cpu(), offload_dir=tmp_path) as storage:
    split = make_split(storage, rows, (b, t, h), dtype)
    np.testing.assert_array_equal(split.read_offloaded(t), offloaded_of(expected, rows))
    split.write_offloaded(jnp.asarray(full[:, :s]), 0)
    expected[:, :s] = full[:, :s]
    for step in range(gen):
      np.testing.assert_array_equal(split.read_offloaded(t), offloaded_of(expected, rows))
      slot = s + step
      split.write_offloaded(jnp.asarray(full[:, slot:slot + 1]), slot)
      expected[:, slot] = full[:, slot]
      np.testing.assert_array_equal(split.read_offloaded(slot + 1),
                                    offloaded_of(expected, rows)[:, :slot + 1])
    np.testing.assert_array_equal(split.read_offloaded(t), offloaded_of(full, rows))
    split.close()


@pytest.mark.parametrize('entry', [6, 1024], ids=['buffered', 'direct-sized'])
@pytest.mark.parametrize('rows', SPLITS, ids=SPLIT_IDS)
def test_a_cache_read_takes_the_written_positions_and_zeros_the_rest(tmp_path, monkeypatch,
                                                                       rows, entry):
  """Decode reads a cache's first `written` positions into a buffer of all t (the rest
  masked): the positions past them come back zero, whatever the file and the reused memory
  hold there, and the disk rows' reads cover the written positions only."""
  b, t = 4, 9
  full = random_array((b, t, entry), np.float32, seed=8)
  with Storage(cpu(), offload_dir=tmp_path) as storage:
    split = make_split(storage, rows, (b, t, entry), np.float32)
    split.write_offloaded(jnp.asarray(full), 0)  # every position holds a non-zero value
    read_bytes = []
    if split.disk is not None:
      real = split.disk._file.read_into
      monkeypatch.setattr(split.disk._file, 'read_into',
                          lambda view, offset: (read_bytes.append(len(view)), real(view, offset)))
    for written in (1, 5, t - 1, t):
      read_bytes.clear()
      np.full(rows['host'] * t * entry + 4096, 7.0, np.float32)  # freed: garbage to reuse
      out = split.read_offloaded(written, padded_to=t)
      expected = offloaded_of(full, rows).copy()
      expected[:, written:] = 0
      assert out.shape == (split.offloaded_rows, t, entry)
      np.testing.assert_array_equal(out, expected)
      assert sum(read_bytes) == rows['disk'] * written * entry * 4
    split.close()


@pytest.mark.parametrize('rows', SPLITS, ids=SPLIT_IDS)
def test_a_cache_read_into_a_reused_buffer_clears_only_what_an_earlier_read_left(tmp_path, rows):
  """A reused staging buffer is known to hold zeros from `zeros_from` on: a read of `written`
  positions fills those, clears [written, zeros_from), and writes nothing from zeros_from on
  (a marker left there stays); a buffer of another shape is refused."""
  b, t, entry = 4, 9, 1024
  full = random_array((b, t, entry), np.float32, seed=9)
  with Storage(cpu(), offload_dir=tmp_path) as storage:
    split = make_split(storage, rows, (b, t, entry), np.float32)
    split.write_offloaded(jnp.asarray(full), 0)
    buffer = aligned_empty((split.offloaded_rows, t, entry), np.float32)
    for written, zeros_from in ((3, 7), (5, 5), (6, 2)):
      buffer[...] = 7.0
      out = split.read_offloaded(written, padded_to=t, out=buffer, zeros_from=zeros_from)
      assert out is buffer
      np.testing.assert_array_equal(out[:, :written], offloaded_of(full, rows)[:, :written])
      assert (out[:, written:max(written, zeros_from)] == 0).all()
      assert (out[:, max(written, zeros_from):] == 7.0).all()
    with pytest.raises(ValueError, match='is not'):
      split.read_offloaded(3, padded_to=t, out=buffer[:, :t - 1], zeros_from=t)
    split.close()


@pytest.mark.parametrize('rows', SPLITS, ids=SPLIT_IDS)
def test_split_array_write_in_the_middle_leaves_zeros_around(tmp_path, rows):
  shape = (4, 8, 5)
  value = random_array((4, 3, 5), np.float16)
  expected = np.zeros(shape, np.float16)
  expected[:, 2:5] = value
  with Storage(cpu(), offload_dir=tmp_path) as storage:
    split = make_split(storage, rows, shape, np.float16)
    split.write_offloaded(jnp.asarray(value), 2)
    np.testing.assert_array_equal(split.read_offloaded(8), offloaded_of(expected, rows))
    split.close()


@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('rows', SPLITS, ids=SPLIT_IDS)
def test_split_array_row_gather_equals_take_along_axis(tmp_path, rows, dtype):
  b, t, h, keep = 4, 12, 5, 6
  value = random_array((b, t, h), dtype, seed=5)
  rng = np.random.default_rng(6)
  with Storage(cpu(), offload_dir=tmp_path) as storage:
    split = make_split(storage, rows, (b, t, h), dtype)
    split.write_offloaded(jnp.asarray(value[:, :7]), 0)  # entries 7.. stay zeros
    expected = np.zeros_like(value)
    expected[:, :7] = value[:, :7]
    n = split.offloaded_rows
    for positions in [rng.integers(0, t, size=(n, keep)),  # unsorted, repeats, unwritten slots
                      np.tile(np.arange(t - keep, t), (n, 1)),
                      np.full((n, 1), 3)]:
      positions = positions.astype(np.int32)
      out = split.read_offloaded_rows(positions)
      assert out.shape == (n, positions.shape[1], h) and out.dtype == np.dtype(dtype)
      np.testing.assert_array_equal(
          out, np.take_along_axis(offloaded_of(expected, rows), positions[:, :, None], axis=1))
    split.close()


def test_split_array_with_disk_rows_reads_a_snapshot(tmp_path):
  rows = {'device': 1, 'host': 1, 'disk': 2}
  with Storage(cpu(), offload_dir=tmp_path) as storage:
    split = make_split(storage, rows, (4, 3, 2))
    first = random_array((4, 3, 2), np.float32, seed=7)
    split.write_offloaded(jnp.asarray(first), 0)
    before = split.read_offloaded(3)
    split.write_offloaded(jnp.asarray(random_array((4, 3, 2), np.float32, seed=8)), 0)
    np.testing.assert_array_equal(before, first[1:])
    split.close()


def test_split_array_all_on_device_has_nothing_offloaded(tmp_path):
  rows = {'device': 4, 'host': 0, 'disk': 0}
  with Storage(cpu(), offload_dir=tmp_path) as storage:
    split = make_split(storage, rows, (4, 6, 3), preallocate_device=True)
    assert split.offloaded_rows == 0
    assert split.device.shape == (4, 6, 3)
    np.testing.assert_array_equal(np.asarray(split.device), 0)
    split.write_offloaded(jnp.ones((4, 6, 3)), 0)  # nothing to do
    assert split.read_offloaded(6) is None
    split.close()
  assert not any(tmp_path.iterdir())  # no disk rows: no offload folder either


def blocked_write(split, value, start):
  """A write-back like the engine's: a Future whose write runs only once `release` is set."""
  release = threading.Event()
  executor = ThreadPoolExecutor(max_workers=1)

  def write():
    assert release.wait(TIMEOUT_S), 'the test never released the write'
    split.write_offloaded(value, start)

  split.pending = executor.submit(write)
  return release, executor


@pytest.mark.parametrize('read', ['read_offloaded', 'read_offloaded_rows'])
@pytest.mark.parametrize('rows', SPLITS, ids=SPLIT_IDS)
def test_reads_wait_for_the_pending_write(tmp_path, rows, read):
  shape = (4, 6, 3)
  value = random_array(shape, np.float32, seed=9)
  n = rows['host'] + rows['disk']
  positions = np.tile(np.array([5, 0, 2], np.int32), (n, 1))
  expected = offloaded_of(value, rows)
  if read == 'read_offloaded_rows':
    expected = np.take_along_axis(expected, positions[:, :, None], axis=1)
  with Storage(cpu(), offload_dir=tmp_path) as storage:
    split = make_split(storage, rows, shape)
    release, executor = blocked_write(split, jnp.asarray(value), 0)
    started, finished, result = threading.Event(), threading.Event(), {}

    def reader():
      started.set()
      result['out'] = (split.read_offloaded(shape[1]) if read == 'read_offloaded'
                       else split.read_offloaded_rows(positions))
      finished.set()

    thread = threading.Thread(target=reader)
    thread.start()
    try:
      assert started.wait(TIMEOUT_S)
      # The write cannot have run yet, so neither can a read that waits for it.
      assert not split.pending.done()
      assert not finished.is_set()
    finally:
      release.set()
      thread.join(TIMEOUT_S)
      executor.shutdown()
    assert not thread.is_alive()
    np.testing.assert_array_equal(result['out'], expected)
    split.close()


def test_a_failed_pending_write_surfaces_at_the_next_read(tmp_path):
  with Storage(cpu(), offload_dir=tmp_path) as storage:
    split = make_split(storage, {'device': 0, 'host': 2, 'disk': 2})
    with ThreadPoolExecutor(max_workers=1) as executor:
      split.pending = executor.submit(split.write_offloaded, jnp.ones((4, 3, 7)), 0)  # bad width
    with pytest.raises(ValueError):
      split.read_offloaded(10)
    split.close()


@pytest.mark.parametrize('rows', SPLITS, ids=SPLIT_IDS)
def test_split_array_accounts_its_rows_per_tier(tmp_path, rows):
  shape, dtype = (4, 10, 6), np.float16
  row_bytes = 10 * 6 * 2
  with Storage(cpu(), offload_dir=tmp_path) as storage:
    split = make_split(storage, rows, shape, dtype)
    assert {tier: a.current for tier, a in storage.accounts.items()} == {
        tier: rows[tier] * row_bytes for tier in rows}
    split.close()
    assert {tier: a.current for tier, a in storage.accounts.items()} == {
        'device': 0, 'host': 0, 'disk': 0}
    assert storage.peaks() == {tier: rows[tier] * row_bytes for tier in rows}


# ---- Storage and budgets -------------------------------------------------------------------------


def test_offload_folder_lives_from_first_disk_array_to_close(tmp_path):
  parent = tmp_path / 'offload'  # does not exist yet: created on demand
  storage = Storage(cpu(), offload_dir=parent)
  storage.host_array((4, 4), np.float32)
  assert not parent.exists() or not any(parent.iterdir())  # no disk array, no folder
  first = storage.disk_array((2, 3), np.float32)
  second = storage.disk_array((5,), np.uint8)
  (run_dir,) = parent.iterdir()  # one folder per run, shared by its disk arrays
  assert run_dir.is_dir()
  assert first.path.parent == run_dir and second.path.parent == run_dir
  assert first.path != second.path
  first.write(..., np.ones((2, 3), np.float32))
  second.write(..., np.arange(5, dtype=np.uint8))
  np.testing.assert_array_equal(first.read(), 1)  # distinct files: no overlap
  np.testing.assert_array_equal(second.read(), np.arange(5))
  storage.close()
  assert not run_dir.exists()
  assert parent.is_dir() and not any(parent.iterdir())  # only the run's own folder goes
  storage.close()  # a second close is harmless


def test_offload_folder_is_removed_when_the_run_fails(tmp_path):
  with pytest.raises(RuntimeError, match='boom'):
    with Storage(cpu(), offload_dir=tmp_path) as storage:
      storage.disk_array((3,), np.float32).write(..., np.ones(3, np.float32))
      assert len(list(tmp_path.iterdir())) == 1
      raise RuntimeError('boom')
  assert not any(tmp_path.iterdir())


def test_split_array_with_disk_rows_writes_under_the_run_folder(tmp_path):
  with Storage(cpu(), offload_dir=tmp_path) as storage:
    split = make_split(storage, {'device': 1, 'host': 1, 'disk': 2})
    (run_dir,) = tmp_path.iterdir()
    assert any(run_dir.iterdir())
    split.close()
  assert not any(tmp_path.iterdir())


def test_tier_account_refuses_past_its_budget():
  account = TierAccount('host', 100)
  account.reserve(60)
  account.reserve(40)  # exactly the budget is fine
  with pytest.raises(FlexjaxError, match='host budget exceeded'):
    account.reserve(1)
  assert account.current == 100  # a refused reservation takes nothing
  account.release(70)
  account.reserve(50)
  assert (account.current, account.peak) == (80, 100)
  unlimited = TierAccount('disk', None)
  unlimited.reserve(10**15)
  assert unlimited.peak == 10**15


@pytest.mark.parametrize('tier,rows', [
    ('device', {'device': 3, 'host': 1, 'disk': 0}),
    ('host', {'device': 0, 'host': 3, 'disk': 1}),
    ('disk', {'device': 0, 'host': 0, 'disk': 3}),
])
def test_storage_budgets_refuse_a_split_array_that_does_not_fit(tmp_path, tier, rows):
  row_bytes = 10 * 6 * 4  # make_split's default shape and dtype
  budgets = {'device': 2 * row_bytes, 'host': 2 * row_bytes, 'disk': 2 * row_bytes}
  with Storage(cpu(), budgets, offload_dir=tmp_path) as storage:
    with pytest.raises(FlexjaxError, match=f'{tier} budget exceeded'):
      make_split(storage, rows)
    assert storage.accounts[tier].current == 0  # the refused rows take nothing
    fits = make_split(storage, {'device': 2, 'host': 1, 'disk': 1})
    assert storage.accounts[tier].current <= 2 * row_bytes
    fits.close()


def test_storage_budgets_and_peaks(tmp_path):
  with Storage(cpu(), {'host': 64, 'disk': 40}, offload_dir=tmp_path) as storage:
    assert storage.accounts['device'].budget is None  # a missing key: unlimited
    storage.host_array((8,), np.float32)  # 32 bytes
    with pytest.raises(FlexjaxError, match='host budget exceeded'):
      storage.host_array((9,), np.float32)  # 32 + 36 > 64
    storage.disk_array((10,), np.float32)  # exactly 40
    with pytest.raises(FlexjaxError, match='disk budget exceeded'):
      storage.disk_array((1,), np.uint8)
    storage.free('host', 32)
    storage.free('disk', 40)
    assert storage.peaks() == {'device': 0, 'host': 32, 'disk': 40}
    assert storage.accounts['host'].current == 0 and storage.accounts['disk'].current == 0
    storage.host_array((16,), np.float32)  # the freed bytes can be used again
    assert storage.peaks()['host'] == 64


@pytest.mark.parametrize('dtype', DTYPES)
def test_a_host_buffer_in_place_is_the_device_array_without_a_copy(tmp_path, dtype):
  """On a CPU backend a host-tier buffer becomes a device array over the same memory
  (plan.used_in_place): a later write into the buffer is what the array holds."""
  with Storage(cpu(), offload_dir=tmp_path) as storage:
    buffer = storage.host_weights(random_array((64, 48), dtype), 'weights.host')
    value = storage.in_place(buffer)
    assert isinstance(value, jax.Array) and value.unsafe_buffer_pointer() == buffer.ctypes.data
    buffer[3] = random_array((48,), dtype, seed=9)
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda a: a + 0)(value)), buffer)


def test_a_host_buffer_the_device_would_copy_stays_a_buffer(tmp_path):
  """A buffer XLA:CPU would copy (not aligned for it) is kept as it is, not doubled."""
  with Storage(cpu(), offload_dir=tmp_path) as storage:
    unaligned = aligned_empty((4096 + 2,), np.uint8)[2:].view(np.float16)
    assert storage.in_place(unaligned) is unaligned
