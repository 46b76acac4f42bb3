"""Cost model and policy search: toy LPs with known optima, monotonicity, the paper's setting,
and the memory plan against what the runtime measures."""

import dataclasses

import pytest

from conftest import PROMPTS
from flexjax import cost_model
from flexjax import plan as plan_lib
from flexjax.checkpoint import Checkpoint
from flexjax.config import ModelConfig, preset
from flexjax.engine import Engine, GenerationConfig
from flexjax.errors import FlexjaxError
from flexjax.hardware import HardwareProfile, t4_profile
from flexjax.model import linear
from flexjax.policy import Policy
from flexjax.search import search, solve_placement

TINY = ModelConfig(name='tiny', num_layers=2, hidden_size=64, num_heads=4, ffn_dim=128,
                   vocab_size=1000, max_positions=128)
FP16 = plan_lib.Itemsizes(2, 2, 2)
FP32 = plan_lib.Itemsizes(4, 4, 4)
GIB = 2**30
T4_BUDGETS = {'device': 16 * 10**9, 'host': 208 * 10**9, 'disk': 1500 * 10**9}


def toy_hardware(**kw) -> HardwareProfile:
  base = dict(name='toy', ctog_bw=10e9, gtoc_bw=10e9, dtoc_bw=1e9, ctod_bw=1e9,
              mm_flops={1: 1e12, 4096: 1e13}, bmm_flops={1: 1e11, 4096: 1e12}, cpu_flops=1e10)
  return HardwareProfile(**(base | kw))


def test_everything_fits_gives_the_all_device_policy():
  found = search(TINY, toy_hardware(), {'device': 10 * GIB, 'host': 10 * GIB, 'disk': 10 * GIB},
                 prompt_len=16, gen_len=8, sizes=FP32, gpu_batch_sizes=(4,), num_gpu_batches=(1,))
  p = found.policy
  assert (p.w_gpu_percent, p.cache_gpu_percent, p.act_gpu_percent) == (100, 100, 100)


def test_tiny_device_moves_weights_off_it():
  planner = plan_lib.Planner.for_sizes(TINY, FP32, device_is_host=False)
  all_device = planner.plan(Policy(gpu_batch_size=1), prompt_len=16, gen_len=8).peaks()
  budget = all_device['device'] * 9 // 10
  found = search(TINY, toy_hardware(), {'device': budget, 'host': GIB, 'disk': GIB},
                 prompt_len=16, gen_len=8, sizes=FP32, gpu_batch_sizes=(1, 2, 4),
                 num_gpu_batches=(1, 2))
  assert found.policy.w_gpu_percent < 100
  assert found.planned_peak_bytes['device'] <= budget


