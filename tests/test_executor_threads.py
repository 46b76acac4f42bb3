"""Work already on the device is not handed to the engine's threads: a step whose inputs and a
stage whose weights are all on the device are looked up on the thread that dispatches the steps
(a handoff, and for weights a wait for the previous stage's outputs, is most of a small decode
step's time: tools/step_overhead.py); what is off the device still loads on its own threads."""

import threading

import jax
import pytest

from flexjax.config import ModelConfig
from flexjax.engine import Engine, GenerationConfig
from flexjax.mover import Mover
from flexjax.policy import Policy
from flexjax.weights import DummyWeights

ON_DEVICE = dict(w_gpu_percent=100, w_cpu_percent=0, cache_gpu_percent=100, cache_cpu_percent=0,
                 act_gpu_percent=100, act_cpu_percent=0)


def threads_used(monkeypatch, **placement) -> dict[str, set[str]]:
  """The threads that ran Mover.load_inputs and Mover.load_weights in a generation of 3 tokens
  with overlap (two GPU batches of two rows)."""
  seen: dict[str, set[str]] = {'load_inputs': set(), 'load_weights': set()}
  for name in seen:
    real = getattr(Mover, name)

    def recorded(self, *args, _real=real, _name=name, **kw):
      seen[_name].add(threading.current_thread().name.split('_')[0])
      return _real(self, *args, **kw)
    monkeypatch.setattr(Mover, name, recorded)
  cfg = ModelConfig(name='threads', num_layers=2, hidden_size=32, num_heads=2, ffn_dim=64,
                    vocab_size=128, max_positions=32)
  policy = Policy(gpu_batch_size=2, num_gpu_batches=2, **{**ON_DEVICE, **placement})
  with Engine(DummyWeights(cfg, 'float32'), policy=policy) as engine:
    engine.generate([[1, 5, 7], [1, 9, 2], [1, 3, 3], [1, 4, 4]],
                    GenerationConfig(gen_len=3, stop_at_eos=False))
  return seen


def test_all_on_the_device_nothing_is_handed_to_a_thread(monkeypatch):
  seen = threads_used(monkeypatch)
  assert seen == {'load_inputs': {'MainThread'}, 'load_weights': {'MainThread'}}


@pytest.mark.parametrize('placement, loader', [
    (dict(act_gpu_percent=0, act_cpu_percent=100), 'load_inputs'),
    (dict(cache_gpu_percent=0, cache_cpu_percent=100), 'load_inputs'),
    # a tensor split between the device and the host is joined when its stage loads
    (dict(w_gpu_percent=50, w_cpu_percent=50), 'load_weights'),
], ids=['hidden_on_host', 'cache_on_host', 'weights_split_device_host'])
def test_what_is_off_the_device_loads_on_its_thread(monkeypatch, placement, loader):
  seen = threads_used(monkeypatch, **placement)
  assert any(name.startswith('flexjax-') for name in seen[loader]), seen


def test_whole_host_tier_weights_on_a_cpu_backend_are_taken_where_they_lie(monkeypatch):
  """The steps take host-tier tensors as placed there (plan.used_in_place): no stage is
  handed to the weights thread."""
  if jax.default_backend() != 'cpu':
    pytest.skip('a CPU backend\'s behaviour')
  seen = threads_used(monkeypatch, w_gpu_percent=0, w_cpu_percent=100)
  assert seen['load_weights'] == {'MainThread'}, seen
