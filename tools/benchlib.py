"""Benchmark tools' shared helpers: paper throughputs, peak RSS, run provenance, result files."""

from __future__ import annotations

import contextlib
import datetime
import functools
import importlib.metadata
import json
import math
import os
import platform
import resource
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

from flexjax.errors import FlexjaxError, flags_parser
from flexjax.memwatch import meminfo_bytes  # noqa: F401  (re-exported for the tools)


# ---- throughput and memory -----------------------------------------------------------------------
def throughputs(*, batch_size: int, prompt_len: int, gen_len: int, prefill_s: float,
                decode_s: float) -> dict[str, float]:
  """The FlexGen paper's prefill, decode and total tokens per second."""
  return {
      'prefill_tok_s': batch_size * prompt_len / prefill_s,
      'decode_tok_s': batch_size * (gen_len - 1) / decode_s,
      'total_tok_s': batch_size * gen_len / (prefill_s + decode_s),
  }


def reset_peak_rss() -> None:
  """Restarts the kernel's peak-RSS counter (VmHWM) so the next reading covers one run only."""
  try:
    with open('/proc/self/clear_refs', 'w') as f:
      f.write('5')
  except OSError:
    pass  # not Linux, or not allowed: host_peak_rss() then reports the process-lifetime peak


def host_peak_rss() -> int:
  """Peak resident bytes since the last reset_peak_rss() (process lifetime where unsupported)."""
  try:
    with open('/proc/self/status') as f:
      for line in f:
        if line.startswith('VmHWM:'):
          return int(line.split()[1]) * 1024
  except OSError:
    pass
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024




# ---- provenance ----------------------------------------------------------------------------------
def git_commit() -> str:
  try:
    out = subprocess.run(['git', 'rev-parse', '--short', 'HEAD'], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parent, timeout=10, check=True)
    return out.stdout.strip() or 'unknown'
  except (OSError, subprocess.SubprocessError):
    return 'unknown'


def machine_info() -> dict[str, Any]:
  import jax
  from flexjax import hardware
  model, vector_flags = hardware.cpu_info()
  return {
      'processor': platform.processor() or platform.machine(),
      'cpu_model': model,
      'cpu_vector_flags': vector_flags,
      'cpu_count': os.cpu_count(),
      'ram_bytes': meminfo_bytes('MemTotal'),
      'jax_device': jax.devices()[0].device_kind,
  }


def versions() -> dict[str, str | None]:
  """Installed versions, read from package metadata (torch is not imported for this)."""
  out = {}
  for package in ('jax', 'jaxlib', 'torch', 'transformers'):
    try:
      out[package] = importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
      out[package] = None
  return out


def new_run_id() -> str:
  """A UTC timestamp naming one benchmark invocation (sorts in time order)."""
  return datetime.datetime.now(datetime.timezone.utc).strftime('%Y%m%dT%H%M%S.%fZ')


def timestamp() -> str:
  return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')


# ---- result files --------------------------------------------------------------------------------
def fmt_number(value: float | None) -> str:
  """A table cell: thousands separators and one decimal, or a dash for missing values."""
  return '—' if value is None or not math.isfinite(value) else f'{value:,.1f}'


def read_records(path: str, flag: str = 'render') -> list[dict[str, Any]]:
  """The JSON records of a results file (one per line; blank lines skipped); errors name it as
  the value of --`flag`."""
  p = Path(path)
  if not p.is_file():
    raise FlexjaxError(f'--{flag}={path!r} does not exist; pass a JSONL file written by --output')
  records = []
  for number, line in enumerate(p.read_text().splitlines(), 1):
    if not line.strip():
      continue
    try:
      records.append(json.loads(line))
    except json.JSONDecodeError as e:
      raise FlexjaxError(f'--{flag}={path!r} line {number} is not JSON ({e.msg}); '
                         'remove or fix that line') from None
  return records


@contextlib.contextmanager
def jsonl_appender(path: str | os.PathLike):
  """Yields emit(record): prints the record as a JSON line and appends it to `path`."""
  output = Path(path)
  output.parent.mkdir(parents=True, exist_ok=True)
  with output.open('a') as f:
    def emit(record: dict[str, Any]) -> None:
      line = json.dumps(record)
      print(line, flush=True)
      f.write(line + '\n')
      f.flush()
    yield emit


# ---- entry points --------------------------------------------------------------------------------
def report_error(tool: str, error: Exception) -> int:
  """A tool's one-line error on stderr; returns its exit status."""
  print(f'{tool}: error: {error}', file=sys.stderr)
  return 2


OUTPUT_FLAGS = ('output', 'plot_output')  # the tools' flags naming a file they write


def check_output_flags(fv) -> None:
  """Registers the checks of a tool's output-file flags (OUTPUT_FLAGS, where it has them): a
  folder, or a file whose folder cannot be made or written, is refused as the flags are parsed,
  before any work."""
  from absl import flags
  for name in OUTPUT_FLAGS:
    if name in fv:
      flags.register_validator(name, writable_file, flag_values=fv)
      flags.register_validator(name, functools.partial(_apart, fv, name), flag_values=fv)


def _apart(fv, name: str, value: str | None) -> bool:
  """Whether output flag `name`'s file is no file or folder another of the tool's flags names
  (a flag validator: raises absl's ValidationError naming the other flag)."""
  from absl import flags
  if not value:
    return True
  target = Path(value).resolve()
  for module, defined in fv.flags_by_module_dict().items():
    for flag in defined:
      if (not module.startswith('absl') and flag.name != name and isinstance(flag.value, str)
          and flag.value and Path(flag.value).resolve() == target):
        raise flags.ValidationError(f'names the file --{flag.name} gives; the tool would write '
                                    'over it: give another path')
  return True


def writable_file(value: str | None) -> bool:
  """Whether `value` names a file that can be written (a flag validator: raises absl's
  ValidationError with the reason and the fix; absl names the flag and value first)."""
  from absl import flags
  from flexjax import scratch
  if value:
    try:
      scratch.check_output_file(value)
    except FlexjaxError as e:
      raise flags.ValidationError(str(e)) from None
  return True


def run_tool(define_flags: Callable[[Any], None], run_cli: Callable[[Any], int]) -> None:
  """Defines a tool's flags and runs it with absl (flags are defined only here, so importing a
  tool is free)."""
  from absl import app, flags
  define_flags(flags.FLAGS)
  check_output_flags(flags.FLAGS)
  app.run(lambda argv: run_cli(flags.FLAGS), flags_parser=flags_parser())
