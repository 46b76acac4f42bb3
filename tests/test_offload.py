"""Offloading: every placement reproduces the all-device run; loads, budgets, offload folder."""

import dataclasses
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import PROMPTS, interruptible
from flexjax.checkpoint import Checkpoint
from flexjax.engine import BREAKDOWN_PARTS, Engine, GenerationConfig
from flexjax.errors import FlexjaxError
from flexjax.policy import Policy

GEN = GenerationConfig(gen_len=6, stop_at_eos=False)

POLICIES = {
    'weights_on_disk': Policy(gpu_batch_size=4, w_gpu_percent=0, w_cpu_percent=0),
    'weights_on_host': Policy(gpu_batch_size=4, w_gpu_percent=0, w_cpu_percent=100),
    'weights_split_3_ways': Policy(gpu_batch_size=4, w_gpu_percent=30, w_cpu_percent=40),
    'weights_flexgen_placement': Policy(gpu_batch_size=4, w_gpu_percent=30, w_cpu_percent=40,
                                        placement='flexgen'),
    'cache_split_device_host': Policy(gpu_batch_size=4, cache_gpu_percent=50,
                                      cache_cpu_percent=50),
    'cache_on_disk': Policy(gpu_batch_size=4, cache_gpu_percent=0, cache_cpu_percent=0),
    'cache_split_3_ways': Policy(gpu_batch_size=4, cache_gpu_percent=25, cache_cpu_percent=50),
    'activations_on_host': Policy(gpu_batch_size=4, act_gpu_percent=0, act_cpu_percent=100),
    'activations_split_3_ways': Policy(gpu_batch_size=4, act_gpu_percent=25,
                                       act_cpu_percent=25),
    '2x2_batches': Policy(gpu_batch_size=2, num_gpu_batches=2),
    '1x4_batches_cache_host': Policy(gpu_batch_size=1, num_gpu_batches=4, cache_gpu_percent=0,
                                     cache_cpu_percent=100),
    'cpu_attention_cache_host': Policy(gpu_batch_size=4, cache_gpu_percent=0,
                                       cache_cpu_percent=100, cpu_attention=True),
    # two GPU batches overlapping: each attends over its live host cache rows (read in place)
    # while the other's steps run and write theirs
    'cpu_attention_2x2_cache_host': Policy(gpu_batch_size=2, num_gpu_batches=2,
                                           cache_gpu_percent=0, cache_cpu_percent=100,
                                           cpu_attention=True),
    'cpu_attention_cache_split': Policy(gpu_batch_size=4, cache_gpu_percent=25,
                                        cache_cpu_percent=25, cpu_attention=True),
    'no_overlap_all_split': Policy(gpu_batch_size=2, num_gpu_batches=2, w_gpu_percent=20,
                                   w_cpu_percent=30, cache_gpu_percent=50, cache_cpu_percent=0,
                                   act_gpu_percent=50, act_cpu_percent=0, overlap=False),
    'everything_off_device': Policy(gpu_batch_size=2, num_gpu_batches=2, w_gpu_percent=0,
                                    w_cpu_percent=50, cache_gpu_percent=0, cache_cpu_percent=50,
                                    act_gpu_percent=0, act_cpu_percent=50, cpu_attention=True),
}


@pytest.fixture(scope='module')
def reference(pre_ln):
  with Engine(Checkpoint(pre_ln.ckpt_dir), policy=Policy(gpu_batch_size=4)) as engine:
    return engine.generate(PROMPTS, GEN, return_logits=True)


@pytest.mark.parametrize('name', list(POLICIES))
def test_placement_reproduces_the_all_device_run(pre_ln, reference, tmp_path, name):
  with Engine(Checkpoint(pre_ln.ckpt_dir), policy=POLICIES[name],
              offload_dir=str(tmp_path)) as engine:
    result = engine.generate(PROMPTS, GEN, return_logits=True)
  np.testing.assert_array_equal(result.tokens, reference.tokens)
  np.testing.assert_allclose(result.logits, reference.logits, atol=1e-5, rtol=0)
  if same_products(POLICIES[name]):  # lossless, float32: the very same values
    np.testing.assert_array_equal(result.logits, reference.logits)
  for tier, peak in result.peak_bytes.items():
    assert peak <= result.planned_peak_bytes[tier], (tier, peak, result.planned_peak_bytes)
  assert (result.breakdown is None) is POLICIES[name].overlap  # parts overlap: no breakdown
  assert list(tmp_path.iterdir()) == []


