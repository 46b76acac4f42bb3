"""Whether this machine can read the disk and compute at the same time.

  python -m tools.overlap_probe [--folder=/mnt/nvme] [--file_gib=1] [--seconds=5]

The block schedule hides disk reads behind compute. That holds only where both run at their own
speed side by side. On a virtual machine the hypervisor may serve the virtual disk on the cores
that run the guest's vCPUs: then compute slows while reads are in flight (the kernel counts the
lost time as "steal") and reads slow while the vCPUs compute, and a step takes nearer the sum of
its compute and its reads than their maximum.

Three phases of --seconds each, measured here and now:
  compute  a decode product as the engine runs it (flexjax.model.linear.dense: a float16 weight
           [--weight_out, --weight_in] cast a tile at a time, --rows rows, float32), back to
           back on the jax device;
  read     a file of --file_gib written in --folder, read again and again as the engine reads
           weights (diskio.read_through: O_DIRECT where allowed, --threads x 16 MiB requests);
  both     the two at once, on their own threads.
Each phase reports products per second (as ms per product), read bandwidth and the CPU time
/proc/stat counted as user, system, iowait, idle and steal. The overlap efficiency is
max(compute alone, read alone) / the time both take together for the same work, 1.0 where the
machine overlaps them perfectly and 0.5 where they only take turns.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

from flexjax import diskio, scratch
from flexjax.errors import FlexjaxError

CHUNK = 16 * 2**20
_CPU_FIELDS = ('user', 'nice', 'system', 'idle', 'iowait', 'irq', 'softirq', 'steal')


def cpu_times() -> dict[str, int] | None:
  """The machine's CPU time per kind from /proc/stat (clock ticks); None where unreadable."""
  try:
    with open('/proc/stat') as f:
      fields = f.readline().split()
  except OSError:
    return None
  return dict(zip(_CPU_FIELDS, map(int, fields[1:1 + len(_CPU_FIELDS)])))


def cpu_shares(before: dict[str, int] | None, after: dict[str, int] | None) -> dict[str, float]:
  """Each kind's share of the CPU time between two cpu_times() readings."""
  if before is None or after is None:
    return {}
  spent = {k: after[k] - before[k] for k in _CPU_FIELDS}
  total = sum(spent.values()) or 1
  return {k: round(spent[k] / total, 3) for k in ('user', 'system', 'iowait', 'idle', 'steal')}


def _product(rows: int, out_dim: int, in_dim: int):
  import jax
  import jax.numpy as jnp
  import numpy as np

  from flexjax.model import linear
  w = jnp.asarray(np.random.default_rng(0).standard_normal((out_dim, in_dim), np.float32)
                  .astype(np.float16))
  x = jnp.ones((rows, in_dim), jnp.float32)
  step = jax.jit(lambda x, w: linear.dense(x, w, jnp.float32))
  step(x, w).block_until_ready()
  return lambda: step(x, w).block_until_ready()


def _phase(seconds: float, *, compute=None, path: str | None = None, file_bytes: int = 0,
           threads: int = 3) -> dict[str, Any]:
  """Runs the compute loop and/or the read loop for `seconds`; their counts and CPU shares."""
  stop = threading.Event()
  done = {'products': 0, 'read_bytes': 0}

  def read_loop():
    while not stop.is_set():
      diskio.read_through(path, file_bytes=file_bytes, chunk_bytes=CHUNK, threads=threads)
      done['read_bytes'] += file_bytes

  def compute_loop():
    while not stop.is_set():
      compute()
      done['products'] += 1

  workers = [threading.Thread(target=loop) for loop, on in
             ((read_loop, path is not None), (compute_loop, compute is not None)) if on]
  before, start = cpu_times(), time.perf_counter()
  for t in workers:
    t.start()
  time.sleep(seconds)
  stop.set()
  for t in workers:
    t.join()
  elapsed = time.perf_counter() - start
  return {'seconds': round(elapsed, 3),
          'ms_per_product': (round(1e3 * elapsed / done['products'], 3)
                             if done['products'] else None),
          'read_gbps': round(done['read_bytes'] / elapsed / 1e9, 3) if path else None,
          'cpu': cpu_shares(before, cpu_times())}


