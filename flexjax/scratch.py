"""Folders a process owns while it lives, and the removal of what dead processes left.

A run's offload folder (KV cache, hidden states: up to hundreds of GB), a weight layout or
checkpoint being written, a disk probe's file: a process removes them when it ends, but not when
it is killed (kill -9, the OOM killer, a preempted node). What it left would fill the disk that
the next run, or the resumed job, plans with. So each such folder carries an owner file that its
process holds an exclusive flock on for as long as it uses the folder; the kernel drops the lock
when the process dies, however it dies. Before a process claims a folder it sweeps the parent:
every folder whose owner file it can lock has no live owner and is removed (reported on stderr).

A folder is only ever removed whole while its owner file is locked by the remover, and an owner
file appears (by rename) only once its lock is held, so no live process's folder is touched.
Folders without an owner file (the user's, finished layouts and checkpoints, a filesystem without
flock) are never touched, with one exception: a folder is made, and removed, under a staging
name (STAGING) that only this module uses, so that a process killed before its owner file
exists, or after it went, leaves a folder a sweep recognises. A staging folder without an owner
file is judged by its pending owner file: whoever creates or locks that first (the claimer, or
a sweep) has the folder, and a claimer that lost it to a sweep makes another.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import json
import os
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path

from flexjax.errors import FlexjaxError

OWNER = '.flexjax-owner'  # the owner file's name inside an owned folder
PENDING = OWNER + '.pending'  # the owner file while it is being made (locked first, then renamed)
STAGING = '.flexjax-staging-'  # the name prefix of a folder being claimed or removed


@dataclasses.dataclass(frozen=True)
class Removed:
  path: Path
  nbytes: int  # disk space it held


class Claim:
  """A folder this process owns (with an exclusive flock on its owner file) until release().

  Use as a context manager; `disown()` first where the folder is to be kept (renamed into
  place as a finished artifact)."""

  def __init__(self, path: Path, fd: int | None):
    self.path = path
    self._fd = fd  # the owner file's descriptor holding the lock; None: not lockable here

  def __enter__(self) -> 'Claim':
    return self

  def __exit__(self, *exc) -> None:
    self.release()

  @property
  def owned(self) -> bool:
    return self._fd is not None

  def disown(self) -> None:
    """Drops the owner file and its lock: the folder is no longer scratch (a sweep leaves it)."""
    if self._fd is not None:
      try:
        os.unlink(self.path / OWNER)
      except FileNotFoundError:
        pass
      os.close(self._fd)
      self._fd = None

  def release(self) -> None:
    """Removes the folder (if it is still here), then drops the lock (_remove_held)."""
    _remove_held(self.path)
    if self._fd is not None:
      os.close(self._fd)
      self._fd = None


class _Lost(Exception):
  """A sweep took the staging folder being claimed (its claimer had not locked it yet)."""


def _remove_held(path: Path) -> None:
  """Removes a folder whose owner (or pending owner) file the caller holds locked: renamed to a
  staging name first, then emptied, the owner file last. A process killed at any point leaves
  a folder the next sweep removes; one that is not empty at the end (a writer of this process
  still at work) is left to a later sweep."""
  try:
    if not path.name.startswith(STAGING):
      staging = path.with_name(STAGING + os.urandom(6).hex())
      os.rename(path, staging)
      path = staging
    for entry in path.iterdir():
      if entry.name not in (OWNER, PENDING):
        _remove(entry)
    left = {p.name for p in path.iterdir()}
    if left <= {OWNER, PENDING}:  # else a later sweep tries again
      for name in left:
        os.unlink(path / name)
      os.rmdir(path)
  except OSError:
    pass


def claim(parent: str | os.PathLike, prefix: str, *, report: bool = True) -> Claim:
  """A new folder `parent/<prefix><random>` owned by this process, after sweeping `parent`."""
  parent = Path(parent)
  parent.mkdir(parents=True, exist_ok=True)
  sweep(parent, report=report)
  while True:
    staging = Path(tempfile.mkdtemp(prefix=STAGING, dir=parent))
    try:
      fd = _own(staging)
    except _Lost:
      continue
    except BaseException:
      shutil.rmtree(staging, ignore_errors=True)
      raise
    try:
      return Claim(_rename_fresh(staging, prefix), fd)
    except BaseException:
      Claim(staging, fd).release()
      raise


def _own(path: Path) -> int | None:
  """Puts a locked owner file into the staging folder `path`; its descriptor (None: no flock on
  this filesystem, the folder works but a sweep cannot judge it). _Lost: a sweep took it."""
  pending = path / PENDING
  try:
    fd = os.open(pending, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, 0o644)
  except (FileNotFoundError, FileExistsError):  # the folder went, or a sweep made the file
    raise _Lost from None
  try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except OSError as e:
    os.close(fd)
    if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):  # a sweep opened it first
      raise _Lost from None
    _remove(pending)
    return None
  try:
    os.write(fd, json.dumps({'pid': os.getpid(), 'host': socket.gethostname(),
                             'since': time.strftime('%Y-%m-%dT%H:%M:%S%z')}).encode())
    os.rename(pending, path / OWNER)  # locked, and final: no sweep takes the folder from here
  except FileNotFoundError:  # a sweep removed the folder before this lock was taken
    os.close(fd)
    raise _Lost from None
  except BaseException:
    os.close(fd)
    raise
  return fd


def _rename_fresh(staging: Path, prefix: str) -> Path:
  """Gives the owned staging folder its own name, `prefix` and a random suffix."""
  while True:
    path = staging.with_name(prefix + os.urandom(6).hex())
    if os.path.lexists(path):
      continue
    try:
      os.rename(staging, path)
    except OSError as e:
      if e.errno in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR):  # made meanwhile
        continue
      raise
    return path


def offload_parent(offload_dir: str | os.PathLike | None) -> Path:
  """The folder a run's offload folder is made in (and swept, and its free disk measured):
  --offload_dir, else the system temp folder."""
  return Path(offload_dir) if offload_dir else Path(tempfile.gettempdir())


def sweep(parent: str | os.PathLike, *, report: bool = True) -> list[Removed]:
  """Removes every folder in `parent` whose owner file no live process holds; returns them."""
  parent = Path(parent)
  removed = []
  try:
    entries = list(os.scandir(parent))
  except OSError:
    return removed
  for entry in entries:
    if not entry.is_dir(follow_symlinks=False):
      continue
    path = Path(entry.path)
    fd = _lock_unowned(path)
    if fd is None:  # a live owner, or not a scratch folder (or no flock here)
      continue
    try:
      nbytes = disk_bytes(path)
      _remove_held(path)
      # (another user's folder in a shared parent stays; an empty staging folder is not news)
      if not path.exists() and (nbytes or not path.name.startswith(STAGING)):
        removed.append(Removed(path, nbytes))
    finally:
      os.close(fd)
  if removed and report:
    total = sum(r.nbytes for r in removed)
    names = ', '.join(r.path.name for r in removed)
    print(f'flexjax: removed {len(removed)} folder{"s" * (len(removed) > 1)} in {str(parent)!r} '
          f'left by runs that were killed ({total / 1e9:.2f} GB): {names}', file=sys.stderr,
          flush=True)
  return removed


def _lock_unowned(path: Path) -> int | None:
  """A descriptor holding the lock on the owner file of `path` (or, for a staging folder
  without one, on its pending owner file, made here where missing) where no live process
  holds it; None where one does, where `path` is no scratch folder, or where flock fails."""
  staging = path.name.startswith(STAGING)
  while True:
    try:
      fd = os.open(path / OWNER, os.O_RDONLY | os.O_CLOEXEC)
      made = pending = False
    except OSError:  # no owner file: not a scratch folder, or a staging one not yet owned
      if not staging:
        return None
      try:
        fd, made = _open_pending(path / PENDING)
        pending = True
      except OSError:  # the folder went
        return None
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
      os.close(fd)
      if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.ENOLCK, errno.EOPNOTSUPP):
        raise
      if made and e.errno in (errno.ENOLCK, errno.EOPNOTSUPP):  # no flock here: as it was
        _remove(path / PENDING)
      return None
    if pending and (path / OWNER).exists():  # its claimer locked and renamed its own meanwhile
      if made:
        _remove(path / PENDING)
      os.close(fd)
      continue
    return fd


def _open_pending(path: Path) -> tuple[int, bool]:
  """The pending owner file at `path`, opened (made where missing: True)."""
  try:
    return os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, 0o644), True
  except FileExistsError:
    return os.open(path, os.O_RDWR | os.O_CLOEXEC), False


def disk_bytes(path: Path) -> int:
  """Disk space the files under `path` hold (allocated blocks: reserved space counts)."""
  total = 0
  for root, _, files in os.walk(path):
    for name in files:
      try:
        total += os.lstat(os.path.join(root, name)).st_blocks * 512
      except OSError:
        pass
  return total


def _remove(path: Path) -> None:
  if path.is_dir() and not path.is_symlink():
    shutil.rmtree(path, ignore_errors=True)
  else:
    try:
      os.unlink(path)
    except OSError:
      pass


def check_output_file(value: str | os.PathLike, named: str = '') -> Path:
  """The absolute path of an output file a run will write, checked before any work: not a
  folder; an existing file writable; its folder existing or makeable, and writable (writers make
  it). Creates nothing. `named`: how the user gave it, for the one-line error ('' where the caller
  names it already, as an absl flag validator does)."""
  target = Path(value).absolute()
  subject = named or 'it'
  if target.is_dir():
    raise FlexjaxError(f'{subject} is a folder; give a file path such as '
                       f'{os.path.join(str(value), "out.jsonl")!r}')
  if target.exists() and not os.access(target, os.W_OK):
    raise FlexjaxError(f'{subject} cannot be written (permission denied); choose a writable '
                       'location')
  check_writable(target.parent, f'{named + ": " if named else ""}its folder '
                                f'{str(target.parent)!r}')
  return target


def replace_file(target: Path, text: str) -> None:
  """Writes `target` whole or not at all (its folder made where missing): a temporary file
  beside it, synced, renamed over it; on an error the temporary file is removed and `target`
  is as it was."""
  target.parent.mkdir(parents=True, exist_ok=True)
  tmp = target.with_name(f'.{target.name}.tmp-{os.getpid()}')
  try:
    with open(tmp, 'w') as f:
      f.write(text)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, target)
  finally:
    tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def alone_in(folder: Path, waiting: str):
  """Holds an exclusive flock on `folder` (made where missing) while the block runs: the
  processes doing the same work there take turns. Says `waiting` on stderr where it must wait
  for another. Where the folder cannot be made or locked, the block runs unguarded."""
  try:
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder, os.O_RDONLY | os.O_CLOEXEC)
  except OSError:
    yield
    return
  try:
    if not try_lock(fd):
      print(f'flexjax: {waiting}', file=sys.stderr, flush=True)
      fcntl.flock(fd, fcntl.LOCK_EX)
    yield
  finally:
    os.close(fd)  # drops the lock


def try_lock(fd: int) -> bool:
  """Takes an exclusive flock on the open file `fd` without waiting. False: another open of
  the file (another live process) holds it; True: held now, or the filesystem has no flock (the
  caller goes on unguarded)."""
  try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except OSError as e:
    if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
      return False
    if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP):
      raise
  return True


def check_writable(folder: Path, named: str) -> None:
  """Whether `folder` can be made (where missing) and written to: a file is written once into it,
  or into its nearest existing parent, where it is missing; nothing is left there. One that
  cannot is a one-line error naming it (`named`: how the user gave it), before any work."""
  if folder.exists() and not folder.is_dir():
    raise FlexjaxError(f'{named} is a file; give a folder')
  found = folder
  while not found.exists() and found != found.parent:
    found = found.parent
  if not found.is_dir():
    raise FlexjaxError(f'{named} cannot be written ({str(found)!r} is a file); give a folder this '
                       'user can create and write to')
  try:
    with tempfile.TemporaryFile(dir=found):
      pass
  except OSError as e:
    raise FlexjaxError(f'{named} cannot be written ({e.strerror}); give a folder this user can '
                       'create and write to') from None
