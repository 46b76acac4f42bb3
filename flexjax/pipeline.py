"""Pipeline parallelism over processes (FlexGen section 4.4): the decoder layers are split into
contiguous stages, one process (and one device) each, on jax.distributed. Each stage runs the
single-device runtime (placement, mover, executor steps, its own plan and budgets) on its layers;
micro-batches (the GPU batches of a block) stream through the stages, hidden states go from
stage to stage with a `ppermute`, and the last stage's sampled tokens reach every stage with a
`psum`, both under `shard_map` over a mesh of one device per process.

The GPU batches of a block form as many groups as there are stages. The stages advance in
ticks: in a tick each stage runs at most one group through all its layers, each layer's weights
loaded once for the group's batches (the block schedule within a stage), then every process
joins the tick's one collective (multi-controller jax needs every
process to issue the same collectives in the same order). Which stage runs which micro-batch in
which tick is computed alike by every process (`tick_schedule`), so the collectives' shapes and
the early stop at EOS agree everywhere without messages of their own.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from flexjax.config import ModelConfig
from flexjax.engine import Engine
from flexjax.errors import FlexjaxError
from flexjax.executor import Executor
from flexjax.model import params as params_lib
from flexjax.schedule import Step

_LAYER_PREFIX = 'layer_'


@dataclasses.dataclass(frozen=True)
class Topology:
  """Where this process sits in the pipeline."""

  num_processes: int
  process_id: int
  layers: range  # the decoder layers of this process's stage (global indices)

  @property
  def first(self) -> bool:
    return self.process_id == 0

  @property
  def last(self) -> bool:
    return self.process_id == self.num_processes - 1


def split_layers(cfg: ModelConfig, num_stages: int) -> list[range]:
  """Contiguous decoder layers per stage, each stage at least one, balanced by weight bytes (the
  cost a stage streams and multiplies by): a decoder layer costs the same everywhere, and the
  input embedding (first stage) and the tied LM head (last stage) each cost about the token
  embedding, so those stages take fewer layers where that evens the largest stage's cost.
  Among partitions of equal largest cost, the one with the fewest layers on the first stage."""
  n = cfg.num_layers
  if not 1 <= num_stages <= n:
    raise FlexjaxError(f'--num_processes={num_stages} must lie in [1, {n}]: every pipeline '
                       f'stage needs at least one of the {n} decoder layers of {cfg.name}')
  layer = cfg.layer_weight_bytes(1)
  edge = cfg.vocab_size * cfg.embed_dim + cfg.embedding_weight_bytes(1) // 2

  def cost(stage: int, count: int) -> int:
    return (count * layer + (edge if stage == 0 else 0)
            + (edge if stage == num_stages - 1 else 0))

  @functools.lru_cache(maxsize=None)
  def best(stage: int, start: int) -> tuple[int, tuple[int, ...]]:
    """(largest cost, layer counts) of stages stage.. over layers start.."""
    left = num_stages - stage
    if left == 1:
      return cost(stage, n - start), (n - start,)
    options = []
    for count in range(1, n - start - left + 2):
      rest, counts = best(stage + 1, start + count)
      options.append((max(cost(stage, count), rest), (count, *counts)))
    return min(options)

  counts, start, out = best(0, 0)[1], 0, []
  for count in counts:
    out.append(range(start, start + count))
    start += count
  return out


class StageWeights:
  """A weight source holding one stage's layers: a model of len(layers) decoder layers whose
  layer i is the source's layer layers.start + i (embedding and head as the source's)."""

  def __init__(self, source, layers: range):
    self.source, self.layers = source, layers
    self.config = dataclasses.replace(source.config, num_layers=len(layers))
    self.dtype = source.dtype

  def read(self, stage: str) -> params_lib.HostParams:
    return self.source.read(self._global(stage))

  def _global(self, stage: str) -> str:
    if stage.startswith(_LAYER_PREFIX):
      return params_lib.layer_name(self.layers.start + int(stage[len(_LAYER_PREFIX):]))
    return stage

  def fingerprint(self) -> str:
    return f'{self.source.fingerprint()}-layers{self.layers.start}-{self.layers.stop}'

  def stream_folder(self, cache_dir: Path) -> Path:
    folder = Path(self.source.stream_folder(cache_dir))
    return folder.with_name(f'{folder.name}-layers{self.layers.start}-{self.layers.stop}')

  def __getattr__(self, name):  # tokenizer_path and the like
    return getattr(self.source, name)


def tick_schedule(num_stages: int, num_tokens: int, num_batches: int) -> list[list[int]]:
  """ticks[p][i]: the tick in which stage p runs item i = token * num_batches + batch (a batch
  here is a group of micro-batches that move together).

  A stage runs its items in order, one per tick; item i reaches stage p the tick after stage
  p-1 ran it; the first stage embeds a decode token of a batch the tick after the last stage
  sampled that batch's previous token."""
  items = num_tokens * num_batches
  ticks = [[0] * items for _ in range(num_stages)]
  for i in range(items):
    for p in range(num_stages):
      ready = ticks[p][i - 1] + 1 if i else 0
      if p:
        ready = max(ready, ticks[p - 1][i] + 1)
      elif i >= num_batches:
        ready = max(ready, ticks[num_stages - 1][i - num_batches] + 1)
      ticks[p][i] = ready
  return ticks