def measure(folder: str, *, file_bytes: int, seconds: float, rows: int = 32,
            out_dim: int = 8192, in_dim: int = 2048, threads: int = 3) -> dict[str, Any]:
  """The three phases (module doc) and the overlap efficiency."""
  from tools import roofline
  if seconds <= 0 or rows <= 0 or out_dim <= 0 or in_dim <= 0 or threads <= 0:
    raise FlexjaxError(f'seconds={seconds}, rows={rows}, out={out_dim}, in={in_dim} and '
                       f'threads={threads} must be positive')
  file_bytes = max(CHUNK, file_bytes // CHUNK * CHUNK)
  compute = _product(rows, out_dim, in_dim)
  with scratch.claim(folder, 'flexjax-overlap-probe-') as owned:
    path = str(owned.path / 'probe.bin')
    roofline.write_probe_file(path, file_bytes=file_bytes, chunk_bytes=CHUNK)
    roofline.drop_from_page_cache(path)
    io = dict(path=path, file_bytes=file_bytes, threads=threads)
    phases = {'compute': _phase(seconds, compute=compute),
              'read': _phase(seconds, **io),
              'both': _phase(seconds, compute=compute, **io)}
  efficiency = overlap_efficiency(phases['compute'], phases['read'], phases['both'])
  return {'tool': 'overlap_probe', 'folder': folder, 'file_bytes': file_bytes,
          'product': {'rows': rows, 'out': out_dim, 'in': in_dim}, 'threads': threads,
          **phases, 'overlap_efficiency': efficiency}


def overlap_efficiency(compute: dict[str, Any], read: dict[str, Any],
                       both: dict[str, Any]) -> float | None:
  """max(seconds the compute alone, seconds the reads alone) for the work the `both` phase did,
  over that phase's seconds; None where it did no work of one kind."""
  if not both['ms_per_product'] or not both['read_gbps']:
    return None
  products = both['seconds'] / (both['ms_per_product'] / 1e3)
  read_bytes = both['read_gbps'] * 1e9 * both['seconds']
  alone = max(products * compute['ms_per_product'] / 1e3, read_bytes / (read['read_gbps'] * 1e9))
  return round(alone / both['seconds'], 3)


def format_result(r: dict[str, Any]) -> str:
  lines = []
  for name in ('compute', 'read', 'both'):
    p = r[name]
    parts = []
    if p['ms_per_product'] is not None:
      parts.append(f'{p["ms_per_product"]:.2f} ms per product')
    if p['read_gbps'] is not None:
      parts.append(f'read {p["read_gbps"]:.2f} GB/s')
    cpu = ', '.join(f'{k} {v:.0%}' for k, v in p['cpu'].items())
    lines.append(f'{name:8s} {"; ".join(parts)}' + (f'  (cpu: {cpu})' if cpu else ''))
  lines.append(f'overlap efficiency: {r["overlap_efficiency"]} (1.0: reads fully hidden behind '
               'compute; 0.5: they take turns)')
  return '\n'.join(lines)


# ---- command line --------------------------------------------------------------------------------
def define_flags(fv) -> None:
  from absl import flags
  f = dict(flag_values=fv)
  flags.DEFINE_string('folder', None, 'Folder on the disk to probe (the offload folder; default: '
                      'the system temp folder).', **f)
  flags.DEFINE_float('file_gib', 1.0, 'Size of the file read again and again, in GiB.', **f)
  flags.DEFINE_float('seconds', 5.0, 'Seconds per phase.', **f)
  flags.DEFINE_integer('rows', 32, 'Rows of the decode product.', **f)
  flags.DEFINE_integer('weight_out', 8192, 'Output features (rows) of the product\'s weight.',
                       **f)
  flags.DEFINE_integer('weight_in', 2048, 'Input features of the product\'s weight.', **f)
  flags.DEFINE_integer('threads', 3, 'Reader threads (the engine\'s --io_threads).', **f)
  flags.DEFINE_string('output', None, 'Also append the result as one JSON line to this file.',
                      **f)


def run_cli(fv) -> int:
  import tempfile

  from tools.benchlib import report_error
  try:
    folder = fv.folder or tempfile.gettempdir()
    if not Path(folder).is_dir():
      raise FlexjaxError(f'--folder={folder!r} does not exist; create it or pass another')
    result = measure(folder, file_bytes=int(fv.file_gib * 2**30), seconds=fv.seconds,
                     rows=fv.rows, out_dim=fv.weight_out, in_dim=fv.weight_in,
                     threads=fv.threads)
  except (FlexjaxError, OSError) as e:
    return report_error('overlap_probe', e)
  print(format_result(result))
  if fv.output:
    target = Path(fv.output)
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target, 'a') as f:
      f.write(json.dumps(result) + '\n')
  return 0


if __name__ == '__main__':
  from tools.benchlib import run_tool
  run_tool(define_flags, run_cli)
