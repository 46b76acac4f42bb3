"""Layer steps: the pure step functions jitted once per run, the calls a run makes of them (a decode
step of one layer is one to three XLA executions), and XLA's working memory of each call, read
from the very functions the run calls (the execution plan's source for it).

Compiling them at the run's real shapes, with the shardings the run's arguments have, is also the
run's warm-up: jax's jit call path reuses those executables (plan.Planner.compile_run).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from flexjax import quant as quant_lib
from flexjax.config import ModelConfig, np_dtype
from flexjax.library_scratch import scratch_bytes
from flexjax.model import attention, linear
from flexjax.model import params as params_lib
from flexjax.model.family import layers
from flexjax.plan import sparse_keep
from flexjax.policy import Policy
from flexjax.quant import QuantConfig
from flexjax.sampler import Logprobs, next_token, token_logprobs


@dataclasses.dataclass(frozen=True)
class StepMemory:
  """The bytes one call of a compiled function adds: XLA's temporaries, what XLA:CPU's library
  fusions allocate beside them (`library`, flexjax/library_scratch.py), and fresh outputs
  (arguments are buffers the plan already lists; outputs aliasing a donated input are not
  new)."""

  temp: int
  output: int
  library: int = 0

  @property
  def working(self) -> int:
    """Bytes held only while the call runs."""
    return self.temp + self.library

  @property
  def total(self) -> int:
    return self.working + self.output

  def scaled(self, factor: float) -> 'StepMemory':
    return StepMemory(int(self.temp * factor), int(self.output * factor),
                      int(self.library * factor))

  @staticmethod
  def of(compiled) -> 'StepMemory':
    stats = compiled.memory_analysis()
    return StepMemory(temp=int(stats.temp_size_in_bytes),
                      output=max(0, int(stats.output_size_in_bytes - stats.alias_size_in_bytes)),
                      library=scratch_bytes(compiled.as_text()))


@dataclasses.dataclass(frozen=True)
class Geometry:
  """The shapes of a run's layer steps: one GPU batch and how its KV cache rows are split."""

  rows: int  # sequences of a GPU batch
  device_rows: int  # of them, the rows whose KV cache lives on the device (the first ones)
  cpu_attention: bool  # the other rows attend on the CPU backend, next to their cache
  prompt_len: int
  total_len: int  # cache positions: prompt + generated tokens - 1

  @property
  def offloaded_rows(self) -> int:
    return self.rows - self.device_rows

  @staticmethod
  def prompt(rows: int, prompt_len: int, total_len: int | None = None) -> 'Geometry':
    """A prompt step of `rows` sequences that keeps no cache (total_len: prompt_len unless
    given)."""
    return Geometry(rows=rows, device_rows=0, cpu_attention=False, prompt_len=prompt_len,
                    total_len=total_len or prompt_len)

  @staticmethod
  def of(policy: Policy, *, prompt_len: int, gen_len: int) -> 'Geometry':
    return Geometry(rows=policy.gpu_batch_size, device_rows=policy.rows('cache')['device'],
                    cpu_attention=policy.cpu_attention, prompt_len=prompt_len,
                    total_len=prompt_len + gen_len - 1)


class StepInputs(NamedTuple):
  """A GPU batch's per-token inputs of its decode steps, kept where the steps read them (put
  there once per token, not once per layer)."""

  mask: jax.Array  # [b, t] bool on the device: cache positions holding a real token
  offloaded_mask: jax.Array | None  # [offloaded rows, t] bool on the CPU backend (cpu_attention)
  slot: jax.Array  # int32 [] on the device: the position the new token's K and V go to


class _Run:
  """Calls step functions: the executor's mode of the step sequences below."""

  def __call__(self, fn, *args, on: str = 'device', **static):
    del on
    return fn(*args, **static)

  def move(self, tree, device: jax.Device):
    return jax.device_put(tree, device)


# XLA:CPU without LLVM's optimisation of the generated code: the buffers, and so the memory
# analysis, are those of the optimised HLO as in a run's compile (the same bytes for every step
# of opt-6.7b's plans), at ~60% of the compile time. For compiles whose bytes alone are wanted.
QUICK_CPU_OPTIONS = {'xla_backend_optimization_level': 0}


