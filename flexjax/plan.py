"""Execution plan: every buffer a run holds, per tier, with the phases it is alive in.

This is flexjax's one memory model. The same buffer list serves three readers:
  * the runtime: a run is checked against the plan's peak per tier before anything is
    allocated, and every allocation draws from a buffer the plan named (storage.Pools);
  * the cost model / LP: `memory_forms` evaluates the same list with the placement fractions
    as variables (cost_model.Linear), one form per tier and phase;
  * the search's exact re-check: `build` for a rounded policy.
XLA's working memory comes from the compiled step functions (steps.Steps.working_memory), and
the runtime's fixed overhead per backend from the hardware profile.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np

from flexjax.config import ModelConfig, np_dtype
from flexjax.diskio import BLOCK, align_up
from flexjax.errors import FlexjaxError
from flexjax.model import linear
from flexjax.model import params as params_lib
from flexjax.policy import Policy, flexgen_tiers, share_order, split_by_share
from flexjax.quant import Packed
from flexjax.sampler import Logprobs

Path = tuple[str, ...]
TIERS = ('device', 'host', 'disk')
# probe: this machine is measured for the cost model (a first --policy=auto run without a cached
# profile); compile: the stage functions compile (before any placement); place: weights are read
# from their source and put on their tiers; prefill / decode: the block schedule runs.
PHASES = ('probe', 'compile', 'place', 'prefill', 'decode')
RUN = ('prefill', 'decode')


# ---- linear forms (the LP's view of a byte count) ------------------------------------------------
@dataclasses.dataclass
class Linear:
  """const + sum(coef[v] * v) over placement fractions (wg, wc, wd, cg, cc, cd, hg, hc, hd)."""

  const: float = 0.0
  coef: dict[str, float] = dataclasses.field(default_factory=dict)

  def __add__(self, other) -> 'Linear':
    if not isinstance(other, Linear):
      return Linear(self.const + other, dict(self.coef))
    coef = dict(self.coef)
    for k, v in other.coef.items():
      coef[k] = coef.get(k, 0.0) + v
    return Linear(self.const + other.const, coef)

  __radd__ = __add__

  def __mul__(self, factor: float) -> 'Linear':
    return Linear(self.const * factor, {k: v * factor for k, v in self.coef.items()})

  __rmul__ = __mul__

  def value(self, x: dict[str, float]) -> float:
    return self.const + sum(c * x[k] for k, c in self.coef.items())


def term(const: float = 0.0, **coef: float) -> Linear:
  return Linear(const, coef)


# ---- the weight walk --------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Itemsizes:
  storage: int  # weights on host and disk
  compute: int  # weights on the device, hidden states
  cache: int
  # whether a step casts an unpacked stored weight to the compute dtype before multiplying
  # by it (float16 stored, float32 computed); None: where the sizes differ. Equal sizes
  # may still cast (float16 stored, bfloat16 computed): Itemsizes.of knows the dtypes.
  cast: bool | None = None

  def __post_init__(self):
    if self.cast is None:
      object.__setattr__(self, 'cast', self.storage != self.compute)

  @classmethod
  def of(cls, storage_dtype: str, compute_dtype: str, cache_dtype: str) -> 'Itemsizes':
    storage, compute = np_dtype(storage_dtype), np_dtype(compute_dtype)
    return cls(storage=storage.itemsize, compute=compute.itemsize,
               cache=np_dtype(cache_dtype).itemsize, cast=storage != compute)


def stage_names(cfg: ModelConfig) -> list[str]:
  """Compute stages in model order: input embedding, decoder layers, output head."""
  return ['embed'] + [params_lib.layer_name(i) for i in range(cfg.num_layers)] + ['head']


def stage_shapes(cfg: ModelConfig, stage: str) -> dict[Path, tuple[int, ...]]:
  """Flat shapes of a compute stage; the token embedding belongs to embed, and to head when the
  LM head is tied to it."""
  if stage == 'embed' or (stage == 'head' and cfg.head_uses_tokens):
    shapes = {'tokens': cfg.tokens_shape(), **params_lib.stage_shapes(cfg, stage)}
  else:
    shapes = params_lib.stage_shapes(cfg, stage)
  return params_lib.flatten(shapes)


def distinct_stages(cfg: ModelConfig) -> dict[str, int]:
  """Stages with distinct shapes and how many times each occurs (all decoder layers alike)."""
  return {'embed': 1, params_lib.layer_name(0): cfg.num_layers, 'head': 1}


def compressed(policy: Policy, shape: tuple[int, ...]) -> bool:
  """Whether a weight is stored quantized: matrices are, biases and LayerNorms are not."""
  return policy.compress_weight and len(shape) >= 2


def cache_row_bytes(cfg: ModelConfig, policy: Policy, sizes: Itemsizes) -> int:
  """Bytes of one token's K (or V) in one layer (its KV heads' width: GQA's cache is smaller)."""
  if policy.compress_cache:
    return policy.quant.row_bytes(cfg.kv_dim)
  return cfg.kv_dim * sizes.cache


def cache_read_in_place(policy: Policy, device_is_host: bool, disk_rows: int) -> bool:
  """Whether a decode step's attention reads a GPU batch's offloaded cache rows where they lie:
  when none is on disk and the CPU backend attends over them (cpu_attention, or a CPU device),
  which takes the aligned host array as it is. Else they are copied (disk rows read) into a
  fresh buffer first. (The step's own write-back, at its new position, goes to a position its
  attention masks out.)"""
  return disk_rows == 0 and (policy.cpu_attention or device_is_host)


def sparse_keep(policy: Policy, cache_len: int) -> int:
  """Cached positions kept per decode step by sparse attention."""
  return max(1, math.ceil(policy.attn_sparsity * cache_len))


@dataclasses.dataclass(frozen=True)
class TensorSlot:
  """Rows [rows[0], rows[1]) of one weight tensor of a stage (all of it unless the tensor is
  split across tiers): where they live, and their bytes there and once loaded."""

  path: Path
  shape: tuple[int, ...]  # of these rows
  tier: str
  packed: bool  # stored quantized (in every tier, the device included)
  stored: int  # bytes where they live (storage dtype, or packed bytes)
  loaded: int  # bytes on the device once loaded (as stored; packed ones dequantized once per load)
  rows: tuple[int, int]
  full_shape: tuple[int, ...]  # of the whole tensor
  join: int = 0  # device bytes joining a split tensor's parts when it is loaded (first offloaded
  #                part only): the whole tensor (not for one in_parts), plus a packed resident
  #                part dequantized
  in_parts: bool = False  # split across tiers, and its step takes it as the tuple of its row
  #                         parts, joined nowhere (params.used_in_parts)

  @property
  def resident(self) -> int:
    """Bytes of a device-resident tensor: as stored (packed ones are dequantized in the step,
    the others cast a tile at a time at their products)."""
    return self.stored

  @property
  def whole(self) -> bool:
    return self.rows == (0, self.full_shape[0])


