"""The streaming weight layout: one flat file per stage holding every tensor at a 4 KiB-aligned
offset, as stored (or int4-packed), written once per model and variant and then read in place
by direct I/O. Runs open it read-only; nothing of it is copied into a run's offload folder.

A layout is a folder `<variant>/` with `<stage>.bin` files and `index.json` (written last). It is
assembled in a hidden sibling folder and renamed into place when complete, so an interrupted
write leaves nothing that looks like a layout.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Callable

import numpy as np

from flexjax import diskio, scratch
from flexjax import progress as progress_lib
from flexjax.config import np_dtype
from flexjax.errors import FlexjaxError
from flexjax.model import params as params_lib

FORMAT = 'flexjax-stream-v3'
ROW_GAP = 16 << 10  # rows gathered from a tensor this close are read in one request
INDEX = 'index.json'


@dataclasses.dataclass(frozen=True)
class StreamTensor:
  """A tensor (or some of its rows) in a layout: `nbytes` at byte `offset` of `file`. Direct I/O
  reads whole aligned blocks: `padded` bytes from `start`, the tensor `skip` bytes in."""

  file: diskio.DiskFile
  offset: int
  shape: tuple[int, ...]
  dtype: np.dtype
  nbytes: int

  @property
  def start(self) -> int:
    return self.offset - self.offset % diskio.BLOCK

  @property
  def skip(self) -> int:
    return self.offset - self.start

  @property
  def padded(self) -> int:
    return diskio.align_up(self.skip + self.nbytes)

  def rows(self, first: int, end: int) -> 'StreamTensor':
    """Rows [first, end) along axis 0."""
    row = self.nbytes // self.shape[0]
    return StreamTensor(self.file, self.offset + first * row, (end - first, *self.shape[1:]),
                        self.dtype, (end - first) * row)

  def view(self, buffer: np.ndarray) -> np.ndarray:
    """The tensor inside a buffer its padded bytes were read into."""
    return buffer[self.skip:self.skip + self.nbytes].view(self.dtype).reshape(self.shape)

  def read(self) -> np.ndarray:
    """A fresh aligned host array of the tensor (read on the calling thread)."""
    buffer = diskio.aligned_buffer(self.padded)
    self.file.read_into(memoryview(buffer), self.start)
    return self.view(buffer)

  def gather(self, rows: np.ndarray, reader: diskio.Reader) -> tuple[np.ndarray, int]:
    """Rows `rows` ([n] ints, any order and repeats; those outside [0, shape[0]) give zeros)
    as a fresh [n, ...] array, reading only the aligned blocks that hold them: nearby rows
    (under ROW_GAP bytes apart) in one request, the requests on the reader's threads.
    Returns (the rows, bytes read)."""
    row = self.nbytes // self.shape[0]
    out = np.zeros((len(rows), *self.shape[1:]), self.dtype)
    inside = (rows >= 0) & (rows < self.shape[0])
    wanted = np.unique(rows[inside])
    if not len(wanted):
      return out, 0
    starts = self.offset + wanted * row  # file offset of each wanted row
    first = starts - starts % diskio.BLOCK
    ends = -(-(starts + row) // diskio.BLOCK) * diskio.BLOCK
    # runs of rows whose blocks lie within ROW_GAP of each other are read as one span
    cuts = np.flatnonzero(first[1:] > ends[:-1] + ROW_GAP) + 1
    span_start, span_end = first[np.r_[0, cuts]], ends[np.r_[cuts, len(wanted)] - 1]
    at = np.r_[0, np.cumsum(span_end - span_start)]  # where each span lies in the buffer
    buffer = diskio.aligned_buffer(int(at[-1]))
    futures = [f for start, end, a in zip(span_start, span_end, at)
               for f in reader.read(self.file, int(start), buffer[a:a + end - start])]
    diskio.wait(futures)
    span_of = np.searchsorted(span_start, first, side='right') - 1
    in_buffer = at[span_of] + starts - span_start[span_of]  # of each wanted row
    found = in_buffer[np.searchsorted(wanted, rows[inside])]
    out.view(np.uint8).reshape(len(rows), row)[inside] = buffer[found[:, None] + np.arange(row)]
    return out, len(buffer)


@dataclasses.dataclass(frozen=True)
class Entry:
  """Where a tensor lies in its stage file."""

  offset: int
  shape: tuple[int, ...]
  dtype: str

  @property
  def nbytes(self) -> int:
    return int(np.prod(self.shape)) * _dtype(self.dtype).itemsize


def stored_form(shape: tuple[int, ...], dtype: np.dtype, packed: Callable | None,
                pack: bool) -> tuple[tuple[int, ...], np.dtype]:
  """Shape and dtype of a tensor as the layout stores it."""
  if pack:
    return tuple(packed(shape)), np.dtype(np.uint8)
  return tuple(shape), np.dtype(dtype)


def plan_layout(stage_shapes: dict[str, dict], dtype: np.dtype, *, pack: Callable[[tuple], bool],
                packed_shape: Callable[[tuple], tuple] | None) -> dict[str, dict[str, Entry]]:
  """Every stage's tensors with their aligned offsets (from shapes alone)."""
  index = {}
  for stage, shapes in stage_shapes.items():
    entries, offset = {}, 0
    for path in sorted(shapes):
      shape, dt = stored_form(shapes[path], dtype, packed_shape, pack(shapes[path]))
      entry = Entry(offset, shape, 'uint8' if dt == np.uint8 else dt.name)
      entries['/'.join(path)] = entry
      offset += diskio.align_up(entry.nbytes)
    index[stage] = entries
  return index