class _Compile:
  """Compiles step functions at argument specs instead of calling them (the plan's mode): keeps
  XLA's bytes of each call per backend and returns its outputs as specs. `quick`: compiles for
  the bytes alone, never run (QUICK_CPU_OPTIONS on a CPU backend)."""

  def __init__(self, devices: dict[str, jax.Device], quick: bool = False):
    self.devices = devices
    self.quick = quick
    self.parts: dict[str, list[StepMemory]] = {name: [] for name in devices}

  def compile(self, fn, *args, on: str = 'device', **static):
    lowered = fn.lower(*args, **static)
    if self.quick and self.devices[on].platform == 'cpu':
      return lowered.compile(compiler_options=QUICK_CPU_OPTIONS)
    return lowered.compile()

  def analyse(self, fn, *args, on: str = 'device', **static) -> StepMemory:
    """XLA's bytes of one call of `fn` (not kept in `parts`)."""
    return StepMemory.of(self.compile(fn, *args, on=on, **static))

  def __call__(self, fn, *args, on: str = 'device', **static):
    compiled = self.compile(fn, *args, on=on, **static)
    self.parts[on].append(StepMemory.of(compiled))
    return self.move(compiled.out_info, self.devices[on])

  def move(self, tree, device: jax.Device):
    return jax.tree.map(lambda s: _spec(s.shape, s.dtype, device), tree)


RUN = _Run()