def stage_layout(cfg: ModelConfig, policy: Policy, sizes: Itemsizes,
                 stage: str) -> tuple[TensorSlot, ...]:
  """Every tensor of a stage (or its parts) with its tier, by the policy's placement rule
  (policy.share_order then policy.split_by_share, or policy.flexgen_tiers). The one walk over
  weight bytes in flexjax."""
  shapes = stage_shapes(cfg, stage)
  stored = {path: _stored_bytes(policy, sizes, shape) for path, shape in shapes.items()}
  if policy.placement == 'flexgen':
    parts = {}
    for group in flexgen_groups(stage, shapes):
      counts = [math.prod(shapes[path]) for path in group]
      for path, tier in zip(group, flexgen_tiers(counts, policy.w_gpu_percent,
                                                 policy.w_cpu_percent)):
        parts[path] = [(tier, 0, shapes[path][0])]
    order = [path for group in flexgen_groups(stage, shapes) for path in group]
  else:
    paths = sorted(shapes)
    order = [paths[i] for i in share_order([stored[p] for p in paths], policy.w_gpu_percent,
                                           policy.w_cpu_percent)]
    split = split_by_share([stored[p] for p in order], [shapes[p][0] for p in order],
                           policy.w_gpu_percent, policy.w_cpu_percent)
    parts = dict(zip(order, split))
  out = []
  for path in order:
    shape, count = shapes[path], shapes[path][0]
    whole_loaded = math.prod(shape) * _loaded_itemsize(policy, sizes, shape)
    split_load = len(parts[path]) > 1 and any(t != 'device' for t, _, _ in parts[path])
    in_parts = len(parts[path]) > 1 and params_lib.used_in_parts(
        stage, path, cast=sizes.cast and not compressed(policy, shape))
    # the joined tensor (none for one used in parts), plus a packed resident part dequantized
    joined = 0 if in_parts else whole_loaded
    first_offloaded = True
    for tier, lo, hi in parts[path]:
      join = 0
      if split_load and tier != 'device' and first_offloaded:
        first_offloaded = False
        device_rows = sum(h - l for t, l, h in parts[path] if t == 'device')
        join = joined + (whole_loaded * device_rows // count if compressed(policy, shape) else 0)
      out.append(TensorSlot(path, (hi - lo, *shape[1:]), tier, compressed(policy, shape),
                            stored[path] * (hi - lo) // count, whole_loaded * (hi - lo) // count,
                            (lo, hi), tuple(shape), join, in_parts))
  return tuple(out)


def _loaded_itemsize(policy: Policy, sizes: Itemsizes, shape: tuple[int, ...]) -> int:
  """Bytes per value of a tensor loaded to the device: dequantized into the compute dtype if
  packed, else as stored."""
  return sizes.compute if compressed(policy, shape) else sizes.storage


def _stored_bytes(policy: Policy, sizes: Itemsizes, shape: tuple[int, ...]) -> int:
  count = math.prod(shape)
  if compressed(policy, shape):
    return count // shape[-1] * policy.quant.row_bytes(shape[-1])
  return count * sizes.storage


def flexgen_groups(stage: str, shapes: dict[Path, tuple[int, ...]]) -> list[list[Path]]:
  """A stage's tensors as FlexGen's layers hold them, in FlexGen's order: input embedding
  (tokens, positions), attention (q, k, v, out with biases, then its LayerNorm), MLP (fc1, fc2
  with biases, then its LayerNorm), output embedding (final LayerNorm, tokens). Tensors FlexGen
  has no place for (OPT-350m's projections) join the stage's last group."""
  if stage == 'embed':
    names = [[('tokens',), ('positions',)]]
  elif stage == 'head':
    names = [[('final_ln', 'scale'), ('final_ln', 'bias'), ('final_norm', 'scale'), ('tokens',),
              ('lm_head',)]]
  else:  # OPT's names, then the llama family's
    dense = lambda *layers: [(n, part) for n in layers for part in ('weight', 'bias')]
    names = [dense('q', 'k', 'v', 'o') + [('attn_ln', 'scale'), ('attn_ln', 'bias'),
                                          ('attn_norm', 'scale')],
             dense('fc1', 'fc2', 'gate', 'up', 'down') + [('mlp_ln', 'scale'), ('mlp_ln', 'bias'),
                                                          ('mlp_norm', 'scale')]]
  groups = [[path for path in group if path in shapes] for group in names]
  known = {path for group in groups for path in group}
  groups[-1] += sorted(path for path in shapes if path not in known)
  return [group for group in groups if group]


@dataclasses.dataclass(frozen=True)
class WeightTotals:
  """Weight bytes per tier over the whole model, and the largest per-load quantities."""

  placed: dict[str, int]  # device: resident bytes; host, disk: stored bytes
  stored: dict[str, int]  # stored bytes per tier (the placement's realised shares)
  loaded_max: int  # the largest stage's non-resident tensors once loaded
  join_max: int  # of that, the largest stage's joins of tensors split across tiers
  transfer_max: int  # the largest non-resident tensor as stored (in flight to the device)
  disk_stage_max: int  # the largest stage's disk tensors, 4 KiB-aligned (read into staging)
  stage_max: int  # the largest stage as stored, token embedding aside (read while placing)
  resident_transfer_max: int  # the largest device-resident tensor as stored
  tensor_max: int  # the largest tensor but the tokens' (float32 while dummy weights are drawn)
  tokens: int  # the token embedding as stored (read once, placed in two stages)
  largest_load: tuple | None  # (packed shape, dim) of the largest tensor dequantized on load
  tensors_max: int  # the most tensors of one stage (each has at most one part on disk)


def stage_join_bytes(slots) -> int:
  """Bytes a stage's split tensors are joined into when it loads: each at an aligned offset of
  one buffer (mover.Mover._join_all on a CPU backend)."""
  return sum(align_up(s.join) for s in slots if s.join)


def weight_totals(cfg: ModelConfig, policy: Policy, sizes: Itemsizes) -> WeightTotals:
  placed = dict.fromkeys(TIERS, 0)
  stored = dict.fromkeys(TIERS, 0)
  loaded_max = join_max = transfer_max = disk_max = stage_max = tensor_max = resident_max = 0
  tensors_max = 0
  largest_load, largest_loaded = None, -1
  for stage, count in distinct_stages(cfg).items():
    layout = stage_layout(cfg, policy, sizes, stage)
    tensors_max = max(tensors_max, len({slot.path for slot in layout}))
    for slot in layout:
      placed[slot.tier] += count * (slot.resident if slot.tier == 'device' else slot.stored)
      stored[slot.tier] += count * slot.stored
      if slot.path != ('tokens',):  # read on its own, before anything is placed
        tensor_max = max(tensor_max, math.prod(slot.full_shape) * 4)
      if slot.tier != 'device':
        transfer_max = max(transfer_max, slot.stored)
        whole = math.prod(slot.full_shape) * sizes.compute
        # the whole tensor bounds a part's cast, and depends less on the percents (fewer
        # distinct compiles in the search)
        if slot.packed and whole > largest_loaded:
          largest_loaded = whole
          shape = slot.full_shape
          largest_load = ((*shape[:-1], policy.quant.row_bytes(shape[-1])), shape[-1])
      if slot.tier == 'device':
        resident_max = max(resident_max, slot.stored)
    loaded_max = max(loaded_max, sum(s.loaded + s.join for s in layout if s.tier != 'device'))
    join_max = max(join_max, stage_join_bytes(layout))
    disk_max = max(disk_max, sum(align_up(s.stored) + (0 if s.whole else BLOCK)
                                 for s in layout if s.tier == 'disk'))
    stage_max = max(stage_max, sum(math.prod(s.shape) * sizes.storage for s in layout
                                   if s.path != ('tokens',)))
  tokens = math.prod(cfg.tokens_shape()) * sizes.storage
  return WeightTotals(placed, stored, loaded_max, join_max, transfer_max, disk_max, stage_max,
                      resident_max, tensor_max, tokens, largest_load, tensors_max)


# ---- buffers ----------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Buffer:
  """`count` buffers of `nbytes` each on `tier`, alive during `phases`."""

  name: str
  tier: str
  nbytes: Any  # int for a plan, Linear in the LP
  count: int
  phases: tuple[str, ...]
  what: str

  @property
  def total(self):
    return self.count * self.nbytes


@dataclasses.dataclass(frozen=True)
class Overhead:
  """The runtime's own bytes beside the plan's buffers, per backend (hardware profile):
  what the process keeps once the stage functions are compiled and have run (code, thread
  pools, allocator slack), the compiler's extra memory while compiling, and what measuring
  this machine holds where the run measures it (hardware.probe_bytes; 0 where the profile
  was loaded)."""

  runtime: int
  compile: int
  probe_device: int = 0
  probe_host: int = 0


def runtime_buffers(overhead: Overhead, device_is_host: bool) -> list[Buffer]:
  """The runtime's own buffers, in every plan and alone in the probe phase."""
  return [
      # on a CPU backend the runtime's own memory is RAM beside the (simulated) device tier
      Buffer('runtime', 'host' if device_is_host else 'device', overhead.runtime, 1,
             PHASES, 'runtime overhead of the backend'),
      Buffer('compiler', 'host', overhead.compile, 1, ('compile',), 'compiler working memory'),
      Buffer('probe.device', 'device', overhead.probe_device, 1, ('probe',),
             "measuring this machine's rates for the cost model"),
      Buffer('probe.host', 'host', overhead.probe_host, 1, ('probe',),
             "measuring this machine's rates for the cost model"),
  ]


def check_probe(overhead: Overhead, device_is_host: bool,
                budgets: dict[str, int | None]) -> None:
  """Refuses, before it starts, a measurement of this machine that would pass a budget."""
  phases = peaks_by_phase(runtime_buffers(overhead, device_is_host))
  need = {tier: phases[tier]['probe'] for tier in TIERS}
  if device_is_host:
    need = {'ram': need['device'] + need['host']}
  for tier, nbytes in need.items():
    budget = budgets.get(tier)
    if budget is not None and nbytes > budget:
      flag = {'device': '--gpu_mem', 'host': '--cpu_mem', 'ram': '--cpu_mem'}[tier]
      raise FlexjaxError(
          f'measuring this machine for --policy=auto needs {format_bytes(nbytes)} of '
          f'{"RAM" if tier == "ram" else tier + " memory"} but {flag} allows '
          f'{format_bytes(budget)}; raise {flag}, or pass --hw_profile=FILE (measured once by '
          'python -m tools.profile_hw) or --hw_profile=paper-t4')


@dataclasses.dataclass(frozen=True)
class Shape:
  """What the buffers depend on besides the placement: the run's geometry and dtypes."""

  cfg: ModelConfig
  policy: Policy
  sizes: Itemsizes
  prompt_len: int
  gen_len: int
  device_is_host: bool  # a CPU backend: device and host tiers are the same RAM
  return_logits: bool = False
  read_ahead: bool = False  # under overlap: disk reads of the stage after next start early
  logprobs: Logprobs = Logprobs()  # the log-probabilities the block keeps

  @property
  def total_len(self) -> int:
    return self.prompt_len + self.gen_len - 1


@dataclasses.dataclass(frozen=True)
class Shares:
  """What the placement puts where: ints for a policy, Linear forms for the LP."""

  weights: dict[str, Any]  # tier -> placed bytes
  loaded: Any  # the largest stage's loaded (non-resident) bytes
  transfer: Any  # the largest non-resident tensor as stored
  disk_staging: Any  # the largest stage's disk tensors as read (aligned)
  cache_rows: dict[str, Any]  # tier -> rows of a GPU batch
  act_rows: dict[str, Any]
  act_partial: Any  # 1 when the hidden states are split between the device and elsewhere


def stages_loaded(overlap: bool) -> int:
  """Stages whose non-resident weights are loaded at once: the one computing and, with
  overlap, the next one loading."""
  return 2 if overlap else 1


def runs_alone(phase: str, device_is_host: bool) -> bool:
  """Whether a step of `phase` runs alone: a CPU backend's prompt steps, one at a time. Each
  runs for a tenth of a second or more there (its dispatch gap is a few milliseconds) and
  XLA:CPU's library fusions make it large (an opt-6.7b layer of 64 x 64 rows: 1.9 GB), so a
  second one in flight would cost a batch twice its size in memory. What the finished step
  freed is handed back to the system before the next one starts (executor.Executor), or the
  heap would hold it beside the next step's."""
  return phase == 'prefill' and device_is_host


def steps_in_flight(phase: str, overlap: bool, device_is_host: bool) -> int:
  """Steps the executor dispatches before the oldest has finished: two with overlap, so the
  device never waits for the next dispatch, except steps that run alone (runs_alone)."""
  if not overlap or runs_alone(phase, device_is_host):
    return 1
  return 2


def buffers(shape: Shape, shares: Shares, totals: WeightTotals, xla: dict[str, Any],
            overhead: Overhead) -> list[Buffer]:
  """Every buffer of a run. xla: step kind -> bytes of one call (steps.Steps.working_memory)."""
  cfg, policy, sizes = shape.cfg, shape.policy, shape.sizes
  b, g, L = policy.gpu_batch_size, policy.num_gpu_batches, cfg.num_layers
  s, t, h = shape.prompt_len, shape.total_len, cfg.hidden_size
  overlap = policy.overlap
  stages_alive = stages_loaded(overlap)
  steps_alive = steps_in_flight('decode', overlap, shape.device_is_host)  # executor's bound
  inputs_alive = steps_alive + (1 if overlap else 0)  # loaded inputs: those steps + one loading
  row = cache_row_bytes(cfg, policy, sizes)
  kv_seq = 2 * t * row  # K and V of one sequence, one layer
  kept = sparse_keep(policy, t) if policy.attn_sparsity < 1 else t
  kv_read = (t + kept) * row  # read for one sequence's attention: all of K, kept rows of V
  hid = h * sizes.compute
  cr, ar = shares.cache_rows, shares.act_rows
  off_cache = cr['host'] + cr['disk']
  off_act = ar['host'] + ar['disk']
  # read for one offloaded sequence's attention into a fresh buffer: nothing of K (nor of dense
  # V) where the rows are read in place, the kept rows of a sparse V always
  staged = ((kept * row if policy.attn_sparsity < 1 else 0)
            if cache_read_in_place(policy, shape.device_is_host, cr['disk']) else kv_read)
  out = runtime_buffers(overhead, shape.device_is_host) + [
      Buffer('weights.resident', 'device', shares.weights['device'], 1, ('place',) + RUN,
             'weights resident on the device'),
      Buffer('weights.host', 'host', shares.weights['host'], 1, ('place',) + RUN,
             'weights in host RAM'),
      Buffer('weights.disk', 'disk', shares.weights['disk'], 1, ('place',) + RUN,
             'weights on disk'),
      Buffer('source.stage', 'host', totals.stage_max + totals.tensor_max, 1, ('place',),
             'one stage read from the weight source'),
      Buffer('source.tokens', 'host', totals.tokens, 1, ('place',),
             'token embedding read once for two stages'),
      Buffer('weights.place_transfer', 'device', totals.resident_transfer_max, 1, ('place',),
             'a resident tensor put on the device, before its cast'),
      Buffer('xla.quantize_weights', 'device' if shape.device_is_host else 'host',
             xla.get('place', 0), 1, ('place',), 'quantizing a weight tensor'),
      Buffer('weights.loaded', 'device', shares.loaded, stages_alive, RUN,
             'non-resident weights of a stage, loaded'),
      Buffer('weights.transfer', 'device', shares.transfer, 1, RUN,
             'a weight tensor in flight, before its cast'),
      Buffer('weights.staging', 'host', shares.disk_staging,
             2 if overlap and shape.read_ahead else 1, RUN,
             "a stage's disk weights read into RAM (and the one after, when read ahead)"),
      Buffer('xla.load', 'device', xla['load'], 1, RUN, 'cast / dequantize of a loaded tensor'),
      # on a CPU backend a stage's unpacked disk tensors are device arrays over its staging
      # buffer, kept until its steps have run (mover.Mover.keeps_staging): the two stages
      # loaded hold theirs, counted above at their tensors' bytes; each disk tensor's part
      # takes up to two blocks more there (aligned, and read from a block boundary)
      Buffer('weights.staging_align', 'host',
             2 * BLOCK * totals.tensors_max if shape.device_is_host else 0, stages_alive, RUN,
             'alignment of the staging buffers that loaded weights are (CPU backend)'),
      Buffer('cache.device', 'device', L * g * kv_seq * cr['device'], 1, RUN,
             'KV cache rows on the device'),
      Buffer('cache.host', 'host', L * g * kv_seq * cr['host'], 1, RUN, 'KV cache rows in RAM'),
      Buffer('cache.disk', 'disk', L * g * kv_seq * cr['disk'], 1, RUN, 'KV cache rows on disk'),
      Buffer('hidden.device', 'device', g * s * hid * ar['device'], 1, RUN,
             'hidden states on the device'),
      Buffer('hidden.host', 'host', g * s * hid * ar['host'], 1, RUN, 'hidden states in RAM'),
      Buffer('hidden.disk', 'disk', g * s * hid * ar['disk'], 1, RUN, 'hidden states on disk'),
      Buffer('hidden.staging', 'host', s * hid * off_act, inputs_alive, RUN,
             'offloaded hidden rows read for a step'),
      Buffer('hidden.loaded', 'device', s * hid * (off_act + b * shares.act_partial),
             inputs_alive, RUN, 'offloaded hidden rows on the device, joined to the rest'),
      Buffer('cache.staging', 'host', staged * off_cache, inputs_alive, ('decode',),
             'offloaded KV rows read for attention'),
      Buffer('xla.prefill', 'device', xla['prefill_step'],
             steps_in_flight('prefill', overlap, shape.device_is_host), ('prefill',),
             'XLA temporaries and outputs of the steps in flight'),
      Buffer('xla.decode', 'device', xla['decode_step'], steps_alive, ('decode',),
             'XLA temporaries and outputs of the steps in flight'),
      Buffer('xla.cpu_attention', 'host', xla['cpu_attention'], steps_alive, ('decode',),
             'attention over host KV rows on the CPU backend'),
      Buffer('store.pending', 'device', s * (2 * row * off_cache + hid * off_act), steps_alive, RUN,
             'offloaded rows of a step awaiting write-back'),
  ]
  if not shape.device_is_host:  # on a CPU backend these are the host buffers themselves
    out += [
        Buffer('cache.loaded', 'device', kv_read * off_cache if not policy.cpu_attention
               else (kept * row if policy.attn_sparsity < 1 else 0) * off_cache, inputs_alive,
               ('decode',), 'offloaded KV rows copied to the device for attention (with '
               'cpu_attention, the V rows sparse attention keeps)'),
        Buffer('store.host_copy', 'host', s * (2 * row * off_cache + hid * off_act),
               steps_alive, RUN, 'offloaded rows of the steps in flight copied to RAM for '
               'write-back (into pinned memory as each step is dispatched, Storage.to_host)'),
    ]
  if shape.return_logits:
    out.append(Buffer('logits', 'host', g * b * shape.gen_len * cfg.vocab_size * 4, 1, RUN,
                      'logits of the block, returned'))
  outputs = shape.gen_len * 4 + shape.logprobs.host_bytes(shape.gen_len)
  out.append(Buffer('block.host_state', 'host', g * b * (outputs + t + 2 * s * 5), 1,
                    RUN, 'tokens, masks and outputs of the block'))
  return out


def peaks_by_phase(buffers_: list[Buffer], tiers=TIERS) -> dict[str, dict[str, Any]]:
  """tier -> phase -> bytes alive (sums of the buffers alive in that phase)."""
  out = {tier: dict.fromkeys(PHASES, 0) for tier in tiers}
  for buf in buffers_:
    for phase in buf.phases:
      out[buf.tier][phase] = out[buf.tier][phase] + buf.total
  return out


# ---- the plan of one run ----------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ExecutionPlan:
  """Every buffer of one run with its tier and phases; its peaks are what the run is checked
  against before anything is allocated."""

  shape: Shape
  buffers: tuple[Buffer, ...]
  working: dict[str, int]  # XLA bytes per step kind, from the compiled functions

  @property
  def policy(self) -> Policy:
    return self.shape.policy

  def by_phase(self) -> dict[str, dict[str, int]]:
    return peaks_by_phase(list(self.buffers))

  def peaks(self) -> dict[str, int]:
    """Peak bytes per tier ('device', 'host', 'disk'), and 'ram' on a CPU backend where the
    device and the host are the same memory (the peak of their sum, phase by phase)."""
    phases = self.by_phase()
    out = {tier: int(max(phases[tier].values())) for tier in TIERS}
    if self.shape.device_is_host:
      out['ram'] = int(max(phases['device'][p] + phases['host'][p] for p in PHASES))
    return out

  def capacity(self, name: str) -> int:
    """Bytes the runtime may hold at once in the buffer(s) called `name`."""
    return sum(int(b.total) for b in self.buffers if b.name == name)

  def _over(self, budgets: dict[str, int | None]) -> list[str]:
    """The tiers whose peak exceeds their budget."""
    peaks = self.peaks()
    return [tier for tier in (('ram',) if self.shape.device_is_host else ()) + TIERS
            if budgets.get(tier) is not None and peaks.get(tier, 0) > budgets[tier]]

  def fits(self, budgets: dict[str, int | None]) -> bool:
    return not self._over(budgets)

  def check(self, budgets: dict[str, int | None]) -> None:
    """Refuses a plan whose peak exceeds a budget, naming the tier, the need and the budget."""
    over = self._over(budgets)
    if not over:
      return
    tier, peaks = over[0], self.peaks()
    budget = budgets[tier]
    flag = {'device': '--gpu_mem', 'host': '--cpu_mem', 'ram': '--cpu_mem',
            'disk': '--disk_mem'}[tier]
    where = 'RAM (device and host tiers together)' if tier == 'ram' else f'{tier} tier'
    top = sorted((b for b in self.buffers if b.tier == tier or tier == 'ram' and
                  b.tier in ('device', 'host')), key=lambda b: -b.total)[:3]
    largest = ', '.join(f'{b.name} {format_bytes(b.total)}' for b in top)
    raise FlexjaxError(
        f'policy {self.policy.describe()} needs {format_bytes(peaks[tier])} on the {where} but '
        f'{flag} allows {format_bytes(budget)} (short by {format_bytes(peaks[tier] - budget)}; '
        f'largest: {largest}); raise {flag}, or move weights/cache/hidden states to a lower tier '
        'or use smaller GPU batches')

  def table(self) -> str:
    """The buffers, one line each, with the peak per tier."""
    lines = [f'{"buffer":<22} {"tier":<6} {"bytes":>12} x{"n":<2} phases']
    for buf in self.buffers:
      if buf.total:
        lines.append(f'{buf.name:<22} {buf.tier:<6} {format_bytes(buf.nbytes):>12} x{buf.count:<2} '
                     f'{",".join(buf.phases)}')
    lines.append('peak: ' + ', '.join(f'{k} {format_bytes(v)}' for k, v in self.peaks().items()))
    return '\n'.join(lines)


def exact_shares(shape: Shape, totals: WeightTotals) -> Shares:
  policy = shape.policy
  act = policy.rows('act')
  return Shares(weights=totals.placed, loaded=totals.loaded_max, transfer=totals.transfer_max,
                disk_staging=totals.disk_stage_max, cache_rows=policy.rows('cache'),
                act_rows=act,
                act_partial=int(act['device'] > 0 and act['device'] < policy.gpu_batch_size))


def step_bytes(working: dict) -> dict[str, int]:
  """Bytes of one step of each kind from the compiled functions' memory (steps.StepMemory)."""
  return {
      'prefill_step': max(working['embed'].total, working['prefill'].total,
                          working['head'].total),
      'decode_step': max(working['embed'].total, working['decode'].total, working['head'].total),
      'cpu_attention': working['cpu_attention'].total,
      'load': working['load'].working,
      'place': working['place'].total,
  }


def memory_forms(shape: Shape, xla: dict[str, Any], overhead: Overhead) -> dict[str, list[Linear]]:
  """The plan's peaks as linear forms of the placement fractions, one per tier and phase (the
  LP's memory constraints). Weight shares are proportional to the fractions of stored bytes,
  the largest per-load quantities to the non-device share; joins of tensors split across tiers
  are those of the template policy's own percents (the exact plan re-checks the rounded
  result)."""
  cfg, policy, sizes = shape.cfg, shape.policy, shape.sizes
  full = dataclasses.replace(policy, w_gpu_percent=0, w_cpu_percent=100)
  all_resident = weight_totals(cfg, dataclasses.replace(policy, w_gpu_percent=100,
                                                        w_cpu_percent=0), sizes)
  resident_all = all_resident.placed['device']
  # a resident tensor's transfer while placing: counted whole whatever the device's share (at
  # most the largest tensor; the exact plan counts it where a tensor is resident)
  totals = dataclasses.replace(weight_totals(cfg, full, sizes),
                               resident_transfer_max=all_resident.resident_transfer_max)
  stored_all = totals.placed['host']
  b = policy.gpu_batch_size
  rows = lambda letter: {'device': term(**{f'{letter}g': b}), 'host': term(**{f'{letter}c': b}),
                         'disk': term(**{f'{letter}d': b})}
  shares = Shares(
      weights={'device': term(wg=resident_all), 'host': term(wc=stored_all),
               'disk': term(wd=stored_all)},
      loaded=term(weight_totals(cfg, policy, sizes).join_max, wc=totals.loaded_max,
                  wd=totals.loaded_max),
      transfer=term(wc=totals.transfer_max, wd=totals.transfer_max),
      disk_staging=term(wd=weight_totals(cfg, dataclasses.replace(
          policy, w_gpu_percent=0, w_cpu_percent=0), sizes).disk_stage_max),
      cache_rows=rows('c'), act_rows=rows('h'),
      act_partial=term(hc=1, hd=1))
  bufs = buffers(shape, shares, totals, xla, overhead)
  phases = peaks_by_phase(bufs)
  forms = {tier: [_as_linear(phases[tier][p]) for p in PHASES] for tier in TIERS}
  if shape.device_is_host:
    forms['ram'] = [_as_linear(phases['device'][p]) + _as_linear(phases['host'][p])
                    for p in PHASES]
  return forms


def _approximations(policy: Policy) -> tuple:
  """The policy fields the step functions depend on (compression and sparsity)."""
  return (policy.compress_weight, policy.compress_cache, policy.compress_bits,
          policy.compress_group_size, policy.attn_sparsity)


def _as_linear(value) -> Linear:
  return value if isinstance(value, Linear) else Linear(float(value))


# ---- compiled working memory --------------------------------------------------------------------
def used_in_place(slot: TensorSlot, host_in_place: bool) -> bool:
  """Whether the steps take a host-tier slot as it lies, with nothing loaded, where host-tier
  weights are plain buffers in the device's own RAM (host_in_place: a CPU backend without
  pinned host memory): an unpacked tensor wholly on the host tier, or a part of one the step
  takes in parts (TensorSlot.in_parts). Placement makes it a device array over its host
  buffer once (no copy), so a load neither puts nor waits for it, and a stage of only such
  slots (and device-resident ones) is looked up without the weights thread."""
  return (host_in_place and slot.tier == 'host' and not slot.packed
          and (slot.whole or slot.in_parts))


def gathers_rows(stage: str, slot: TensorSlot, prompt_ids: int) -> bool:
  """Whether the steps of a run read only the rows they look up of this slot instead of
  loading it whole: the embedding stage's token table where it lies on disk unpacked, when a
  prompt step looks up fewer ids (prompt_ids: GPU batch x prompt length) than it has rows. The
  mover then reads those rows for each embedding step (Mover.token_rows), a few KiB per
  sequence instead of the whole part once per token."""
  return (params_lib.gathered(stage, slot.path) and slot.tier == 'disk'
          and not slot.packed and prompt_ids < slot.shape[0])


def param_specs(cfg: ModelConfig, policy: Policy, sizes: Itemsizes, compute_dtype: str,
                storage_dtype: str, *, prompt_ids: int, step_ids: int) -> dict[str, dict]:
  """Loaded parameter trees of the embed, layer and head steps as shape structs: device-resident
  quantized tensors stay packed (dequantized inside the step), other quantized ones arrive
  dequantized into the compute dtype, the rest as stored; token-table rows read for the step
  (gathers_rows) as [step_ids, embed_dim]."""
  dtype = np_dtype(compute_dtype)
  storage = np_dtype(storage_dtype)
  out = {}
  for kind, stage in (('embed', 'embed'), ('layer', params_lib.layer_name(0)), ('head', 'head')):
    flat, row_parts = {}, {}
    for slot in stage_layout(cfg, policy, sizes, stage):
      shape = slot.full_shape  # a tensor split across tiers and not used in parts is joined
      if gathers_rows(stage, slot, prompt_ids):
        row_parts.setdefault(slot.path, []).append(
            jax.ShapeDtypeStruct((step_ids, *slot.shape[1:]), storage))
      elif slot.packed and slot.tier == 'device' and slot.whole:
        data = jax.ShapeDtypeStruct((*shape[:-1], policy.quant.row_bytes(shape[-1])), np.uint8)
        flat[slot.path] = Packed(data, shape[-1], policy.quant)
      elif slot.in_parts:
        row_parts.setdefault(slot.path, []).append(
            jax.ShapeDtypeStruct(slot.shape, dtype if slot.packed else storage))
      else:
        flat[slot.path] = jax.ShapeDtypeStruct(shape, dtype if slot.packed else storage)
    flat.update({path: tuple(specs) for path, specs in row_parts.items()})
    out[kind] = params_lib.unflatten(flat)
  return out


def format_bytes(nbytes) -> str:
  """1536 -> '1.50 KiB'."""
  nbytes = float(nbytes)
  for unit, scale in (('GiB', 2**30), ('MiB', 2**20), ('KiB', 2**10)):
    if abs(nbytes) >= scale:
      return f'{nbytes / scale:.2f} {unit}'
  return f'{int(nbytes)} B'


def estimate_rows(batch: int, prompt_len: int,
                  forms: tuple[int, ...] = (linear.CAST_ALL_ROWS,)) -> int:
  """The smaller of the two consecutive sequence counts whose compiled steps estimate a GPU
  batch of `batch` (Planner.xla): 1, unless the batch's prompt products take another form than
  one sequence's (`forms`: the product rows from which they do, steps.Steps.prompt_forms: the
  whole cast matrix from linear.CAST_ALL_ROWS, oneDNN from linear.LIBRARY_ROWS on a CPU); then
  the first count whose prompt takes the batch's form, so that every batch of one form shares
  its two counts (at most the batch: the line is exact there). The cast matrix and oneDNN's
  scratch are there once whatever the rows, so a line through one count of each form would
  charge them once per sequence, or not at all."""
  reached = [rows for rows in forms if batch * prompt_len >= rows]
  if not reached:
    return 1
  return math.ceil(max(reached) / prompt_len)  # <= batch, as batch * prompt_len >= the rows


class Planner:
  """Plans runs of one model, weight source dtype and compute/cache dtypes on one backend.

  The step functions are compiled at each geometry once per planner (the compiled executables
  are the run's warm-up: jax reuses them), and their XLA memory feeds the plan.
  """

  def __init__(self, cfg: ModelConfig, *, storage_dtype: str, compute_dtype: str,
               cache_dtype: str, device: jax.Device, cpu: jax.Device, overhead: Overhead,
               device_is_host: bool | None = None):
    self.cfg = cfg
    self.dtypes = dict(storage_dtype=storage_dtype, compute_dtype=compute_dtype,
                       cache_dtype=cache_dtype)
    self.sizes = Itemsizes.of(storage_dtype, compute_dtype, cache_dtype)
    self.device, self.cpu = device, cpu
    # planning for another machine (a GPU profile on a CPU) names its kind; XLA's memory is then
    # read from this backend's compile of the same functions
    self.device_is_host = device.platform == 'cpu' if device_is_host is None else device_is_host
    # A GPU target planned on a CPU: XLA:CPU widens float16 math to float32 (with float32
    # copies of the weights) where a GPU would not, so the steps are compiled in float32, with
    # weights in float32 too (a GPU computes on its stored dtype, with no cast tiles), and
    # their bytes scaled to the compute dtype's size.
    self.scale = 1.0
    self.compile_dtypes = dict(self.dtypes)
    # and XLA:CPU's library fusions (steps.StepMemory.library) do not run there
    self.library_runs = not (device.platform == 'cpu' and not self.device_is_host)
    if not self.library_runs:
      self.compile_dtypes.update(compute_dtype='float32', cache_dtype='float32',
                                 storage_dtype='float32')
      self.scale = self.sizes.compute / 4
    self.overhead = overhead
    self._steps: dict[tuple, Any] = {}
    self._working: dict[tuple, dict] = {}  # XLA's bytes, measured by compiling the steps
    self._compiled: set[tuple] = set()  # geometries of _working whose executables are live
    self._compiled_rest: set[tuple] = set()  # runs whose compile_run is done

  @classmethod
  def for_device(cls, cfg: ModelConfig, device: jax.Device, *, storage_dtype: str,
                 compute_dtype: str, cache_dtype: str | None = None,
                 overhead: Overhead | None = None) -> 'Planner':
    """The planner of a run on `device` (an Engine's own): its steps compiled there, the
    process's CPU backend for CPU attention, the backend's runtime overhead unless given."""
    from flexjax import hardware
    return cls(cfg, storage_dtype=storage_dtype, compute_dtype=compute_dtype,
               cache_dtype=cache_dtype or compute_dtype, device=device,
               cpu=hardware.cpu_device(),
               overhead=overhead or hardware.runtime_overhead(device.platform))

  @classmethod
  def for_sizes(cls, cfg: ModelConfig, sizes: Itemsizes, *, device_is_host: bool,
                overhead: Overhead | None = None) -> 'Planner':
    """A planner from item sizes alone (cost-model studies), compiling on the CPU backend."""
    from flexjax import hardware
    names = {1: 'float16', 2: 'float16', 4: 'float32'}
    cpu = hardware.cpu_device()
    return cls(cfg, storage_dtype=names[sizes.storage], compute_dtype=names[sizes.compute],
               cache_dtype=names[sizes.cache], device=cpu, cpu=cpu,
               overhead=overhead or hardware.runtime_overhead('cpu' if device_is_host else 'gpu'),
               device_is_host=device_is_host)

  def _spec_dtypes(self) -> dict[str, str]:
    return dict(compute_dtype=self.compile_dtypes['compute_dtype'],
                storage_dtype=self.compile_dtypes['storage_dtype'])

  def steps(self, policy: Policy):
    """The jitted step functions for a policy's approximations (shared by equal ones)."""
    from flexjax.steps import Steps
    key = _approximations(policy)
    if key not in self._steps:
      self._steps[key] = Steps(self.cfg, policy, device=self.device, cpu=self.cpu,
                               **self.compile_dtypes)
    return self._steps[key]

  def release_compiled(self) -> None:
    """Frees every executable compiled so far, this planner's and jax's caches alike: the
    search compiles the steps of many candidates, which would otherwise stay in the process's
    memory through the run, outside its plan (SmolLM2's search left 310 MB, 96 MB once freed
    and trimmed). The bytes measured stay: later plans reuse them without compiling; a run
    compiles what it calls again (Engine's warm-up, `compile_run`)."""
    import gc

    from flexjax.memwatch import return_free_memory
    self._steps.clear()
    self._compiled.clear()
    self._compiled_rest.clear()
    jax.clear_caches()
    gc.collect()
    return_free_memory()

  def shape(self, policy: Policy, prompt_len: int, gen_len: int, *,
            return_logits: bool = False, read_ahead: bool = False,
            logprobs: Logprobs = Logprobs()) -> Shape:
    return Shape(self.cfg, policy, self.sizes, prompt_len, gen_len, self.device_is_host,
                 return_logits, read_ahead, logprobs)

  def working(self, policy: Policy, *, rows: int, device_rows: int, cpu_attention: bool,
              prompt_len: int, gen_len: int, temperature: float = 0.0,
              top_p: float = 1.0, logprobs: Logprobs = Logprobs(), compile: bool = False,
              quick: bool = False) -> dict:
    """XLA bytes per step kind at these shapes, measured once per planner by compiling the
    steps (steps.Steps.working_memory). `compile`: the run's warm-up, whose executables must be
    live: compiled again where `release_compiled` freed them. `quick`: compiled for the bytes
    alone (the screening estimate's; never a run's executables)."""
    from flexjax.steps import Geometry
    totals = weight_totals(self.cfg, policy, self.sizes)
    largest_tensor = None
    if policy.compress_weight:
      largest_tensor = max((slot.full_shape for stage in distinct_stages(self.cfg)
                            for slot in stage_layout(self.cfg, policy, self.sizes, stage)
                            if slot.packed), key=lambda shape: math.prod(shape))
    geom = Geometry(rows=rows, device_rows=device_rows, cpu_attention=cpu_attention,
                    prompt_len=prompt_len, total_len=prompt_len + gen_len - 1)
    key = (_approximations(policy), geom, temperature, top_p, logprobs, totals.largest_load,
           largest_tensor, quick)
    if key not in self._working or compile and key not in self._compiled:
      working = self.steps(policy).working_memory(
          params=param_specs(self.cfg, policy, self.sizes, **self._spec_dtypes(),
                             prompt_ids=rows * prompt_len, step_ids=rows * prompt_len),
          geom=geom, temperature=temperature, top_p=top_p, logprobs=logprobs,
          largest_load=totals.largest_load,
          largest_tensor=largest_tensor, quick=quick)
      if not self.library_runs:  # XLA:CPU's library fusions do not run on the target
        working = {k: dataclasses.replace(v, library=0) for k, v in working.items()}
      self._working[key] = {k: v.scaled(self.scale) for k, v in working.items()}
      self._compiled.add(key)
    return self._working[key]

  def compile_run(self, policy: Policy, *, prompt_len: int, gen_len: int,
                  temperature: float = 0.0, top_p: float = 1.0,
                  logprobs: Logprobs = Logprobs()) -> None:
    """Compiles every function a run of `policy` calls (the run's warm-up: jax's jit reuses
    the executables): its plan's steps (`working`), then the rest (steps.Steps.compile_rest),
    among them the dequantization of every distinct packed weight tensor, or part of one, that
    it loads."""
    self.working(policy, rows=policy.gpu_batch_size, device_rows=policy.rows('cache')['device'],
                 cpu_attention=policy.cpu_attention, prompt_len=prompt_len, gen_len=gen_len,
                 temperature=temperature, top_p=top_p, logprobs=logprobs, compile=True)
    loads = tuple(sorted({((*slot.shape[:-1], policy.quant.row_bytes(slot.shape[-1])),
                           slot.shape[-1])
                          for stage in distinct_stages(self.cfg)
                          for slot in stage_layout(self.cfg, policy, self.sizes, stage)
                          if slot.tier != 'device' and slot.packed}, key=repr))
    from flexjax.steps import Geometry
    geom = Geometry.of(policy, prompt_len=prompt_len, gen_len=gen_len)
    key = (_approximations(policy), geom, temperature, top_p, logprobs, loads)
    if key not in self._compiled_rest:
      self.steps(policy).compile_rest(
          params=param_specs(self.cfg, policy, self.sizes, **self._spec_dtypes(),
                             prompt_ids=policy.gpu_batch_size * prompt_len,
                             step_ids=policy.gpu_batch_size),
          geom=geom, temperature=temperature, top_p=top_p, logprobs=logprobs, loads=loads)
      self._compiled_rest.add(key)

  def xla(self, policy: Policy, *, prompt_len: int, gen_len: int, temperature: float = 0.0,
          top_p: float = 1.0, logprobs: Logprobs = Logprobs(),
          estimate: bool = False) -> dict[str, Any]:
    """XLA bytes per step kind of `policy`: compiled at its real shapes, or (estimate) from
    the steps compiled for two consecutive sequence counts, extended linearly to the GPU batch
    (their sizes grow linearly with it within one form of the products; the search screens
    many batch sizes this way). See `estimate_rows` for the two counts."""
    if not estimate:
      return step_bytes(self.working(
          policy, rows=policy.gpu_batch_size, device_rows=policy.rows('cache')['device'],
          cpu_attention=policy.cpu_attention, prompt_len=prompt_len, gen_len=gen_len,
          temperature=temperature, top_p=top_p, logprobs=logprobs))
    b = policy.gpu_batch_size
    low = estimate_rows(b, prompt_len, self.steps(policy).prompt_forms())
    fits = []
    for rows in (low, low + 1):
      kw = dict(rows=rows, prompt_len=prompt_len, gen_len=gen_len, temperature=temperature,
                top_p=top_p, logprobs=logprobs, quick=True)
      on_device = step_bytes(self.working(policy, device_rows=rows, cpu_attention=False, **kw))
      if policy.cpu_attention:
        on_cpu = step_bytes(self.working(policy, device_rows=0, cpu_attention=True, **kw))
        on_device = {k: max(on_device[k], on_cpu[k]) for k in on_device}
      fits.append(on_device)
    one, two = fits
    return {k: max(one[k], one[k] + (b - low) * (two[k] - one[k])) for k in one}

  def plan(self, policy: Policy, *, prompt_len: int, gen_len: int, return_logits: bool = False,
           temperature: float = 0.0, top_p: float = 1.0, logprobs: Logprobs = Logprobs(),
           estimate: bool = False, read_ahead: bool = False) -> ExecutionPlan:
    """The plan of a run of `policy`: exact (its steps compiled at their real shapes), or with
    XLA's bytes estimated (`xla`). The search plans without read-ahead (the least a policy
    needs); `run_plan` adds it where the budgets have room."""
    xla = self.xla(policy, prompt_len=prompt_len, gen_len=gen_len, temperature=temperature,
                   top_p=top_p, logprobs=logprobs, estimate=estimate)
    return self._plan(self.shape(policy, prompt_len, gen_len, return_logits=return_logits,
                                 read_ahead=read_ahead, logprobs=logprobs), xla)

  def run_plan(self, policy: Policy, budgets: dict[str, int | None], **kw) -> ExecutionPlan:
    """The plan a run executes: reading disk weights two stages ahead where the budgets have
    room for the second staging buffer, else one stage ahead (`plan`'s keywords)."""
    ahead = self.plan(policy, read_ahead=True, **kw)
    if policy.overlap and ahead.fits(budgets):
      return ahead
    return self.plan(policy, **kw)

  def weights_plan(self, policy: Policy) -> ExecutionPlan:
    """The plan's weight buffers alone (no step compiled): what placing the weights needs."""
    xla = dict.fromkeys(('prefill_step', 'decode_step', 'cpu_attention', 'load', 'place'), 0)
    return self._plan(self.shape(policy, 1, 1), xla)

  def _plan(self, shape: Shape, xla: dict[str, Any]) -> ExecutionPlan:
    totals = weight_totals(self.cfg, shape.policy, self.sizes)
    return ExecutionPlan(shape, tuple(buffers(shape, exact_shares(shape, totals), totals, xla,
                                              self.overhead)), xla)

  def forms(self, policy: Policy, *, prompt_len: int, gen_len: int) -> dict[str, list[Linear]]:
    """The LP's memory constraints for `policy`'s batch geometry (placement left free), with
    XLA's bytes estimated; the plan of the rounded policy re-checks the result."""
    xla = self.xla(policy, prompt_len=prompt_len, gen_len=gen_len, estimate=True)
    xla['cpu_attention'] = term(cc=xla['cpu_attention'], cd=xla['cpu_attention'])
    return memory_forms(self.shape(policy, prompt_len, gen_len), xla, self.overhead)
