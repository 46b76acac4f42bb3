"""Hardware profile for the cost model: bandwidths between tiers and FLOP/s, measured or given.

Throughputs vary with size, so FLOP/s are kept per size (rows M of an [M, k] x [k, n] matmul) and
interpolated; bandwidths are single numbers per direction. Profiles are JSON files.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import os
import time
from pathlib import Path

import numpy as np

from flexjax import diskio, memwatch, scratch
from flexjax.errors import FlexjaxError

GB = 1e9
# Defaults of the CPU backend's overhead (see runtime_overhead).
CPU_RUNTIME_OVERHEAD = 256 * 2**20
CPU_COMPILE_OVERHEAD = 96 * 2**20


_RATE_TABLES = ('mm_flops', 'bmm_flops', 'xla_mm_flops')  # rows -> FLOP/s, keyed by int


@dataclasses.dataclass(frozen=True)
class HardwareProfile:
  """Bytes/s between tiers and FLOP/s of the compute units.

  mm_flops maps a matmul's row count M to FLOP/s (prefill uses M = batch x prompt, decode
  M = batch); bmm_flops likewise for decode attention (the engine's own: one new token per
  sequence over its cache); cpu_flops is the host's rate for attention delegated to it.
  """

  name: str
  ctog_bw: float  # host -> device
  gtoc_bw: float  # device -> host
  dtoc_bw: float  # disk -> host (page cache bypassed)
  ctod_bw: float  # host -> disk
  mm_flops: dict[int, float]
  bmm_flops: dict[int, float]
  cpu_flops: float
  # True where the "device" is the host CPU: copies between tiers and layer compute then share
  # the same cores and memory bus, so only disk waits overlap with compute.
  copies_share_compute: bool = False
  # The engine's prefill attention (whole prompts over themselves, in chunks), as FLOP/s of the
  # full square 4·b·s²·q_dim; where None, prefill attention is charged at bmm_flops.
  prefill_attention_flops: float | None = None
  # The engine's own time per step (one layer on one GPU batch) beside its products: scheduling,
  # dispatch, bookkeeping. Where None, steps are free (FlexGen's model).
  step_overhead_s: float | None = None
  # Share of the shorter of disk I/O and compute that runs hidden behind the other when both run
  # at once: 1 where the disk needs no cores (DMA), less on machines whose reads take CPU time.
  disk_overlap: float = 1.0
  # The runtime's own memory on this backend beside the plan's buffers (execution plan): kept
  # once the steps are compiled and have run, and the compiler's extra while compiling.
  runtime_overhead_bytes: int | None = None
  compile_overhead_bytes: int | None = None
  # Where mm_flops holds oneDNN's rate (a CPU's float32 prompt-sized products:
  # linear.in_library), XLA's own products' rate at the same sizes: that of the layers that keep
  # them (linear.family_in_library). None: mm_flops' rates hold for every layer.
  xla_mm_flops: dict[int, float] | None = None

  def __post_init__(self):
    """Refuses a rate the cost model cannot divide by (a profile measured with nothing to move,
    or edited by hand): a FlexjaxError naming the field and the value."""
    rates = {name: getattr(self, name) for name in ('ctog_bw', 'gtoc_bw', 'dtoc_bw', 'ctod_bw',
                                                    'cpu_flops', 'prefill_attention_flops')}
    for table in _RATE_TABLES:
      if getattr(self, table) is not None:
        if not getattr(self, table):
          raise FlexjaxError(f'{table} is empty; it needs the rate of at least one size')
        rates.update({f'{table}[{rows}]': v for rows, v in getattr(self, table).items()})
    for name, value in rates.items():
      if value is not None and not (isinstance(value, numbers.Real) and not isinstance(value, bool)
                                    and math.isfinite(value) and value > 0):
        raise FlexjaxError(f'{name}={value!r} is not a positive rate')
    if not 0 <= self.disk_overlap <= 1:
      raise FlexjaxError(f'disk_overlap={self.disk_overlap!r} must lie in [0, 1]')

  def matmul_flops(self, rows: int, library: bool = True) -> float:
    """The matmul rate at `rows`, never below a smaller size's: a product of many rows can
    always run as products of fewer (the measured tables dip where a size leaves the caches).
    `library`: whether the layer's long prompt steps run oneDNN's products. Where both were
    measured (xla_mm_flops' sizes and up), oneDNN's rates then hold; below them, and for layers
    that keep XLA's own products, XLA's."""
    xla = self.xla_mm_flops or {}
    rates = (self.mm_flops if library and xla and rows >= min(xla)
             else {**self.mm_flops, **xla})
    sizes = sorted(rates)
    envelope = dict(zip(sizes, np.maximum.accumulate([rates[m] for m in sizes])))
    return _interpolate(envelope, rows)

  def attention_flops(self, rows: int) -> float:
    return _interpolate(self.bmm_flops, rows)

  def prompt_attention_flops(self, rows: int) -> float:
    """Prefill attention's rate (the decode attention rate of `rows` where none was measured)."""
    return self.prefill_attention_flops or self.attention_flops(rows)

  def to_json(self) -> str:
    d = dataclasses.asdict(self)
    for table in _RATE_TABLES:
      if d[table] is not None:
        d[table] = {str(k): v for k, v in d[table].items()}
    return json.dumps(d, indent=2) + '\n'

  @classmethod
  def load(cls, path: str | os.PathLike) -> 'HardwareProfile':
    try:
      d = json.loads(Path(path).read_text())
      for table in _RATE_TABLES:
        if d.get(table) is not None:
          d[table] = {int(k): float(v) for k, v in d[table].items()}
      return cls(**d)
    except FileNotFoundError:
      raise FlexjaxError(f'hardware profile {str(path)!r} does not exist; measure one with '
                         '`python -m tools.profile_hw --output=...`') from None
    except IsADirectoryError:
      raise FlexjaxError(f'hardware profile {str(path)!r} is a folder; give its JSON file '
                         '(tools/profile_hw.py writes one)') from None
    except (json.JSONDecodeError, KeyError, TypeError, ValueError, FlexjaxError) as e:
      raise FlexjaxError(f'hardware profile {str(path)!r} is not valid ({e}); measure it '
                         'again') from None

  def save(self, path: str | os.PathLike) -> None:
    scratch.replace_file(Path(path), self.to_json())


def _interpolate(table: dict[int, float], rows: int) -> float:
  """Piecewise-linear in log(rows) between measured sizes; clamped at the ends."""
  sizes = sorted(table)
  if rows <= sizes[0]:
    return table[sizes[0]]
  if rows >= sizes[-1]:
    return table[sizes[-1]]
  x = np.log([s for s in sizes])
  return float(np.interp(np.log(rows), x, [table[s] for s in sizes]))


GPU_PLATFORMS = ('gpu', 'cuda', 'rocm')


VECTOR_FLAGS = ('avx2', 'fma', 'avx512f', 'avx512_bf16', 'avx512_fp16', 'amx_bf16', 'amx_tile')


def cpu_info() -> tuple[str | None, list[str]]:
  """The CPU's model name and which of VECTOR_FLAGS it has (matmul rates depend on them: the
  same VM type runs on CPUs with and without AVX-512). (None, []) where /proc/cpuinfo is not."""
  model, flags = None, set()
  try:
    with open('/proc/cpuinfo') as f:
      for line in f:
        if line.startswith('model name') and model is None:
          model = line.split(':', 1)[1].strip()
        elif line.startswith('flags') and not flags:
          flags = set(line.split(':', 1)[1].split())
  except OSError:
    pass
  return model, [flag for flag in VECTOR_FLAGS if flag in flags]


# What a measured profile holds; a cached one of another format is measured again. 2: XLA's own
# products' rate apart where oneDNN's was measured (xla_mm_flops).
PROFILE_FORMAT = 2


def machine_key(device, scratch_dir: str | None) -> dict[str, object]:
  """What a measured profile holds for: its format, the device, the cores this process may use,
  the CPU and its RAM, the jax build (rates and the runtime's own memory), and the filesystem the
  disk rates were read from (scratch_dir's, else the system temp folder's)."""
  import importlib.metadata
  import jax
  model, flags = cpu_info()
  folder = scratch.offload_parent(scratch_dir).absolute()
  while not folder.exists() and folder != folder.parent:  # made later, on its parent's disk
    folder = folder.parent
  cores = len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count()
  return {'profile': PROFILE_FORMAT, 'platform': device.platform,
          'device_kind': device.device_kind, 'devices': jax.local_device_count(device.platform),
          'cpu_model': model, 'cpu_vector_flags': flags, 'cores': cores,
          'ram_bytes': memwatch.meminfo_bytes('MemTotal'),
          'jax': jax.__version__, 'jaxlib': importlib.metadata.version('jaxlib'),
          'disk': folder.stat().st_dev}


def default_compute_dtype(platform: str) -> str:
  """The layer math's dtype when none is asked for: float16 on a GPU (half the bytes to move and
  store, tensor cores), float32 on the CPU backend (fastest and exact there: XLA:CPU widens
  float16 math anyway)."""
  return 'float16' if platform in GPU_PLATFORMS else 'float32'


HOST_MEMORY = ('auto', 'pinned', 'pageable')


def host_memory_kind(device, requested: str = 'auto') -> str | None:
  """The jax memory kind host-tier weights live in: 'pinned_host' (page-locked host memory the
  device copies by DMA at the link's full rate, the paper's pinned CPU buffers) or None (aligned
  numpy buffers, which the runtime copies through its own staging).

  auto: pinned where the device is an accelerator that offers it. On the CPU backend host and
  device are one RAM and an aligned numpy buffer becomes a device array without a copy, which
  pinned memory would add. pinned: pinned wherever the device offers it (tests use it on the
  CPU backend); an error where it does not.
  """
  if requested not in HOST_MEMORY:
    raise FlexjaxError(f'host_memory={requested!r} is not one of {", ".join(HOST_MEMORY)}')
  if requested == 'pageable':
    return None
  try:
    kinds = sorted(memory.kind for memory in device.addressable_memories())
  except (AttributeError, NotImplementedError, RuntimeError):
    kinds = []
  if requested == 'pinned':
    if 'pinned_host' not in kinds:
      raise FlexjaxError(f'--host_memory=pinned: device {device} offers no pinned host memory '
                         f'(its memory kinds: {", ".join(kinds) or "none listed"}); use '
                         '--host_memory=auto or --host_memory=pageable')
    return 'pinned_host'
  return 'pinned_host' if device.platform != 'cpu' and 'pinned_host' in kinds else None


def with_cpu_platform(platforms: str | None) -> str | None:
  """A jax_platforms value (JAX_PLATFORMS) that also starts the CPU backend: 'cuda' ->
  'cuda,cpu' (the first stays the default device). None or '' (every platform jax finds, the
  CPU included) is kept."""
  if not platforms:
    return platforms
  names = [name.strip() for name in platforms.split(',') if name.strip()]
  return ','.join(names if 'cpu' in names else names + ['cpu'])


def include_cpu_platform() -> None:
  """Makes jax start its CPU backend beside the platforms JAX_PLATFORMS names (flexjax runs CPU
  attention and quantization there). Takes effect before jax's first backend use; call it at
  program start."""
  import jax
  platforms = jax.config.jax_platforms
  wanted = with_cpu_platform(platforms)
  if wanted != platforms:
    jax.config.update('jax_platforms', wanted)


def cpu_device():
  """This process's host CPU as a jax device (CPU attention, quantization while placing; a
  distributed run lists every process's CPU devices, of which only its own are local)."""
  import jax
  try:
    return jax.local_devices(backend='cpu')[0]
  except RuntimeError:
    platforms = jax.config.jax_platforms
    if with_cpu_platform(platforms) == platforms:  # the CPU was asked for: another failure
      raise
    raise FlexjaxError(
        f'jax has no CPU backend (JAX_PLATFORMS={jax.config.jax_platforms!r}) and flexjax needs '
        'it for CPU attention and quantization; add cpu to it (e.g. JAX_PLATFORMS=cuda,cpu) or '
        'unset JAX_PLATFORMS') from None


def runtime_overhead(platform: str, profile: 'HardwareProfile | None' = None,
                     probe: dict[str, int] | None = None):
  """The runtime's own memory beside the plan's buffers on a backend: the profile's measured
  figures where it has them, else these defaults, measured on this project's CPU machines
  (tools/memcheck.py --overhead) and, for GPUs, XLA's allocations outside the compiled
  functions (none: memory_stats counts buffers only). probe: probe_bytes' where this process
  measures the machine."""
  from flexjax.plan import Overhead
  probe = {'probe_device': (probe or {}).get('device', 0),
           'probe_host': (probe or {}).get('host', 0)}
  if profile is not None and profile.runtime_overhead_bytes is not None:
    return Overhead(runtime=profile.runtime_overhead_bytes,
                    compile=profile.compile_overhead_bytes or 0, **probe)
  if platform == 'cpu':
    return Overhead(runtime=CPU_RUNTIME_OVERHEAD, compile=CPU_COMPILE_OVERHEAD, **probe)
  return Overhead(runtime=0, compile=0, **probe)


def t4_profile() -> HardwareProfile:
  """The paper's machine (T4 16 GB, PCIe, NVMe) from FlexGen's fitted constants.

  FlexGen fits one rate for prefill and one for decode; they become the large-M and small-M
  ends of the tables. Device->host and host->disk use the KV-cache rates (the slower ones).
  """
  return HardwareProfile(
      name='paper-t4', ctog_bw=12.89 * GB, gtoc_bw=0.97 * GB, dtoc_bw=0.473 * GB,
      ctod_bw=0.746 * GB, mm_flops={64: 4.3e12, 4096: 21.24e12},
      bmm_flops={64: 0.079e12, 4096: 9.97e12}, cpu_flops=0.0123e12)


def best_seconds(fn, repeats: int = 3, min_total: float = 0.0) -> float:
  """The shortest of `repeats` timed calls of fn (the least disturbed by a noisy machine), or
  of more calls while they have taken less than `min_total` seconds (short calls vary most)."""
  times = []
  while len(times) < repeats or sum(times) < min_total and len(times) < 100:
    start = time.perf_counter()
    fn()
    times.append(time.perf_counter() - start)
  return min(times)


def transfer_rate(host: np.ndarray, device, memory_kind: str | None = None,
                  repeats: int = 3) -> float:
  """Bytes/s of copying `host` to `device`'s own memory with jax.device_put: from host memory
  of `memory_kind` ('pinned_host': an accelerator's DMA), or (None) from the numpy buffer, a
  fresh copy of it each time on a CPU backend, whose device_put could alias the buffer."""
  import jax
  if memory_kind is None:
    fresh = device.platform == 'cpu'
    put = lambda: jax.device_put(np.array(host) if fresh else host, device)
  else:
    from jax.sharding import SingleDeviceSharding
    source = jax.device_put(host, SingleDeviceSharding(device, memory_kind=memory_kind))
    target = SingleDeviceSharding(device, memory_kind=device.default_memory().kind)
    put = lambda: jax.device_put(source, target)
  put().block_until_ready()
  return host.nbytes / best_seconds(lambda: put().block_until_ready(), repeats)


# What measuring a machine holds at once (`measure`, `probe_bytes`): one transfer buffer of
# size_mb and its copies, PROBE_WEIGHTS of float16 product matrices (more than a CPU's caches
# hold, so decode-sized products read them from memory as a layer's are read), and attention's
# K and V rows of at most a quarter of size_mb each.
PROBE_WEIGHTS = 256 * 2**20


def _probe_sizes(quick: bool) -> tuple[int, ...]:
  from flexjax.model import linear
  # up to a prompt step's products (linear.LIBRARY_ROWS rows: oneDNN's on a CPU in float32)
  return (1, 16, 256) if quick else (1, 8, 32, 128, 512, 2048, linear.LIBRARY_ROWS)


def _probe_positions(rows: int, hidden: int, itemsize: int, size_mb: int,
                     positions: int = 512) -> int:
  """Cached positions of the decode attention probe at `rows`: 512, fewer where K or V would
  pass a quarter of size_mb (a memory-bound rate needs no more)."""
  cap = size_mb * 2**20 // 4 // (rows * hidden * itemsize)
  return max(16, min(positions, cap))


def probe_bytes(platform: str, *, size_mb: int = 256, hidden: int = 2048,
                quick: bool = False) -> dict[str, int]:
  """The most `measure` holds at once, per tier ('device', 'host'; on a CPU backend the two are
  one RAM and add up), from the buffers each of its parts keeps (see measure):

  - transfers: the host buffer, the copy put on the device and the copy read back or the fresh
    / pinned source of a put;
  - disk: the host buffer and the reader's window, then the same beside the product matrices;
  - products: the matrices, the rows, two results in flight and, where oneDNN runs (a CPU's
    float32 prompt-sized products), two packed float32 matrices and its buffers;
  - attention: K and V at their capped positions and the scores of the prefill probe.
  """
  from flexjax import diskio
  from flexjax import library_scratch
  from flexjax.model import linear
  size = size_mb * 2**20
  cpu = platform == 'cpu'
  itemsize = 4 if cpu else 2
  rows = max(_probe_sizes(quick))
  window = diskio.IO_THREADS * diskio.CHUNK  # diskio.read_through's window
  library = (2 * 4 * hidden * hidden * 4 + library_scratch.ONEDNN_WORKSPACE
             if linear.in_library(platform, 'float32' if cpu else 'float16', rows) else 0)
  products = PROBE_WEIGHTS + rows * hidden * itemsize + 2 * rows * 4 * hidden * itemsize + library
  kv = max(2 * r * _probe_positions(r, hidden, itemsize, size_mb) * hidden * itemsize
           for r in _probe_sizes(quick)[:4] + (32,))
  prefill_attention = 3 * 4 * 512 * hidden * itemsize + 2 * 4 * (hidden // 64) * 512 * 512 * 4
  # (device, host) of each part
  parts = [(size, 2 * size), (size, 2 * size), (0, size + window),
           (PROBE_WEIGHTS + 2 * 8 * 4 * hidden * itemsize, size + window),
           (products, 0), (max(kv, prefill_attention), 0)]
  if cpu:
    return {'device': 0, 'host': max(d + h for d, h in parts)}
  return {'device': max(d for d, _ in parts), 'host': max(h for _, h in parts)}


def measure(device=None, *, scratch_dir: str | None = None, size_mb: int = 256,
            hidden: int = 2048, quick: bool = False, progress: bool = False) -> HardwareProfile:
  """Measures this machine: transfers, disk reads as the engine makes them (O_DIRECT, I/O
  threads), matmul rates and the engine's decode attention rate. Each part frees what it
  held before the next begins, so the most held at once is probe_bytes'."""
  import collections
  import functools

  import jax
  import jax.numpy as jnp

  from flexjax import memwatch
  from flexjax import progress as progress_lib
  from flexjax.config import ModelConfig
  from flexjax.model import attention
  from flexjax.model import linear

  device = device or jax.devices()[0]
  cpu = cpu_device()
  compute = jnp.float32 if device.platform == 'cpu' else jnp.float16
  itemsize = np.dtype(compute).itemsize
  sizes = _probe_sizes(quick)
  # sizes whose products an OPT layer's prompt step runs in oneDNN: XLA's own measured there too
  library_sizes = [m for m in sizes if linear.in_library(device.platform, compute, m)]
  bar = progress_lib.bar(3 + len(sizes) + len(library_sizes) + 4 + 4, 'measuring', unit='test',
                         show=progress)

  # The engine's product: weights as stored (float16), cast a tile at a time where the backend
  # computes in float32 (a decode step of few rows is bound by reading them, not by FLOPs), and
  # each weight read from memory, as a layer's are, not from a cache that holds a small matrix:
  # one product on each of PROBE_WEIGHTS of distinct matrices in turn, two in flight at most
  # (as the engine's steps).
  def product_matrices():
    return [jax.device_put(np.ones((4 * hidden, hidden), np.float16), device)
            for _ in range(max(1, PROBE_WEIGHTS // (8 * hidden * hidden)))]

  def over_all(f, a, weights):
    in_flight = collections.deque()
    for w in weights:
      if len(in_flight) == 2:
        in_flight.popleft().block_until_ready()
      in_flight.append(f(a, w))
    jax.block_until_ready(list(in_flight))

  def transfers_and_disk():
    host = np.random.default_rng(0).random(size_mb * 2**20 // 4, dtype=np.float32)
    # Host to device as host-tier weights move: from pinned host memory where the engine keeps
    # them there (an accelerator's DMA), else from a numpy buffer.
    ctog = transfer_rate(host, device, host_memory_kind(device))
    bar.update(1)
    on_device = jax.device_put(host, device)
    gtoc = host.nbytes / best_seconds(lambda: np.array(on_device))
    on_device.delete()
    bar.update(1)
    dtoc, ctod = _disk_rates(host, scratch_dir)
    bar.update(1)
    weights = product_matrices()
    a = jax.device_put(np.ones((8, hidden), compute), device)  # a decode step's rows
    product = jax.jit(functools.partial(linear.dense, dtype=compute))
    product(a, weights[0]).block_until_ready()
    overlap = _disk_overlap(lambda: over_all(product, a, weights), host, scratch_dir)
    bar.update(1)
    return ctog, gtoc, dtoc, ctod, overlap

  def matmul_rates():
    weights = product_matrices()

    def rate(rows, library):
      a = jax.device_put(np.ones((rows, hidden), compute), device)
      # compiled as a prompt step of that many rows is (oneDNN's products where `library`)
      f = jax.jit(functools.partial(linear.dense, dtype=compute)).lower(a, weights[0]).compile(
          linear.library_options() if library else None)
      programs.append(f)  # freed once the later parts are done (linear.library_options)
      f(a, weights[0]).block_until_ready()
      seconds = best_seconds(lambda: over_all(f, a, weights), min_total=0.5)
      bar.update(1)
      return 2 * rows * hidden * 4 * hidden * len(weights) / seconds

    return ({m: rate(m, m in library_sizes) for m in sizes},
            {m: rate(m, False) for m in library_sizes} or None)

  probe_cfg = ModelConfig(name='attention-probe', num_layers=1, hidden_size=hidden,
                          num_heads=hidden // 64, ffn_dim=4 * hidden, vocab_size=64,
                          max_positions=1024)

  # One new token per sequence over up to 512 cached positions, in the dtype a run's decode
  # attention reads: the compute dtype, which is also the cache's by default, on the device
  # and on the CPU backend with cpu_attention (there as the engine compiles it, a program of
  # its own, which converts the rows it reads to float32: attention.attend_dtype). XLA:CPU's
  # rates differ by dtype (opt-6.7b, 16 x 544: float32 15.1, float16 10.1 ms), so a GPU's
  # profile must not take the float32 rate for it.
  def attention_rate(rows, backend, standalone=False):
    positions = _probe_positions(rows, hidden, itemsize, size_mb)
    args = [jax.device_put(np.ones(shape, compute), backend)
            for shape in ((rows, hidden), (rows, hidden), (rows, hidden),
                          (rows, positions, hidden), (rows, positions, hidden))]
    mask = jax.device_put(np.ones((rows, positions), bool), backend)
    f = jax.jit(functools.partial(attention.attend_decode, cfg=probe_cfg,
                                  standalone=standalone))
    f(*args, mask).block_until_ready()
    rate = 4 * rows * hidden * positions / best_seconds(
        lambda: f(*args, mask).block_until_ready(), min_total=0.5)
    bar.update(1)
    return rate

  def prefill_attention_rate(rows, positions=512):
    args = [jax.device_put(np.ones((rows, positions, hidden), compute), device)
            for _ in range(3)]
    mask = jax.device_put(np.ones((rows, positions), bool), device)
    f = jax.jit(functools.partial(attention.prefill_attend, cfg=probe_cfg,
                                  dtype=attention.prefill_dtype(compute, device.platform)))
    f(*args, mask).block_until_ready()
    seconds = best_seconds(lambda: f(*args, mask).block_until_ready())
    bar.update(1)
    return 4 * rows * positions * positions * hidden / seconds

  def part(fn, *args, **kwargs):
    """One part of the measurement, whose freed memory goes back before the next starts."""
    out = fn(*args, **kwargs)
    memwatch.return_free_memory()
    return out

  programs = []
  with bar:
    ctog, gtoc, dtoc, ctod, overlap = part(transfers_and_disk)
    mm, xla_mm = part(matmul_rates)
    bmm = {m: part(attention_rate, m, device) for m in sizes[:4]}
    cpu_flops = part(attention_rate, 32, cpu, standalone=True)
    prefill_attention = part(prefill_attention_rate, 4)
    overhead = part(step_overhead)
    bar.update(1)
  jax.clear_caches()  # the probes' programs: the run compiles its own
  programs.clear()
  memwatch.return_free_memory()
  return HardwareProfile(name=f'{device.platform}:{device.device_kind}', ctog_bw=ctog,
                         gtoc_bw=gtoc, dtoc_bw=dtoc, ctod_bw=ctod, mm_flops=mm, bmm_flops=bmm,
                         cpu_flops=cpu_flops, copies_share_compute=device.platform == 'cpu',
                         prefill_attention_flops=prefill_attention, step_overhead_s=overhead,
                         disk_overlap=overlap, xla_mm_flops=xla_mm)


def step_overhead(num_layers: int = 4, gpu_batches: int = 8, gen_len: int = 9) -> float:
  """Seconds per decode step of one layer on one GPU batch of the engine itself, its products
  negligible: a model of width 64 decodes one sequence per GPU batch, everything resident."""
  from flexjax.config import ModelConfig
  from flexjax.engine import Engine, GenerationConfig
  from flexjax.policy import Policy
  from flexjax.weights import DummyWeights
  cfg = ModelConfig(name='overhead-probe', num_layers=num_layers, hidden_size=64, num_heads=4,
                    ffn_dim=128, vocab_size=256, max_positions=64)
  policy = Policy(gpu_batch_size=1, num_gpu_batches=gpu_batches, w_gpu_percent=100)
  prompts = [[2, 10 + i, 20 + i] for i in range(gpu_batches)]
  gen = GenerationConfig(gen_len=gen_len, stop_at_eos=False)
  with Engine(DummyWeights(cfg, 'float32'), policy=policy) as engine:
    engine.generate(prompts, gen)  # compiles
    decode_s = min(engine.generate(prompts, gen).decode_s for _ in range(2))
  return decode_s / ((gen_len - 1) * (num_layers + 2) * gpu_batches)


def _disk_overlap(compute, data: np.ndarray, scratch_dir: str | None) -> float:
  """Share of the shorter of an O_DIRECT file read and a run of `compute` calls (decode-sized
  products, as long as the read) hidden when the two run at once on two threads."""
  import threading
  with scratch.claim(scratch.offload_parent(scratch_dir), 'flexjax-overlap-') as folder:
    path = folder.path / 'probe.bin'
    with open(path, 'wb') as f:
      data.tofile(f)
      f.flush()
      os.fsync(f.fileno())
    nbytes = data.nbytes // diskio.BLOCK * diskio.BLOCK

    def read() -> float:
      return diskio.read_through(path, file_bytes=nbytes)[0]

    read_s = min(read() for _ in range(2))
    once = best_seconds(compute)
    calls = max(1, round(read_s / once))

    def computing() -> float:
      start = time.perf_counter()
      for _ in range(calls):
        compute()
      return time.perf_counter() - start

    compute_s = min(computing() for _ in range(2))
    both = []
    for _ in range(2):
      reader = threading.Thread(target=read)
      start = time.perf_counter()
      reader.start()
      computing()
      reader.join()
      both.append(time.perf_counter() - start)
  hidden = (read_s + compute_s - min(both)) / min(read_s, compute_s)
  return float(min(1.0, max(0.0, hidden)))


def _disk_rates(data: np.ndarray, scratch_dir: str | None) -> tuple[float, float]:
  """(read, write) bytes/s of a file, with the page cache dropped before reading."""
  with scratch.claim(scratch.offload_parent(scratch_dir), 'flexjax-profile-') as folder:
    path = folder.path / 'probe.bin'
    start = time.perf_counter()
    with open(path, 'wb') as f:
      data.tofile(f)
      f.flush()
      os.fsync(f.fileno())
    write = data.nbytes / (time.perf_counter() - start)
    nbytes = data.nbytes // diskio.BLOCK * diskio.BLOCK
    seconds, _, _ = diskio.read_through(path, file_bytes=nbytes)  # as the engine reads weights
    read = nbytes / seconds
  return read, write