class Steps:
  """The jitted step functions of one model, policy and dtype set, and the calls a run makes.

  Every function is jitted once; its shapes are static within a run (the KV cache is allocated
  at its full length), so the compiles of `working_memory` and `compile_rest` serve every call.
  """

  def __init__(self, cfg: ModelConfig, policy: Policy, *, storage_dtype: str, compute_dtype: str,
               cache_dtype: str, device: jax.Device, cpu: jax.Device):
    self.cfg, self.policy = cfg, policy
    self.storage = np_dtype(storage_dtype)
    self.compute = np_dtype(compute_dtype)
    self.cache = np_dtype(cache_dtype)
    self.device, self.cpu = device, cpu
    model = layers(cfg)
    kw = dict(cfg=cfg, compute_dtype=self.compute)
    cache_quant = policy.quant if policy.compress_cache else None
    layer_kw = dict(kw, cache_dtype=self.cache, cache_quant=cache_quant)
    attend_kw = dict(cfg=cfg, cache_quant=cache_quant)
    self.embed = jax.jit(functools.partial(model.embed, **kw))
    self.head = jax.jit(functools.partial(head_sample, **kw),
                        static_argnames=('temperature', 'top_p', 'logprobs'))
    attend = attention.prefill_dtype(self.compute, device.platform)
    prefill = lambda options: jax.jit(  # noqa: E731
        functools.partial(prefill_layer, **layer_kw, attend_dtype=attend),
        static_argnames=('device_rows',),
        donate_argnums=(2,), compiler_options=options)
    self.prefill_layer = prefill(None)
    # On a CPU backend, long float32 prompt steps of OPT's layers run their products in oneDNN
    # (`uses_library`; bfloat16 ones ran slower there: opt-1.3b prefill layer of 8 x 512, 897
    # against 773 ms); Llama's keep XLA's own (linear.family_in_library).
    self.library = linear.family_in_library(cfg.family) and linear.in_library(
        device.platform, self.compute, linear.LIBRARY_ROWS)
    self.prefill_layer_library = prefill(linear.library_options()) if self.library else None
    self.decode_layer = jax.jit(functools.partial(decode_layer, **layer_kw),
                                static_argnames=('device_rows', 'keep'), donate_argnums=(2,))
    self.decode_front = jax.jit(functools.partial(decode_front, **layer_kw),
                                static_argnames=('device_rows', 'keep'), donate_argnums=(2,))
    self.decode_back = jax.jit(functools.partial(decode_back, **attend_kw,
                                                 compute_dtype=self.compute))
    self.offloaded_attend = jax.jit(functools.partial(attention.decode_attend, **attend_kw,
                                                      standalone=True))
    self.offloaded_select = jax.jit(functools.partial(attention.decode_select, **attend_kw),
                                    static_argnames=('keep',))
    # Whole-prompt scoring (Engine.score), weight loading and placing.
    self.prefill = jax.jit(functools.partial(model.decoder_prefill, **kw, cache_dtype=self.cache,
                                             attend_dtype=attend))
    self.quantize = jax.jit(functools.partial(quant_lib.quantize, config=policy.quant))
    self.write_kv = jax.jit(_write, donate_argnums=(0,))
    self.dequantize = jax.jit(lambda p: quant_lib.unpack(p, self.compute))

  def cache_entry(self) -> tuple[int, np.dtype]:
    """Last axis and dtype of a stored KV cache entry (byte rows when compressed)."""
    if self.policy.compress_cache:
      return self.policy.quant.row_bytes(self.cfg.kv_dim), np.dtype(np.uint8)
    return self.cfg.kv_dim, self.cache

  def uses_library(self, geom: Geometry) -> bool:
    """Whether the prefill steps of `geom` run their products in oneDNN (OPT's layers on
    XLA:CPU, float32, prompt products of linear.LIBRARY_ROWS rows or more)."""
    return self.library and linear.in_library(self.device.platform, self.compute,
                                              geom.rows * geom.prompt_len)

  def prompt_forms(self) -> tuple[int, ...]:
    """The product rows from which a prompt step's products take another form: the cast matrix
    (linear.CAST_ALL_ROWS) and, on a CPU backend, from linear.LIBRARY_ROWS, oneDNN's products
    in float32 and XLA:CPU's YNNPACK graph fusions in other dtypes (their tensors are
    flexjax/library_scratch.py's; none at 3584 rows, from 4096 on). Float32 layers that keep
    XLA's own products (Llama's, `library`) take no other form there."""
    library_form = self.device.platform == 'cpu' and (
        self.library or jnp.dtype(self.compute) != jnp.float32)
    return (linear.CAST_ALL_ROWS, linear.LIBRARY_ROWS) if library_form else (
        linear.CAST_ALL_ROWS,)

  def keep(self, total_len: int) -> int | None:
    """Cached positions sparse attention keeps per decode step; None for dense attention."""
    return None if self.policy.attn_sparsity == 1 else sparse_keep(self.policy, total_len)

  # ---- the calls of a run -----------------------------------------------------------------------
  def step_inputs(self, geom: Geometry, cache_mask: np.ndarray, slot: int) -> StepInputs:
    """A batch's decode inputs put where the steps read them (copies: the host mask changes)."""
    d = geom.device_rows
    offloaded = (jax.device_put(np.array(cache_mask[d:]), self.cpu)
                 if geom.cpu_attention and geom.offloaded_rows else None)
    return StepInputs(mask=jax.device_put(np.array(cache_mask), self.device),
                      offloaded_mask=offloaded,
                      slot=jax.device_put(np.int32(slot), self.device))

  def head_step(self, params, x, counters, given=None, *, temperature: float, top_p: float,
                logprobs: Logprobs = Logprobs(), call=RUN):
    """LM head of the last position and the next token: (logits [b, vocab] f32, tokens [b],
    log-probabilities or None: see head_sample). given: [b] int32 where logprobs.given."""
    return call(self.head, params, x, counters, given, temperature=temperature, top_p=top_p,
                logprobs=logprobs)

  def prefill_step(self, geom: Geometry, params, x, caches, mask, call=RUN):
    """A prefill step of one layer: (y, device caches, offloaded rows' entries or None)."""
    fn = self.prefill_layer_library if self.uses_library(geom) else self.prefill_layer
    return call(fn, params, x, caches, mask, device_rows=geom.device_rows)

  def decode_step(self, geom: Geometry, params, x, caches, inputs: StepInputs, loaded,
                  gather_v: Callable, call=RUN):
    """A decode step of one layer in one to three executions.

    Args:
      caches: (K, V) device rows [d, t, entry] (donated: the returned ones replace them) or None.
      loaded: the offloaded rows' cache where they attend (the device, or the CPU backend with
        cpu_attention): (K, V) [rows, t, entry], V None under sparse attention; None when
        every row is on the device.
      gather_v: (positions [rows, keep], device) -> the offloaded rows' V at those positions
        [rows, keep, entry] on that device (sparse attention reads only those rows).
    Returns:
      (y [b, 1, hidden], device caches, (K, V) entries of the offloaded rows [rows, 1, entry]
      to write back, or None).
    Executions: one with every row on the device, or with dense attention of the offloaded
    rows on the device; two for their sparse attention on the device (select; kept V rows are
    read; attend and finish); three with cpu_attention (device part; the offloaded rows'
    attention, or selection, on the CPU backend; the rest on the device).
    """
    d, keep = geom.device_rows, self.keep(geom.total_len)
    if loaded is None or (not geom.cpu_attention and keep is None):
      return call(self.decode_layer, params, x, caches, inputs.mask, inputs.slot, loaded,
                  device_rows=d, keep=keep)
    on_device = not geom.cpu_attention
    front = call(self.decode_front, params, x, caches, inputs.mask, inputs.slot,
                 loaded[0] if on_device else None, device_rows=d, keep=keep)
    if on_device:  # sparse: the offloaded rows' selection ran in the front part
      scores, positions = front['scores'], front['positions']
    elif keep is None:
      q, k, v = call.move(front['qkv'], self.cpu)
      attn = call(self.offloaded_attend, q, k, v, loaded[0], loaded[1], inputs.offloaded_mask,
                  on='cpu')
      y = call(self.decode_back, params, x, front['attn'], call.move(attn, self.device))
      return y, front['caches'], front['written']
    else:
      q, k, _ = call.move(front['qkv'], self.cpu)
      scores, positions = call.move(call(self.offloaded_select, q, k, loaded[0],
                                         inputs.offloaded_mask, keep=keep, on='cpu'),
                                    self.device)
    selected = (scores, positions, gather_v(positions, self.device), front['qkv'][2])
    y = call(self.decode_back, params, x, front['attn'], selected)
    return y, front['caches'], front['written']

  # ---- working memory ---------------------------------------------------------------------------
  def working_memory(self, *, params: dict[str, dict], geom: Geometry, temperature: float,
                     top_p: float, logprobs: Logprobs = Logprobs(),
                     largest_load: tuple | None = None,
                     largest_tensor: tuple[int, ...] | None = None,
                     quick: bool = False) -> dict[str, StepMemory]:
    """Compiles the functions a run calls, at its real shapes and with the shardings its
    arguments have there, and returns XLA's bytes per step kind: every layer step as the run
    calls it (`prefill_step`, `decode_step`), the embedding and the head at the prompt's shapes,
    the dequantization of the largest loaded packed tensor (`compile_rest` compiles the rest,
    no larger).

    The run's jit calls find these compilations in jax's caches (the lowering is cached on the
    traced function, its shardings and static arguments): no step compiles while a run is timed.

    Args:
      params: stage kind ('embed', 'layer', 'head') -> {path: ShapeDtypeStruct or Packed of one}
        as the step receives them once loaded.
      largest_load: (packed shape, dim) of the largest tensor dequantized when weights are
        loaded, or None when no packed tensor is loaded.
      largest_tensor: shape of the largest weight matrix, quantized on the CPU backend while
        weights are placed (compress_weight), else None.
      quick: for the bytes alone (the search's screening; QUICK_CPU_OPTIONS): the run's calls
        do not find these compilations.
    Returns:
      {'embed', 'prefill', 'decode', 'head', 'cpu_attention', 'load', 'place'}: bytes of one
      call, where a step made of parts sums their outputs and takes their largest temporary.
    """
    cfg, b, s = self.cfg, geom.rows, geom.prompt_len
    h, cdt = cfg.hidden_size, self.compute
    on = lambda tree: jax.tree.map(lambda a: _spec(a.shape, a.dtype, self.device), tree)
    spec = lambda shape, dtype: _spec(shape, dtype, self.device)
    params = {kind: on(tree) for kind, tree in params.items()}
    compile_ = self._compiler(quick)
    out = {}
    out['embed'] = compile_.analyse(self.embed, params['embed'], spec((b, s), np.int32),
                                    spec((b, s), np.int32))
    out['head'] = self._analyse_head(params['head'], spec((b, s, h), cdt), temperature, top_p,
                                     logprobs, compile_)
    self.prefill_step(geom, params['layer'], spec((b, s, h), cdt), self._cache_specs(geom),
                      spec((b, s), bool), call=compile_)
    out['prefill'] = _combine(compile_.parts['device'])
    compile_ = self._compiler(quick)
    self.decode_step(geom, params['layer'], spec((b, 1, h), cdt), self._cache_specs(geom),
                     self._input_specs(geom), self._loaded_specs(geom), self._gather_spec(geom),
                     call=compile_)
    out['decode'] = _combine(compile_.parts['device'])
    out['cpu_attention'] = _combine(compile_.parts['cpu'])
    out['place'] = StepMemory(0, 0)
    if largest_tensor is not None:
      out['place'] = compile_.analyse(self.quantize, _spec(largest_tensor, self.storage, self.cpu),
                                      on='cpu')
    out['load'] = (StepMemory(0, 0) if largest_load is None
                   else self.analyse_load(*largest_load, compile_))
    return out

  def compile_rest(self, *, params: dict[str, dict], geom: Geometry, temperature: float,
                   top_p: float, logprobs: Logprobs = Logprobs(),
                   loads: tuple = ()) -> None:
    """Compiles what a run calls besides the functions `working_memory` compiled: the
    embedding and the head at the decode shapes (their XLA bytes are at most those at the
    prompt's), and the dequantization of every loaded packed tensor ((packed shape, dim) each)."""
    on = lambda tree: jax.tree.map(lambda a: _spec(a.shape, a.dtype, self.device), tree)
    ids = _spec((geom.rows, 1), np.int32, self.device)
    compile_ = self._compiler()
    compile_.analyse(self.embed, on(params['embed']), ids, ids)
    self._analyse_head(on(params['head']), _spec((geom.rows, 1, self.cfg.hidden_size),
                                                 self.compute, self.device), temperature, top_p,
                       logprobs, compile_)
    for shape, dim in loads:
      self.analyse_load(shape, dim, compile_)

  def _compiler(self, quick: bool = False) -> _Compile:
    return _Compile({'device': self.device, 'cpu': self.cpu}, quick=quick)

  def _analyse_head(self, params, x, temperature, top_p, logprobs: Logprobs,
                    compiler: _Compile) -> StepMemory:
    counters = _spec((x.shape[0], 2), np.uint32, self.device)
    given = _spec((x.shape[0],), np.int32, self.device) if logprobs.given else None
    return compiler.analyse(self.head, params, x, counters, given, temperature=temperature,
                            top_p=top_p, logprobs=logprobs)

  def analyse_load(self, shape: tuple[int, ...], dim: int, compiler: _Compile) -> StepMemory:
    """Compiles the dequantization of a loaded tensor packed as `shape` (uint8 rows)."""
    stored = _spec(shape, np.uint8, self.device)
    return compiler.analyse(self.dequantize, quant_lib.Packed(stored, dim, self.policy.quant))

  def _cache_specs(self, geom: Geometry):
    entry, edt = self.cache_entry()
    if not geom.device_rows:
      return None
    return tuple(_spec((geom.device_rows, geom.total_len, entry), edt, self.device)
                 for _ in range(2))

  def _input_specs(self, geom: Geometry) -> StepInputs:
    offloaded = (_spec((geom.offloaded_rows, geom.total_len), bool, self.cpu)
                 if geom.cpu_attention and geom.offloaded_rows else None)
    return StepInputs(mask=_spec((geom.rows, geom.total_len), bool, self.device),
                      offloaded_mask=offloaded, slot=_spec((), np.int32, self.device))

  def _loaded_specs(self, geom: Geometry):
    """The offloaded rows' cache as the mover brings it (V only for dense attention)."""
    if not geom.offloaded_rows:
      return None
    entry, edt = self.cache_entry()
    where = self.cpu if geom.cpu_attention else self.device
    rows = _spec((geom.offloaded_rows, geom.total_len, entry), edt, where)
    return rows, rows if self.keep(geom.total_len) is None else None

  def _gather_spec(self, geom: Geometry) -> Callable:
    entry, edt = self.cache_entry()
    return lambda positions, device: _spec((*positions.shape, entry), edt, device)