def stage_file_bytes(entries: dict[str, Entry]) -> int:
  return max((e.offset + diskio.align_up(e.nbytes) for e in entries.values()), default=0)


class StreamLayout:
  """An opened layout: one read-only handle per stage file, shared by its tensors."""

  def __init__(self, folder: Path, *, drop_page_cache: bool = False):
    self.folder = folder
    self.index = _index(json.loads((folder / INDEX).read_text()))
    self._files = {stage: diskio.DiskFile(folder / f'{stage}.bin',
                                          drop_page_cache=drop_page_cache)
                   for stage, entries in self.index.items() if entries}

  @property
  def direct(self) -> bool:
    """Whether every file is read with O_DIRECT (False: the filesystem refused it)."""
    return all(f.direct for f in self._files.values())

  def files(self) -> list[Path]:
    """The layout's stage files, by name."""
    return sorted(f.path for f in self._files.values())

  def tensor(self, stage: str, path: tuple[str, ...]) -> StreamTensor:
    if path == ('tokens',):  # stored once, used by two stages
      stage = 'tokens'
    entry = self.index[stage]['/'.join(path)]
    return StreamTensor(self._files[stage], entry.offset, entry.shape, _dtype(entry.dtype),
                        entry.nbytes)

  def close(self) -> None:
    for f in self._files.values():
      f.close()
    self._files = {}


def layout_matches(folder: Path, meta: dict) -> bool:
  """Whether `folder` holds a complete layout written for `meta` (model, dtype, variant): its
  index, and every stage file at the size the index gives it (one removed or cut short since,
  by hand or by a full disk's cleanup, makes the layout stale: it is written again)."""
  try:
    found = json.loads((folder / INDEX).read_text())
    if not all(found.get(k) == v for k, v in meta.items()):
      return False
    for stage, entries in _index(found).items():
      if entries and (folder / f'{stage}.bin').stat().st_size != stage_file_bytes(entries):
        return False
  except (OSError, ValueError, KeyError, TypeError):  # unreadable, or not an index of ours
    return False
  return True


def _index(meta: dict) -> dict[str, dict[str, Entry]]:
  """A layout index's entries, per stage (as write_layout records them)."""
  return {stage: {k: Entry(v['offset'], tuple(v['shape']), v['dtype']) for k, v in entries.items()}
          for stage, entries in meta['stages'].items()}


def write_layout(folder: Path, index: dict[str, dict[str, Entry]], meta: dict, *,
                 read_stage: Callable[[str], dict], pack: Callable[[np.ndarray], np.ndarray],
                 progress: bool) -> None:
  """Writes a layout into `folder` atomically: space for every file is reserved first (a full
  disk fails here, naming the folder and the bytes), then each stage is written and synced."""
  total = sum(stage_file_bytes(entries) for entries in index.values())
  # owned while written: a run killed here leaves a folder the next layout write removes
  with scratch.claim(folder.parent, f'.{folder.name}.partial-') as partial:
    tmp = partial.path
    fds = {}
    try:
      for stage, entries in index.items():
        fds[stage] = diskio.reserve_file(
            tmp / f'{stage}.bin', stage_file_bytes(entries), what='the streaming weight layout',
            where=folder.parent,
            fix=f'free space there ({total:,} bytes in all) or point --weights_cache elsewhere')
      bar = progress_lib.bar(total, f'writing weight layout {folder.name}', unit='B',
                             unit_scale=True, show=progress, leave=False)
      for stage, entries in index.items():
        host = params_lib.flatten(read_stage(stage)) if entries else {}
        for key, entry in entries.items():
          array = np.asarray(host.pop(tuple(key.split('/'))))
          data = (pack(array) if entry.dtype == 'uint8' and array.dtype != np.uint8
                  else array.astype(_dtype(entry.dtype), copy=False))
          data = np.ascontiguousarray(data)
          if data.shape != entry.shape:
            raise FlexjaxError(f'weight {stage}/{key} has shape {data.shape}, the layout expects '
                               f'{entry.shape}; the weights and the config disagree')
          diskio.write_all(fds[stage], memoryview(data.reshape(-1).view(np.uint8)), entry.offset)
          bar.update(diskio.align_up(entry.nbytes))
        os.fsync(fds[stage])
      bar.close()
    finally:
      for fd in fds.values():
        os.close(fd)
    stages = {stage: {k: dataclasses.asdict(e) for k, e in entries.items()}
              for stage, entries in index.items()}
    (tmp / INDEX).write_text(json.dumps({**meta, 'stages': stages}) + '\n')
    partial.disown()  # a finished layout: never swept
    try:
      os.rename(tmp, folder)
    except OSError:  # another process finished the same layout first: keep theirs
      if not layout_matches(folder, meta):
        raise


