"""User-facing errors: one line that names the offending value and the fix."""

import sys
from pathlib import Path


class FlexjaxError(ValueError):
  """An error caused by user input; the CLI prints its message alone, without a traceback."""


def flags_parser(prog: str | None = None):
  """app.run's flags_parser for the command `prog` (default: the name of the script run, as a
  tool's `python -m tools.NAME` gives it): absl's parsing, a flag it refuses (a value out of its
  range or not among its choices, an unknown flag, a flagfile that cannot be read) said in one
  line, exit status 2."""
  def parse(argv: list[str]) -> list[str]:
    from absl import flags
    try:
      return flags.FLAGS(argv)
    except flags.Error as e:
      name = prog or Path(argv[0]).stem
      hint = '; --helpfull lists every flag' if isinstance(e, flags.UnrecognizedFlagError) else ''
      print(f'{name}: error: {_unreadable_flagfile(e) or e}{hint}', file=sys.stderr)
      sys.exit(2)
  return parse


def _unreadable_flagfile(e: Exception) -> str | None:
  """absl's refusal of a flagfile it cannot open, said with the path and the fix (None for other
  errors)."""
  from absl import flags
  cause = e.__context__
  if not (isinstance(e, flags.CantOpenFlagFileError) and isinstance(cause, OSError)):
    return None
  return (f'--flagfile={cause.filename!r} cannot be read ({cause.strerror}); give the path of a '
          'flags file, such as configs/opt125m.flags')
