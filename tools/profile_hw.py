"""Measures this machine for the cost model and writes a hardware profile (JSON).

  python -m tools.profile_hw --output=configs/hw/this-machine.json [--scratch_dir=/mnt/nvme]
"""

import sys

from absl import app, flags

from flexjax.errors import FlexjaxError, flags_parser

_OUTPUT = flags.DEFINE_string('output', None, 'Profile file to write.', required=True)
_SCRATCH = flags.DEFINE_string('scratch_dir', None, 'Folder on the disk to measure (default: the '
                               'system temp folder).')
_SIZE = flags.DEFINE_integer('size_mb', 256, 'Transfer size in MiB.', lower_bound=1)
_QUICK = flags.DEFINE_bool('quick', False, 'Fewer matmul sizes.')


def main(argv):
  del argv
  from flexjax import hardware
  from flexjax import progress as progress_lib
  try:
    profile = hardware.measure(scratch_dir=_SCRATCH.value, size_mb=_SIZE.value, quick=_QUICK.value,
                               progress=progress_lib.enabled())
    profile.save(_OUTPUT.value)
  except (FlexjaxError, OSError) as e:
    print(f'profile_hw: error: {e}', file=sys.stderr)
    return 2
  print(profile.to_json(), end='')
  return 0


if __name__ == '__main__':
  from tools import benchlib
  # --output refused as flags are parsed, not after the minute of measuring
  benchlib.check_output_flags(flags.FLAGS)
  app.run(main, flags_parser=flags_parser())