@contextlib.contextmanager
def _stdout_to_stderr():
  """File descriptor 1 (what native code prints) sent to descriptor 2 for the block."""
  sys.stdout.flush()
  saved = os.dup(1)
  try:
    os.dup2(2, 1)
    yield
  finally:
    os.dup2(saved, 1)
    os.close(saved)


class Link:
  """The collectives between the stages: a mesh of one device per process (in process order)."""

  def __init__(self, num_processes: int):
    from jax.sharding import Mesh, NamedSharding, PartitionSpec
    devices = sorted(jax.devices(), key=lambda d: d.process_index)
    if len(devices) != num_processes or len({d.process_index for d in devices}) != num_processes:
      raise FlexjaxError(f'a pipeline of {num_processes} stages needs one device per process; '
                         f'jax sees {len(devices)} devices over the processes')
    self.n = num_processes
    self._warm: set = set()  # (shape, dtype) of the hidden-state exchanges compiled
    self.mesh = Mesh(np.array(devices), ('stage',))
    self.sharding = NamedSharding(self.mesh, PartitionSpec('stage'))
    self.local = jax.local_devices()[0]
    spec = PartitionSpec('stage')
    perm = [(p, p + 1) for p in range(num_processes - 1)]

    def exchange(hidden, tokens):
      return jax.lax.ppermute(hidden, 'stage', perm), jax.lax.psum(tokens, 'stage')

    def total(values):
      return jax.lax.psum(values, 'stage')

    shard_map = jax.shard_map
    self._exchange = jax.jit(shard_map(exchange, mesh=self.mesh, in_specs=(spec, spec),
                                       out_specs=(spec, spec)))
    self._total = jax.jit(shard_map(total, mesh=self.mesh, in_specs=spec, out_specs=spec))
    # The first collective connects the processes, and the CPU collectives announce that on
    # file descriptor 1: stage 0's stdout is the launcher's report, so it goes to the stage's
    # log (its stderr) instead.
    with _stdout_to_stderr():
      self._total(self._global(jnp.zeros((1,), jnp.int32))).block_until_ready()

  def _global(self, local: jax.Array) -> jax.Array:
    local = jax.device_put(local, self.local)[None]
    return jax.make_array_from_single_device_arrays((self.n, *local.shape[1:]), self.sharding,
                                                    [local])

  def warm_up(self, shape: tuple[int, ...], dtype) -> None:
    """Compiles (by running it on zeros, on every process alike) the exchange of hidden
    states of this shape, once."""
    if (shape, str(dtype)) not in self._warm:
      self._warm.add((shape, str(dtype)))
      self.exchange(jnp.zeros(shape, dtype), np.zeros(shape[0], np.int32))

  def exchange(self, hidden: jax.Array, tokens: np.ndarray) -> tuple[jax.Array, np.ndarray]:
    """Sends `hidden` to the next stage and adds `tokens` over all stages (zeros but on the
    sampling stage). Returns (the previous stage's hidden, the sum)."""
    out, total = self._exchange(self._global(hidden), self._global(jnp.asarray(tokens)))
    return (out.addressable_shards[0].data[0],
            np.asarray(total.addressable_shards[0].data[0]))

  def everyone(self, value, process_id: int) -> list:
    """Every process's JSON-able `value`, in process order (sent as bytes, 7 per gathered int:
    gather takes 61 bits)."""
    data = json.dumps(value).encode()
    sizes = self.gather([len(data)], process_id)[:, 0]
    width = -(-int(sizes.max()) // 7)
    padded = np.frombuffer(data.ljust(width * 7, b'\0'), np.uint8).reshape(width, 7)
    mine = (padded.astype(np.int64) << (8 * np.arange(7))).sum(axis=1)
    rows = self.gather(mine.tolist(), process_id)
    return [json.loads(((row[:, None] >> (8 * np.arange(7))) & 255).astype(np.uint8)
                       .tobytes()[:size]) for row, size in zip(rows, sizes)]

  def gather(self, values: list[int], process_id: int) -> np.ndarray:
    """[num_processes, len(values)] of every process's non-negative ints below 2**61 (sent as
    int32 pieces of 30 bits: jax computes in 32 bits by default)."""
    values = np.asarray(values, np.int64)
    rows = np.zeros((self.n, len(values), 3), np.int32)
    for k in range(3):
      rows[process_id, :, k] = (values >> (30 * k)) & (2**30 - 1)
    total = self.total(rows).astype(np.int64)
    return sum(total[..., k] << (30 * k) for k in range(3))

  def total(self, values: np.ndarray) -> np.ndarray:
    """The sum over all stages of `values` (an array of one shape and dtype on each)."""
    return np.asarray(self._total(self._global(jnp.asarray(values)))
                      .addressable_shards[0].data[0])


class StageEngine(Engine):
  """The engine of one pipeline stage: its weights are a StageWeights, and a block runs through
  the tick schedule with the other stages (Engine.generate does the rest: padding, the plan and
  its check against this stage's budgets, the warm-up compile, the report's numbers)."""

  def __init__(self, weights: StageWeights, topology: Topology, link: Link, **kw):
    super().__init__(weights, **kw)
    self.topology, self.link = topology, link

  _reads_ahead = False  # a stage's weights load one stage ahead (in _run_item), not two

  def _execute(self, executor: Executor, batches, gen, max_steps: int) -> tuple[float, float]:
    return self._ticks(executor, batches, gen, max_steps)

  def _ticks(self, executor: Executor, batches, gen, max_steps: int) -> tuple[float, float]:
    topo, m = self.topology, self.topology.num_processes
    p, n_local = topo.process_id, self.config.num_layers
    stages = ([0] if topo.first else []) + list(range(1, n_local + 1)) + (
        [n_local + 1] if topo.last else [])
    groups = micro_batch_groups(len(batches), m)
    ng = len(groups)
    ticks = tick_schedule(m, max_steps, ng)
    runs = [{tick: i for i, tick in enumerate(row)} for row in ticks]  # per stage: tick -> item
    b, s, h = batches[0].tokens.shape[0], batches[0].tokens.shape[1], self.config.hidden_size
    rows = b * len(groups[0])  # the rows of a group, exchanged together
    received: dict[int, jax.Array] = {}
    for length in (s, 1):  # the exchanges' compiles, before the clock starts
      self.link.warm_up((rows, length, h), self.steps.compute)
    start = time.perf_counter()
    prefill_s = None
    first = None  # this process's next item's first weights, loading
    try:
      for tick in range(ticks[m - 1][-1] + 1):
        item = runs[p].get(tick)
        if item is not None:
          outputs, first = self._run_item(executor, batches, groups, item, stages, received,
                                          gen, first=first, more=item + 1 < len(ticks[p]))
        senders = {q: runs[q][tick] for q in range(m) if tick in runs[q]}
        sent = [i for q, i in senders.items() if q < m - 1]
        sampled = senders.get(m - 1)
        if not sent and sampled is None:
          continue
        length = s if any(i < ng for i in sent) else 1
        hidden = jnp.zeros((rows, length, h), self.steps.compute)
        if item is not None and not topo.last:
          hidden = jnp.concatenate([jnp.pad(y, ((0, 0), (0, length - y.shape[1]), (0, 0)))
                                    for y in outputs])
        tokens = np.zeros(rows, np.int32)
        if topo.last and sampled is not None:
          token, g = divmod(sampled, ng)
          tokens = np.concatenate([batches[k].out[:, token] for k in groups[g]]).astype(np.int32)
        got, tokens = self.link.exchange(hidden, tokens)
        if p and p - 1 in senders:
          i = senders[p - 1]
          received[i] = got[:, :s if i < ng else 1]
        if sampled is None:
          continue
        token, g = divmod(sampled, ng)
        if not topo.last:
          for j, k in enumerate(groups[g]):
            _take_tokens(batches[k], token, tokens[j * b:(j + 1) * b], gen,
                         self.config.eos_token_id)
        if g == ng - 1:
          if token == 0:
            prefill_s = time.perf_counter() - start
          if all(batch.finished[:batch.real_rows].all() for batch in batches):
            break
    finally:
      if first is not None:
        executor.mover.free_weights(first.result())
    if batches[0].logprobs is not None:
      # the sampling stage's log-probabilities (zeros elsewhere) reach every stage
      for key in batches[0].logprobs:
        every = self.link.total(np.stack([batch.logprobs[key] for batch in batches]))
        for batch, values in zip(batches, every):
          batch.logprobs[key][:] = values
    total = time.perf_counter() - start
    prefill_s = total if prefill_s is None else prefill_s
    return prefill_s, total - prefill_s

  def _run_item(self, executor: Executor, batches, groups: list[list[int]], item: int,
                stages: list[int], received: dict, gen, *, first, more: bool):
    """Runs one group of micro-batches for one token through this process's stages: each
    stage's weights load once for the group (under overlap while the stage before computes)
    and serve its micro-batches in turn, the block schedule within a stage.

    Args:
      first: a future of the first stage's loaded weights, or None to load them now.
      more: whether this process runs another item after this one (its first stage's weights
        then start loading while this item's last stage computes).
    Returns:
      (the last stage's output per micro-batch: hidden states, or logits on the last stage;
      the future of the next item's first weights or None).
    """
    mover = executor.mover
    token, g = divmod(item, len(groups))
    group = [batches[k] for k in groups[g]]
    if not self.topology.first:
      got = received.pop(item)
      b = group[0].tokens.shape[0]
      mover.begin_step_stores()
      for j, batch in enumerate(group):
        mover.store_hidden(batch.hidden, got[j * b:(j + 1) * b])
    outputs: list = []
    overlap = self.policy.overlap
    weights = first or mover.workers['weights'].submit(mover.load_weights, stages[0])
    for n, stage in enumerate(stages):
      loaded = weights.result()
      upcoming = stages[n + 1] if n + 1 < len(stages) else (stages[0] if more else None)
      if overlap and upcoming is not None:  # loads while this stage computes
        weights = mover.workers['weights'].submit(mover.load_weights, upcoming,
                                                  outputs[-1] if outputs else None)
      outputs = []
      for k, batch in zip(groups[g], group):
        step = Step(token, stage, k)
        inputs = mover.load_inputs(step, batch)
        output, released = executor._compute(step, batch, loaded.params, inputs, gen)
        if released is not None:
          released.result()
        outputs.append(output)
      jax.block_until_ready(outputs)
      for batch in group:
        batch.hidden.wait()
      mover.free_weights(loaded, outputs)
      if not overlap and n + 1 < len(stages):
        weights = mover.workers['weights'].submit(mover.load_weights, stages[n + 1])
    s = group[0].tokens.shape[1]
    if token > 0:  # this stage's caches hold the token's slot: the next token attends to it
      for batch in group:
        batch.cache_mask[:, s + token - 1] = True
        batch.step_inputs = self.steps.step_inputs(batch.geometry, batch.cache_mask,
                                                   slot=s + token)
    return outputs, (weights if overlap and more else None)


def micro_batch_groups(num_batches: int, num_stages: int) -> list[list[int]]:
  """The GPU batches of a block in as many groups as there are stages (so every stage can be
  busy with a different group), or one batch per group where they do not divide evenly."""
  groups = num_stages if num_batches % num_stages == 0 else num_batches
  size = num_batches // groups
  return [list(range(g * size, (g + 1) * size)) for g in range(groups)]


def _take_tokens(batch, token: int, tokens: np.ndarray, gen, eos_token_id: int) -> None:
  """What the sampling stage's head step records, from the tokens it sent."""
  batch.out[:, token] = tokens
  batch.steps = token + 1
  if gen.stop_at_eos:
    batch.finished |= batch.out[:, token] == eos_token_id
  batch.finished |= batch.limits <= token + 1
