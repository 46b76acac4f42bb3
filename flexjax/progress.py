"""Progress bars (tqdm on stderr): shown on a terminal unless turned off, silent otherwise."""

from __future__ import annotations

import sys


def enabled(wanted: bool = True) -> bool:
  """Whether bars should show: wanted (--progress) and stderr is a terminal."""
  return wanted and sys.stderr.isatty()


def bar(total: int | float | None, desc: str, *, unit: str = 'it', show: bool,
        unit_scale: bool = False, leave: bool = True):
  """A tqdm bar with an ETA; disabled (a no-op with the same methods) when not `show`."""
  from tqdm import tqdm
  return tqdm(total=total, desc=desc, unit=unit, unit_scale=unit_scale, disable=not show,
              leave=leave, dynamic_ncols=True, file=sys.stderr)
