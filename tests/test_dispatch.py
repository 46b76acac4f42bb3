"""What a run dispatches, seen by JAX itself: XLA executions per decoder layer per decode step
(counted by jax's profiler: at most three in every placement, one where every cache row is on the
device), and no compilation once the run is planned (the plan's compile is the warm-up)."""

import contextlib
import tempfile
from pathlib import Path

import jax
import numpy as np
import pytest
from jax import monitoring

from flexjax.config import ModelConfig
from flexjax.engine import Engine, GenerationConfig
from flexjax.policy import Policy
from flexjax.weights import DummyWeights

# The PjRt client's span for one launch of a compiled executable on one device (XLA:CPU's
# runtime; every jit call, primitive and AOT-compiled call goes through it).
EXECUTE_EVENT = 'CommonPjRtLoadedExecutable::ExecuteHelperOnSingleDevice'

BATCHES, ROWS = 2, 4
SPLIT = dict(cache_gpu_percent=50, cache_cpu_percent=50)  # 2 device rows, 2 host rows per batch
VARIANTS = {
    # name: (policy fields, most executions per layer per decode step of one GPU batch)
    'all_device': (dict(), 1),
    'offloaded_rows_device_attention': (SPLIT, 1),
    'offloaded_rows_on_disk': (dict(cache_gpu_percent=50, cache_cpu_percent=0), 1),
    'cpu_attention': (dict(SPLIT, cpu_attention=True), 3),
    'cpu_attention_all_offloaded': (dict(cache_gpu_percent=0, cache_cpu_percent=100,
                                         cpu_attention=True), 3),
    'compressed_cache_all_device': (dict(compress_cache=True), 1),
    'compressed_cache_offloaded': (dict(SPLIT, compress_cache=True), 1),
    'compressed_cache_cpu_attention': (dict(SPLIT, compress_cache=True, cpu_attention=True), 3),
    'sparse_all_device': (dict(attn_sparsity=0.5), 1),
    'sparse_offloaded': (dict(SPLIT, attn_sparsity=0.5), 2),
    'sparse_cpu_attention': (dict(SPLIT, attn_sparsity=0.5, cpu_attention=True), 3),
    'sparse_compressed_cpu_attention': (dict(SPLIT, attn_sparsity=0.5, compress_cache=True,
                                             cpu_attention=True), 3),
}


def count_executions(fn) -> int:
  """Executable launches while fn() runs, read from a jax.profiler trace."""
  options = jax.profiler.ProfileOptions()
  options.host_tracer_level = 3  # the runtime's own spans (launches included)
  options.python_tracer_level = 0
  with tempfile.TemporaryDirectory() as folder:
    with jax.profiler.trace(folder, profiler_options=options):
      fn()
    path, = Path(folder).rglob('*.xplane.pb')
    data = jax.profiler.ProfileData.from_file(str(path))
  return sum(event.name == EXECUTE_EVENT for plane in data.planes for line in plane.lines
             for event in line.events)


def test_the_counter_sees_each_launch():
  f = jax.jit(lambda x: x * 2)
  x = jax.device_put(np.ones(4, np.float32))
  f(x).block_until_ready()
  assert count_executions(lambda: [f(x).block_until_ready() for _ in range(3)]) == 3


def tiny_config(num_layers: int) -> ModelConfig:
  return ModelConfig(name=f'dispatch-{num_layers}', num_layers=num_layers, hidden_size=64,
                     num_heads=4, ffn_dim=128, vocab_size=512, max_positions=64)


def executions_per_layer_step(policy: Policy, *, layers=(2, 4), stops=(1, 3)) -> float:
  """Launches per decoder layer per decode step per GPU batch, from whole runs of models of two
  depths, each stopped after two numbers of decode steps (forced EOS tokens; the same shapes, so
  the same compiled steps): prefill, embedding, head and sampling cancel out."""
  prompts = [[2] + list(range(10, 10 + n)) for n in (6, 3, 5, 2, 7, 4, 6, 1)]
  gen = GenerationConfig(gen_len=max(stops) + 1)
  counts = {}
  for num_layers in layers:
    with Engine(DummyWeights(tiny_config(num_layers), 'float32'), policy=policy) as engine:
      for stop in stops:
        forced = np.full((len(prompts), gen.gen_len), 5, np.int32)
        forced[:, stop] = engine.config.eos_token_id  # decode steps 1 .. stop run
        run = lambda: engine.generate(prompts, gen, forced_tokens=forced)
        counts[num_layers, stop] = count_executions(run)
  (l1, l2), (s1, s2) = layers, stops
  extra = counts[l2, s2] - counts[l2, s1] - counts[l1, s2] + counts[l1, s1]
  return extra / ((l2 - l1) * (s2 - s1) * policy.num_gpu_batches)