def test_lp_prefers_the_faster_tier_for_weights():
  """With slow disk and room on the host, no weights go to disk. (Eight layers: offloading a
  share of the weights must free more than the two stages it then loads take.)"""
  deep = dataclasses.replace(TINY, num_layers=8, vocab_size=256)
  model = cost_model.build(deep, Policy(gpu_batch_size=4), toy_hardware(dtoc_bw=1e6), FP32,
                           prompt_len=16, gen_len=8)
  planner = plan_lib.Planner.for_sizes(deep, FP32, device_is_host=False)
  all_device = planner.plan(Policy(gpu_batch_size=4), prompt_len=16, gen_len=8).peaks()['device']
  x = solve_placement(model, {'device': all_device * 95 // 100, 'host': GIB, 'disk': GIB})
  assert x['wd'] == pytest.approx(0, abs=1e-6) and x['cd'] == pytest.approx(0, abs=1e-6)
  assert x['wg'] + x['cg'] + x['hg'] < 3 - 1e-6  # something left the device


@pytest.mark.slow  # two full opt-1.3b searches (~1 min); tests/test_suite.py holds fixed fields too
def test_fixed_percents_are_held_and_ties_go_to_the_faster_tier():
  """Compute-bound (prompt 128 on a 2-core CPU profile): where the weights live is hidden behind
  compute, so only the tie-break keeps them on the host rather than on disk."""
  cfg, cpu = preset('opt-1.3b'), HardwareProfile.load('configs/hw/cpu-2core.json')
  budgets = {'device': 6 * GIB, 'host': 1 * GIB, 'disk': 100 * GIB}
  free = search(cfg, cpu, budgets, prompt_len=128, gen_len=32, sizes=FP32, max_block_size=32)
  assert free.policy.w_gpu_percent > 0  # the device tier has room for weights
  held = search(cfg, cpu, budgets, prompt_len=128, gen_len=32, sizes=FP32, max_block_size=32,
                template=Policy(w_gpu_percent=0, cache_gpu_percent=100, cache_cpu_percent=0),
                fixed_percents=('w_gpu_percent', 'cache_gpu_percent', 'cache_cpu_percent'))
  p = held.policy
  assert (p.w_gpu_percent, p.cache_gpu_percent, p.cache_cpu_percent) == (0, 100, 0)
  assert p.w_cpu_percent > 0 and held.planned_peak_bytes['host'] <= budgets['host']
  with pytest.raises(FlexjaxError, match=r"\['gpu_batch_size'\]"):
    search(cfg, cpu, budgets, prompt_len=128, gen_len=32, sizes=FP32,
           fixed_percents=('gpu_batch_size',))


@pytest.mark.slow  # four full searches of opt-6.7b (~2 min); python -m pytest -m slow runs it
def test_more_memory_never_predicts_lower_throughput_beyond_the_tie():
  """Every placement that fits a smaller device fits a larger one, so the best prediction never
  falls; the policy taken may be up to TIE below it (within TIE, fewer and larger GPU batches
  win: over block shapes {8, 32, 64} x {1, 4, 8}, 64 x 1 at 14.146 tok/s is taken at 32 GiB
  where 8 x 1 at 14.191 is taken at 16 GiB and found again at 32)."""
  from flexjax.search import TIE
  cfg = preset('opt-6.7b')
  previous = 0.0
  for device_gib in (4, 8, 16, 32):
    found = search(cfg, t4_profile(), {'device': device_gib * GIB, 'host': 64 * GIB,
                                       'disk': 500 * GIB},
                   prompt_len=512, gen_len=32, sizes=FP16)
    assert found.prediction.throughput >= (1 - TIE) * previous, device_gib
    previous = found.prediction.throughput


# slow: tests/test_cli.py searches OPT-30B's paper setting through the command line, and plans
# the OPT-175B flagfile
@pytest.mark.slow
@pytest.mark.parametrize('name', ['opt-30b', 'opt-175b'])
def test_paper_setting_gives_feasible_policies(name):
  found = search(preset(name), t4_profile(), T4_BUDGETS, prompt_len=512, gen_len=32, sizes=FP16)
  assert found.prediction.throughput > 0
  for tier, budget in T4_BUDGETS.items():
    assert found.planned_peak_bytes[tier] <= budget


@pytest.mark.slow  # tests/test_cli.py runs the same search through the command line
def test_no_feasible_policy_names_the_short_tier():
  with pytest.raises(FlexjaxError, match=r'on the disk, [\d.]+ GiB more than its budget'):
    search(preset('opt-30b'), t4_profile(), {'device': 16 * GIB, 'host': 8 * GIB,
                                              'disk': 10 * GIB},
           prompt_len=512, gen_len=32, sizes=FP16)


def test_latency_limit_is_honoured():
  shapes = dict(gpu_batch_sizes=(1, 2, 4, 8, 16, 32), num_gpu_batches=(1, 2, 4))
  free = search(TINY, toy_hardware(), {'device': GIB, 'host': GIB, 'disk': GIB}, prompt_len=16,
                gen_len=8, sizes=FP32, **shapes)
  limit = (free.prediction.prefill_s + free.prediction.decode_s) / 4
  bounded = search(TINY, toy_hardware(), {'device': GIB, 'host': GIB, 'disk': GIB},
                   prompt_len=16, gen_len=8, sizes=FP32, max_block_seconds=limit, **shapes)
  assert bounded.prediction.prefill_s + bounded.prediction.decode_s <= limit


POLICIES = [
    Policy(gpu_batch_size=4),
    Policy(gpu_batch_size=4, w_gpu_percent=0, w_cpu_percent=100),
    Policy(gpu_batch_size=4, w_gpu_percent=50, w_cpu_percent=50, cache_gpu_percent=50,
           cache_cpu_percent=50),
    Policy(gpu_batch_size=2, num_gpu_batches=2, w_gpu_percent=0, w_cpu_percent=0,
           cache_gpu_percent=0, cache_cpu_percent=100),
    Policy(gpu_batch_size=4, cache_gpu_percent=0, cache_cpu_percent=100, cpu_attention=True),
    Policy(gpu_batch_size=2, num_gpu_batches=2, w_gpu_percent=20, w_cpu_percent=80,
           act_gpu_percent=0, act_cpu_percent=100, overlap=False),
]


@pytest.mark.parametrize('policy', POLICIES, ids=lambda p: p.describe().replace(' ', '_'))
def test_runtime_stays_in_the_plan_and_the_lp_reads_the_same_plan(pre_ln, tmp_path, policy):
  """The runtime draws every byte it holds from the plan's buffers (it would raise otherwise),
  and the LP's linear forms, evaluated at the policy's realised placement, agree with the plan
  of the policy: one memory model. (Real memory against the plan: tests/test_memcheck.py.)"""
  gen = GenerationConfig(gen_len=6, stop_at_eos=False)
  with Engine(Checkpoint(pre_ln.ckpt_dir), policy=policy, offload_dir=str(tmp_path)) as engine:
    result = engine.generate(PROMPTS, gen)
    for tier in ('device', 'host', 'disk'):
      assert result.peak_bytes[tier] <= result.planned_peak_bytes[tier]
    model = cost_model.build(engine.config, policy, t4_profile(), engine.sizes,
                             prompt_len=result.prompt_len, gen_len=6, planner=engine.planner)
  predicted = model.predict(cost_model.fractions(policy, engine.config)).peak_bytes
  for tier in ('device', 'host', 'disk', 'ram'):
    assert predicted[tier] == pytest.approx(result.planned_peak_bytes[tier], rel=0.15, abs=2**16)


def test_matmul_rate_never_drops_with_more_rows():
  """A dip in the measured table (a size that left the caches) does not make a larger batch
  look slower than a smaller one: it could run as products of the smaller size."""
  hw = toy_hardware(mm_flops={1: 1e10, 8: 8e10, 128: 2e11, 512: 1.5e11, 2048: 1.6e11})
  rates = [hw.matmul_flops(m) for m in (1, 4, 8, 64, 128, 300, 512, 1024, 2048, 8192)]
  assert rates == sorted(rates)
  assert hw.matmul_flops(8192) == 2e11 and hw.matmul_flops(8) == 8e10


def test_long_prompt_steps_are_charged_at_the_rate_of_the_products_their_family_runs(tmp_path):
  """Where a profile measured both, an OPT layer's long prompt step is charged at oneDNN's rate
  and a Llama layer's at XLA's own (linear.family_in_library); decode steps alike. The table
  survives the profile's file."""
  both = toy_hardware(mm_flops={1: 1e10, 2048: 1e11, 4096: 4e11}, xla_mm_flops={4096: 1e11})
  both.save(tmp_path / 'hw.json')
  assert HardwareProfile.load(tmp_path / 'hw.json') == both
  onednn = toy_hardware(mm_flops={1: 1e10, 2048: 1e11, 4096: 4e11})
  xla = toy_hardware(mm_flops={1: 1e10, 2048: 1e11, 4096: 1e11})
  # a product of fewer rows than oneDNN's runs XLA's, whatever the family
  assert both.matmul_flops(3000) == xla.matmul_flops(3000) < onednn.matmul_flops(3000)
  llama = ModelConfig(name='tiny-llama', family='llama', num_layers=2, hidden_size=64,
                      num_heads=4, num_kv_heads=2, ffn_dim=128, vocab_size=1000,
                      max_positions=64)
  policy = Policy(gpu_batch_size=256)
  for cfg, same, other in ((TINY, onednn, xla),
                           (llama, xla, onednn)):
    planner = plan_lib.Planner.for_sizes(cfg, FP32, device_is_host=False)  # compiles once
    times = {name: cost_model.predict(cfg, policy, hw, FP32, prompt_len=16, gen_len=2,
                                      planner=planner)
             for name, hw in (('both', both), ('same', same), ('other', other))}
    assert times['both'] == times['same'] != times['other'], (cfg.family, times)


def _cpu_model(disk_overlap: float, overlap: bool = True):
  hw = toy_hardware(copies_share_compute=True, disk_overlap=disk_overlap)
  policy = Policy(gpu_batch_size=4, w_gpu_percent=0, w_cpu_percent=0, overlap=overlap)
  model = cost_model.build(TINY, policy, hw, FP32, prompt_len=16, gen_len=8)
  return model, cost_model.fractions(policy, TINY)


def test_disk_overlap_on_a_cpu_device_adds_the_unhidden_share():
  """hidden = 1: a layer takes the longer of its disk reads and its compute; hidden = 0: both;
  in between, the longer plus the unhidden share of the shorter (the same without overlap)."""
  full, x = _cpu_model(1.0)
  compute = full.decode['compute'].value(x)
  disk = full.decode['dtoc'].value(x)
  assert disk > compute > 0  # all weights on disk: the read is the longer
  assert full.layer_time(full.decode, x) == pytest.approx(disk)
  none, _ = _cpu_model(0.0)
  assert none.layer_time(none.decode, x) == pytest.approx(disk + compute)
  part, _ = _cpu_model(0.75)
  assert part.layer_time(part.decode, x) == pytest.approx(disk + 0.25 * compute)
  serial, _ = _cpu_model(0.75, overlap=False)
  assert serial.layer_time(serial.decode, x) == pytest.approx(disk + compute)


def test_weights_on_a_cpu_device_cost_no_copy():
  """A CPU device takes host weight buffers as they are: loading host-tier weights adds no
  copy time there, while a GPU pays host -> device for every byte."""
  policy = Policy(gpu_batch_size=4, w_gpu_percent=0, w_cpu_percent=100)
  x = cost_model.fractions(policy, TINY)
  cpu = cost_model.build(TINY, policy, toy_hardware(copies_share_compute=True), FP32,
                         prompt_len=16, gen_len=8)
  gpu = cost_model.build(TINY, policy, toy_hardware(), FP32, prompt_len=16, gen_len=8)
  resident = cost_model.build(TINY, dataclasses.replace(policy, w_gpu_percent=100,
                                                        w_cpu_percent=0),
                              toy_hardware(copies_share_compute=True), FP32, prompt_len=16,
                              gen_len=8)
  xr = cost_model.fractions(dataclasses.replace(policy, w_gpu_percent=100, w_cpu_percent=0),
                            TINY)
  assert cpu.layer_time(cpu.decode, x) == pytest.approx(resident.layer_time(resident.decode, xr))
  assert gpu.decode['ctog'].value(x) > 0


def test_cpu_attention_on_a_cpu_device_runs_at_the_device_attention_rate():
  """On a CPU backend 'CPU attention' runs on the cores the device attention runs on: its cost
  follows the device's measured attention rate, not the profile's separate CPU rate (two
  measurements of one rate); on a GPU the CPU rate is what it costs."""
  policy = Policy(gpu_batch_size=4, w_gpu_percent=100, cache_gpu_percent=0,
                  cache_cpu_percent=100, cpu_attention=True)
  x = cost_model.fractions(policy, TINY)
  decode = lambda **hw: cost_model.build(TINY, policy, toy_hardware(**hw), FP32, prompt_len=16,
                                         gen_len=8).decode['compute'].value(x)
  cpu_slow, cpu_fast = (decode(cpu_flops=f, copies_share_compute=True) for f in (1e8, 1e12))
  assert cpu_slow == pytest.approx(cpu_fast)
  slower_device = decode(cpu_flops=1e12, copies_share_compute=True,
                         bmm_flops={1: 1e9, 4096: 1e10})
  assert slower_device > 2 * cpu_fast
  gpu_slow, gpu_fast = (decode(cpu_flops=f) for f in (1e8, 1e12))
  assert gpu_slow > 10 * gpu_fast


def test_step_overhead_is_charged_per_gpu_batch_and_stage():
  """The engine's measured time per stage step is paid once per GPU batch on every decoder layer
  and on the embedding and head stages, for the prompt and for each generated token."""
  policy = Policy(gpu_batch_size=4, num_gpu_batches=3, w_gpu_percent=100, overlap=False)
  x = cost_model.fractions(policy, TINY)
  kw = dict(prompt_len=16, gen_len=8)
  bare = cost_model.build(TINY, policy, toy_hardware(), FP32, **kw).predict(x)
  slow = cost_model.build(TINY, policy, toy_hardware(step_overhead_s=1e-3), FP32,
                          **kw).predict(x)
  stages = TINY.num_layers + 2
  assert slow.prefill_s - bare.prefill_s == pytest.approx(3 * 1e-3 * stages)
  assert slow.decode_s - bare.decode_s == pytest.approx(3 * 1e-3 * stages * 7)


def test_near_ties_go_to_fewer_gpu_batches():
  """When decode is bound by the disk, every batch geometry of a block predicts about the same
  time: the search then takes the fewest GPU batches (one product per weight per step)."""
  hw = toy_hardware(copies_share_compute=True, dtoc_bw=1e7, mm_flops={1: 1e13, 4096: 1e13})
  budgets = {'device': 10 * GIB, 'host': 10 * GIB, 'disk': 10 * GIB}
  found = search(TINY, hw, budgets, prompt_len=16, gen_len=8, sizes=FP32,
                 gpu_batch_sizes=(2, 4, 8), num_gpu_batches=(1, 2, 4), max_block_size=8,
                 cpu_attention=(False,), template=Policy(w_gpu_percent=0, w_cpu_percent=0),
                 fixed_percents=('w_gpu_percent', 'w_cpu_percent'))
  assert found.policy.block_size == 8
  assert found.policy.num_gpu_batches == 1, found.policy.describe()


def test_ranking_takes_fewer_gpu_batches_within_the_tie_only():
  """Within TIE of the best prediction, fewer GPU batches win; beyond it, throughput does."""
  from flexjax.search import TIE, SearchResult, _ranked

  def result(gbs, ngb, tok_s):
    prediction = cost_model.Prediction(prefill_s=1.0, decode_s=1.0, throughput=tok_s,
                                       peak_bytes={})
    return SearchResult(Policy(gpu_batch_size=gbs, num_gpu_batches=ngb), prediction, {}, 0, 0.0)

  near = 1 - TIE / 2
  ranked = _ranked([result(2, 8, 10.0), result(16, 1, 10.0 * near), result(4, 4, 10.0 * near)])
  assert [r.policy.num_gpu_batches for r in ranked] == [1, 4, 8]
  far = 1 - 2 * TIE
  ranked = _ranked([result(2, 8, 10.0), result(16, 1, 10.0 * far)])
  assert [r.policy.num_gpu_batches for r in ranked] == [8, 1]


def test_a_known_number_of_sequences_bounds_the_block_and_ranks_by_their_tokens():
  """Five sequences: no block past the smallest that holds them all (8) is screened; blocks
  are ranked by the five's tokens (a last block's padding rows generate nothing)."""
  from flexjax.search import SearchResult, _ranked, useful_throughput
  grid = dict(gpu_batch_sizes=(2, 8, 16), num_gpu_batches=(1,), cpu_attention=(False,))
  budgets = {'device': 10 * GIB, 'host': 10 * GIB, 'disk': 10 * GIB}
  five = search(TINY, toy_hardware(), budgets, prompt_len=16, gen_len=8, sizes=FP32,
                num_sequences=5, **grid)
  assert five.policy.block_size <= 8 and five.candidates == 2  # 16 rows: not screened
  with pytest.raises(FlexjaxError, match='num_sequences=0'):
    search(TINY, toy_hardware(), budgets, prompt_len=16, gen_len=8, sizes=FP32,
           num_sequences=0, **grid)

  def result(gbs, tok_s):
    prediction = cost_model.Prediction(prefill_s=1.0, decode_s=1.0, throughput=tok_s,
                                       peak_bytes={})
    return SearchResult(Policy(gpu_batch_size=gbs), prediction, {}, 0, 0.0)

  four, two = result(4, 10.0), result(2, 9.0)
  assert useful_throughput(two, 3) == pytest.approx(9.0 * 3 / 4)  # two blocks, one pad row
  assert useful_throughput(four, None) == 10.0
  for n, first in ((3, four), (2, two), (None, four)):
    assert _ranked([two, four], lambda r: useful_throughput(r, n))[0] is first, n


def test_the_screenings_quick_compiles_report_the_bytes_of_a_runs_compiles():
  """The screening estimate compiles without LLVM's optimisation of the generated code
  (steps.QUICK_CPU_OPTIONS): XLA reports the same bytes as for the steps a run compiles, with
  device and CPU attention, compressed weights and cache, and prompt products of
  linear.LIBRARY_ROWS rows (oneDNN's scratch included)."""
  cfg = ModelConfig(name='mid', num_layers=1, hidden_size=128, num_heads=4, ffn_dim=256,
                    vocab_size=1000, max_positions=64)
  planner = plan_lib.Planner.for_sizes(cfg, plan_lib.Itemsizes(2, 4, 4), device_is_host=True)
  assert 8 * 512 >= linear.LIBRARY_ROWS
  for policy in (Policy(gpu_batch_size=8, cache_gpu_percent=0, cache_cpu_percent=100,
                        cpu_attention=True),
                 Policy(gpu_batch_size=8, w_gpu_percent=0, w_cpu_percent=100,
                        compress_weight=True, compress_cache=True)):
    kw = dict(rows=8, device_rows=policy.rows('cache')['device'],
              cpu_attention=policy.cpu_attention, prompt_len=512, gen_len=4)
    quick, full = planner.working(policy, quick=True, **kw), planner.working(policy, **kw)
    assert quick == full, policy.describe()
    assert full['prefill'].library > 0 and full['decode'].temp > 0


@pytest.mark.parametrize('batch,prompt_len', [(8, 512), (16, 128)])
def test_estimated_step_bytes_follow_the_compiled_ones_past_the_cast(batch, prompt_len):
  """A batch whose prompt products run against the whole cast matrix (linear.CAST_ALL_ROWS rows
  or more) while one sequence's run as tiles: the screening estimate stays near what XLA
  reports for the steps compiled at the batch's real shapes. A line through one and two
  sequences charged the cast matrix once per sequence (2.3x the compiled bytes for 8 x 512) or
  missed it (0.9x for 16 x 128)."""
  cfg = ModelConfig(name='wide', num_layers=1, hidden_size=1024, num_heads=16, ffn_dim=4096,
                    vocab_size=1000, max_positions=64)
  planner = plan_lib.Planner.for_sizes(cfg, plan_lib.Itemsizes(2, 4, 4), device_is_host=True)
  policy = Policy(gpu_batch_size=batch, num_gpu_batches=1)
  assert batch * prompt_len >= linear.CAST_ALL_ROWS > prompt_len
  compiled = planner.xla(policy, prompt_len=prompt_len, gen_len=4)['prefill_step']
  estimated = planner.xla(policy, prompt_len=prompt_len, gen_len=4, estimate=True)
  assert 0.95 * compiled <= estimated['prefill_step'] <= 1.25 * compiled


def test_a_searched_policy_fits_the_plan_of_the_runs_own_head_step():
  """The search plans every candidate with the run's head step (sampling with top-p sorts the
  vocabulary; the top log-probabilities): at a device budget where a policy searched with
  the greedy head leaves no room for it, the run's plan of the searched policy fits."""
  from pathlib import Path
  from flexjax.run import RunConfig, run
  profile = str(Path(__file__).resolve().parents[1] / 'configs' / 'hw' / 'cpu-2core.json')
  for extra in (dict(temperature=0.8, top_p=0.9), dict(top_logprobs=20)):
    report = run(RunConfig(model='opt-125m', policy_mode='auto', hw_profile=profile,
                           budgets={'device': int(0.35 * GIB), 'host': 4 * GIB, 'disk': None},
                           prompt_len=64, generation=GenerationConfig(gen_len=8, **extra),
                           dry_run=True, progress=False))
    assert report['fits'] is True, (extra, report)
    assert report['planned_device_peak_bytes'] <= int(0.35 * GIB)
