"""Converts a Hugging Face checkpoint directory or a GGUF file into a flexjax (orbax) checkpoint.

  python -m tools.convert_hf --hf_dir=/path/to/opt-1.3b --output=checkpoints/opt-1.3b
  python -m tools.convert_hf --gguf=SmolLM2-135M-Instruct.Q4_1.gguf --output=checkpoints/smollm2
"""

import sys

from absl import app, flags

from flexjax.errors import FlexjaxError, flags_parser

_HF_DIR = flags.DEFINE_string('hf_dir', None, 'HF directory: config.json + weights.')
_GGUF = flags.DEFINE_string('gguf', None, 'A llama-architecture .gguf file (llama.cpp), any of '
                            'the tensor types the gguf package dequantizes (F32, F16, Q4_1, '
                            'Q8_0, ...); weights are stored dequantized.')
_TOKENIZER_DIR = flags.DEFINE_string('tokenizer_dir', None, 'With --gguf: an HF folder whose '
                                     'tokenizer files replace the tokenizer built from the file.')
_OUTPUT = flags.DEFINE_string('output', None, 'Checkpoint directory to create.', required=True)
_DTYPE = flags.DEFINE_enum('dtype', 'source', ['source', 'float32', 'float16', 'bfloat16'],
                           'Stored dtype; "source" keeps the checkpoint\'s (float32 for a GGUF: '
                           'its dequantized values exactly).')
_OVERWRITE = flags.DEFINE_bool('overwrite', False, 'Replace an existing output (atomically).')


def main(argv):
  del argv
  import jax
  jax.config.update('jax_platforms', 'cpu')  # conversion never needs the accelerator
  from flexjax import flags as flags_lib
  from flexjax import progress as progress_lib
  flags_lib.quiet_library_logs()  # orbax's INFO lines; errors come as one line below
  try:
    convert = _converter(_HF_DIR.value, _GGUF.value, _TOKENIZER_DIR.value)
    path = convert(_HF_DIR.value or _GGUF.value, _OUTPUT.value, dtype=_DTYPE.value,
                   overwrite=_OVERWRITE.value, progress=progress_lib.enabled())
  except FlexjaxError as e:
    print(f'convert_hf: error: {e}', file=sys.stderr)
    return 2
  print(f'wrote {path}')
  return 0


def _converter(hf_dir: str | None, gguf: str | None, tokenizer_dir: str | None):
  """hf_import.convert or gguf_import.convert, for exactly one of --hf_dir and --gguf."""
  if (hf_dir is None) == (gguf is None):
    raise FlexjaxError('give exactly one of --hf_dir=FOLDER (HF config.json + weights) and '
                       '--gguf=FILE.gguf')
  if gguf is not None:
    import functools
    from flexjax.gguf_import import convert
    return functools.partial(convert, tokenizer_dir=tokenizer_dir)
  if tokenizer_dir is not None:
    raise FlexjaxError(f'--tokenizer_dir={tokenizer_dir!r} goes with --gguf; an HF folder '
                       'brings its own tokenizer files')
  from flexjax.gguf_import import is_gguf
  if is_gguf(hf_dir):
    raise FlexjaxError(f'--hf_dir={hf_dir!r} is a GGUF file; pass it as --gguf={hf_dir}')
  from flexjax.hf_import import convert
  return convert


if __name__ == '__main__':
  app.run(main, flags_parser=flags_parser())
