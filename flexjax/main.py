"""Command-line entry point: python -m flexjax.main --flagfile=configs/opt-125m.flags"""

import functools
import json
import logging
import sys
from pathlib import Path

from absl import app

from flexjax import flags as flags_lib
from flexjax import hardware
from flexjax.errors import FlexjaxError, flags_parser
from flexjax.job import progress_path, write_atomically
from flexjax.stopping import STOP_GRACE_S, StopWatch


def main(argv, stop: StopWatch | None = None) -> int:
  if len(argv) > 1:
    print(f'flexjax: error: unexpected arguments {argv[1:]}; every option is a --flag',
          file=sys.stderr)
    return 2
  from absl import flags
  report_json = flags.FLAGS.report_json
  flags_lib.quiet_library_logs()
  logging.getLogger('jax._src.xla_bridge').setLevel(logging.WARNING)  # no backend probing chatter
  hardware.include_cpu_platform()  # JAX_PLATFORMS=cuda would leave out the CPU backend
  from flexjax.run import check_paths, run, use_compile_cache
  rc = None
  try:
    flags_lib.use_stop_grace(stop)
    rc = flags_lib.run_config_from_flags()
    if stop is not None:
      stop.kept = functools.partial(kept, rc.input, rc.output)
    check_paths(rc, report_json)
    use_compile_cache(flags.FLAGS.compile_cache, rc.weights_cache)  # before anything compiles
    result = run(rc)
    print(table(result))
    if report_json:
      write_atomically(report_json, json.dumps(result, indent=1) + '\n')
  except FlexjaxError as e:
    print(f'flexjax: error: {e}', file=sys.stderr)
    return 2
  except KeyboardInterrupt:
    # the run's own folders are removed on the way out; a job's synced outputs stay
    print(interrupted(rc.input if rc else None, rc.output if rc else None), file=sys.stderr)
    return 130
  return 0


def interrupted(job_input: str | None, output: str | None) -> str:
  """The line a run stopped by Ctrl-C ends with: a job's output keeps its finished blocks."""
  return f'flexjax: interrupted{kept(job_input, output)}'


def kept(job_input: str | None, output: str | None) -> str:
  """What a stopped run leaves the user, as the end of its last line, read from the files as it
  stops: a job's written rows, or the whole job where it ended before the stop came (its output
  holds rows and its progress file is gone)."""
  if not (job_input and output):
    return ''
  if not progress_path(output).exists() and _holds_rows(Path(output)):
    return f'; the job had ended: {output!r} holds all its rows'
  return f'; {output!r} keeps the rows written so far: run the same command again to resume'


def _holds_rows(path: Path) -> bool:
  try:
    return path.stat().st_size > 0
  except OSError:
    return False


def table(report: dict) -> str:
  """The report as aligned `key: value` lines (a nested dict's keys as `key.inner`)."""
  flat = {}
  for key, value in report.items():
    if isinstance(value, dict):
      flat.update({f'{key}.{inner}': v for inner, v in value.items()})
    else:
      flat[key] = value
  width = max(map(len, flat), default=0)
  return '\n'.join(f'{key:>{width}}: {_shown(value)}' for key, value in flat.items())


def _shown(value) -> str:
  if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 2**20:
    return f'{value:,} ({value / 2**30:.2f} GiB)' if abs(value) >= 2**27 else f'{value:,}'
  return str(value)


def entry(grace_s: float = STOP_GRACE_S) -> None:
  """SIGTERM and Ctrl-C unwind the run; a run that has not ended `grace_s` after them
  (--stop_grace_s where given) ends without its clean-up (flexjax.stopping)."""
  stop = StopWatch(grace_s)
  flags_lib.define_flags()
  app.run(functools.partial(main, stop=stop), flags_parser=flags_parser('flexjax'))


if __name__ == '__main__':
  entry()