# ---- the pure step functions --------------------------------------------------------------------
def head_sample(params, x, counters, given=None, *, cfg: ModelConfig, compute_dtype,
                temperature: float, top_p: float, logprobs: Logprobs = Logprobs()):
  """LM head of the last position and the next token.

  Args:
    x: [b, s, hidden]; counters: uint32 [b, 2] (the row's seed, token) naming each row's
      sampling key.
    given: [b] int32, the next tokens where logprobs.given (teacher forcing: nothing is
      sampled, the given tokens are scored), else None.
    logprobs: which log-probabilities to give too (sampler.token_logprobs: the model's
      distribution, before temperature and top-p).
  Returns:
    (logits [b, vocab] float32, tokens [b] int32, None where none are asked, else (the tokens'
    [b] float32, the most likely (ids [b, k] int32, values [b, k] float32) or None)).
  """
  logits = layers(cfg).head(params, x[:, -1:], cfg=cfg, compute_dtype=compute_dtype)[:, 0]
  if logprobs.given:
    tokens = given
  else:
    keys = jax.vmap(lambda c: jax.random.fold_in(jax.random.key(c[0]), c[1]))(counters)
    tokens = next_token(logits, keys, temperature=temperature, top_p=top_p)
  if not logprobs:
    return logits, tokens, None
  chosen, ids, values = token_logprobs(logits, tokens, logprobs.top)
  return logits, tokens, (chosen, (ids, values) if logprobs.top else None)


