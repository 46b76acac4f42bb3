"""Roofline: this machine's measured rates, and the least time a run's work could take at them.

  python -m tools.roofline [--folder=/mnt/nvme] [--file_gib=1] [--dtypes=float32,bfloat16]
                           [--torch] [--output=rates.json]

Rates (measure_rates), each measured here and now:
  matmul_flops   a large square matmul (grown from 512 until one run takes >= 0.25 s, at most
                 8192) in each compute dtype on the jax device, best of 3; with --torch also in
                 torch (CUDA if it has one, else the CPU). The roofline takes the faster
                 framework: it is what the hardware has shown it can do.
  host_device    RAM -> device copy bandwidth: jax.device_put of 256 MiB (GPU), or on the CPU
                 backend, where the device is the same RAM, a memcpy (numpy copyto), best of 5.
  disk_read      a file of --file_gib written in --folder and fsynced, then read with O_DIRECT
                 (no page cache) by 4 threads in 16 MiB os.preadv calls into page-aligned
                 buffers. Where O_DIRECT is refused (tmpfs on older kernels, some network file
                 systems) the file is read buffered after dropping it from the page cache, and
                 the result says "o_direct": false.
  disk_write     the same file's buffered write + fsync.
  device_memory  an accelerator's own memory: the best of a jitted sum over 1 GiB (bytes read)
                 and a jitted copy of it (bytes read and written), best of 5. Not measured on a
                 CPU backend, whose device memory is the RAM and whose probes here (XLA:CPU's
                 reductions on a few cores) read slower than its attention does: there the
                 roofline has no memory term.

Roofline (roofline): a run's work per phase is its FLOPs and its bytes over each link
(work_of_policy for flexjax and FlexGen rows, work_of_accelerate for Accelerate rows); its
roofline time is the largest of FLOPs / matmul rate and bytes / bandwidth over the links, i.e.
perfect overlap at the measured peaks. Prefill and decode are bounded separately (decode needs
the prefill's KV cache) and added. Only necessary work is counted, so the roofline is a lower
bound; what is left out is listed in work()'s docstring. roofline_fraction = roofline time /
measured time (1.0: at the hardware's limit).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from flexjax import diskio, hardware, scratch
from flexjax.config import DTYPES
from flexjax.errors import FlexjaxError
from flexjax.hardware import best_seconds

LINKS = ('disk_read', 'disk_write', 'host_device', 'device_memory')
PHASES = ('prefill', 'decode')
ALIGN = diskio.BLOCK  # O_DIRECT offsets, lengths and buffers


# ---- measuring -----------------------------------------------------------------------------------
def _grow_and_time(run_at: Callable[[int], Callable[[], Any]], *, start_n: int = 512,
                   max_n: int = 8192, target_s: float = 0.25,
                   repeats: int = 3) -> tuple[float, int]:
  """FLOP/s of an n x n x n matmul, n grown until one run takes target_s (or max_n): each
  step to the size the last run's rate says takes target_s (at least 1.25x; a multiple of
  256), not a doubling that overshoots it up to eightfold.
  run_at(n) prepares operands and returns a function that runs the matmul once and waits."""
  n = min(start_n, max_n)
  while True:
    fn = run_at(n)
    fn()  # compile / warm up
    one = best_seconds(fn, 1)
    if one >= target_s or n >= max_n:
      return 2 * n**3 / min(one, best_seconds(fn, max(1, repeats - 1))), n
    grow = max(1.25, (target_s / max(one, 1e-9)) ** (1 / 3))
    n = min(max_n, -(-int(n * grow) // 256) * 256)


def jax_matmul_rate(dtype: str, *, programs: list, device=None, **grow) -> tuple[float, int]:
  """(FLOP/s, n) of a square matmul in `dtype` on the jax device, as the engine computes its
  products (linear.dense: 16-bit products summed in float32; XLA:CPU's bfloat16 products that
  round as they sum ran at less than half that rate, below what the engine's prompt steps
  reach). Where the engine compiles long prompt steps with oneDNN's products
  (linear.in_library: float32 on a CPU backend), the faster of XLA's own and oneDNN's.
  The compiled programs are appended to `programs`, which the caller keeps until later work is
  done (linear.library_options: a oneDNN program freed right after its run can abort)."""
  import functools

  import jax
  import jax.numpy as jnp

  from flexjax.model import linear
  device = device or jax.devices()[0]
  f = jax.jit(functools.partial(linear.dense, dtype=jnp.dtype(dtype)))
  programs.append(f)

  def run_at(n, options=None):
    keys = jax.random.split(jax.random.PRNGKey(0))
    a, b = (jax.device_put(jax.random.normal(k, (n, n), jnp.float32).astype(dtype), device)
            for k in keys)
    compiled = f.lower(a, b).compile(options)
    programs.append(compiled)
    return lambda: compiled(a, b).block_until_ready()

  rates = [_grow_and_time(run_at, **grow)]
  if linear.in_library(device.platform, dtype, linear.LIBRARY_ROWS):
    rates.append(_grow_and_time(functools.partial(run_at, options=linear.library_options()),
                                **grow))
  return max(rates)


def torch_matmul_rate(dtype: str, **grow) -> tuple[float, int]:
  """(FLOP/s, n) of a square matmul in `dtype` in torch (on CUDA if present, else the CPU)."""
  import torch
  cuda = torch.cuda.is_available()
  if not cuda:
    torch.set_num_threads(os.cpu_count() or 1)
  device = 'cuda' if cuda else 'cpu'

  def run_at(n):
    a, b = (torch.randn(n, n, device=device).to(getattr(torch, dtype)) for _ in range(2))

    def run():
      torch.matmul(a, b)
      if cuda:
        torch.cuda.synchronize()
    return run

  return _grow_and_time(run_at, **grow)


def host_device_bandwidth(*, nbytes: int = 256 * 2**20, device=None) -> tuple[float, str]:
  """(bytes/s, method) of copying RAM to the jax device; a memcpy where the device is the CPU."""
  import jax
  device = device or jax.devices()[0]
  src = np.ones(nbytes, np.uint8)  # pages touched
  if device.platform == 'cpu':
    dst = np.empty_like(src)
    np.copyto(dst, src)
    return nbytes / best_seconds(lambda: np.copyto(dst, src), 5), 'memcpy (numpy copyto)'
  kind = hardware.host_memory_kind(device)  # the link's rate: DMA from pinned memory
  return hardware.transfer_rate(src, device, kind, repeats=5), (
      'jax.device_put' + (f' from {kind}' if kind else ''))


def device_memory_bandwidth(*, nbytes: int = 2**30, device=None) -> float:
  """Bytes/s of the jax device's own memory: the better of a sum of `nbytes` (read once) and a
  copy of them (read and written)."""
  import jax
  import jax.numpy as jnp
  device = device or jax.devices()[0]
  x = jax.device_put(jnp.ones(nbytes // 4, jnp.float32), device)
  total, copy = jax.jit(jnp.sum), jax.jit(lambda a: a + 1)
  rates = []
  for fn, moved in ((total, nbytes), (copy, 2 * nbytes)):
    run = lambda: fn(x).block_until_ready()  # noqa: E731 (fn of this iteration, called now)
    run()
    rates.append(moved / best_seconds(run, 5))
  return max(rates)


@dataclasses.dataclass(frozen=True)
class DiskProbe:
  read_bw: float  # bytes/s
  write_bw: float  # bytes/s, buffered write + fsync
  o_direct: bool  # False: buffered reads after dropping the file from the page cache
  folder: str
  file_bytes: int
  chunk_bytes: int
  threads: int
  note: str = ''


def _write_file(path: str, *, file_bytes: int, chunk_bytes: int) -> float:
  """Writes file_bytes of random bytes and fsyncs; returns the seconds it took."""
  block = np.random.default_rng(0).integers(0, 256, chunk_bytes, np.uint8).tobytes()
  start = time.perf_counter()
  fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
  try:
    written = 0
    while written < file_bytes:
      view = memoryview(block)[:min(chunk_bytes, file_bytes - written)]
      while view:
        n = os.write(fd, view)
        view = view[n:]
        written += n
    os.fsync(fd)
  finally:
    os.close(fd)
  return time.perf_counter() - start


def disk_bandwidth(folder: str | None = None, *, file_bytes: int = 2**30,
                   chunk_bytes: int = 16 * 2**20, threads: int = 4) -> DiskProbe:
  """Write and cold-read bandwidth of a file of file_bytes in `folder` (default: the temp
  folder), read with O_DIRECT where the file system allows it. The file is removed after."""
  folder = str(scratch.offload_parent(folder))
  if chunk_bytes % ALIGN or chunk_bytes <= 0:
    raise FlexjaxError(f'chunk_bytes={chunk_bytes} must be a positive multiple of {ALIGN}')
  file_bytes = file_bytes // ALIGN * ALIGN
  if file_bytes <= 0 or threads <= 0:
    raise FlexjaxError(f'file_bytes={file_bytes} and threads={threads} must be positive')
  if not os.path.isdir(folder):
    raise FlexjaxError(f'disk probe folder {folder!r} does not exist; create it or pass another')
  scratch.sweep(folder)  # what killed probes left, before the free space is measured
  free = shutil.disk_usage(folder).free
  if free < file_bytes + 256 * 2**20:
    raise FlexjaxError(f'{folder!r} has {free / 2**30:.2f} GiB free; the disk probe writes '
                       f'{file_bytes / 2**30:.2f} GiB: free space or lower --file_gib')
  with scratch.claim(folder, 'flexjax-disk-probe-') as owned:
    path = str(owned.path / 'probe.bin')
    write_s = _write_file(path, file_bytes=file_bytes, chunk_bytes=chunk_bytes)
    read_s, direct, note = diskio.read_through(path, file_bytes=file_bytes,
                                               chunk_bytes=chunk_bytes, threads=threads)
    if not direct:
      note += '; read buffered after dropping the file from the page cache'
  return DiskProbe(read_bw=file_bytes / read_s, write_bw=file_bytes / write_s, o_direct=direct,
                   folder=str(folder), file_bytes=file_bytes, chunk_bytes=chunk_bytes,
                   threads=threads, note=note)


def files_read_bandwidth(paths, *, limit_bytes: int = 2**30, chunk_bytes: int = 16 * 2**20,
                         threads: int = 4) -> float | None:
  """Read bandwidth of existing files (a model's weight files, say) read as the engine reads
  weights (diskio.read_through: cold, O_DIRECT where allowed), whole and in order, until
  limit_bytes; None when nothing was read. Where storage serves
  recently written blocks faster (a virtual disk's cache), disk_bandwidth's fresh file can
  read several times faster than files written earlier."""
  seconds, done = 0.0, 0
  for path in paths:
    size = min(os.path.getsize(path), limit_bytes - done) // ALIGN * ALIGN
    if size <= 0:
      continue
    took, _, _ = diskio.read_through(path, file_bytes=size, chunk_bytes=chunk_bytes,
                                     threads=threads)
    seconds, done = seconds + took, done + size
    if done >= limit_bytes:
      break
  return done / seconds if done else None


def measure_rates(*, folder: str | None = None, dtypes=('float32',), torch: bool = False,
                  file_bytes: int = 2**30, chunk_bytes: int = 16 * 2**20, threads: int = 4,
                  matmul_max_n: int = 8192, copy_bytes: int = 256 * 2**20,
                  log: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
  """Every rate the roofline needs, as a JSON-ready dict (see the module doc)."""
  import jax
  device = jax.devices()[0]
  start = time.perf_counter()
  flops: dict[str, dict[str, float]] = {}
  sizes: dict[str, dict[str, int]] = {}
  programs: list = []  # freed after the probes below (jax_matmul_rate)
  for dtype in dtypes:
    rate, n = jax_matmul_rate(dtype, programs=programs, device=device, max_n=matmul_max_n)
    flops[dtype], sizes[dtype] = {'jax': rate}, {'jax': n}
    log(f'matmul {dtype} jax: {rate / 1e9:.1f} GFLOP/s at n={n}')
    if torch:
      rate, n = torch_matmul_rate(dtype, max_n=matmul_max_n)
      flops[dtype]['torch'], sizes[dtype]['torch'] = rate, n
      log(f'matmul {dtype} torch: {rate / 1e9:.1f} GFLOP/s at n={n}')
  copy_bw, method = host_device_bandwidth(nbytes=copy_bytes, device=device)
  log(f'host -> device: {copy_bw / 1e9:.2f} GB/s ({method})')
  memory_bw = None if device.platform == 'cpu' else device_memory_bandwidth(device=device)
  if memory_bw:
    log(f'device memory: {memory_bw / 1e9:.0f} GB/s')
  disk = disk_bandwidth(folder, file_bytes=file_bytes, chunk_bytes=chunk_bytes, threads=threads)
  log(f'disk read: {disk.read_bw / 1e9:.2f} GB/s (o_direct={disk.o_direct}), '
      f'write + fsync: {disk.write_bw / 1e9:.2f} GB/s in {disk.folder}')
  programs.clear()
  return {'device': f'{device.platform}:{device.device_kind}', 'matmul_flops': flops,
          'matmul_n': sizes, 'host_device_bw': copy_bw, 'host_device_method': method,
          'device_memory_bw': memory_bw,
          'disk_read_bw': disk.read_bw, 'disk_write_bw': disk.write_bw,
          'disk': dataclasses.asdict(disk), 'seconds': time.perf_counter() - start,
          'measured_at': time.strftime('%Y-%m-%dT%H:%M:%S%z')}


# ---- work of a run -------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Work:
  """One phase's work: FLOPs, and bytes over each link (keys of LINKS)."""

  flops: float
  bytes: dict[str, float]


def work(cfg, *, batch: int, prompt_len: int, gen_len: int, weight_bytes: dict[str, float],
         kv_rows: dict[str, int], kv_token_bytes: float, kv_read_factor: float = 2.0,
         cpu_attention: bool = False) -> dict[str, Work]:
  """FLOPs and link bytes of prefill and decode for `batch` sequences (one block).

  Args:
    weight_bytes: bytes per link of one pass over the weights (every layer loaded once); there
      is one pass in prefill and one per decode step (gen_len - 1). 'device_memory': the bytes
      the device's compute reads of them (all of them, wherever they are kept).
    kv_rows: sequences of the block whose KV cache is on 'device', 'host', 'disk'.
    kv_token_bytes: bytes of one token's K in one layer (V is as large).
    kv_read_factor: K and V read per attended position, in units of kv_token_bytes (2; less
      with sparse attention, which reads only the kept V rows).
    cpu_attention: host-cache attention runs on the host, so that cache is not moved.

  FLOPs: 2 per multiply-add of the decoder's matmuls (every weight of a layer's matrices once
  per token: cost_model.layer_matmul_params; OPT's 4h^2 + 2h*ffn, Llama's q, k, v, o with
  grouped KV heads and its gate, up and down), attention (4 q_dim per attended position: scores
  and the weighted sum; causal prefill attends (s+1)/2 positions on average, decode step j
  attends s+j), and the LM head
  (2*embed*vocab) once per generated token only. KV bytes: prefill writes the prompt's K and V
  of off-device rows; decode step j reads s+j-1 cached positions of off-device rows and writes
  one. Host rows cross the host<->device link, disk rows the disk links (and, without CPU
  attention, host<->device too). Device memory: the weights read per pass, the cached positions
  of the rows that attend on the device read per decode step, the device rows' new K and V
  written. Not counted (the roofline stays a lower bound): layer norms, softmax, biases, the
  embedding gather, hidden states moved between tiers or read and written in device memory,
  loaded bytes written to device memory, and re-reads of the same bytes.
  """
  from flexjax.cost_model import layer_matmul_params
  q, s, n, L = cfg.q_dim, prompt_len, gen_len, cfg.num_layers
  layer_mm = 2 * layer_matmul_params(cfg)  # per token
  head = 2 * cfg.embed_dim * cfg.vocab_size
  steps = n - 1
  prefill_flops = batch * (L * (s * layer_mm + 4 * q * s * (s + 1) / 2) + head)
  attended = steps * s + steps * (steps + 1) / 2  # sum over j = 1..n-1 of s + j
  decode_flops = batch * (steps * (L * layer_mm + head) + L * 4 * q * attended)
  kv = 2 * kv_token_bytes * L  # K and V of one token, all layers
  read = kv_read_factor * kv_token_bytes * L
  cached = steps * s + steps * (steps - 1) / 2  # sum over j of s + j - 1
  to_device = 0 if cpu_attention else kv_rows['host'] + kv_rows['disk']  # rows read there

  def moved(passes: int, written_tokens: float, read_tokens: float) -> dict[str, float]:
    return {
        'disk_read': passes * weight_bytes.get('disk_read', 0) + kv_rows['disk'] * read_tokens
        * read,
        'disk_write': kv_rows['disk'] * written_tokens * kv,
        'host_device': passes * weight_bytes.get('host_device', 0)
        + (kv_rows['host'] + kv_rows['disk']) * written_tokens * kv
        + to_device * read_tokens * read,
        'device_memory': passes * weight_bytes.get('device_memory', 0)
        + (kv_rows['device'] + to_device) * read_tokens * read
        + kv_rows['device'] * written_tokens * kv,
    }

  return {'prefill': Work(prefill_flops, moved(1, s, 0)),
          'decode': Work(decode_flops, moved(steps, steps, cached))}


def policy_weight_bytes(cfg, policy, sizes) -> dict[str, float]:
  """One pass over the weights as flexjax (and FlexGen) place them with `policy`: disk tensors
  are read from disk, and they and host tensors cross to the device; device tensors stay. The
  tied token embedding is counted once, where the head keeps it. Every tensor is read in device
  memory by the step that uses it."""
  from flexjax import plan as plan_lib
  per_tier = dict.fromkeys(('device', 'host', 'disk'), 0)
  for stage, count in plan_lib.distinct_stages(cfg).items():
    for slot in plan_lib.stage_layout(cfg, policy, sizes, stage):
      if not (stage == 'embed' and slot.path == ('tokens',)):
        per_tier[slot.tier] += count * slot.stored
  return {'disk_read': per_tier['disk'], 'host_device': per_tier['host'] + per_tier['disk'],
          'device_memory': sum(per_tier.values())}


def work_of_policy(cfg, policy, sizes, *, prompt_len: int, gen_len: int) -> dict[str, Work]:
  """A flexjax or FlexGen run of one block with `policy` (plan.Itemsizes `sizes`)."""
  from flexjax import plan as plan_lib
  rows = {tier: r * policy.num_gpu_batches for tier, r in policy.rows('cache').items()}
  return work(cfg, batch=policy.block_size, prompt_len=prompt_len, gen_len=gen_len,
              weight_bytes=policy_weight_bytes(cfg, policy, sizes), kv_rows=rows,
              kv_token_bytes=plan_lib.cache_row_bytes(cfg, policy, sizes),
              kv_read_factor=1 + min(1.0, policy.attn_sparsity),
              cpu_attention=policy.cpu_attention)


def work_of_accelerate(cfg, *, batch: int, prompt_len: int, gen_len: int,
                       placed: dict[str, int], compute_itemsize: int, storage_itemsize: int,
                       device_is_host: bool) -> dict[str, Work]:
  """An Accelerate run: `placed` is its device map's weight bytes per tier in the compute dtype.
  Its disk weights are read from the checkpoint (storage dtype) at every forward pass; on a GPU
  its CPU and disk weights then cross to the device; on a CPU they are used where they are.
  Its KV cache stays on its device, where its weights are read in the compute dtype."""
  disk_stored = placed.get('disk', 0) * storage_itemsize / compute_itemsize
  to_device = 0 if device_is_host else placed.get('host', 0) + disk_stored
  return work(cfg, batch=batch, prompt_len=prompt_len, gen_len=gen_len,
              weight_bytes={'disk_read': disk_stored, 'host_device': to_device,
                            'device_memory': sum(placed.get(t, 0) for t in
                                                 ('device', 'host', 'disk'))},
              kv_rows={'device': batch, 'host': 0, 'disk': 0},
              kv_token_bytes=cfg.kv_dim * compute_itemsize)


# ---- the roofline --------------------------------------------------------------------------------
def link_bandwidths(rates: dict[str, Any]) -> dict[str, float]:
  """Bytes/s per link; device memory where it was measured (an accelerator's)."""
  out = {'disk_read': rates['disk_read_bw'], 'disk_write': rates['disk_write_bw'],
         'host_device': rates['host_device_bw']}
  if rates.get('device_memory_bw'):
    out['device_memory'] = rates['device_memory_bw']
  return out


def compute_rate(rates: dict[str, Any], dtype: str) -> float:
  """The fastest measured matmul rate of `dtype` on this machine (any framework)."""
  by_framework = rates['matmul_flops'].get(dtype)
  if not by_framework:
    raise FlexjaxError(f'no matmul rate was measured for dtype={dtype!r} (measured: '
                       f'{sorted(rates["matmul_flops"])}); measure it with --dtypes={dtype}')
  return max(by_framework.values())


def phase_bound(w: Work, *, flops_rate: float, bandwidths: dict[str, float]) -> dict[str, Any]:
  """Seconds of each term of one phase; the roofline is the largest, named by 'bound'."""
  seconds = {'compute': w.flops / flops_rate}
  seconds.update({link: w.bytes.get(link, 0) / bw for link, bw in bandwidths.items()})
  bound = max(seconds, key=seconds.get)
  return {'flops': w.flops, 'bytes': dict(w.bytes), 'seconds': seconds, 'bound': bound,
          'roofline_s': seconds[bound]}


def roofline(works: dict[str, Work], *, flops_rate: float, bandwidths: dict[str, float],
             measured: dict[str, float]) -> dict[str, Any]:
  """Per phase and in total: the roofline time, the measured time and their ratio.
  `measured` holds 'prefill' and 'decode' seconds."""
  out: dict[str, Any] = {}
  for phase in PHASES:
    out[phase] = phase_bound(works[phase], flops_rate=flops_rate, bandwidths=bandwidths)
    out[phase].update(measured_s=measured[phase],
                      fraction=_fraction(out[phase]['roofline_s'], measured[phase]))
  total = sum(out[p]['roofline_s'] for p in PHASES)
  total_measured = sum(measured[p] for p in PHASES)
  out['total'] = {'roofline_s': total, 'measured_s': total_measured,
                  'fraction': _fraction(total, total_measured)}
  out['rates'] = {'compute_flops': flops_rate, **bandwidths}
  return out


def _fraction(ideal: float, measured: float) -> float | None:
  return ideal / measured if measured > 0 and math.isfinite(measured) else None


def record_config(record: dict[str, Any]):
  """The ModelConfig of a suite record: its spec's preset name, or the config itself."""
  from flexjax import config as config_lib
  model = record['spec']['model']
  return (config_lib.ModelConfig.from_dict(model) if isinstance(model, dict)
          else config_lib.preset(model))


def record_dtypes(record: dict[str, Any]) -> tuple[str, str]:
  """(compute dtype, weight storage dtype) of a suite record, with the systems' defaults."""
  compute = record.get('compute_dtype') or ('float16' if record['system'] == 'flexgen'
                                            else 'float32')
  return compute, record.get('weight_storage_dtype', 'float16')


def of_record(record: dict[str, Any], rates: dict[str, Any]) -> dict[str, Any]:
  """The roofline of a successful suite record (flexjax, accelerate or flexgen) at `rates`."""
  from flexjax import config as config_lib
  from flexjax import plan as plan_lib
  from flexjax.policy import Policy
  cfg = record_config(record)
  lengths = dict(prompt_len=record['prompt_len'], gen_len=record['gen_len'])
  itemsize = lambda dtype: config_lib.np_dtype(dtype).itemsize  # noqa: E731
  dtype, storage = record_dtypes(record)
  if record['system'] == 'accelerate':
    works = work_of_accelerate(
        cfg, batch=record['num_prompts'], placed=record['peak_bytes'],
        compute_itemsize=itemsize(dtype), storage_itemsize=itemsize(storage),
        device_is_host=str(record.get('device', 'cpu')).startswith('cpu'), **lengths)
  else:
    policy = Policy(**record['policy_fields'])
    sizes = plan_lib.Itemsizes.of(storage, dtype, dtype)
    works = work_of_policy(cfg, policy, sizes, **lengths)
  return roofline(works, flops_rate=compute_rate(rates, dtype), bandwidths=link_bandwidths(rates),
                  measured={'prefill': record['prefill_s'], 'decode': record['decode_s']})


# ---- command line --------------------------------------------------------------------------------
def define_flags(fv) -> None:
  from absl import flags
  f = dict(flag_values=fv)
  flags.DEFINE_string('folder', None, 'Folder on the disk to probe (the offload folder; default: '
                      'the system temp folder).', **f)
  flags.DEFINE_float('file_gib', 1.0, 'Size of the disk probe file in GiB (>= 1 for a real '
                     'disk number).', lower_bound=1 / 1024, **f)
  flags.DEFINE_integer('threads', 4, 'Reader threads of the disk probe.', lower_bound=1, **f)
  flags.DEFINE_integer('chunk_mib', 16, 'Bytes per read call of the disk probe, in MiB.',
                       lower_bound=1, **f)
  flags.DEFINE_list('dtypes', ['float32'], 'Compute dtypes whose matmul rate to measure.', **f)
  flags.register_validator(
      'dtypes', lambda names: bool(names) and set(names) <= set(DTYPES),
      message=f'must name dtypes flexjax computes in; choose from {", ".join(DTYPES)}', **f)
  flags.DEFINE_bool('torch', False, 'Also time the matmuls in torch (the peers\' framework).', **f)
  flags.DEFINE_string('output', None, 'Also write the rates as JSON to this file.', **f)


def format_rates(rates: dict[str, Any]) -> str:
  lines = [f'device {rates["device"]}']
  for dtype, by_framework in rates['matmul_flops'].items():
    lines.append(f'matmul {dtype}: ' + ', '.join(
        f'{fw} {v / 1e9:,.1f} GFLOP/s (n={rates["matmul_n"][dtype][fw]})'
        for fw, v in by_framework.items()))
  disk = rates['disk']
  if rates.get('device_memory_bw'):
    lines.append(f'device memory: {rates["device_memory_bw"] / 1e9:,.0f} GB/s')
  lines += [f'host -> device: {rates["host_device_bw"] / 1e9:.2f} GB/s '
            f'({rates["host_device_method"]})',
            f'disk read: {rates["disk_read_bw"] / 1e9:.2f} GB/s (o_direct={disk["o_direct"]}, '
            f'{disk["threads"]} threads x {disk["chunk_bytes"] // 2**20} MiB, '
            f'{disk["file_bytes"] / 2**30:.2f} GiB in {disk["folder"]})'
            + (f'; {disk["note"]}' if disk['note'] else ''),
            f'disk write + fsync: {rates["disk_write_bw"] / 1e9:.2f} GB/s']
  return '\n'.join(lines)


def run_cli(fv) -> int:
  from tools.benchlib import report_error
  try:
    if fv.torch:
      import importlib.util
      if importlib.util.find_spec('torch') is None:
        raise FlexjaxError("--torch needs torch; install it with pip install -e '.[peers]'")
    rates = measure_rates(folder=fv.folder, dtypes=tuple(fv.dtypes), torch=fv.torch,
                          file_bytes=int(fv.file_gib * 2**30), chunk_bytes=fv.chunk_mib * 2**20,
                          threads=fv.threads)
  except (FlexjaxError, OSError) as e:
    return report_error('roofline', e)
  print(format_rates(rates))
  if fv.output:
    target = Path(fv.output)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(rates, indent=1) + '\n')
  return 0


if __name__ == '__main__':
  from tools.benchlib import run_tool
  run_tool(define_flags, run_cli)
