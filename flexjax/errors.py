"""User-facing errors: one line that names the offending value and the fix."""


class FlexjaxError(ValueError):
  """An error caused by user input; the CLI prints its message alone, without a traceback."""