def prefill_layer(params, x, caches, mask, *, cfg: ModelConfig, compute_dtype, cache_dtype,
                  cache_quant: QuantConfig | None, device_rows: int, attend_dtype=None):
  """A prefill step of one layer with its cache writes.

  Args:
    x: [b, s, hidden]; mask: [b, s] bool (left-padded prompts).
    caches: (K, V) of the first device_rows rows [d, t, entry] (donated), or None.
  Returns:
    (y [b, s, hidden], caches with positions [0, s) written, (K, V) entries of the other rows
    [b - d, s, entry] for the host and disk tiers, or None).
  """
  y, (k, v) = layers(cfg).decoder_prefill(params, x, mask, cfg=cfg, compute_dtype=compute_dtype,
                                          cache_dtype=cache_dtype, attend_dtype=attend_dtype)
  entries = tuple(_entries(a, cache_quant) for a in (k, v))  # [b, s, entry]
  return (y, *_store(caches, entries, 0, device_rows))


def decode_layer(params, x, caches, mask, slot, loaded, *, cfg: ModelConfig, compute_dtype,
                 cache_dtype, cache_quant: QuantConfig | None, device_rows: int,
                 keep: int | None):
  """A whole decode step of one layer: every row attends on the device (its cache rows there, or
  `loaded` (K, V) [b - d, t, entry] for the offloaded rows).

  Returns (y [b, 1, hidden], device caches, offloaded rows' (K, V) entries or None).
  """
  model = layers(cfg)
  q, k, v = model.decode_qkv(params, x, mask, cfg=cfg, compute_dtype=compute_dtype,
                             cache_dtype=cache_dtype)
  d, attend = device_rows, functools.partial(_attend, cfg=cfg, cache_quant=cache_quant, keep=keep)
  caches, written = _store(caches, _new_entries(k, v, cache_quant), slot, d)
  parts = []
  if d:
    parts.append(attend(q[:d], k[:d], v[:d], *caches, mask[:d]))
  if loaded is not None:
    parts.append(attend(q[d:], k[d:], v[d:], *loaded, mask[d:]))
  y = model.decode_out(params, x, _join(parts), cfg=cfg, compute_dtype=compute_dtype)
  return y, caches, written


