"""Converts a Hugging Face OPT checkpoint directory into a flexjax (orbax) checkpoint.

  python -m tools.convert_hf --hf_dir=/path/to/opt-1.3b --output=checkpoints/opt-1.3b
"""

import sys

from absl import app, flags

from flexjax.errors import FlexjaxError

_HF_DIR = flags.DEFINE_string('hf_dir', None, 'HF OPT directory: config.json + weights.',
                              required=True)
_OUTPUT = flags.DEFINE_string('output', None, 'Checkpoint directory to create.', required=True)
_DTYPE = flags.DEFINE_enum('dtype', 'source', ['source', 'float32', 'float16', 'bfloat16'],
                           'Stored dtype; "source" keeps the checkpoint\'s.')
_OVERWRITE = flags.DEFINE_bool('overwrite', False, 'Replace an existing output (atomically).')


def main(argv):
  del argv
  import jax
  jax.config.update('jax_platforms', 'cpu')  # conversion never needs the accelerator
  from flexjax import progress as progress_lib
  from flexjax.hf_import import convert
  try:
    path = convert(_HF_DIR.value, _OUTPUT.value, dtype=_DTYPE.value, overwrite=_OVERWRITE.value,
                   progress=progress_lib.enabled())
  except FlexjaxError as e:
    print(f'convert_hf: error: {e}', file=sys.stderr)
    return 2
  print(f'wrote {path}')
  return 0


if __name__ == '__main__':
  app.run(main)
