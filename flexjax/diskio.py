"""The disk reader/writer of the mover: files opened once (O_DIRECT where the filesystem allows
it), aligned reads in large chunks spread over a few I/O threads, and space reserved up front."""

from __future__ import annotations

import concurrent.futures
import errno
import mmap
import os
import time
from pathlib import Path

import numpy as np

from flexjax.errors import FlexjaxError

BLOCK = 4096  # alignment of offsets, lengths and buffers for direct I/O
CHUNK = 8 << 20  # bytes per read request: large enough for full-speed sequential reads
IO_THREADS = 3  # reader threads by default: a window of IO_THREADS x CHUNK bytes in flight


def align_up(nbytes: int, alignment: int = BLOCK) -> int:
  return -(-nbytes // alignment) * alignment


def aligned_buffer(nbytes: int, alignment: int = BLOCK) -> np.ndarray:
  """A uint8 buffer of `nbytes` starting on an `alignment`-byte boundary, contents unspecified,
  every page backed by a CPU write as it is made: a direct read into pages nothing had written
  ran at a third of the disk's rate, at every read into them and not only the first (opt-1.3b,
  32 x 128, 85% of the weights on disk: the head's 175 MB of token table read into a staging
  buffer whose other half the layers' reads had filled in 0.14-0.28 s against 0.08-0.11 s,
  the decode step 13% faster; 175 MB alone into a fresh buffer 1.8-2.3 GB/s, into a written
  one 3.1)."""
  raw = np.empty(nbytes + alignment, np.uint8)
  offset = -raw.ctypes.data % alignment
  raw[offset::mmap.PAGESIZE] = 0
  return raw[offset:offset + nbytes]


class DiskFile:
  """One file, opened once for the run: O_DIRECT where the filesystem accepts it (`direct`),
  else buffered (then `drop_page_cache` drops what was read from the page cache)."""

  def __init__(self, path: str | os.PathLike, *, writable: bool = False,
               drop_page_cache: bool = False, direct: bool = True):
    self.path = Path(path)
    self.mode = os.O_RDWR if writable else os.O_RDONLY
    self.direct = direct and hasattr(os, 'O_DIRECT')
    self.why_buffered = ('' if self.direct else 'not asked for' if not direct
                         else 'this OS has no O_DIRECT')
    try:
      self.fd = os.open(self.path, self.mode | (os.O_DIRECT if self.direct else 0))
    except OSError as e:
      if e.errno != errno.EINVAL:  # EINVAL: the filesystem refuses direct I/O (e.g. tmpfs)
        raise FlexjaxError(f'cannot open {str(self.path)!r} ({e.strerror}); check that it exists '
                           'and is readable') from None
      self.fd = os.open(self.path, self.mode)
      self.direct, self.why_buffered = False, 'O_DIRECT refused (EINVAL)'
    self.drop_page_cache_asked = drop_page_cache
    self.drop_page_cache = drop_page_cache and not self.direct

  def read_into(self, view: memoryview, offset: int) -> None:
    """Fills `view` from byte `offset`. Direct reads need an aligned offset, length and buffer;
    a filesystem refusing one mid-run (EINVAL) is retried buffered."""
    self._transfer(os.preadv, 'read', view, offset)
    if self.drop_page_cache:
      os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_DONTNEED)

  def write_from(self, view: memoryview, offset: int) -> None:
    """Writes `view` at byte `offset` (direct writes: aligned offset, length and buffer; a
    refusal mid-run is retried buffered)."""
    self._transfer(os.pwritev, 'write', view, offset)

  def _transfer(self, call, what: str, view: memoryview, offset: int) -> None:
    """All of `view` through `call` (os.preadv or os.pwritev) from byte `offset` on."""
    while len(view):
      try:
        n = call(self.fd, [view], offset)
      except OSError as e:
        if e.errno != errno.EINVAL or not self.direct:
          raise FlexjaxError(f'{what} of {str(self.path)!r} at byte {offset} failed '
                             f'({e.strerror})') from None
        self._reopen_buffered()
        self.why_buffered = f'O_DIRECT {what}s refused (EINVAL)'
        continue
      if n <= 0:
        raise FlexjaxError(f'short {what} at byte {offset} of {str(self.path)!r}; the file was '
                           'changed or truncated by another process')
      view, offset = view[n:], offset + n

  def _reopen_buffered(self) -> None:
    """The same descriptor number, now for a buffered open of the file (dup2 swaps it in one
    step, so other threads' requests on it go on without a closed descriptor)."""
    fd = os.open(self.path, self.mode)
    os.dup2(fd, self.fd)
    os.close(fd)
    self.direct = False
    self.drop_page_cache = self.drop_page_cache_asked

  def close(self) -> None:
    if self.fd is not None:
      os.close(self.fd)
      self.fd = None