def discard(folder: Path) -> None:
  """Removes a layout folder: renamed aside first, so that no half-removed folder is left where
  a layout is looked for."""
  try:
    aside = scratch.claim(folder.parent, f'.{folder.name}.stale-')
  except OSError as e:
    raise _cannot_discard(folder, e) from None
  with aside:  # a run killed while removing leaves it to the next sweep
    try:
      os.rename(folder, aside.path / folder.name)
    except FileNotFoundError:  # another process removed it first
      pass
    except OSError as e:
      raise _cannot_discard(folder, e) from None


def _cannot_discard(folder: Path, error: OSError) -> FlexjaxError:
  return FlexjaxError(f'the weight layout {str(folder)!r} is stale and cannot be replaced '
                      f'({error.strerror}); remove it, or pass --weights_cache=<a writable '
                      'folder>')


def default_cache_dir() -> Path:
  """Where layouts of dummy weights (and of read-only checkpoints) go: $FLEXJAX_CACHE, else
  $XDG_CACHE_HOME/flexjax, else ~/.cache/flexjax."""
  if os.environ.get('FLEXJAX_CACHE'):
    return Path(os.environ['FLEXJAX_CACHE'])
  base = os.environ.get('XDG_CACHE_HOME') or os.path.join(os.path.expanduser('~'), '.cache')
  return Path(base) / 'flexjax'


def writable(folder: Path) -> bool:
  """Whether a layout can be created under `folder` (it or its nearest existing parent)."""
  probe = folder
  while not probe.exists():
    probe = probe.parent
  return os.access(probe, os.W_OK)


def ensure_layout(source, *, packs: Callable[[tuple], bool],
                  pack: Callable[[np.ndarray], np.ndarray] | None,
                  packed_shape: Callable[[tuple], tuple] | None, variant: str,
                  cache_dir: Path | None, drop_page_cache: bool = False,
                  progress: bool = False) -> StreamLayout:
  """Opens the source's layout of `variant`, writing it first when it is missing or stale.

  Args:
    source: a WeightSource (Checkpoint or DummyWeights).
    packs: whether a tensor of a shape is stored packed (quantized) in this variant.
    pack: quantizes a tensor to byte rows (for the tensors `packs` names).
    packed_shape: shape of a matrix once packed (with pack).
    variant: the layout's name, e.g. 'float16' or 'float16-q4g64'.
    cache_dir: the cache folder (default: default_cache_dir()).
  """
  cfg = source.config
  folder = source.stream_folder(Path(cache_dir) if cache_dir else default_cache_dir()) / variant
  meta = {'format': FORMAT, 'variant': variant, 'dtype': source.dtype,
          'source': source.fingerprint(), 'model': cfg.to_dict()}
  if not layout_matches(folder, meta):
    # one process writes a model's layouts at a time (runs started together would each write
    # the whole layout, reserving its disk space twice); one that waited takes the layout the
    # other wrote
    with scratch.alone_in(folder.parent, f'waiting for another process writing the weight '
                                         f'layout {str(folder)!r}'):
      if not layout_matches(folder, meta):
        if folder.exists():  # stale (an older format, or weights since rewritten): derived data
          discard(folder)
        shapes = {stage: params_lib.flatten(params_lib.stage_shapes(cfg, stage))
                  for stage in params_lib.stage_names(cfg)}
        index = plan_layout(shapes, np_dtype(source.dtype), pack=packs,
                            packed_shape=packed_shape)
        write_layout(folder, index, meta, read_stage=source.read, pack=pack, progress=progress)
  return StreamLayout(folder, drop_page_cache=drop_page_cache)


def _dtype(name: str) -> np.dtype:
  return np.dtype(np.uint8) if name == 'uint8' else np.dtype(np_dtype(name))
