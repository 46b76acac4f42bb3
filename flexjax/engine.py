"""Generation engine: executes the block schedule over weights, KV cache and hidden states placed
across device, host and disk, with loads and stores overlapped with compute on worker threads.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from flexjax import memory
from flexjax.config import ModelConfig, np_dtype
from flexjax.errors import FlexjaxError
from flexjax.model import opt
from flexjax.model import params as params_lib
from flexjax import quant as quant_lib
from flexjax.policy import Policy
from flexjax.schedule import Step, block_schedule
from flexjax.storage import TIERS, SplitArray, Storage
from flexjax.weights import WeightSource


@dataclasses.dataclass(frozen=True)
class GenerationConfig:
  """What to generate: length and sampling. (How to batch it is the Policy's business.)"""

  gen_len: int = 32
  temperature: float = 0.0  # 0: greedy
  top_p: float = 1.0
  seed: int = 0
  stop_at_eos: bool = True

  def __post_init__(self):
    if self.gen_len <= 0:
      raise FlexjaxError(f'gen_len={self.gen_len} must be a positive number of new tokens')
    if self.temperature < 0:
      raise FlexjaxError(f'temperature={self.temperature} must be >= 0 (0 means greedy)')
    if not 0 < self.top_p <= 1:
      raise FlexjaxError(f'top_p={self.top_p} must be in (0, 1]')


@dataclasses.dataclass
class GenerationResult:
  """Generated tokens and timings. Throughputs follow the FlexGen paper's definitions."""

  tokens: np.ndarray  # [num_prompts, gen_len] int32, pad_token_id after EOS
  sequences: list[np.ndarray]  # per prompt: generated ids up to and including EOS
  num_prompts: int
  prompt_len: int  # padded prompt length
  gen_len: int
  generated_tokens: int  # rows x decode steps actually computed
  prefill_s: float
  decode_s: float
  peak_bytes: dict[str, int]  # per tier, as accounted by the runtime
  planned_peak_bytes: dict[str, int]  # per tier, as predicted before allocating
  weight_loads: dict[str, int]  # per stage: times its weights were brought to the device
  bytes_moved: dict[str, int]  # from host/disk tiers: weights, k_cache, v_cache
  logits: np.ndarray | None = None  # [num_prompts, gen_len, vocab] float32 when asked for
  # Without overlap: seconds per phase ('prefill', 'decode') and part of the work (BREAKDOWN_PARTS
  # and 'total'); None under overlap, where the parts run at the same time.
  breakdown: dict[str, dict[str, float]] | None = None

  @property
  def total_s(self) -> float:
    return self.prefill_s + self.decode_s

  @property
  def prefill_throughput(self) -> float:
    """Prompt tokens processed per second of prefill."""
    return self.num_prompts * self.prompt_len / self.prefill_s

  @property
  def decode_throughput(self) -> float:
    """Tokens generated per second after the first (which prefill produces)."""
    decoded = self.generated_tokens - self.num_prompts
    return decoded / self.decode_s if self.decode_s > 0 else float('nan')

  @property
  def total_throughput(self) -> float:
    """Generated tokens / (prefill + decode time): the paper's generation throughput."""
    return self.generated_tokens / self.total_s


def pad_prompts(prompts: Sequence[Sequence[int]], length: int, pad_id: int):
  """Left-pads prompts to `length`. Returns tokens [n, length] int32 and mask [n, length] bool."""
  tokens = np.full((len(prompts), length), pad_id, np.int32)
  mask = np.zeros((len(prompts), length), bool)
  for i, p in enumerate(prompts):
    if len(p):
      tokens[i, length - len(p):] = p
      mask[i, length - len(p):] = True
  return tokens, mask


BREAKDOWN_PARTS = ('compute', 'weight_read', 'cache_read', 'cache_write', 'hidden_read',
                   'hidden_write')


class _Clock:
  """Seconds per phase and part of the work of a run without overlap (the paper's Table 8).

  Each part waits for its results before it stops, so time is charged where the work happens;
  a part nested in another (a cache write inside a step's computation) is charged to itself only.
  Disabled, it costs nothing and adds no waits.
  """

  def __init__(self, enabled: bool):
    self.enabled = enabled
    self.phase = 'prefill'
    self.seconds = {phase: dict.fromkeys(BREAKDOWN_PARTS, 0.0) for phase in ('prefill', 'decode')}
    self._nested: list[float] = []  # per open part: seconds of the parts nested in it

  @contextlib.contextmanager
  def part(self, name: str):
    if not self.enabled:
      yield
      return
    self._nested.append(0.0)
    start = time.perf_counter()
    try:
      yield
    finally:
      elapsed = time.perf_counter() - start
      self.seconds[self.phase][name] += elapsed - self._nested.pop()
      if self._nested:
        self._nested[-1] += elapsed

  def ready(self, tree):
    """Waits for the arrays of `tree` when enabled; returns it."""
    if self.enabled:
      jax.block_until_ready(tree)
    return tree


class _Inline:
  """Runs submitted work at once on the caller's thread (the no-overlap executor)."""

  def submit(self, fn, *args):
    future = concurrent.futures.Future()
    future.set_result(fn(*args))
    return future

  def shutdown(self, wait=True, cancel_futures=False):
    del wait, cancel_futures


@dataclasses.dataclass
class _Batch:
  """Host-side state of one GPU batch of a block, and its hidden states and KV caches."""

  tokens: np.ndarray  # [b, s] prompt ids
  mask: np.ndarray  # [b, s]
  real_rows: int  # rows that are prompts (the rest pad the last block)
  cache_mask: np.ndarray  # [b, t]
  positions: np.ndarray  # [b] position of the first generated token
  out: np.ndarray  # [b, gen_len]
  finished: np.ndarray  # [b]
  logits: np.ndarray | None
  hidden: SplitArray
  caches: list[tuple[SplitArray, SplitArray]]
  forced: np.ndarray | None = None  # [b, gen_len] tokens to emit instead of samples
  steps: int = 0


class Engine:
  """Runs an OPT model under an offloading Policy, within per-tier byte budgets.

  Weights are read once from the source and placed: device tensors are cast to the compute dtype
  and stay; host tensors stay in the storage dtype in RAM; disk tensors go to files under the
  offload folder. Non-resident tensors are brought to the device once per block for each stage
  and cast there. Use as a context manager (or call close()) so the offload folder is removed.

  Args:
    weights: a Checkpoint or DummyWeights.
    policy: placement and schedule (default: everything on the device, one GPU batch of 8).
    compute_dtype: dtype of the layer math (float32 is fastest and exact on the CPU backend).
    cache_dtype: KV cache dtype (default: compute_dtype).
    budgets: bytes per tier ('device', 'host', 'disk'); None or a missing key: unlimited.
    offload_dir: parent of the run's offload folder (default: the system temp folder).
    drop_page_cache: drop offloaded files from the OS page cache after each access, so disk reads
      are real reads (benchmarks).
  """

  def __init__(self, weights: WeightSource, *, policy: Policy = Policy(),
               compute_dtype: str = 'float32', cache_dtype: str | None = None,
               device: jax.Device | None = None, budgets: dict[str, int | None] | None = None,
               offload_dir: str | None = None, drop_page_cache: bool = False):
    self._source = weights
    self.config: ModelConfig = weights.config
    self.policy = policy
    self.weight_dtype = weights.dtype
    self.compute_dtype = compute_dtype
    self.cache_dtype = cache_dtype or compute_dtype
    self.device = device or jax.devices()[0]
    self.cpu = jax.devices('cpu')[0]
    self.sizes = memory.Itemsizes(storage=np_dtype(self.weight_dtype).itemsize,
                                  compute=np_dtype(compute_dtype).itemsize,
                                  cache=np_dtype(self.cache_dtype).itemsize)
    self.storage = Storage(self.device, budgets, offload_dir=offload_dir,
                           drop_page_cache=drop_page_cache)
    self._check_budgets(memory.weight_bytes(self.config, policy, self.sizes).__dict__,
                        what='the weights alone')
    self._jit()
    self._workers: dict[str, object] = {}
    self._clock = _Clock(enabled=False)
    self.stats = _new_stats(self.config)
    try:
      tokens = params_lib.flatten(self._source.read('tokens'))  # read once, used by two stages
      self._stages = [self._place_stage(name, tokens)
                      for name in memory.stage_names(self.config)]
    except BaseException:
      self.close()
      raise

  # ---- setup ------------------------------------------------------------------------------------
  def _jit(self) -> None:
    cfg = self.config
    kw = dict(cfg=cfg, compute_dtype=np_dtype(self.compute_dtype))
    cache_kw = dict(kw, cache_dtype=np_dtype(self.cache_dtype))
    self._embed = jax.jit(functools.partial(opt.embed, **kw))
    self._head = jax.jit(functools.partial(opt.head, **kw))
    self._prefill = jax.jit(functools.partial(opt.decoder_prefill, **cache_kw))
    self._qkv = jax.jit(functools.partial(opt.decode_qkv, **cache_kw))
    quant = self.policy.quant
    cache_quant = quant if self.policy.compress_cache else None
    self._attend = jax.jit(functools.partial(opt.decode_attend, cfg=cfg, cache_quant=cache_quant))
    self._select = jax.jit(functools.partial(opt.decode_select, cfg=cfg, cache_quant=cache_quant),
                           static_argnames=('keep',))
    self._attend_selected = jax.jit(functools.partial(opt.decode_attend_selected, cfg=cfg,
                                                      cache_quant=cache_quant))
    self._quantize = jax.jit(functools.partial(quant_lib.quantize, config=quant))
    self._out = jax.jit(functools.partial(opt.decode_out, **kw))
    self._write_kv = jax.jit(_write_kv, donate_argnums=(0,))
    self._sample = jax.jit(_next_token, static_argnames=('temperature', 'top_p'))
    self._cast = jax.jit(lambda a: a.astype(np_dtype(self.compute_dtype)))
    self._dequantize = jax.jit(lambda p: quant_lib.unpack(p, np_dtype(self.compute_dtype)))

  def _place_stage(self, stage: str, tokens: dict) -> dict:
    """Reads a stage from the source and puts each tensor on its tier (the embedding and head
    stages also get the tied token embedding, read once by the caller)."""
    cfg = self.config
    host = params_lib.flatten(self._source.read(stage))
    if stage in ('embed', 'head'):
      host.update(tokens)
    placed = {}
    for path, tier in memory.place_stage(cfg, stage, self.policy).items():
      array = np.asarray(host[path])
      packed = memory.compressed(self.policy, array.shape)
      if packed:  # quantized once, on the CPU backend; kept and moved as byte rows
        array = np.asarray(self._quantize(jax.device_put(array, self.cpu)))
      if tier == 'device':
        self.storage.accounts['device'].reserve(
            array.nbytes if packed else array.size * self.sizes.compute)
        value = jax.device_put(array, self.device)
        value = value if packed else self._cast(value)
      elif tier == 'host':
        value = self.storage.host_array(array.shape, array.dtype)
        value[...] = array
      else:
        value = self.storage.disk_array(array.shape, array.dtype)
        value.write(..., array)
      placed[path] = (tier, quant_lib.Packed(value, host[path].shape[-1], self.policy.quant)
                      if packed else value)
    return placed

  def _check_budgets(self, need: dict[str, int], what: str) -> None:
    for tier in TIERS:
      budget = self.storage.accounts[tier].budget
      if budget is not None and need[tier] > budget:
        raise FlexjaxError(
            f'{what} need {need[tier]:,} bytes ({need[tier] / 2**30:.2f} GiB) on the {tier} but '
            f'its budget is {budget:,} ({budget / 2**30:.2f} GiB), short by '
            f'{need[tier] - budget:,}; raise the {tier} budget or move more to other tiers '
            f'(policy {self.policy.describe()})')

  def __enter__(self) -> 'Engine':
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def close(self) -> None:
    """Stops the workers and removes the offload folder."""
    self._stop_workers()
    self.storage.close()

  def _stop_workers(self) -> None:
    for worker in self._workers.values():
      worker.shutdown(wait=True, cancel_futures=True)
    self._workers = {}

  # ---- weights ----------------------------------------------------------------------------------
  def _load_weights(self, index: int):
    """Brings a stage's weights to the device. Returns (params, device bytes to release)."""
    tree, loaded = {}, 0
    for path, (tier, value) in self._stages[index].items():
      if tier == 'device':
        tree[path] = value
        continue
      packed = isinstance(value, quant_lib.Packed)
      stored = value.data if packed else value
      shape = (*stored.shape[:-1], value.dim) if packed else stored.shape
      nbytes = int(np.prod(shape)) * self.sizes.compute  # dequantized / cast once, on the device
      self.storage.accounts['device'].reserve(nbytes)
      loaded += nbytes
      finish = ((lambda a: self._dequantize(quant_lib.Packed(a, value.dim, value.config)))
                if packed else self._cast)
      if tier == 'host':
        tree[path] = finish(self.storage.to_device(stored, private=True))
      else:
        staged = stored.nbytes
        self.storage.accounts['host'].reserve(staged)
        try:
          tree[path] = finish(self.storage.to_device(stored.read(), private=True))
          jax.block_until_ready(tree[path])  # the staging copy may be reused only after this
        finally:
          self.storage.free('host', staged)
      self.stats['bytes_moved']['weights'] += stored.nbytes
    self.stats['weight_loads'][memory.stage_names(self.config)[index]] += 1
    return params_lib.unflatten(tree), loaded

  # ---- generation -------------------------------------------------------------------------------
  def generate(self, prompts: Sequence[Sequence[int]], gen: GenerationConfig, *,
               policy: Policy | None = None, warmup: bool = False,
               return_logits: bool = False,
               forced_tokens: np.ndarray | None = None) -> GenerationResult:
    """Generates `gen.gen_len` tokens for each prompt (token ids, BOS included).

    Prompts are left-padded to the longest one and processed a block (policy.block_size
    prompts) at a time with the zig-zag block schedule.

    Args:
      policy: batch geometry, cache/hidden placement, overlap and CPU attention for this call
        (default: the engine's); its weight percentages must equal the engine's, which placed
        the weights at construction.
      forced_tokens: [num_prompts, gen_len] ids to emit instead of sampling (teacher forcing:
        the logits then score a given continuation through the decode path, KV cache
        compression and sparse attention included).
    """
    if forced_tokens is not None:
      forced_tokens = np.asarray(forced_tokens, np.int32)
      if forced_tokens.shape != (len(prompts), gen.gen_len):
        raise FlexjaxError(f'forced_tokens has shape {forced_tokens.shape}; expected '
                           f'({len(prompts)}, gen_len={gen.gen_len})')
    policy = policy or self.policy
    fixed = ('w_gpu_percent', 'w_cpu_percent', 'compress_weight', 'compress_cache',
             'compress_bits', 'compress_group_size')
    for name in fixed:
      if getattr(policy, name) != getattr(self.policy, name):
        raise FlexjaxError(f'policy {name}={getattr(policy, name)} differs from the engine\'s '
                           f'{getattr(self.policy, name)}; weight placement and compression are '
                           'fixed when the engine is built: build another engine')
    placed_policy, self.policy = self.policy, policy
    try:
      return self._generate(prompts, gen, warmup=warmup, return_logits=return_logits,
                            forced=forced_tokens)
    finally:
      self.policy = placed_policy
      self._stop_workers()

  def _generate(self, prompts, gen: GenerationConfig, *, warmup: bool, return_logits: bool,
                forced: np.ndarray | None) -> GenerationResult:
    cfg, policy = self.config, self.policy
    if not prompts:
      raise FlexjaxError('no prompts given; pass at least one prompt')
    prompt_len = max(len(p) for p in prompts)
    if prompt_len == 0:
      raise FlexjaxError('all prompts are empty; each prompt needs at least one token')
    self._check_length(prompt_len + gen.gen_len - 1)
    planned = memory.peak_bytes(cfg, policy, self.sizes, prompt_len=prompt_len,
                                gen_len=gen.gen_len)
    self._check_budgets(planned, what='the weights, KV cache and hidden states')
    n, block = len(prompts), policy.block_size
    tokens, mask = pad_prompts(prompts, prompt_len, cfg.pad_token_id)
    padded_n = -(-n // block) * block
    tokens = np.concatenate([tokens, np.full((padded_n - n, prompt_len), cfg.pad_token_id,
                                             np.int32)])
    mask = np.concatenate([mask, np.zeros((padded_n - n, prompt_len), bool)])
    if forced is not None:
      forced = np.concatenate([forced, np.full((padded_n - n, gen.gen_len), cfg.pad_token_id,
                                               np.int32)])
    self._workers = ({'load': concurrent.futures.ThreadPoolExecutor(1, 'flexjax-load'),
                        'weights': concurrent.futures.ThreadPoolExecutor(1, 'flexjax-weights'),
                        'store': concurrent.futures.ThreadPoolExecutor(1, 'flexjax-store')}
                       if policy.overlap else {'load': _Inline(), 'weights': _Inline(),
                                               'store': _Inline()})
    if warmup:  # compile every shape on the first GPU batch (all batches share them), untimed
      b = policy.gpu_batch_size
      self.policy = dataclasses.replace(policy, num_gpu_batches=1)
      try:
        self._run_block(tokens[:b], mask[:b], n, gen, 0, max_steps=2, return_logits=False,
                        forced=None)
      finally:
        self.policy = policy
    self.stats = _new_stats(cfg)
    self._clock = _Clock(enabled=not policy.overlap)
    for account in self.storage.accounts.values():
      account.peak = account.current

    outs, logits, prefill_s, decode_s, generated = [], [], 0.0, 0.0, 0
    for start in range(0, padded_n, block):
      res = self._run_block(tokens[start:start + block], mask[start:start + block],
                            n - start, gen, start // block, max_steps=gen.gen_len,
                            return_logits=return_logits,
                            forced=None if forced is None else forced[start:start + block])
      outs.append(res['tokens'])
      logits.append(res['logits'])
      prefill_s += res['prefill_s']
      decode_s += res['decode_s']
      generated += res['generated']
    all_tokens = np.concatenate(outs)[:n]
    return GenerationResult(
        tokens=all_tokens,
        sequences=[_trim(row, cfg.eos_token_id, gen.stop_at_eos) for row in all_tokens],
        num_prompts=n, prompt_len=prompt_len, gen_len=gen.gen_len, generated_tokens=generated,
        prefill_s=prefill_s, decode_s=decode_s, peak_bytes=self.storage.peaks(),
        planned_peak_bytes=planned, weight_loads=dict(self.stats['weight_loads']),
        bytes_moved=dict(self.stats['bytes_moved']),
        logits=np.concatenate(logits)[:n] if return_logits else None,
        breakdown=self._breakdown(prefill_s, decode_s))

  def _breakdown(self, prefill_s: float, decode_s: float) -> dict[str, dict[str, float]] | None:
    if not self._clock.enabled:
      return None
    totals = {'prefill': prefill_s, 'decode': decode_s}
    return {phase: {**parts, 'total': totals[phase]}
            for phase, parts in self._clock.seconds.items()}

  def _new_batches(self, tokens, mask, real_rows, gen, return_logits, forced) -> list[_Batch]:
    cfg, policy = self.config, self.policy
    b, s = policy.gpu_batch_size, tokens.shape[1]
    t = s + gen.gen_len - 1
    cache_rows, act_rows = policy.rows('cache'), policy.rows('act')
    batches = []
    for k in range(policy.num_gpu_batches):
      rows = slice(k * b, (k + 1) * b)
      cache_mask = np.zeros((b, t), bool)
      cache_mask[:, :s] = mask[rows]
      row = memory.cache_row_bytes(cfg, policy, self.sizes)
      shape, dtype = (((b, t, row), np.uint8) if policy.compress_cache
                      else ((b, t, cfg.hidden_size), np_dtype(self.cache_dtype)))
      caches = [tuple(SplitArray(self.storage, shape, dtype, cache_rows, preallocate_device=True)
                      for _ in range(2)) for _ in range(cfg.num_layers)]
      batches.append(_Batch(
          tokens=tokens[rows], mask=mask[rows], real_rows=max(0, min(b, real_rows - k * b)),
          cache_mask=cache_mask, positions=mask[rows].sum(axis=1).astype(np.int32),
          out=np.full((b, gen.gen_len), cfg.pad_token_id, np.int32),
          finished=np.zeros(b, bool),
          logits=(np.zeros((b, gen.gen_len, cfg.vocab_size), np.float32) if return_logits
                  else None),
          hidden=SplitArray(self.storage, (b, s, cfg.hidden_size), np_dtype(self.compute_dtype),
                            act_rows, preallocate_device=False),
          caches=caches, forced=None if forced is None else forced[rows]))
    return batches

  def _run_block(self, tokens, mask, real_rows, gen, block_index, *, max_steps,
                 return_logits, forced) -> dict:
    """Runs one block through the schedule. Returns its tokens, logits, timings."""
    batches = self._new_batches(tokens, mask, real_rows, gen, return_logits, forced)
    key = jax.random.fold_in(jax.random.key(gen.seed), block_index)
    try:
      prefill_s, decode_s = self._execute(batches, gen, key, max_steps)
    finally:
      for batch in batches:
        for pair in batch.caches:
          for array in pair:
            array.wait()
            array.close()
        batch.hidden.wait()
        batch.hidden.close()
    generated = sum(batch.steps * batch.real_rows for batch in batches)
    return dict(tokens=np.concatenate([batch.out for batch in batches]),
                logits=(np.concatenate([batch.logits for batch in batches]) if return_logits
                        else None),
                prefill_s=prefill_s, decode_s=decode_s, generated=generated)

  def _execute(self, batches: list[_Batch], gen: GenerationConfig, key, max_steps: int):
    """The executor of the block schedule: load j+1 / compute j / store j-1.

    Under overlap, the next stage's weights load on one thread while every GPU batch of this
    stage computes, the next step's hidden and cache rows load on another once this step is
    dispatched (jax dispatch is asynchronous), and offloaded results are written back on a third.
    Without overlap, each load runs just before its use and each step is waited for.
    """
    overlap, clock = self.policy.overlap, self._clock
    steps = list(block_schedule(max_steps, len(self._stages), len(batches)))
    load, load_weights = self._workers['load'], self._workers['weights']
    weights: dict[int, concurrent.futures.Future] = {}
    inputs: dict[Step, concurrent.futures.Future] = {}
    current: tuple | None = None  # (params, device bytes loaded)
    releases: list[concurrent.futures.Future] = []  # steps whose inputs are still held
    start = time.perf_counter()
    prefill_s = 0.0
    try:
      for n, step in enumerate(steps):
        batch = batches[step.batch]
        clock.phase = 'decode' if step.token else 'prefill'
        if step.batch == 0:  # a new stage
          if current is not None:
            self.storage.free('device', current[1])
            current = None
          with clock.part('weight_read'):
            future = weights.pop(step.stage, None) or load_weights.submit(self._load_weights,
                                                                          step.stage)
            current = clock.ready(future.result())
          upcoming = next((s for s in steps[n + 1:] if s.stage != step.stage), None)
          if overlap and upcoming is not None:
            weights[upcoming.stage] = load_weights.submit(self._load_weights, upcoming.stage)
        future = inputs.pop(step, None) or load.submit(self._load_inputs, step, batches)
        loaded = future.result()
        with clock.part('compute'):
          released = self._compute(step, batch, current[0], loaded, gen, key)
          if released is not None:
            releases.append(released)
          while len(releases) > 1:  # bounds the loaded inputs alive at once (see memory.py)
            releases.pop(0).result()
          if overlap and n + 1 < len(steps):
            inputs[steps[n + 1]] = load.submit(self._load_inputs, steps[n + 1], batches)
          elif not overlap:
            jax.block_until_ready(batch.hidden.device)
            batch.hidden.wait()
        if step.stage == len(self._stages) - 1 and step.batch == len(batches) - 1:
          self._end_token(step.token, batches)
          if step.token == 0:
            prefill_s = time.perf_counter() - start
          if gen.stop_at_eos and all(b.finished[:b.real_rows].all() for b in batches):
            break
    finally:
      for future in releases:
        future.result()
      for future in inputs.values():
        _release(future.result(), self.storage)
      for future in weights.values():
        self.storage.free('device', future.result()[1])
      if current is not None:
        self.storage.free('device', current[1])
    return prefill_s, time.perf_counter() - start - prefill_s

  # ---- per-step work ----------------------------------------------------------------------------
  def _load_inputs(self, step: Step, batches: list[_Batch]) -> dict:
    """Brings a step's offloaded hidden rows and (decode) offloaded cache rows to where the
    computation needs them. Runs on the load thread under overlap."""
    batch = batches[step.batch]
    out = {'held': []}
    if step.stage > 0:
      with self._clock.part('hidden_read'):
        out['hidden'] = self._clock.ready(self._read_hidden(
            batch.hidden, 1 if step.token else batch.tokens.shape[1], out['held']))
    layer = step.stage - 1
    if step.token > 0 and 0 <= layer < self.config.num_layers:
      k_cache, v_cache = batch.caches[layer]
      if k_cache.offloaded_rows:  # sparse attention reads V later, only the rows it keeps
        dense = self.policy.attn_sparsity == 1
        with self._clock.part('cache_read'):
          out['cache'] = self._clock.ready((
              self._read_cache(k_cache, 'k_cache', out['held']),
              self._read_cache(v_cache, 'v_cache', out['held']) if dense else None))
    return out

  def _read_hidden(self, hidden: SplitArray, length: int, held: list) -> jax.Array:
    if not hidden.offloaded_rows:
      hidden.wait()
      return hidden.device
    staged = hidden.rows['disk'] * length * hidden.shape[2] * hidden.dtype.itemsize
    self.storage.accounts['host'].reserve(staged)
    try:
      rows = hidden.read_offloaded(length)
    finally:
      self.storage.free('host', staged)
    nbytes = rows.nbytes
    self.storage.accounts['device'].reserve(nbytes)
    held.append(('device', nbytes))
    loaded = self.storage.to_device(rows, private=False)
    if hidden.rows['device']:
      return jnp.concatenate([hidden.device, loaded])
    return loaded

  def _read_cache(self, cache: SplitArray, name: str, held: list):
    """Offloaded cache rows: a host array (CPU attention) or a device copy."""
    staged = cache.disk.nbytes if cache.disk is not None else 0
    self.storage.accounts['host'].reserve(staged)
    held.append(('host', staged))
    rows = cache.read_offloaded(cache.shape[1])
    self.stats['bytes_moved'][name] += rows.nbytes
    if self.policy.cpu_attention:
      return jax.device_put(rows, self.cpu)  # may alias host rows: read before the next write
    self.storage.accounts['device'].reserve(rows.nbytes)
    held.append(('device', rows.nbytes))
    return self.storage.to_device(rows, private=False)

  def _compute(self, step: Step, batch: _Batch, params, inputs: dict, gen, key):
    """Dispatches one step. Returns a future of the release of its loaded inputs, if deferred."""
    stage, token = step.stage, step.token
    last = len(self._stages) - 1
    s = batch.tokens.shape[1]
    if stage == 0:
      if token == 0:
        ids, positions = batch.tokens, np.cumsum(batch.mask, axis=1) * batch.mask - 1
      else:
        ids = batch.out[:, token - 1:token]
        positions = (batch.positions + token - 1)[:, None]
      y = self._embed(params, self._put(ids), self._put(positions))
    elif stage == last:
      x = inputs['hidden']
      logits = self._head(params, x[:, -1:])[:, 0]
      sample = self._sample(logits, jax.random.fold_in(key, token), temperature=gen.temperature,
                            top_p=gen.top_p)
      chosen = np.asarray(sample) if batch.forced is None else batch.forced[:, token]
      batch.out[:, token] = np.where(batch.finished, self.config.pad_token_id, chosen)
      if batch.logits is not None:
        batch.logits[:, token] = np.asarray(logits)
      batch.steps = token + 1
      if gen.stop_at_eos:
        batch.finished |= batch.out[:, token] == self.config.eos_token_id
      _release(inputs, self.storage)
      return
    else:
      layer = stage - 1
      x = inputs['hidden']
      k_cache, v_cache = batch.caches[layer]
      if token == 0:
        y, (k, v) = self._prefill(params, x, self._put(batch.mask))
        slot = 0
      else:
        y, (k, v) = self._decode(params, x, batch, k_cache, v_cache, inputs.get('cache'))
        slot = s + token - 1
      self._clock.ready((y, k, v))
      # The loaded inputs stay in use until the step has run (dispatch is asynchronous): their
      # bytes are returned by the store thread once the outputs exist.
      released = self._workers['store'].submit(_release_when_ready, inputs, y, self.storage)
      self._store_cache(k_cache, k, slot)
      self._store_cache(v_cache, v, slot)
      self._store_hidden(batch.hidden, y)
      return released
    _release(inputs, self.storage)
    self._store_hidden(batch.hidden, y)

  def _decode(self, params, x, batch: _Batch, k_cache: SplitArray, v_cache: SplitArray, loaded):
    """A decode step of one layer. Device cache rows attend on the device; offloaded rows attend
    where `loaded` lives (the CPU backend with cpu_attention, else the device)."""
    q, k, v = self._qkv(params, x)
    d = k_cache.rows['device']
    parts = []
    if d:
      parts.append(self._attention(q[:d], k[:d], v[:d], k_cache.device, batch.cache_mask[:d],
                                   v_dense=v_cache.device,
                                   v_rows=lambda pos: _take_rows(v_cache.device, pos),
                                   backend=self.device))
    if loaded is not None:
      backend = self.cpu if self.policy.cpu_attention else self.device
      to = lambda a: jax.device_put(a[d:], backend)
      out = self._attention(to(q), to(k), to(v), loaded[0], batch.cache_mask[d:],
                            v_dense=loaded[1],
                            v_rows=lambda pos: self._gather_v(v_cache, pos, backend),
                            backend=backend)
      parts.append(jax.device_put(out, self.device))
    attn = parts[0] if len(parts) == 1 else jnp.concatenate(parts)
    return self._out(params, x, attn), (k[:, None], v[:, None])

  def _attention(self, q, k, v, k_cache, cache_mask: np.ndarray, *, v_dense, v_rows, backend):
    """Dense attention, or sparse: scores against all of K, then only the kept V rows."""
    mask = jax.device_put(np.array(cache_mask), backend)
    if self.policy.attn_sparsity == 1:
      return self._attend(q, k, v, k_cache, v_dense, mask)
    keep = memory.sparse_keep(self.policy, cache_mask.shape[1])
    scores, positions = self._select(q, k, k_cache, mask, keep=keep)
    return self._attend_selected(scores, positions, v_rows(positions), v)

  def _gather_v(self, v_cache: SplitArray, positions: jax.Array, backend) -> jax.Array:
    """Reads only the kept V rows of the offloaded part of a cache (host gather, disk reads)."""
    positions = np.asarray(positions)
    with self._clock.part('cache_read'):
      rows = v_cache.read_offloaded_rows(positions)
      self.stats['bytes_moved']['v_cache'] += rows.nbytes
      if backend == self.device:
        return self._clock.ready(  # a fresh gather, never written again
            self.storage.to_device(rows, private=True))
      return self._clock.ready(jax.device_put(rows, backend))

  def _store_cache(self, cache: SplitArray, value: jax.Array, slot: int) -> None:
    if self.policy.compress_cache:  # [b, n, hidden] -> byte rows [b, n, row_bytes]
      value = self._clock.ready(self._quantize(value))
    d = cache.rows['device']
    with self._clock.part('cache_write'):
      if d:
        cache.device = self._clock.ready(self._write_kv(cache.device, value[:d], slot))
      if cache.offloaded_rows:
        cache.wait()
        cache.pending = self._workers['store'].submit(cache.write_offloaded, value, slot)

  def _store_hidden(self, hidden: SplitArray, value: jax.Array) -> None:
    d = hidden.rows['device']
    hidden.wait()
    value = self._clock.ready(value)  # computed: the write starts here
    with self._clock.part('hidden_write'):
      hidden.device = self._clock.ready(value if d == value.shape[0] else
                                        (value[:d] if d else None))
      if hidden.offloaded_rows:
        hidden.pending = self._workers['store'].submit(hidden.write_offloaded, value, 0)

  def _end_token(self, token: int, batches: list[_Batch]) -> None:
    """After the last stage of a token: the new slot of every cache becomes visible."""
    s = batches[0].tokens.shape[1]
    if token > 0:
      for batch in batches:
        batch.cache_mask[:, s + token - 1] = True

  # ---- helpers ----------------------------------------------------------------------------------
  def score(self, tokens: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray:
    """Logits of every position of left-padded sequences: [b, s] -> [b, s, vocab] float32.

    Runs the stages one after another with every stage's weights loaded as the policy places
    them (one batch, no KV cache kept).
    """
    tokens = np.asarray(tokens, np.int32)
    mask = np.ones(tokens.shape, bool) if mask is None else np.asarray(mask, bool)
    self._check_length(tokens.shape[1])
    self.stats = _new_stats(self.config)
    x = None
    for index in range(len(self._stages)):
      params, loaded = self._load_weights(index)
      try:
        if index == 0:
          x = self._embed(params, self._put(tokens), self._put(opt.positions_from_mask(mask)))
        elif index == len(self._stages) - 1:
          x = self._head(params, x)
        else:
          x, _ = self._prefill(params, x, self._put(mask))
        x.block_until_ready()
      finally:
        self.storage.free('device', loaded)
    return np.asarray(x)

  def _put(self, array) -> jax.Array:
    """Places a small per-step input on the device (copied: see Storage.to_device)."""
    return self.storage.to_device(np.asarray(array), private=False)

  def _check_length(self, total: int) -> None:
    if total > self.config.max_positions:
      raise FlexjaxError(
          f'prompt plus generated tokens need {total} positions but {self.config.name} has '
          f'{self.config.max_positions}; shorten the prompts or --gen_len')


def _new_stats(cfg: ModelConfig) -> dict:
  return {'weight_loads': {name: 0 for name in memory.stage_names(cfg)},
          'bytes_moved': {'weights': 0, 'k_cache': 0, 'v_cache': 0}}


@jax.jit
def _take_rows(cache: jax.Array, positions: jax.Array) -> jax.Array:
  """cache [b, t, ...] rows at positions [b, keep] -> [b, keep, ...]."""
  return jnp.take_along_axis(cache, positions.reshape(*positions.shape, *([1] * (cache.ndim - 2))),
                             axis=1)


def _release_when_ready(inputs: dict, outputs, storage: Storage) -> None:
  jax.block_until_ready(outputs)
  _release(inputs, storage)


def _release(inputs: dict, storage: Storage) -> None:
  """Returns the bytes a step's loaded inputs held (once)."""
  for tier, nbytes in inputs.pop('held', []):
    storage.free(tier, nbytes)


def _write_kv(cache: jax.Array, new: jax.Array, slot) -> jax.Array:
  """Writes new [b, n, h] into cache [b, t, h] at time `slot` (the cache buffer is donated)."""
  return jax.lax.dynamic_update_slice_in_dim(cache, new.astype(cache.dtype), slot, axis=1)


def _next_token(logits: jax.Array, key: jax.Array, *, temperature: float, top_p: float):
  """Greedy (temperature 0) or temperature + nucleus sampling. logits: [b, vocab] -> [b] int32."""
  if temperature == 0:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  logits = logits / temperature
  if top_p < 1:
    sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    # keep the smallest prefix whose mass reaches top_p (the first token is always kept)
    before = jnp.cumsum(probs, axis=-1) - probs
    cutoff_index = jnp.sum(before < top_p, axis=-1, keepdims=True) - 1
    cutoff = jnp.take_along_axis(sorted_logits, cutoff_index, axis=-1)
    logits = jnp.where(logits < cutoff, -jnp.inf, logits)
  return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def _trim(row: np.ndarray, eos_id: int, stop_at_eos: bool) -> np.ndarray:
  if stop_at_eos:
    hits = np.flatnonzero(row == eos_id)
    if hits.size:
      return row[:hits[0] + 1]
  return row
