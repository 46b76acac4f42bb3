"""Progress bars (tqdm, on stderr unless told otherwise): shown on a terminal unless turned off,
silent otherwise."""

from __future__ import annotations

import sys
from typing import TextIO


def enabled(wanted: bool = True, stream: TextIO | None = None) -> bool:
  """Whether bars should show: wanted (--progress) and their stream (default stderr) is a
  terminal."""
  return wanted and (stream or sys.stderr).isatty()


def bar(total: int | float | None, desc: str, *, unit: str = 'it', show: bool,
        unit_scale: bool = False, leave: bool = True, stream: TextIO | None = None):
  """A tqdm bar with an ETA on `stream` (default stderr); disabled (a no-op with the same
  methods) when not `show`."""
  from tqdm import tqdm
  return tqdm(total=total, desc=desc, unit=unit, unit_scale=unit_scale, disable=not show,
              leave=leave, dynamic_ncols=True, file=stream or sys.stderr)