def decode_front(params, x, caches, mask, slot, k_loaded, *, cfg: ModelConfig, compute_dtype,
                 cache_dtype, cache_quant: QuantConfig | None, device_rows: int,
                 keep: int | None):
  """The first device part of a split decode step of one layer.

  q, k, v of the new token; its cache entries (the device rows' written at `slot`); the device
  rows' attention; and, for the offloaded rows, their sparse selection when their K is given
  on the device (`k_loaded` [b - d, t, entry]).

  Returns {'attn': device rows' attention [d, hidden] or None, 'caches', 'written': offloaded
  rows' (K, V) entries, 'qkv': their q, k, v [b - d, hidden], and with k_loaded 'scores'
  [b - d, t + 1, heads] and 'positions' [b - d, keep]}.
  """
  model = layers(cfg)
  q, k, v = model.decode_qkv(params, x, mask, cfg=cfg, compute_dtype=compute_dtype,
                             cache_dtype=cache_dtype)
  d = device_rows
  caches, written = _store(caches, _new_entries(k, v, cache_quant), slot, d)
  out = {'caches': caches, 'written': written, 'qkv': (q[d:], k[d:], v[d:]), 'attn': None}
  if d:
    out['attn'] = _attend(q[:d], k[:d], v[:d], *caches, mask[:d], cfg=cfg,
                          cache_quant=cache_quant, keep=keep)
  if k_loaded is not None:
    out['scores'], out['positions'] = attention.decode_select(
        q[d:], k[d:], k_loaded, mask[d:], cfg=cfg, keep=keep, cache_quant=cache_quant)
  return out


