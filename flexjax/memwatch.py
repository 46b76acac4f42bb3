"""What the system says a run took: the process's peak resident memory (from the kernel) and,
on an accelerator, the device allocator's peak, each relative to before the run."""

from __future__ import annotations

import dataclasses
import resource
from pathlib import Path


def _proc_fields(path: str, keys: tuple[str, ...]) -> dict[str, int]:
  """Fields in kB of a /proc file, in bytes, from one reading; those unreadable left out."""
  out = {}
  try:
    for line in Path(path).read_text().splitlines():
      key, _, value = line.partition(':')
      if key in keys:
        out[key] = int(value.split()[0]) * 1024
  except (OSError, ValueError, IndexError):
    pass
  return out


def _proc_field(path: str, key: str) -> int | None:
  """A field in kB of a /proc file, in bytes; None where unreadable."""
  return _proc_fields(path, (key,)).get(key)


def _status_bytes(key: str) -> int | None:
  """A /proc/self/status field ('VmRSS', 'VmHWM') in bytes; None where unreadable."""
  return _proc_field('/proc/self/status', key)


def meminfo_bytes(key: str) -> int | None:
  """A /proc/meminfo field ('MemTotal', 'MemAvailable', ...) in bytes; None where unreadable."""
  return _proc_field('/proc/meminfo', key)


def _reset_peak_rss() -> bool:
  """Resets the kernel's peak-RSS mark of this process to its current RSS (Linux >= 4.0)."""
  try:
    Path('/proc/self/clear_refs').write_text('5')
    return True
  except OSError:
    return False


def peak_rss() -> int:
  """The process's peak resident set size in bytes."""
  hwm = _status_bytes('VmHWM')
  return hwm if hwm is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@dataclasses.dataclass
class MemoryWatch:
  """Marks the idle process; later, the peaks the run added to it.

  RSS: the peak-RSS mark is reset to the current RSS when the kernel allows it, so the
  measured peak is the run's own; where it cannot be reset, the earlier peak is included and
  the figure can only be too high. Device: memory_stats()['peak_bytes_in_use'] where the
  backend reports it (GPUs), minus the bytes in use at the mark.
  """

  device: object
  rss_base: int = 0
  device_base: int = 0
  reset: bool = False

  @classmethod
  def start(cls, device) -> 'MemoryWatch':
    watch = cls(device)
    watch.reset = _reset_peak_rss()
    watch.rss_base = current_rss()
    stats = watch._device_stats()
    watch.device_base = int(stats.get('bytes_in_use', 0)) if stats else 0
    return watch

  def _device_stats(self) -> dict | None:
    stats = self.device.memory_stats() if hasattr(self.device, 'memory_stats') else None
    return stats if stats and 'peak_bytes_in_use' in stats else None

  def peaks(self) -> dict[str, int]:
    """{'rss': peak RSS added by the run} and, on an accelerator, {'device': peak in use}."""
    out = {'rss': max(0, peak_rss() - self.rss_base)}
    stats = self._device_stats()
    if stats is not None:
      out['device'] = max(0, int(stats['peak_bytes_in_use']) - self.device_base)
    return out


def current_rss() -> int:
  """The process's resident bytes now, as the kernel reports them (0 where unreadable)."""
  return _status_bytes('VmRSS') or 0


def rss_and_peak() -> tuple[int, int]:
  """(resident bytes now, peak resident bytes) from one reading of /proc/self/status, where the
  kernel gives a peak no lower than the RSS beside it. Two readings can disagree: the counters
  move in between, and the kernel's peak mark does not take in every value the RSS passes
  through (a phase's mark once read an RSS above the peak read right after it)."""
  fields = _proc_fields('/proc/self/status', ('VmRSS', 'VmHWM'))
  rss = fields.get('VmRSS', 0)
  return rss, fields.get('VmHWM') or max(rss, peak_rss())


def return_free_memory() -> None:
  """Hands memory the process has freed back to the system (glibc keeps freed blocks in its
  arenas, so RSS would stay at the high-water mark of everything done so far)."""
  import ctypes
  try:  # the C library is linked into the interpreter: its symbols, without a library search
    ctypes.CDLL(None).malloc_trim(0)
  except (OSError, AttributeError):  # not glibc
    pass
