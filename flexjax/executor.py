"""The executor: walks the block schedule (schedule.block_schedule) and dispatches the jitted
layer steps, while the mover loads step j+1 and stores step j-1."""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import time

import jax
import numpy as np

from flexjax import memwatch
from flexjax import plan as plan_lib
from flexjax.config import ModelConfig
from flexjax.mover import Mover
from flexjax.policy import Policy
from flexjax.sampler import Logprobs
from flexjax.schedule import Step, block_schedule
from flexjax.steps import Geometry, StepInputs, Steps
from flexjax.storage import SplitArray, Storage


@dataclasses.dataclass
class Batch:
  """Host-side state of one GPU batch of a block, and its hidden states and KV caches."""

  tokens: np.ndarray  # [b, s] prompt ids
  mask: np.ndarray  # [b, s]
  real_rows: int  # rows that are prompts (the rest pad the last block)
  cache_mask: np.ndarray  # [b, t]
  positions: np.ndarray  # [b] position of the first generated token
  out: np.ndarray  # [b, gen_len]
  finished: np.ndarray  # [b]
  logits: np.ndarray | None
  # log-probabilities kept (sampler.Logprobs): 'chosen' [b, gen_len] float32, and with top k
  # 'top_ids' [b, gen_len, k] int32 and 'top_logprobs' [b, gen_len, k] float32; or None
  logprobs: dict[str, np.ndarray] | None
  hidden: SplitArray
  caches: list[tuple[SplitArray, SplitArray]]
  seeds: np.ndarray | None = None  # [b] uint32: each row's sampling seed
  limits: np.ndarray | None = None  # [b]: new tokens each row may have (at most gen_len)
  forced: np.ndarray | None = None  # [b, gen_len] tokens to emit instead of samples
  steps: int = 0
  geometry: Geometry | None = None
  prompt_mask: jax.Array | None = None  # `mask` on the device (prefill)
  step_inputs: StepInputs | None = None  # the next decode step's masks and slot, where read

  def close(self) -> None:
    for pair in self.caches:
      for array in pair:
        array.wait()
        array.close()
    self.hidden.wait()
    self.hidden.close()


def new_batches(cfg: ModelConfig, policy: Policy, storage: Storage, steps: Steps, *, tokens,
                mask, real_rows: int, gen_len: int, return_logits: bool, logprobs: Logprobs,
                forced, seeds, limits) -> list[Batch]:
  """The GPU batches of a block with their caches and hidden states allocated on their tiers.
  seeds, limits: [block] per-row sampling seeds and new-token limits."""
  b, s = policy.gpu_batch_size, tokens.shape[1]
  t = s + gen_len - 1
  entry, dtype = steps.cache_entry()
  batches = []
  try:
    for k in range(policy.num_gpu_batches):
      rows = slice(k * b, (k + 1) * b)
      cache_mask = np.zeros((b, t), bool)
      cache_mask[:, :s] = mask[rows]
      batch = Batch(
          tokens=tokens[rows], mask=mask[rows], real_rows=max(0, min(b, real_rows - k * b)),
          cache_mask=cache_mask, positions=mask[rows].sum(axis=1).astype(np.int32),
          out=np.full((b, gen_len), cfg.pad_token_id, np.int32), finished=np.zeros(b, bool),
          logits=(np.zeros((b, gen_len, cfg.vocab_size), np.float32) if return_logits
                  else None),
          logprobs=kept_logprobs(logprobs, b, gen_len),
          hidden=SplitArray(storage, (b, s, cfg.hidden_size), steps.compute,
                            policy.rows('act'), preallocate_device=False, kind='hidden'),
          caches=[], seeds=seeds[rows], limits=limits[rows],
          forced=None if forced is None else forced[rows],
          geometry=Geometry.of(policy, prompt_len=s, gen_len=gen_len))
      batch.prompt_mask = jax.device_put(np.array(batch.mask), steps.device)
      batch.step_inputs = steps.step_inputs(batch.geometry, cache_mask, slot=s)
      batches.append(batch)
      for _ in range(cfg.num_layers):
        batch.caches.append(tuple(
            SplitArray(storage, (b, t, entry), dtype, policy.rows('cache'),
                       preallocate_device=True, kind='cache') for _ in range(2)))
  except BaseException:
    for batch in batches:
      batch.close()
    raise
  return batches


def kept_logprobs(asked: Logprobs, rows: int, gen_len: int) -> dict[str, np.ndarray] | None:
  """A batch's arrays of the log-probabilities asked for (Batch.logprobs), zeros."""
  if not asked:
    return None
  out = {'chosen': np.zeros((rows, gen_len), np.float32)}
  if asked.top:
    out['top_ids'] = np.zeros((rows, gen_len, asked.top), np.int32)
    out['top_logprobs'] = np.zeros((rows, gen_len, asked.top), np.float32)
  return out