def decode_back(params, x, attn, offloaded, *, cfg: ModelConfig, compute_dtype,
                cache_quant: QuantConfig | None):
  """The last device part of a split decode step: the offloaded rows' attention (given [b - d,
  hidden], or sparse from (scores, positions, kept V rows, new v)), joined to the device rows'
  `attn` (or None), then the output projection and the MLP. -> y [b, 1, hidden]."""
  if isinstance(offloaded, tuple):
    offloaded = attention.decode_attend_selected(*offloaded, cfg=cfg, cache_quant=cache_quant)
  parts = [offloaded] if attn is None else [attn, offloaded]
  return layers(cfg).decode_out(params, x, _join(parts), cfg=cfg, compute_dtype=compute_dtype)


def _entries(a: jax.Array, cache_quant: QuantConfig | None) -> jax.Array:
  """K or V [b, n, hidden] in the cache dtype as the cache stores it (byte rows if quantized)."""
  return a if cache_quant is None else quant_lib.quantize(a, cache_quant)


def _new_entries(k, v, cache_quant):
  """The new token's cache entries: [b, hidden] -> [b, 1, entry]."""
  return tuple(_entries(a[:, None], cache_quant) for a in (k, v))


def _store(caches, entries, slot, device_rows: int):
  """Writes the device rows' entries into their caches at `slot`; returns (caches, the other
  rows' entries or None)."""
  d, b = device_rows, entries[0].shape[0]
  if d:
    caches = tuple(_write(c, e[:d], slot) for c, e in zip(caches, entries))
  return caches, (tuple(e[d:] for e in entries) if d < b else None)


def _attend(q, k, v, k_cache, v_cache, mask, *, cfg: ModelConfig,
            cache_quant: QuantConfig | None, keep: int | None):
  """Dense attention of rows over their cache, or sparse: scores against all of K, then only the
  `keep` selected V rows."""
  if keep is None:
    return attention.decode_attend(q, k, v, k_cache, v_cache, mask, cfg=cfg,
                                   cache_quant=cache_quant)
  scores, positions = attention.decode_select(q, k, k_cache, mask, cfg=cfg, keep=keep,
                                          cache_quant=cache_quant)
  return attention.decode_attend_selected(scores, positions, _take_rows(v_cache, positions), v,
                                      cfg=cfg, cache_quant=cache_quant)


def _join(parts: list[jax.Array]) -> jax.Array:
  return parts[0] if len(parts) == 1 else jnp.concatenate(parts)


def _take_rows(cache: jax.Array, positions: jax.Array) -> jax.Array:
  """cache [b, t, ...] rows at positions [b, keep] -> [b, keep, ...]."""
  return jnp.take_along_axis(cache, positions.reshape(*positions.shape, *([1] * (cache.ndim - 2))),
                             axis=1)


def _write(cache: jax.Array, new: jax.Array, slot) -> jax.Array:
  """Writes new [b, n, entry] into cache [b, t, entry] at time `slot`."""
  return jax.lax.dynamic_update_slice_in_dim(cache, new.astype(cache.dtype), slot, axis=1)


# ---- compile helpers ----------------------------------------------------------------------------
def _spec(shape, dtype, device: jax.Device | None = None) -> jax.ShapeDtypeStruct:
  sharding = jax.sharding.SingleDeviceSharding(device) if device is not None else None
  return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


def _combine(parts: list[StepMemory]) -> StepMemory:
  """Parts run one after another: their outputs add up, their temporaries do not."""
  if not parts:
    return StepMemory(0, 0)
  return StepMemory(temp=max(p.temp for p in parts), output=sum(p.output for p in parts),
                    library=max(p.library for p in parts))


# ---- one layer on its own -----------------------------------------------------------------------
def one_layer(cfg: ModelConfig, *, compute_dtype: str = 'float32',
              device: jax.Device) -> tuple[Steps, dict]:
  """Steps of the default policy (weights stored float16, the cache in the compute dtype) and
  layer 0's dummy weights on `device`: a layer step as a run calls it, to time or measure it
  alone (with Geometry.prompt for a prompt step)."""
  steps = Steps(cfg, Policy(), storage_dtype='float16', compute_dtype=compute_dtype,
                cache_dtype=compute_dtype, device=device, cpu=device)
  layer = jax.device_put(params_lib.dummy_stage(cfg, params_lib.layer_name(0), np.float16, 0),
                         device)
  return steps, layer
