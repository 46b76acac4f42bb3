"""Generation engine: plans a run, places the weights, and runs blocks of prompts through the
executor; the front door of flexjax's runtime (plan -> placement -> mover <-> executor)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Sequence

import jax
import numpy as np

from flexjax import diskio
from flexjax import hardware
from flexjax import memwatch
from flexjax import scratch
from flexjax import stream as stream_lib
from flexjax import plan as plan_lib
from flexjax.config import ModelConfig
from flexjax.errors import FlexjaxError
from flexjax.executor import Executor, new_batches
from flexjax.mover import BREAKDOWN_PARTS, Clock, Mover
from flexjax.placement import cpu_quantizer, open_layout, place_weights
from flexjax.policy import Policy
from flexjax.sampler import Logprobs, trim
from flexjax.storage import Storage
from flexjax.weights import WeightSource

__all__ = ['BREAKDOWN_PARTS', 'Engine', 'GenerationConfig', 'GenerationResult', 'pad_prompts']


ROW_READERS = 8  # threads reading the token rows of embedding steps
MAX_TOP_LOGPROBS = 20  # most likely tokens a step's log-probabilities may be given for


@dataclasses.dataclass(frozen=True)
class GenerationConfig:
  """What to generate: length and sampling. (How to batch it is the Policy's business.)"""

  gen_len: int = 32
  temperature: float = 0.0  # 0: greedy
  top_p: float = 1.0
  seed: int = 0
  stop_at_eos: bool = True
  logprobs: bool = False  # keep each sampled token's log-probability (GenerationResult)
  top_logprobs: int = 0  # and those of each step's this many most likely tokens (then logprobs)

  def __post_init__(self):
    if self.gen_len <= 0:
      raise FlexjaxError(f'gen_len={self.gen_len} must be a positive number of new tokens')
    if not 0 <= self.temperature < math.inf:
      raise FlexjaxError(f'temperature={self.temperature} must be a finite number >= 0 (0 means '
                         'greedy)')
    if not 0 < self.top_p <= 1:
      raise FlexjaxError(f'top_p={self.top_p} must be in (0, 1]')
    if self.seed < 0:
      raise FlexjaxError(f'seed={self.seed} must be >= 0')
    if (not isinstance(self.top_logprobs, int) or isinstance(self.top_logprobs, bool)
        or not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS):
      raise FlexjaxError(f'top_logprobs={self.top_logprobs} must be an integer in '
                         f'[0, {MAX_TOP_LOGPROBS}] (0: none)')

  @property
  def asked_logprobs(self) -> Logprobs:
    """The log-probabilities the head step computes."""
    return Logprobs(chosen=self.logprobs or self.top_logprobs > 0, top=self.top_logprobs)

  def head_args(self, *, forced: bool = False) -> dict:
    """What the head step's program depends on: the planner's keywords for it. forced: the
    run's tokens are given (generate's forced_tokens); the log-probabilities asked are then
    the given tokens' (Logprobs.given)."""
    logprobs = self.asked_logprobs
    if forced and logprobs:
      logprobs = dataclasses.replace(logprobs, given=True)
    return dict(temperature=self.temperature, top_p=self.top_p, logprobs=logprobs)


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
  peak_bytes: dict[str, int]  # per tier, drawn from the plan's buffers by the runtime
  planned_peak_bytes: dict[str, int]  # per tier (and 'ram' on a CPU backend), from the plan
  weight_loads: dict[str, int]  # per stage: times its weights were brought to the device
  bytes_moved: dict[str, int]  # from host/disk tiers: weights, weights_disk, k_cache, v_cache
  disk_weight_bytes: dict[str, int]  # weight bytes read from disk per phase (prefill, decode)
  # host buffers disk weights were read into, as allocated (the most a block's run held)
  staging_bytes: int = 0
  # [num_prompts, gen_len, vocab] float32 when asked for; zeros after a row's EOS or limit
  logits: np.ndarray | None = None
  # [num_prompts, gen_len] float32 with gen.logprobs: each token's log-probability under the
  # model's distribution (before temperature and top-p); zeros after a row's EOS or limit
  token_logprobs: np.ndarray | None = None
  # with gen.top_logprobs = k: each step's k most likely tokens, most likely first: their ids
  # [num_prompts, gen_len, k] int32 and log-probabilities (float32); zeros after EOS or limit
  top_ids: np.ndarray | None = None
  top_logprobs: np.ndarray | None = None
  # Without overlap: seconds per phase ('prefill', 'decode') and part of the work (BREAKDOWN_PARTS
  # and 'total'); None under overlap, where the parts run at the same time.
  breakdown: dict[str, dict[str, float]] | None = None
  plan: plan_lib.ExecutionPlan | None = None

  def logprob_fields(self, row: int, n: int, *, chosen: bool = True,
                     top: int | None = None) -> dict[str, list]:
    """An output line's log-probabilities of prompt `row`'s first n new tokens, of those the
    result holds: 'logprobs' (one per token; not where `chosen` is false) and 'top_logprobs'
    (per token, the `top` most likely as [id, log-probability], most likely first; by default
    all the result holds, none for 0)."""
    out = {}
    if self.token_logprobs is not None and chosen:
      out['logprobs'] = [float(v) for v in self.token_logprobs[row, :n]]
    if self.top_ids is not None and top != 0:
      ids, values = self.top_ids[row, :n, :top], self.top_logprobs[row, :n, :top]
      out['top_logprobs'] = [[[int(t), float(v)] for t, v in zip(*step)]
                             for step in zip(ids, values)]
    return out

  @property
  def decode_weight_stream(self) -> float:
    """Bytes per second of weights read from disk during decode."""
    return self.disk_weight_bytes['decode'] / self.decode_s if self.decode_s > 0 else 0.0

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


class Engine:
  """Runs an OPT model under an offloading Policy, within per-tier byte budgets.

  Construction plans the weights' placement, checks it against the budgets, and places every
  tensor on its tier; generate() plans the whole run (weights, caches, hidden states, XLA's
  working memory at the real shapes, runtime overhead), refuses a plan that exceeds a budget,
  and only then allocates. Use as a context manager (or call close()) so the offload folder is
  removed.

  Args:
    weights: a Checkpoint or DummyWeights.
    policy: placement and schedule (default: everything on the device, one GPU batch of 8).
    compute_dtype: dtype of the layer math (default: hardware.default_compute_dtype of the
      device: float16 on a GPU, float32 on the CPU backend, where it is fastest and exact).
    cache_dtype: KV cache dtype (default: compute_dtype).
    budgets: bytes per tier ('device', 'host', 'disk', and 'ram': device and host together on
      a CPU backend); None or a missing key: unlimited.
    overhead: the backend's runtime overhead (default: hardware.runtime_overhead(platform)).
    planner: a Planner for these weights and dtypes to reuse (its compiled steps included).
    offload_dir: parent of the run's offload folder (default: the system temp folder).
    drop_page_cache: drop offloaded files from the OS page cache after each access, so disk reads
      are real reads (benchmarks). Weights on disk are read with O_DIRECT, which bypasses the
      page cache anyway (where the filesystem refuses it, this drops them too).
    weights_cache: where streaming layouts of dummy weights and of read-only checkpoints are
      written (default: stream.default_cache_dir()).
    io_threads: threads reading weights from disk.
    host_memory: where host-tier weights live (hardware.host_memory_kind): 'auto' (pinned host
      memory on an accelerator that offers it, numpy buffers on the CPU backend), 'pinned' or
      'pageable'.
    progress: show a progress bar while a streaming layout is written.
  """

  def __init__(self, weights: WeightSource, *, policy: Policy = Policy(),
               compute_dtype: str | None = None, cache_dtype: str | None = None,
               device: jax.Device | None = None, budgets: dict[str, int | None] | None = None,
               overhead: plan_lib.Overhead | None = None,
               planner: plan_lib.Planner | None = None, offload_dir: str | None = None,
               drop_page_cache: bool = False, weights_cache: str | None = None,
               io_threads: int = diskio.IO_THREADS, host_memory: str = 'auto',
               progress: bool = False):
    self.config: ModelConfig = weights.config
    self.policy = policy
    self.weight_dtype = weights.dtype
    self.device = device or jax.local_devices()[0]
    self.host_memory = hardware.host_memory_kind(self.device, host_memory)
    compute_dtype = compute_dtype or hardware.default_compute_dtype(self.device.platform)
    self.compute_dtype = compute_dtype
    self.cache_dtype = cache_dtype or compute_dtype
    self.budgets = dict(budgets or {})
    self.planner = planner or plan_lib.Planner.for_device(
        self.config, self.device, storage_dtype=self.weight_dtype, compute_dtype=compute_dtype,
        cache_dtype=self.cache_dtype, overhead=overhead)
    self.cpu = self.planner.cpu
    self.sizes = self.planner.sizes
    self.steps = self.planner.steps(policy)
    placing = self.planner.weights_plan(policy)
    placing.check(self.budgets)
    for name, folder in (('offload_dir', offload_dir), ('weights_cache', weights_cache)):
      if folder:
        scratch.check_writable(Path(folder), f'{name}={folder!r}')
    self.storage = Storage(self.device, self.budgets, capacities=_capacities(placing),
                           offload_dir=offload_dir, drop_page_cache=drop_page_cache,
                           host_memory=self.host_memory)
    # host-tier weights in the device's own RAM as plain buffers: the steps take them as placed
    self._host_in_place = self.planner.device_is_host and self.host_memory is None
    self.stats = _new_stats(self.config)
    self.reader = diskio.Reader(io_threads)
    # token rows an embedding step reads (Mover.token_rows): threads of their own, so these
    # small reads do not queue behind the stages' reads under way
    self.row_reader = diskio.Reader(ROW_READERS)
    self.layout: stream_lib.StreamLayout | None = None
    try:
      # Disk-tier weights are read where the layout holds them; compressed weights are packed
      # once into it (or kept as a converted checkpoint packed them) instead of in every run.
      if (policy.compress_weight
          or plan_lib.weight_totals(self.config, policy, self.sizes).placed['disk']):
        self.layout = open_layout(weights, policy,
                                  cpu_quantizer(self.steps.quantize, self.steps.cpu),
                                  cache_dir=weights_cache, drop_page_cache=drop_page_cache,
                                  progress=progress)
      self._stages = place_weights(weights, policy, self.sizes, self.storage, self.steps,
                                   self.layout, host_in_place=self._host_in_place)
      # what placing freed (reads, casts, dummy values) leaves the process: glibc would keep it
      # resident, outside the plan (bfloat16 opt-1.3b 24 x 128: 180 MiB, and a peak 0.9% over
      # its plan)
      memwatch.return_free_memory()
    except BaseException:
      self.close()
      raise

  def __enter__(self) -> 'Engine':
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def close(self) -> None:
    """Removes the offload folder; closes the weight files."""
    self.storage.close()
    self.reader.close()
    self.row_reader.close()
    if self.layout is not None:
      self.layout.close()

  def plan(self, prompt_len: int, gen: 'GenerationConfig', *, policy: Policy | None = None,
           return_logits: bool = False, forced: bool = False) -> plan_lib.ExecutionPlan:
    """The execution plan of a generate() call with prompts padded to prompt_len (forced: with
    forced_tokens)."""
    return self.planner.run_plan(policy or self.policy, self.budgets, prompt_len=prompt_len,
                                 gen_len=gen.gen_len, return_logits=return_logits,
                                 **gen.head_args(forced=forced))

  # ---- generation -------------------------------------------------------------------------------
  def generate(self, prompts: Sequence[Sequence[int]], gen: GenerationConfig, *,
               policy: Policy | None = None,
               return_logits: bool = False,
               forced_tokens: np.ndarray | None = None,
               seeds: Sequence[int] | None = None,
               limits: Sequence[int] | None = None,
               pad_to: int | None = None) -> GenerationResult:
    """Generates `gen.gen_len` tokens for each prompt (token ids, BOS included).

    Prompts are left-padded to the longest one (or to pad_to) and processed a block
    (policy.block_size prompts) at a time with the zig-zag block schedule.

    Args:
      policy: batch geometry, cache/hidden placement, overlap and CPU attention for this call
        (default: the engine's); its weight percentages must equal the engine's, which placed
        the weights at construction.
      forced_tokens: [num_prompts, gen_len] ids to emit instead of sampling (teacher forcing:
        a given continuation is scored through the decode path, KV cache compression and
        sparse attention included). With gen.logprobs the result's token_logprobs are the
        forced tokens' (and top_logprobs the model's most likely at each step), computed in
        the head step: no logits need be returned.
      seeds: each prompt's sampling seed (default: derived from gen.seed and its index). A row's
        samples depend on its seed alone, not on the rows batched with it.
      limits: each prompt's new-token limit, at most gen.gen_len (default: gen.gen_len); a row
        that reaches it is finished, and a block stops once all its rows are.
      pad_to: the padded prompt length (default: the longest prompt); a few distinct lengths
        let jobs of many prompt lengths reuse compiled steps.
    """
    policy = self._call_policy(policy)
    if not prompts:
      raise FlexjaxError('no prompts given; pass at least one prompt')
    for i, prompt in enumerate(prompts):
      if len(prompt) == 0:
        raise FlexjaxError(f'prompt {i} is empty; each prompt needs at least one token (its BOS '
                           'token, say)')
      _check_ids(f'prompt {i}', prompt, self.config.vocab_size)
    longest = max(len(p) for p in prompts)
    if pad_to is not None and pad_to < longest:
      raise FlexjaxError(f'pad_to={pad_to} is shorter than the longest prompt ({longest} '
                         'tokens); leave it out or raise it')
    prompt_len = pad_to or longest
    seeds = np.asarray(default_seeds(gen.seed, len(prompts)) if seeds is None else seeds,
                       np.uint32)
    limits = np.asarray([gen.gen_len] * len(prompts) if limits is None else limits, np.int64)
    if seeds.shape != (len(prompts),) or limits.shape != (len(prompts),):
      raise FlexjaxError(f'seeds and limits need one value per prompt ({len(prompts)}); got '
                         f'{seeds.shape[0]} and {limits.shape[0]}')
    if limits.size and not 0 < limits.min() <= limits.max() <= gen.gen_len:
      raise FlexjaxError(f'limits must lie in [1, gen_len={gen.gen_len}]; got '
                         f'[{limits.min()}, {limits.max()}]')
    self._check_length(prompt_len + gen.gen_len - 1)
    if gen.top_logprobs > self.config.vocab_size:
      raise FlexjaxError(f'top_logprobs={gen.top_logprobs} exceeds the '
                         f'{self.config.vocab_size} tokens of {self.config.name}\'s vocabulary')
    if forced_tokens is not None:
      for i, forced in enumerate(forced_tokens):
        _check_ids(f'forced_tokens[{i}]', forced, self.config.vocab_size)
      forced_tokens = np.asarray(forced_tokens, np.int32)
      if forced_tokens.shape != (len(prompts), gen.gen_len):
        raise FlexjaxError(f'forced_tokens has shape {forced_tokens.shape}; expected '
                           f'({len(prompts)}, gen_len={gen.gen_len})')
    head = gen.head_args(forced=forced_tokens is not None)
    plan = self.plan(prompt_len, gen, policy=policy, return_logits=return_logits,
                     forced=forced_tokens is not None)
    plan.check(self.budgets)  # before anything of the run is allocated
    self.storage.use_capacities(_capacities(plan))
    n, block = len(prompts), policy.block_size
    padded_n = -(-n // block) * block
    tokens, mask = pad_prompts(list(prompts) + [[]] * (padded_n - n), prompt_len,
                               self.config.pad_token_id)
    seeds = np.concatenate([seeds, np.zeros(padded_n - n, np.uint32)])
    limits = np.concatenate([limits, np.full(padded_n - n, gen.gen_len)])
    if forced_tokens is not None:
      forced_tokens = np.concatenate([forced_tokens, np.full(
          (padded_n - n, gen.gen_len), self.config.pad_token_id, np.int32)])
    # The warm-up: every function the run calls is compiled at its real shapes (mostly the
    # plan's own compiles); jax's jit reuses those executables, and no step runs before timing.
    self.planner.compile_run(policy, prompt_len=prompt_len, gen_len=gen.gen_len, **head)
    self.stats = _new_stats(self.config)
    for account in self.storage.accounts.values():
      account.peak = account.current
    clock = Clock(enabled=not policy.overlap)
    outs, logits, logprobs, prefill_s, decode_s, generated = [], [], [], 0.0, 0.0, 0
    for start in range(0, padded_n, block):
      rows = slice(start, start + block)
      res = self._run_block(policy, tokens[rows], mask[rows], n - start, gen,
                            seeds=seeds[rows], limits=limits[rows],
                            max_steps=gen.gen_len, return_logits=return_logits,
                            read_ahead=plan.shape.read_ahead,
                            forced=None if forced_tokens is None else forced_tokens[rows],
                            head=head, clock=clock)
      outs.append(res['tokens'])
      logits.append(res['logits'])
      if res['logprobs'] is not None:
        logprobs.append(res['logprobs'])
      prefill_s += res['prefill_s']
      decode_s += res['decode_s']
      generated += res['generated']
    all_tokens = np.concatenate(outs)[:n]
    return GenerationResult(
        tokens=all_tokens,
        sequences=[trim(row, self.config.eos_token_id, gen.stop_at_eos) for row in all_tokens],
        num_prompts=n, prompt_len=prompt_len, gen_len=gen.gen_len, generated_tokens=generated,
        prefill_s=prefill_s, decode_s=decode_s, peak_bytes=self.storage.peaks(),
        planned_peak_bytes=plan.peaks(), weight_loads=dict(self.stats['weight_loads']),
        bytes_moved=dict(self.stats['bytes_moved']),
        disk_weight_bytes=dict(self.stats['disk_weights_by_phase']),
        staging_bytes=self.stats['staging_bytes'],
        logits=np.concatenate(logits)[:n] if return_logits else None,
        **_logprob_fields(logprobs, n),
        breakdown=_breakdown(clock, prefill_s, decode_s), plan=plan)

  def _call_policy(self, policy: Policy | None) -> Policy:
    policy = policy or self.policy
    for name in ('w_gpu_percent', 'w_cpu_percent', 'compress_weight', 'compress_cache',
                 'compress_bits', 'compress_group_size', 'attn_sparsity', 'placement'):
      if getattr(policy, name) != getattr(self.policy, name):
        raise FlexjaxError(f'policy {name}={getattr(policy, name)} differs from the engine\'s '
                           f'{getattr(self.policy, name)}; weight placement and the '
                           'approximations are fixed when the engine is built: build another '
                           'engine')
    return policy

  def _run_block(self, policy: Policy, tokens, mask, real_rows, gen, *, seeds, limits,
                 max_steps, return_logits, forced, head: dict, clock: Clock,
                 read_ahead: bool) -> dict:
    """Runs one block through the schedule. Returns its tokens, logits, timings."""
    mover = Mover(self.storage, self.steps, self._stages, policy, reader=self.reader,
                  row_reader=self.row_reader,
                  read_ahead=read_ahead and self._reads_ahead, clock=clock, stats=self.stats,
                  stage_names=plan_lib.stage_names(self.config),
                  device_is_host=self.planner.device_is_host,
                  prompt_ids=policy.gpu_batch_size * tokens.shape[1],
                  host_in_place=self._host_in_place)
    executor = Executor(self.config, policy, self.steps, mover, device=self.device, cpu=self.cpu,
                        head=head)
    batches = new_batches(self.config, policy, self.storage, self.steps, tokens=tokens,
                          mask=mask, real_rows=real_rows, gen_len=gen.gen_len,
                          return_logits=return_logits, logprobs=head['logprobs'], forced=forced,
                          seeds=seeds, limits=limits)
    mover.start()
    try:
      prefill_s, decode_s = self._execute(executor, batches, gen, max_steps)
    finally:
      mover.stop()
      for batch in batches:
        batch.close()
    generated = sum(batch.steps * batch.real_rows for batch in batches)
    return dict(tokens=np.concatenate([batch.out for batch in batches]),
                logits=(np.concatenate([batch.logits for batch in batches]) if return_logits
                        else None),
                logprobs=(None if batches[0].logprobs is None else
                          {key: np.concatenate([batch.logprobs[key] for batch in batches])
                           for key in batches[0].logprobs}),
                prefill_s=prefill_s, decode_s=decode_s, generated=generated)

  _reads_ahead = True  # whether a block may read disk weights two stages ahead (plan permitting)

  def _execute(self, executor: Executor, batches, gen, max_steps: int) -> tuple[float, float]:
    """Runs a block's batches through the schedule: (prefill seconds, decode seconds)."""
    return executor.execute(batches, gen, max_steps)

  # ---- helpers ----------------------------------------------------------------------------------
  def score(self, tokens: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray:
    """Logits of every position of left-padded sequences: [b, s] -> [b, s, vocab] float32.

    Runs the stages one after another with every stage's weights loaded as the policy places
    them (one batch, no KV cache kept).
    """
    from flexjax.model.family import layers
    model = layers(self.config)
    tokens = np.asarray(tokens, np.int32)
    mask = np.ones(tokens.shape, bool) if mask is None else np.asarray(mask, bool)
    self._check_length(tokens.shape[1])
    self.stats = _new_stats(self.config)
    mover = Mover(self.storage, self.steps, self._stages, self.policy, reader=self.reader,
                  row_reader=self.row_reader,
                  clock=Clock(False),
                  stats=self.stats, stage_names=plan_lib.stage_names(self.config),
                  device_is_host=self.planner.device_is_host, prompt_ids=tokens.size,
                  host_in_place=self._host_in_place)
    put = lambda a: jax.device_put(np.array(a, copy=True), self.device)
    x = None
    for index in range(len(self._stages)):
      loaded = mover.load_weights(index)
      params = loaded.params
      try:
        if index == 0:
          params, ids = mover.token_rows(params, tokens)
          x = self.steps.embed(params, put(ids), put(model.positions_from_mask(mask)))
        elif index == len(self._stages) - 1:
          x = model.head(params, x, cfg=self.config, compute_dtype=self.steps.compute)
        else:
          x, _ = self.steps.prefill(params, x, put(mask))
        x.block_until_ready()
      finally:
        mover.free_weights(loaded)
    return np.asarray(x)

  def _check_length(self, total: int) -> None:
    if total > self.config.max_positions:
      raise FlexjaxError(
          f'prompt plus generated tokens need {total} positions but {self.config.name} has '
          f'{self.config.max_positions}; shorten the prompts or --gen_len')


def _logprob_fields(blocks: list[dict[str, np.ndarray]], n: int) -> dict[str, np.ndarray]:
  """GenerationResult's log-probability fields from each block's kept arrays (executor.Batch
  .logprobs), the first n rows; none where no block kept any."""
  if not blocks:
    return {}
  names = {'chosen': 'token_logprobs', 'top_ids': 'top_ids', 'top_logprobs': 'top_logprobs'}
  return {names[key]: np.concatenate([block[key] for block in blocks])[:n] for key in blocks[0]}


def _check_ids(what: str, ids, vocab_size: int) -> None:
  """Refuses token ids that are not integers in [0, vocab_size) (the device's gather would clamp
  them to other tokens without a word)."""
  values = np.asarray(ids)
  if values.ndim != 1 or (values.size and values.dtype.kind not in 'iu'):
    raise FlexjaxError(f'{what} is not a list of integer token ids (got {str(ids)[:60]})')
  bad = values[(values < 0) | (values >= vocab_size)]
  if bad.size:
    raise FlexjaxError(f'{what} holds token id {int(bad[0])}; ids must lie in [0, {vocab_size})')


def default_seeds(seed: int, n: int) -> np.ndarray:
  """Sampling seeds of n prompts derived from one seed: [n] uint32, the i-th the same for any n."""
  return np.array([np.random.SeedSequence([seed, i]).generate_state(1)[0] for i in range(n)],
                  np.uint32)


def _capacities(plan: plan_lib.ExecutionPlan) -> dict[str, int]:
  """Bytes per plan buffer the runtime may hold at once."""
  return {buf.name: plan.capacity(buf.name) for buf in plan.buffers}


def _new_stats(cfg: ModelConfig) -> dict:
  return {'weight_loads': {name: 0 for name in plan_lib.stage_names(cfg)},
          'bytes_moved': {'weights': 0, 'weights_disk': 0, 'k_cache': 0, 'v_cache': 0},
          'disk_weights_by_phase': {'prefill': 0, 'decode': 0},
          'staging_bytes': 0}


def _breakdown(clock: Clock, prefill_s: float, decode_s: float):
  if not clock.enabled:
    return None
  totals = {'prefill': prefill_s, 'decode': decode_s}
  return {phase: {**parts, 'total': totals[phase]} for phase, parts in clock.seconds.items()}