def next_stages(steps: list[Step], n: int, count: int) -> list[int]:
  """The stages of the next `count` stage changes after step n (the weights to load next)."""
  out, current = [], steps[n].stage
  for i in range(n + 1, len(steps)):  # (no copy of the rest of the schedule per step)
    step = steps[i]
    if step.stage != current:
      out.append(step.stage)
      current = step.stage
      if len(out) == count:
        break
  return out


class Executor:
  """Runs blocks through the schedule: load j+1 / compute j / store j-1.

  Under overlap, the next stage's weights load on one thread while every GPU batch of this
  stage computes, the next step's hidden and cache rows load on another once this step is
  dispatched (jax dispatch is asynchronous), and offloaded results are written back on a third.
  At most two steps are in flight (one without overlap, and one prompt step at a time on a CPU
  backend): the plan counts their XLA memory (plan.steps_in_flight).
  """

  def __init__(self, cfg: ModelConfig, policy: Policy, steps: Steps, mover: Mover, *, device,
               cpu, head: dict):
    """head: the head step's keywords (temperature, top_p, logprobs), as the plan compiled it."""
    self.cfg, self.policy, self.steps, self.mover = cfg, policy, steps, mover
    self.device, self.cpu, self.head = device, cpu, head
    self.num_stages = cfg.num_layers + 2

  def execute(self, batches: list[Batch], gen, max_steps: int) -> tuple[float, float]:
    """Runs a block's steps. Returns (prefill seconds, decode seconds)."""
    mover, clock, overlap = self.mover, self.mover.clock, self.policy.overlap
    steps = list(block_schedule(max_steps, self.num_stages, len(batches)))
    in_flight_limit = {phase: plan_lib.steps_in_flight(phase, overlap,
                                                       self.device.platform == 'cpu')
                       for phase in ('prefill', 'decode')}
    # A step that runs alone (a CPU backend's prompt step; the plan counts one) hands what the
    # step before it freed back to the system first: glibc keeps the freed blocks under its mmap
    # threshold, and the next step's would be allocated beside them (opt350m_disk_block measured
    # 2.40 GiB against a 2.38 GiB plan, 2.14-2.16 GiB with the heap trimmed, at no cost in its
    # prefill time).
    alone = {phase: plan_lib.runs_alone(phase, self.device.platform == 'cpu')
             for phase in ('prefill', 'decode')}
    weights: dict[int, concurrent.futures.Future] = {}
    inputs: dict[Step, concurrent.futures.Future] = {}
    current = None  # the stage's mover.Loaded weights
    stage_outputs: list = []  # outputs of the steps that used them
    in_flight: collections.deque = collections.deque()  # outputs of dispatched steps
    releases: list[concurrent.futures.Future] = []
    previous_stage_out = None
    start = time.perf_counter()
    prefill_s = 0.0
    try:
      for n, step in enumerate(steps):
        batch = batches[step.batch]
        clock.phase = 'decode' if step.token else 'prefill'
        if step.batch == 0:  # a new stage
          if current is not None:
            mover.free_weights(current, stage_outputs)
            current, stage_outputs = None, []
          with clock.part('weight_read'):
            future = weights.pop(step.stage, None)
            current = clock.ready(future.result() if future is not None
                                  else mover.load_weights(step.stage))
          upcoming = next_stages(steps, n, 2)
          # The next stage's weights load on their thread once this stage's last outputs exist
          # (two stages' loaded weights alive); a stage with none off the device looks its
          # resident ones up when it comes, and waits for nothing.
          if overlap and upcoming and mover.loads_weights(upcoming[0]):
            weights[upcoming[0]] = mover.workers['weights'].submit(
                mover.load_weights, upcoming[0], previous_stage_out)
          if overlap and len(upcoming) > 1:
            mover.read_ahead(upcoming[1])
        future = inputs.pop(step, None)
        loaded = future.result() if future is not None else mover.load_inputs(step, batch)
        while len(in_flight) >= in_flight_limit[clock.phase]:
          jax.block_until_ready(in_flight.popleft())
          if alone[clock.phase]:
            memwatch.return_free_memory()
        with clock.part('compute'):
          output, released = self._compute(step, batch, current.params, loaded, gen)
          in_flight.append(output)
          stage_outputs.append(output)
          if released is not None:
            releases.append(released)
          if (overlap and n + 1 < len(steps)
              and not mover.loads_nothing(steps[n + 1], batches[steps[n + 1].batch])):
            # The next step's inputs start loading now, before the step before this one has
            # finished: the two steps in flight and the one loading hold inputs (plan's
            # inputs_alive), and the disk never waits for the compute to read a step's cache.
            # Inputs already on the device are looked up when their step comes (no handoff).
            inputs[steps[n + 1]] = mover.workers['load'].submit(mover.load_inputs, steps[n + 1],
                                                                batches[steps[n + 1].batch])
          elif not overlap:
            jax.block_until_ready(output)
            batch.hidden.wait()
          while len(releases) > 1:
            releases.pop(0).result()
        if step.batch == len(batches) - 1:
          previous_stage_out = output
        if step.stage == self.num_stages - 1 and step.batch == len(batches) - 1:
          self._end_token(step.token, batches)
          if step.token == 0:
            prefill_s = time.perf_counter() - start
          if all(b.finished[:b.real_rows].all() for b in batches):
            break
    finally:
      for future in releases:
        future.result()
      for future in inputs.values():
        mover.release(future.result())
      for future in weights.values():
        mover.free_weights(future.result())
      jax.block_until_ready(list(in_flight))
      if current is not None:
        mover.free_weights(current)
    return prefill_s, time.perf_counter() - start - prefill_s

  # ---- per-step work ----------------------------------------------------------------------------
  def _compute(self, step: Step, batch: Batch, params, inputs: dict, gen):
    """Dispatches one step. Returns (its output, a future of the release of its loaded inputs
    or None). Each row's sampling key is derived inside the head step from its seed and the
    token index."""
    stage, token, steps, mover = step.stage, step.token, self.steps, self.mover
    s = batch.tokens.shape[1]
    if stage == self.num_stages - 1:
      counters = np.stack([batch.seeds, np.full_like(batch.seeds, token)], axis=1)
      given = (self._put(batch.forced[:, token]) if self.head['logprobs'].given else None)
      logits, sample, scores = steps.head_step(params, inputs['hidden'], self._put(counters),
                                               given, **self.head)
      chosen = np.asarray(sample) if batch.forced is None else batch.forced[:, token]
      batch.out[:, token] = np.where(batch.finished, self.cfg.pad_token_id, chosen)
      if batch.logits is not None:  # a finished row's are zeros, however long its block runs
        batch.logits[:, token] = np.where(batch.finished[:, None], 0, np.asarray(logits))
      if batch.logprobs is not None:
        chosen, top = scores
        for key, values in (('chosen', chosen), *zip(('top_ids', 'top_logprobs'), top or ())):
          values = np.asarray(values)
          finished = batch.finished.reshape(-1, *(1,) * (values.ndim - 1))
          batch.logprobs[key][:, token] = np.where(finished, 0, values)
      batch.steps = token + 1
      if gen.stop_at_eos:
        batch.finished |= batch.out[:, token] == self.cfg.eos_token_id
      batch.finished |= batch.limits <= token + 1
      mover.release(inputs)
      return logits, None
    mover.begin_step_stores()
    if stage == 0:
      if token == 0:
        ids, positions = batch.tokens, np.cumsum(batch.mask, axis=1) * batch.mask - 1
      else:
        ids = batch.out[:, token - 1:token]
        positions = (batch.positions + token - 1)[:, None]
      params, ids = mover.token_rows(params, ids)
      y = steps.embed(params, self._put(ids), self._put(positions))
      mover.release(inputs)
      mover.store_hidden(batch.hidden, y)
      return y, None
    x = inputs['hidden']
    k_cache, v_cache = batch.caches[stage - 1]
    caches = (k_cache.device, v_cache.device) if k_cache.rows['device'] else None
    if token == 0:
      y, caches, written = steps.prefill_step(batch.geometry, params, x, caches,
                                              batch.prompt_mask)
      slot = 0
    else:
      gather_v = lambda positions, device: mover.gather_v(v_cache, positions, device)
      y, caches, written = steps.decode_step(batch.geometry, params, x, caches,
                                             batch.step_inputs, inputs.get('cache'), gather_v)
      slot = s + token - 1
    if caches is not None:
      k_cache.device, v_cache.device = caches
    mover.clock.ready((y, caches, written))
    # The loaded inputs stay in use until the step has run (dispatch is asynchronous): their
    # bytes are returned by the store thread once the outputs exist.
    released = mover.release_when_ready(inputs, y)
    if written is not None:
      for cache, rows in zip((k_cache, v_cache), written):
        mover.store_cache_rows(cache, rows, slot)
    mover.store_hidden(batch.hidden, y)
    return y, released

  def _end_token(self, token: int, batches: list[Batch]) -> None:
    """After the last stage of a token: the new slot of every cache becomes visible; the next
    token's step inputs (mask and slot) go to where the steps read them, once per batch."""
    s = batches[0].tokens.shape[1]
    if token > 0:
      for batch in batches:
        batch.cache_mask[:, s + token - 1] = True
        batch.step_inputs = self.steps.step_inputs(batch.geometry, batch.cache_mask,
                                                   slot=s + token)

  def _put(self, array) -> jax.Array:
    """A small per-step input on the device, copied (the CPU backend may alias host buffers
    that change later)."""
    return jax.device_put(np.array(array, copy=True), self.device)