# run with -m slow: CPU attention over a compressed or a sparse cache, each of which
# sparse_compressed_cpu_attention runs too
SLOW_VARIANTS = ('compressed_cache_cpu_attention', 'sparse_cpu_attention')


@pytest.mark.parametrize('name', [pytest.param(name, marks=pytest.mark.slow)
                                  if name in SLOW_VARIANTS else name for name in VARIANTS])
def test_decode_executions_per_layer(name):
  fields, most = VARIANTS[name]
  policy = Policy(gpu_batch_size=ROWS, num_gpu_batches=BATCHES, **fields)
  per_layer = executions_per_layer_step(policy)
  print(f'{name}: {per_layer:g} executions per layer per decode step')
  assert per_layer <= most


# jax's events for one executable built: an XLA compilation (recorded by jax's dispatch for jit
# calls and AOT alike), or one loaded from the persistent compilation cache instead.
COMPILE_EVENT = '/jax/core/compile/backend_compile_duration'
CACHE_HIT_EVENT = '/jax/compilation_cache/cache_hits'


@contextlib.contextmanager
def executables_built():
  """The list of executables jax builds (compiles or loads from its cache) within: (event,
  the function's name for a compilation, jax's 'jit(name)')."""
  built = []
  on_compile = lambda event, seconds, **kw: (
      built.append((event, kw.get('fun_name'))) if event == COMPILE_EVENT else None)
  on_event = lambda event, **kw: built.append((event, None)) if event == CACHE_HIT_EVENT else None
  monitoring.register_event_duration_secs_listener(on_compile)
  monitoring.register_event_listener(on_event)
  try:
    yield built
  finally:
    monitoring.unregister_event_duration_listener(on_compile)
    monitoring.unregister_event_listener(on_event)

COMPILED_POLICIES = {
    'all_device': Policy(gpu_batch_size=4, num_gpu_batches=2),
    'weights_host_cache_split': Policy(gpu_batch_size=4, num_gpu_batches=2, w_gpu_percent=0,
                                       w_cpu_percent=100, **SPLIT),
    'sparse_offloaded': Policy(gpu_batch_size=4, num_gpu_batches=2, attn_sparsity=0.5, **SPLIT),
    'cpu_attention_sparse_compressed': Policy(
        gpu_batch_size=4, num_gpu_batches=2, cache_gpu_percent=50, cache_cpu_percent=25,
        cpu_attention=True, attn_sparsity=0.5, compress_cache=True, compress_weight=True),
}


# run with -m slow: sparse attention over a split cache (cpu_attention_sparse_compressed
# compiles sparse steps, weights_host_cache_split those of a split cache)
SLOW_COMPILED = ('sparse_offloaded',)


@pytest.mark.parametrize('index,name', [
    pytest.param(i, name, marks=pytest.mark.slow) if name in SLOW_COMPILED else (i, name)
    for i, name in enumerate(COMPILED_POLICIES)])
def test_after_the_warm_up_a_run_compiles_nothing(index, name, tmp_path):
  """generate()'s warm-up (plan.Planner.compile_run: the plan's compiles and the few it lacks)
  leaves nothing for the run to compile; a model of its own shape, so no earlier test compiled
  these steps (two of them keeping log-probabilities: the tokens', and the top three's of
  forced tokens, which the head step takes as an input)."""
  cfg = ModelConfig(name=f'compiles-{index}', num_layers=2, hidden_size=48 + 16 * index,
                    num_heads=4, ffn_dim=96, vocab_size=300 + index, max_positions=64)
  prompts = [[2] + list(range(10, 10 + n)) for n in (6, 3, 5, 2, 7, 4, 6, 1)]
  asked = {1: dict(logprobs=True), 3: dict(top_logprobs=3)}.get(index, {})
  gen = GenerationConfig(gen_len=4, temperature=0.7, top_p=0.9, stop_at_eos=False, **asked)
  with Engine(DummyWeights(cfg, 'float32'), policy=COMPILED_POLICIES[name],
              offload_dir=str(tmp_path)) as engine:
    forced = (np.arange(len(prompts) * gen.gen_len, dtype=np.int32).reshape(len(prompts), -1)
              if index == 3 else None)
    engine.planner.compile_run(engine.policy, prompt_len=max(map(len, prompts)),
                               gen_len=gen.gen_len,
                               **gen.head_args(forced=forced is not None))  # as generate()
    with executables_built() as compiles:
      engine.generate(prompts, gen, forced_tokens=forced)
  assert compiles == []


