"""Host-tier weights in pinned host memory (jax memory kind 'pinned_host'): the runtime holds
them there, every placement that uses them reproduces the all-device run, and the choice is
validated before any work."""

import types

import jax
import numpy as np
import pytest

from conftest import PROMPTS
from flexjax import hardware
from flexjax.mover import value_bytes
from flexjax.checkpoint import Checkpoint
from flexjax.engine import Engine, GenerationConfig
from flexjax.errors import FlexjaxError
from flexjax.policy import Policy

GEN = GenerationConfig(gen_len=5, stop_at_eos=False)

POLICIES = {
    'weights_on_host': Policy(gpu_batch_size=4, w_gpu_percent=0, w_cpu_percent=100),
    'weights_split_3_ways': Policy(gpu_batch_size=2, num_gpu_batches=2, w_gpu_percent=30,
                                   w_cpu_percent=40),
    'weights_on_host_cpu_attention': Policy(gpu_batch_size=4, w_gpu_percent=0,
                                            w_cpu_percent=100, cache_gpu_percent=0,
                                            cache_cpu_percent=100, cpu_attention=True),
    # on an accelerator their write-back goes through pinned host memory (Storage.to_host)
    'cache_and_hidden_states_on_host': Policy(gpu_batch_size=2, num_gpu_batches=2,
                                              w_gpu_percent=50, w_cpu_percent=50,
                                              cache_gpu_percent=25, cache_cpu_percent=75,
                                              act_gpu_percent=0, act_cpu_percent=100),
}


def host_values(engine: Engine) -> list:
  """The stored arrays of every host-tier weight (or part) the engine placed."""
  return [value_bytes(value) for stage in engine._stages for slot, value in stage
          if slot.tier == 'host']


@pytest.fixture(scope='module')
def reference(pre_ln):
  with Engine(Checkpoint(pre_ln.ckpt_dir), policy=Policy(gpu_batch_size=4)) as engine:
    return engine.generate(PROMPTS, GEN, return_logits=True)


@pytest.mark.parametrize('name', list(POLICIES))
def test_pinned_host_weights_reproduce_the_all_device_run(pre_ln, reference, tmp_path, name):
  with Engine(Checkpoint(pre_ln.ckpt_dir), policy=POLICIES[name], host_memory='pinned',
              offload_dir=str(tmp_path)) as engine:
    held = host_values(engine)
    result = engine.generate(PROMPTS, GEN, return_logits=True)
  assert held and all(isinstance(v, jax.Array) for v in held)
  assert {v.sharding.memory_kind for v in held} == {'pinned_host'}  # what the runtime says
  np.testing.assert_array_equal(result.tokens, reference.tokens)
  np.testing.assert_allclose(result.logits, reference.logits, atol=1e-5, rtol=0)
  for tier, peak in result.peak_bytes.items():
    assert peak <= result.planned_peak_bytes[tier], (tier, peak, result.planned_peak_bytes)


def test_pinned_compressed_weights_match_the_pageable_run_exactly(pre_ln, tmp_path):
  """int4 weights on the host: the same packed bytes, dequantized on the device, either way."""
  policy = Policy(gpu_batch_size=4, w_gpu_percent=0, w_cpu_percent=100, compress_weight=True)
  results = {}
  for kind in ('pageable', 'pinned'):
    with Engine(Checkpoint(pre_ln.ckpt_dir), policy=policy, host_memory=kind,
                offload_dir=str(tmp_path), weights_cache=str(tmp_path / 'layouts')) as engine:
      held = host_values(engine)
      results[kind] = engine.generate(PROMPTS, GEN, return_logits=True)
    assert held
    if kind == 'pinned':
      assert {v.sharding.memory_kind for v in held} == {'pinned_host'}
    else:  # packed matrices stay buffers; the rest are device arrays over theirs
      assert any(isinstance(v, np.ndarray) for v in held)
      assert all(isinstance(v, np.ndarray) or v.sharding.memory_kind == 'device' for v in held)
  np.testing.assert_array_equal(results['pinned'].tokens, results['pageable'].tokens)
  np.testing.assert_array_equal(results['pinned'].logits, results['pageable'].logits)


def test_auto_keeps_numpy_buffers_on_the_cpu_backend(pre_ln):
  """Host and device share RAM on the CPU backend: a host-tier numpy buffer is the device
  array the steps take (plan.used_in_place), without the copy pinned memory would add."""
  if jax.default_backend() != 'cpu':
    pytest.skip('a CPU backend\'s behaviour; an accelerator keeps host-tier weights pinned')
  with Engine(Checkpoint(pre_ln.ckpt_dir), policy=POLICIES['weights_on_host']) as engine:
    assert engine.host_memory is None
    held = host_values(engine)
    loads = [slot for stage in engine._stages for slot, _ in stage if slot.tier == 'host']
  assert held and all(isinstance(v, jax.Array) and v.sharding.memory_kind == 'device'
                      for v in held)
  assert len(held) == len(loads)


def _device(platform: str, kinds: tuple[str, ...]):
  memories = [types.SimpleNamespace(kind=kind) for kind in kinds]
  return types.SimpleNamespace(platform=platform, addressable_memories=lambda: memories)


def test_host_memory_kind_by_device_and_request():
  gpu = _device('gpu', ('device', 'pinned_host', 'unpinned_host'))
  bare = _device('gpu', ('device',))
  cpu = jax.devices('cpu')[0]
  assert hardware.host_memory_kind(gpu) == 'pinned_host'
  assert hardware.host_memory_kind(gpu, 'pageable') is None
  assert hardware.host_memory_kind(bare) is None
  assert hardware.host_memory_kind(cpu) is None
  assert hardware.host_memory_kind(cpu, 'pinned') == 'pinned_host'
  with pytest.raises(FlexjaxError, match='offers no pinned host memory.*--host_memory=auto'):
    hardware.host_memory_kind(bare, 'pinned')
  with pytest.raises(FlexjaxError, match="host_memory='locked' is not one of auto"):
    hardware.host_memory_kind(gpu, 'locked')


def test_lm_eval_model_args_take_host_memory():
  pytest.importorskip('lm_eval')  # an optional extra: GPU machines' images may lack it
  from flexjax.evalharness import options_from_args
  options = options_from_args({'checkpoint': '/x', 'host_memory': 'pinned'})
  assert options.host_memory == 'pinned'
  with pytest.raises(FlexjaxError, match="host_memory='locked' is not one of"):
    options_from_args({'checkpoint': '/x', 'host_memory': 'locked'})