def same_products(policy: Policy) -> bool:
  """Whether a placement computes the reference's products at the reference's shapes (one GPU
  batch of 4; attention in the layer step, not a program of its own on the CPU backend): then
  where its weights, cache and hidden states lie changes no value."""
  return (policy.gpu_batch_size, policy.num_gpu_batches) == (4, 1) and not policy.cpu_attention


def test_breakdown_without_overlap_charges_each_part(pre_ln, tmp_path):
  """Seconds per part add up to no more than the phase; offloaded parts take time, parts with
  nothing offloaded take none."""
  policy = dataclasses.replace(POLICIES['everything_off_device'], overlap=False)
  with Engine(Checkpoint(pre_ln.ckpt_dir), policy=policy, offload_dir=str(tmp_path)) as engine:
    split = engine.generate(PROMPTS, GEN).breakdown
    resident = engine.generate(PROMPTS, GEN, policy=dataclasses.replace(
        policy, cache_gpu_percent=100, cache_cpu_percent=0, act_gpu_percent=100,
        act_cpu_percent=0)).breakdown
  for phase in ('prefill', 'decode'):
    parts = split[phase]
    assert sum(parts[p] for p in BREAKDOWN_PARTS) <= parts['total'] * 1.001
    assert min(parts[p] for p in ('compute', 'weight_read', 'hidden_read', 'hidden_write')) > 0
  assert split['decode']['cache_read'] > 0 and split['prefill']['cache_read'] == 0
  assert resident['decode']['cache_read'] == 0 and resident['decode']['hidden_read'] < (
      split['decode']['hidden_read'])