def reserve_file(path: Path, nbytes: int, *, what: str, fix: str,
                 where: Path | None = None) -> int:
  """Creates `path` with `nbytes` reserved on disk (posix_fallocate); returns its fd (O_RDWR).
  A full disk is a one-line error naming the folder (`where`, default the file's) and the bytes,
  before anything is written."""
  fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
  if nbytes:
    try:
      os.posix_fallocate(fd, 0, nbytes)
    except OSError as e:
      os.close(fd)
      path.unlink(missing_ok=True)
      raise FlexjaxError(f'cannot reserve {nbytes:,} bytes for {what} in '
                         f'{str(where or path.parent)!r} ({e.strerror}); {fix}') from None
  return fd


def write_all(fd: int, data: memoryview, offset: int) -> None:
  while len(data):
    n = os.pwritev(fd, [data], offset)
    data, offset = data[n:], offset + n


class Reader:
  """A few I/O threads reading file ranges into host buffers, CHUNK bytes per request, so the
  disk sees several large requests at once while the caller computes."""

  def __init__(self, threads: int = IO_THREADS, chunk: int = CHUNK):
    if not 1 <= threads <= 16:
      raise FlexjaxError(f'io_threads={threads} must be between 1 and 16')
    self.chunk = chunk
    self._pool = concurrent.futures.ThreadPoolExecutor(threads, 'flexjax-io')

  def read(self, file: DiskFile, offset: int, out: np.ndarray) -> list[concurrent.futures.Future]:
    """Starts reading len(out) bytes from `offset` into `out` (uint8, C-contiguous). Returns
    the futures of its chunks."""
    pieces = requests([(offset, memoryview(out).cast('B'))], self.chunk)
    return [self._pool.submit(file.read_into, view, at) for view, at in pieces]

  def close(self) -> None:
    self._pool.shutdown(wait=True, cancel_futures=False)


def requests(ranges, chunk: int = CHUNK) -> list[tuple[memoryview, int]]:
  """(view, byte offset) requests of at most `chunk` bytes covering each (offset, view) of
  `ranges` in order."""
  return [(view[start:start + chunk], offset + start) for offset, view in ranges
          for start in range(0, len(view), chunk)]


def transfer(call, pieces: list[tuple[memoryview, int]],
             pool: concurrent.futures.Executor | None = None) -> None:
  """call(view, offset) for every request: on `pool`'s threads at once where there is more than
  one, else in turn; returns when all are done."""
  if pool is None or len(pieces) == 1:
    for view, offset in pieces:
      call(view, offset)
  else:
    wait([pool.submit(call, view, offset) for view, offset in pieces])


def wait(futures: list[concurrent.futures.Future]) -> None:
  for future in futures:
    future.result()


def drop_from_page_cache(path: str | os.PathLike) -> None:
  """Asks the kernel to drop the file's pages from the page cache (a later read is cold)."""
  fd = os.open(path, os.O_RDONLY)
  try:
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
  finally:
    os.close(fd)


def read_through(path: str | os.PathLike, *, file_bytes: int, chunk_bytes: int = CHUNK,
                 threads: int = IO_THREADS) -> tuple[float, bool, str]:
  """Reads a file's first file_bytes cold (dropped from the page cache first) as the engine
  reads weights (O_DIRECT where allowed, chunk_bytes per request on `threads` I/O threads, a
  window of threads x chunk_bytes at a time). Returns (seconds, whether the reads were direct,
  why not)."""
  drop_from_page_cache(path)
  file = DiskFile(path)
  reader = Reader(threads, chunk=chunk_bytes)
  window = aligned_buffer(threads * chunk_bytes)
  try:
    start = time.perf_counter()
    for offset in range(0, file_bytes, len(window)):
      length = min(len(window), file_bytes - offset)
      wait(reader.read(file, offset, window[:length]))
    return time.perf_counter() - start, file.direct, file.why_buffered
  finally:
    reader.close()
    file.close()