def test_plans_after_the_search_compile_nothing_and_the_warm_up_compiles_again(tmp_path):
  """The search frees the executables it compiled (plan.Planner.release_compiled) but keeps
  the bytes it measured: planning the chosen policy again compiles nothing; the run's warm-up
  compiles its steps again, and the run itself nothing."""
  from flexjax import plan as plan_lib
  cfg = ModelConfig(name='released', num_layers=2, hidden_size=112, num_heads=4, ffn_dim=96,
                    vocab_size=310, max_positions=64)
  prompts = [[2] + list(range(10, 10 + n)) for n in (6, 3, 5, 2, 7, 4, 6, 1)]
  gen = GenerationConfig(gen_len=4, stop_at_eos=False)
  policy = Policy(gpu_batch_size=4, num_gpu_batches=2)
  width = max(map(len, prompts))
  planner = plan_lib.Planner.for_device(cfg, jax.local_devices()[0], storage_dtype='float32',
                                        compute_dtype='float32')
  planned = planner.plan(policy, prompt_len=width, gen_len=gen.gen_len)
  planner.release_compiled()  # as the search ends
  with executables_built() as compiles:
    assert planner.plan(policy, prompt_len=width, gen_len=gen.gen_len) == planned
    assert compiles == []
    with Engine(DummyWeights(cfg, 'float32'), policy=policy, compute_dtype='float32',
                planner=planner, offload_dir=str(tmp_path)) as engine:
      engine.planner.compile_run(policy, prompt_len=width, gen_len=gen.gen_len)
      assert compiles, 'the warm-up found executables the planner had freed'
      compiles.clear()
      engine.generate(prompts, gen)
  assert compiles == []


def test_the_search_screens_the_batches_of_one_form_with_one_pair_of_compiles():
  """The search's screening (plan.Planner.xla with estimate) compiles two sequence counts per
  form of the prompt products, shared by every GPU batch of that form: after batch 8 at prompt
  128 (past linear.CAST_ALL_ROWS), batches 16 and 24 build no executable, neither compiled nor
  loaded from the session's compilation cache."""
  from flexjax import plan as plan_lib
  cfg = ModelConfig(name='screened', num_layers=2, hidden_size=80, num_heads=4, ffn_dim=96,
                    vocab_size=320, max_positions=160)
  planner = plan_lib.Planner.for_sizes(cfg, plan_lib.Itemsizes(2, 4, 4), device_is_host=True)
  for batch in (8, 16, 24):
    policy = Policy(gpu_batch_size=batch, num_gpu_batches=1, cache_gpu_percent=0,
                    cache_cpu_percent=100, cpu_attention=True)
    with executables_built() as built:
      planner.xla(policy, prompt_len=128, gen_len=4, estimate=True)
    assert (batch == 8) == bool(built), (batch, built)


def test_a_search_where_the_device_is_the_host_compiles_no_cpu_attention_step():
  """Where the device is the host, CPU attention costs what device attention does and its
  screened bytes are at least device attention's (search.search): a search whose device
  attention candidates fit compiles none of CPU attention's steps. A model of its own shape, so
  every step built is compiled here and named."""
  from flexjax import hardware
  from flexjax import plan as plan_lib
  from flexjax.search import search
  cfg = ModelConfig(name='searched-on-host', num_layers=2, hidden_size=88, num_heads=4,
                    ffn_dim=96, vocab_size=330, max_positions=64)
  hw = hardware.HardwareProfile(name='host', ctog_bw=10e9, gtoc_bw=10e9, dtoc_bw=1e9,
                                ctod_bw=1e9, mm_flops={1: 1e10, 4096: 1e11},
                                bmm_flops={1: 1e9, 4096: 1e10}, cpu_flops=1e10,
                                copies_share_compute=True)
  with executables_built() as built:
    found = search(cfg, hw, {'ram': 2**30, 'disk': 2**30}, prompt_len=16, gen_len=4,
                   sizes=plan_lib.Itemsizes(2, 4, 4), gpu_batch_sizes=(2, 4),
                   num_gpu_batches=(1, 2))
  names = {name for _, name in built}
  assert 'jit(decode_layer)' in names, built
  assert not names & {'jit(decode_front)', 'jit(decode_attend)', 'jit(decode_back)'}, names
  assert not found.policy.cpu_attention