def test_post_ln_model_with_everything_split(tiny, tmp_path):
  policy = Policy(gpu_batch_size=2, num_gpu_batches=2, w_gpu_percent=30, w_cpu_percent=30,
                  cache_gpu_percent=50, cache_cpu_percent=0, act_gpu_percent=50,
                  act_cpu_percent=25, cpu_attention=True)
  with Engine(Checkpoint(tiny.ckpt_dir), policy=Policy(gpu_batch_size=4)) as engine:
    want = engine.generate(PROMPTS, GEN, return_logits=True)
  with Engine(Checkpoint(tiny.ckpt_dir), policy=policy, offload_dir=str(tmp_path)) as engine:
    got = engine.generate(PROMPTS, GEN, return_logits=True)
  np.testing.assert_array_equal(got.tokens, want.tokens)
  np.testing.assert_allclose(got.logits, want.logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize('gpu_batch_size,num_gpu_batches', [(2, 2), (1, 4), (2, 1)])
def test_weights_load_once_per_stage_per_token_per_block(pre_ln, gpu_batch_size,
                                                         num_gpu_batches):
  policy = Policy(gpu_batch_size=gpu_batch_size, num_gpu_batches=num_gpu_batches,
                  w_gpu_percent=0, w_cpu_percent=100)
  blocks = len(PROMPTS) // policy.block_size
  with Engine(Checkpoint(pre_ln.ckpt_dir), policy=policy) as engine:
    result = engine.generate(PROMPTS, GenerationConfig(gen_len=5, stop_at_eos=False))
  assert set(result.weight_loads.values()) == {5 * blocks}
  assert len(result.weight_loads) == 2 + 2  # embed, two layers, head


@pytest.mark.parametrize('weights,compress,in_parts', [
    ('float16', False, True), ('float32', False, False), ('float16', True, False)],
    ids=['cast_by_the_step', 'computed_as_stored', 'packed'])
def test_a_split_matrix_reaches_its_step_in_parts_only_where_the_step_casts_it(
    monkeypatch, weights, compress, in_parts):
  """float32 compute: float16 weights are cast a tile at a time, so a matrix split across tiers
  reaches its step as its row parts; float32 ones (and packed ones, dequantized as they load)
  are one product of the whole matrix, so each load joins them and the step gets it whole.
  Either way the run is the all-device run's, bit for bit."""
  from flexjax.config import ModelConfig
  from flexjax.mover import Mover
  from flexjax.weights import DummyWeights
  trees = []
  real = Mover.load_weights

  def recorded(self, index, *args, **kw):
    loaded = real(self, index, *args, **kw)
    trees.append((self.stage_names[index], loaded.params))
    return loaded
  monkeypatch.setattr(Mover, 'load_weights', recorded)
  cfg = ModelConfig(name='parts', num_layers=2, hidden_size=64, num_heads=2, ffn_dim=256,
                    vocab_size=512, max_positions=32)
  prompts = [[1, 5, 7], [1, 9, 2], [1, 3, 3], [1, 4, 4]]
  gen = GenerationConfig(gen_len=3, stop_at_eos=False)
  runs = []
  for placement in (dict(w_gpu_percent=100, w_cpu_percent=0),
                    dict(w_gpu_percent=30, w_cpu_percent=40)):
    policy = Policy(gpu_batch_size=4, compress_weight=compress, **placement)
    with Engine(DummyWeights(cfg, weights), policy=policy) as engine:
      runs.append(engine.generate(prompts, gen, return_logits=True))
  np.testing.assert_array_equal(runs[1].logits, runs[0].logits)
  split = {(stage, '/'.join(path)) for stage, tree in trees
           for path, value in _leaves(tree) if isinstance(value, tuple)}
  matrices = {name for name in split if not name[0] == 'embed'}
  assert bool(matrices) is in_parts, split
  assert any(stage == 'embed' for stage, _ in split), split  # ids gathered from its parts


def _leaves(tree, path=()):
  """(path, value) of a nested dict's leaves; a tuple (a tensor's row parts) is one leaf."""
  if isinstance(tree, dict):
    for key, value in tree.items():
      yield from _leaves(value, (*path, key))
  else:
    yield path, tree


@pytest.mark.parametrize('compress', [False, True], ids=['as_stored', 'packed'])
def test_disk_weights_are_staged_within_the_plan(pre_ln, compress):
  # Two GPU batches, two steps in flight, the next stage loading and the one after read ahead.
  # Packed stages give their staging buffer back once dequantized; an unpacked stage's device
  # arrays are its buffer (a CPU backend), which the plan counts as the stage's loaded weights.
  policy = Policy(gpu_batch_size=2, num_gpu_batches=2, w_gpu_percent=0, w_cpu_percent=0,
                  compress_weight=compress)
  with Engine(Checkpoint(pre_ln.ckpt_dir), policy=policy) as engine:
    result = engine.generate(PROMPTS, GEN)
  plan = result.plan
  assert plan.shape.read_ahead and plan.capacity('weights.staging') > 0
  allowed = plan.capacity('weights.staging') + (0 if compress else (
      plan.capacity('weights.loaded') + plan.capacity('weights.staging_align')))
  assert 0 < result.staging_bytes <= allowed, (result.staging_bytes, allowed)


def test_an_engine_refuses_an_offload_folder_it_cannot_write(pre_ln, tmp_path):
  blocker = tmp_path / 'file'
  blocker.write_text('')
  with pytest.raises(FlexjaxError, match=r"^offload_dir='.*' cannot be written \('.*file' is a "):
    Engine(Checkpoint(pre_ln.ckpt_dir), offload_dir=str(blocker / 'offload'))
  assert [p.name for p in tmp_path.iterdir()] == ['file']


def test_too_small_budget_is_refused_before_allocating(pre_ln, tmp_path):
  with pytest.raises(FlexjaxError, match=r'needs [\d.]+ [KM]iB on the device tier but --gpu_mem '
                                         r'allows 9.77 KiB \(short by'):
    Engine(Checkpoint(pre_ln.ckpt_dir), budgets={'device': 10_000}, offload_dir=str(tmp_path))
  assert list(tmp_path.iterdir()) == []
  # the weights fit, the KV cache of a large batch does not: refused at generate, before caches
  policy = Policy(gpu_batch_size=64)
  with Engine(Checkpoint(pre_ln.ckpt_dir), policy=policy, budgets={'device': 2_000_000}) as engine:
    before = dict(engine.storage.peaks())
    with pytest.raises(FlexjaxError, match=r'on the device tier .*largest: .*cache\.device'):
      engine.generate(PROMPTS * 16, GEN)
    assert engine.storage.peaks() == before


def test_disk_weights_are_read_in_place_and_the_offload_dir_is_removed(pre_ln, tmp_path):
  policy = Policy(gpu_batch_size=4, w_gpu_percent=0, w_cpu_percent=0, cache_gpu_percent=0,
                  cache_cpu_percent=0)
  offload = tmp_path / 'offload'
  with pytest.raises(RuntimeError, match='stop here'):
    with Engine(Checkpoint(pre_ln.ckpt_dir), policy=policy, offload_dir=str(offload)) as engine:
      assert not offload.exists()  # placing disk weights copies nothing
      engine.generate(PROMPTS, GenerationConfig(gen_len=3))
      assert len(list(offload.iterdir())) == 1  # the run folder with the KV cache files
      raise RuntimeError('stop here')
  assert list(offload.iterdir()) == []


def test_offload_dir_is_removed_after_sigint(tmp_path):
  offload = tmp_path / 'offload'
  env = dict(os.environ, JAX_PLATFORMS='cpu', FLEXJAX_CACHE=str(tmp_path / 'cache'))
  cmd = [sys.executable, '-m', 'flexjax.main', '--model=opt-125m', '--w_gpu_percent=0',
         '--w_cpu_percent=0', '--cache_gpu_percent=0', '--cache_cpu_percent=0',
         f'--offload_dir={offload}', '--prompt_len=64', '--gen_len=400', '--gpu_batch_size=2']
  proc = subprocess.Popen(
      interruptible(cmd), env=env, cwd=Path(__file__).resolve().parents[1],
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  deadline = time.time() + 120
  while time.time() < deadline and not (offload.is_dir() and any(offload.iterdir())):
    assert proc.poll() is None, proc.communicate()[1]
    time.sleep(0.2)
  assert offload.is_dir() and any(offload.iterdir()), 'the run never created its offload folder'
  time.sleep(2)
  proc.send_signal(signal.SIGINT)
  proc.communicate(timeout=120)
  assert proc.returncode != 0
  assert list(offload.iterdir()) == []


def test_policy_validation():
  with pytest.raises(FlexjaxError, match='w_gpu_percent=70 \\+ w_cpu_percent=40 exceed 100'):
    Policy(w_gpu_percent=70, w_cpu_percent=40)
  with pytest.raises(FlexjaxError, match='num_gpu_batches=0'):
    Policy(num_gpu_batches=0)
  assert Policy(gpu_batch_size=4, cache_gpu_percent=25, cache_cpu_percent=50).rows('cache') == {
      'device': 1, 'host': 2, 'disk': 1}


def test_buffer_pool_reuses_a_buffer_of_its_size_once_its_users_are_ready():
  """A weight buffer a CPU backend computes on goes back to its pool with the outputs of the
  steps using it: it is handed out again only once those exist, and only for its own size."""
  import jax
  import jax.numpy as jnp

  from flexjax.mover import BufferPool

  # a step still computing: dispatched asynchronously, ready a few tenths of a second later
  busy = jax.jit(lambda x: jax.lax.fori_loop(0, 4, lambda _, y: jnp.tanh(y @ x), x))
  x = jnp.full((2048, 2048), 1e-3, jnp.float32)
  busy(x).block_until_ready()  # compiled
  pool = BufferPool()
  first = pool.take(8192)
  assert first.ctypes.data % 4096 == 0 and first.nbytes == 8192
  user = busy(x)
  pool.give_back(first, after=[user])
  while_running = pool.take(8192)
  assert not user.is_ready()
  assert while_running.ctypes.data != first.ctypes.data
  user.block_until_ready()
  assert pool.take(4096).ctypes.data != first.ctypes.data
  assert pool.take(8192).ctypes.data == first.ctypes.data


def test_buffer_pool_keeps_free_buffers_only_within_its_limit():
  """Free buffers of other sizes go back to the kernel, oldest first, before the pool's buffers
  (in use or free) would exceed its limit: the plan's joins of the stages loaded at once."""
  from flexjax.mover import BufferPool

  pool = BufferPool(limit=3 * 4096)
  big, small = pool.take(2 * 4096), pool.take(4096)
  pool.give_back(small)
  assert pool.take(4096) is small  # reused: its size, nothing waited for
  pool.give_back(small)
  pool.take(2 * 4096)  # with `big` in use, keeping the free small one would exceed the limit
  assert pool.take(4096) is not small  # dropped (still referenced here, so not reallocated)
  assert big.nbytes == 2 * 4096


def test_a_fresh_pool_buffer_has_every_page_backed_before_it_is_read_into():
  """A buffer the pool makes (diskio.aligned_buffer) is backed page by page as it is made, so
  direct reads into it never fault pages in: filling it faults in a small share of what filling
  a buffer left to its first use does (the kernel's count of this thread's page faults)."""
  import numpy as np
  import resource

  from flexjax import diskio
  from flexjax.mover import BufferPool

  def faults_to_fill(buffer) -> int:
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    buffer.fill(1)
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before

  nbytes = 64 << 20
  left = faults_to_fill(np.empty(nbytes, np.uint8))
  for pooled in (faults_to_fill(BufferPool().take(nbytes)),
                 faults_to_fill(diskio.aligned_buffer(nbytes))):
    assert left >= 16 and pooled * 4 < left, (pooled, left)


def test_decode_reads_the_cache_into_a_few_reused_buffers(pre_ln, reference, tmp_path,
                                                         monkeypatch):
  """A run with its cache on disk reads every decode step's K and V rows into buffers of the
  cache staging pool: no more of them than the steps whose inputs are alive at once hold (two
  each: K and V), each handed out again and again, and the tokens are the all-device run's."""
  from flexjax import mover as mover_lib

  handed_out = []
  take = mover_lib.CacheStaging.take
  monkeypatch.setattr(mover_lib.CacheStaging, 'take',
                      lambda self, *a: handed_out.append(take(self, *a)) or handed_out[-1])
  policy = Policy(gpu_batch_size=4, cache_gpu_percent=25, cache_cpu_percent=0)
  with Engine(Checkpoint(pre_ln.ckpt_dir), policy=policy, offload_dir=tmp_path) as engine:
    out = engine.generate(PROMPTS, GEN)
  np.testing.assert_array_equal(out.tokens, reference.tokens)
  layers = pre_ln.torch_model.config.num_hidden_layers
  blocks = -(-len(PROMPTS) // policy.block_size)  # a pool per block (its Mover)
  distinct = {buffer.ctypes.data for buffer, _ in handed_out}
  alive = 3  # the plan's inputs_alive with overlap: two steps in flight, one loading
  assert len(handed_out) == blocks * 2 * (GEN.gen_len - 1) * layers
  assert len(distinct) <= blocks * 2 * alive
  reused = [zeros_from for _, zeros_from in handed_out if zeros_from is not None]
  assert len(reused) == len(handed_out) - len(distinct) > 0


def _bytes_read() -> int:
  """Bytes this process has read through read calls, as the kernel counts them."""
  with open('/proc/self/io') as f:
    return next(int(line.split()[1]) for line in f if line.startswith('rchar:'))


def test_embedding_reads_only_the_rows_it_looks_up_from_disk(pre_ln, reference, tmp_path):
  """With the token table on disk, each embedding step reads the rows its ids look up, not the
  table (the head still reads its copy whole): per pass the kernel counts about a table's bytes
  fewer than for a GPU batch so large (32 x 50 ids > 1000 rows) that a step loads it whole."""
  gen = GenerationConfig(gen_len=6, stop_at_eos=False)
  read = {}
  for name, rows in (('rows', 4), ('whole', 32), ('rows', 4)):
    policy = dataclasses.replace(POLICIES['weights_on_disk'], gpu_batch_size=rows)
    with Engine(Checkpoint(pre_ln.ckpt_dir), policy=policy, offload_dir=str(tmp_path)) as engine:
      table = engine.config.vocab_size * engine.config.hidden_size * np.dtype(
          engine.weight_dtype).itemsize
      before = _bytes_read()
      result = engine.generate(PROMPTS, gen, pad_to=50, return_logits=True)
      read[name] = _bytes_read() - before
    np.testing.assert_array_equal(result.tokens, reference.tokens)
  # the gathers read a few 4 KiB blocks per step (of a 250 KiB table here)
  assert read['whole'] - read['rows'] >= 0.75 * gen.gen_len * table
