"""Command-line entry point: python -m flexjax.main --flagfile=configs/opt-125m.flags"""

import json
import logging
import signal
import sys

from absl import app

from flexjax import flags as flags_lib
from flexjax import hardware
from flexjax.errors import FlexjaxError


def main(argv) -> int:
  if len(argv) > 1:
    print(f'flexjax: error: unexpected arguments {argv[1:]}; every option is a --flag',
          file=sys.stderr)
    return 2
  flags_lib.quiet_library_logs()
  logging.getLogger('jax._src.xla_bridge').setLevel(logging.WARNING)  # no backend probing chatter
  hardware.include_cpu_platform()  # JAX_PLATFORMS=cuda would leave out the CPU backend
  from flexjax.run import run
  try:
    rc = flags_lib.run_config_from_flags()
    result = run(rc)
  except FlexjaxError as e:
    print(f'flexjax: error: {e}', file=sys.stderr)
    return 2
  for key, value in result.items():
    print(f'{key:>20}: {value}')
  print(json.dumps(result))
  return 0


def _exit_on_sigterm(signum, frame) -> None:
  del frame
  sys.exit(128 + signum)  # unwinds like Ctrl-C, so the offload folder and temp files go too


def entry() -> None:
  signal.signal(signal.SIGTERM, _exit_on_sigterm)
  flags_lib.define_flags()
  app.run(main)


if __name__ == '__main__':
  entry()
