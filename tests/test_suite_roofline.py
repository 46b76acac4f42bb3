"""tools/roofline.py: the arithmetic on a hand-computed case, the rate probes on small sizes, and
the roofline the suite gives its records."""

import errno
import os

import pytest

from conftest import ROOFLINE_RATES as RATES
from flexjax import hardware
from flexjax import plan as plan_lib
from flexjax.config import ModelConfig
from flexjax.errors import FlexjaxError
from flexjax.policy import Policy
from tools import roofline, suite

# 2 layers, hidden 4, ffn 8, vocab 10: every number below is worked out by hand.
HAND = ModelConfig(name='hand', num_layers=2, hidden_size=4, num_heads=2, ffn_dim=8,
                   vocab_size=10, max_positions=16)


# ---- arithmetic ----------------------------------------------------------------------------------
def hand_work(**kw):
  return roofline.work(HAND, batch=2, prompt_len=3, gen_len=3,
                       weight_bytes={'disk_read': 100, 'host_device': 300},
                       kv_rows={'device': 0, 'host': 1, 'disk': 1}, kv_token_bytes=8, **kw)


def test_work_of_a_hand_computed_block():
  w = hand_work()
  # matmuls 2*(4*16 + 2*4*8) = 256 per token per layer; head 2*4*10 = 80 per sequence;
  # causal prefill attention 4*4*(3*4/2) = 96 per layer: 2 * (2*(3*256 + 96) + 80)
  assert w['prefill'].flops == 3616
  # decode steps attend 4 and 5 positions: 2 * (2*(2*256 + 80) + 2*4*4*9)
  assert w['decode'].flops == 2944
  # one token's K and V in both layers: 2*8*2 = 32 bytes; prefill writes 3 tokens per off-device
  # row; decode reads 3 + 4 cached positions and writes 2 tokens per off-device row
  # device memory: no device rows; the two off-device rows attend there in decode
  assert w['prefill'].bytes == {'disk_read': 100, 'disk_write': 96, 'host_device': 300 + 2 * 96,
                                'device_memory': 0}
  assert w['decode'].bytes == {'disk_read': 2 * 100 + 7 * 32, 'disk_write': 2 * 32,
                               'host_device': 2 * 300 + 2 * 2 * 32 + 2 * 7 * 32,
                               'device_memory': 2 * 7 * 32}


@pytest.mark.parametrize('name', ['gqa_4_2', 'mqa_6_1_tied'])
def test_a_llama_blocks_flops_are_its_transformers_models_products(name):
  """Every weight of a Llama layer's linear modules (q, k and v with grouped KV heads, o, gate,
  up, down) counted once per token, as the transformers model holds them."""
  import torch

  from conftest import make_hf_llama
  model = make_hf_llama(name)
  hf = model.config
  cfg = ModelConfig.from_hf_config(hf.to_dict())
  layer = sum(m.weight.numel() for m in model.model.layers[0].modules()
              if isinstance(m, torch.nn.Linear))
  q_dim = hf.num_attention_heads * (hf.hidden_size // hf.num_attention_heads)
  head = model.lm_head.weight.numel()
  batch, s, n, layers = 3, 5, 4, hf.num_hidden_layers
  w = roofline.work(cfg, batch=batch, prompt_len=s, gen_len=n, weight_bytes={},
                    kv_rows={'device': batch, 'host': 0, 'disk': 0}, kv_token_bytes=4)
  assert w['prefill'].flops == batch * (layers * (s * 2 * layer + 4 * q_dim * s * (s + 1) / 2)
                                        + 2 * head)
  attended = sum(s + j for j in range(1, n))
  assert w['decode'].flops == batch * ((n - 1) * (layers * 2 * layer + 2 * head)
                                       + layers * 4 * q_dim * attended)


def test_device_memory_bounds_a_small_batch_decode_on_an_accelerator():
  # everything on the device: one pass reads 500 weight bytes; decode reads 3 + 4 cached
  # positions of both rows (2 * 7 * 32) and writes their 2 new tokens (2 * 2 * 32)
  w = roofline.work(HAND, batch=2, prompt_len=3, gen_len=3,
                    weight_bytes={'disk_read': 0, 'host_device': 0, 'device_memory': 500},
                    kv_rows={'device': 2, 'host': 0, 'disk': 0}, kv_token_bytes=8)
  assert w['decode'].bytes['device_memory'] == 2 * 500 + 2 * 7 * 32 + 2 * 2 * 32
  assert w['prefill'].bytes['device_memory'] == 500 + 2 * 3 * 32
  gpu = {**RATES, 'device_memory_bw': 10.0}
  assert roofline.link_bandwidths(gpu)['device_memory'] == 10.0
  assert 'device_memory' not in roofline.link_bandwidths({**RATES, 'device_memory_bw': None})
  r = roofline.roofline(w, flops_rate=1000, bandwidths=roofline.link_bandwidths(gpu),
                        measured={'prefill': 1.0, 'decode': 200.0})
  assert r['decode']['bound'] == 'device_memory'
  assert r['decode']['roofline_s'] == pytest.approx((2 * 500 + 2 * 7 * 32 + 2 * 2 * 32) / 10)
  assert 'device memory: 0 GB/s' in roofline.format_rates({**gpu, 'device_memory_bw': 1e8})


def test_the_device_memory_probe_measures():
  assert roofline.device_memory_bandwidth(nbytes=2**22) > 0


def test_cpu_attention_keeps_the_offloaded_cache_off_the_device_link():
  w = hand_work(cpu_attention=True)
  assert w['decode'].bytes['host_device'] == 2 * 300 + 2 * 2 * 32  # writes only
  assert w['decode'].bytes['disk_read'] == 2 * 100 + 7 * 32  # the disk rows are still read


def test_roofline_takes_the_largest_term_per_phase_and_adds_the_phases():
  r = roofline.roofline(hand_work(), flops_rate=1000, bandwidths=roofline.link_bandwidths(RATES),
                        measured={'prefill': 7.232, 'decode': 8.48})
  assert r['prefill']['bound'] == 'compute' and r['prefill']['roofline_s'] == pytest.approx(3.616)
  assert r['prefill']['seconds']['disk_write'] == pytest.approx(96 / 50)
  assert r['decode']['bound'] == 'disk_read' and r['decode']['roofline_s'] == pytest.approx(4.24)
  assert r['prefill']['fraction'] == pytest.approx(0.5)
  assert r['decode']['fraction'] == pytest.approx(0.5)
  assert r['total'] == pytest.approx({'roofline_s': 7.856, 'measured_s': 15.712, 'fraction': 0.5})


def test_compute_rate_is_the_fastest_framework_and_names_a_missing_dtype():
  assert roofline.compute_rate(RATES, 'float32') == 1000
  with pytest.raises(FlexjaxError, match="dtype='bfloat16'.*--dtypes=bfloat16"):
    roofline.compute_rate(RATES, 'bfloat16')


def test_policy_weight_bytes_follow_the_tiers_with_the_token_embedding_once():
  sizes = plan_lib.Itemsizes(storage=2, compute=4, cache=4)
  tokens = HAND.vocab_size * HAND.embed_dim * 2
  stored = plan_lib.weight_totals(HAND, Policy(w_gpu_percent=0, w_cpu_percent=0), sizes).stored
  unique = sum(stored.values()) - tokens  # weight_totals keeps a copy per stage
  # the device reads every tensor in its memory, wherever it is kept
  assert roofline.policy_weight_bytes(HAND, Policy(w_gpu_percent=0, w_cpu_percent=0), sizes) == {
      'disk_read': unique, 'host_device': unique, 'device_memory': unique}
  assert roofline.policy_weight_bytes(HAND, Policy(w_gpu_percent=0, w_cpu_percent=100),
                                      sizes) == {'disk_read': 0, 'host_device': unique,
                                                 'device_memory': unique}
  assert roofline.policy_weight_bytes(HAND, Policy(), sizes) == {
      'disk_read': 0, 'host_device': 0, 'device_memory': unique}


def test_work_of_policy_counts_the_block_and_its_cache_rows():
  policy = Policy(gpu_batch_size=2, num_gpu_batches=2, w_gpu_percent=0, w_cpu_percent=100,
                  cache_gpu_percent=50, cache_cpu_percent=50)
  sizes = plan_lib.Itemsizes(storage=2, compute=4, cache=4)
  w = roofline.work_of_policy(HAND, policy, sizes, prompt_len=3, gen_len=3)
  assert w['prefill'].flops == 2 * 3616  # a block of 4 sequences
  kv_written = 2 * 3 * (2 * 16 * 2)  # 2 host rows x 3 tokens x (K and V, 16 bytes, 2 layers)
  weights = roofline.policy_weight_bytes(HAND, policy, sizes)['host_device']
  # the 2 device rows' K and V are written in device memory, where every weight is read
  assert w['prefill'].bytes == {'disk_read': 0, 'disk_write': 0,
                                'host_device': weights + kv_written,
                                'device_memory': weights + kv_written}


def test_work_of_accelerate_reads_its_disk_weights_as_stored():
  kw = dict(batch=2, prompt_len=3, gen_len=3, placed={'device': 0, 'host': 400, 'disk': 800},
            compute_itemsize=4, storage_itemsize=2)
  on_cpu = roofline.work_of_accelerate(HAND, device_is_host=True, **kw)
  # device memory: 2 passes over all 1200 weight bytes, 7 cached positions of K and V (64
  # bytes) read and 2 tokens written for both sequences
  assert on_cpu['decode'].bytes == {'disk_read': 2 * 400, 'disk_write': 0, 'host_device': 0,
                                    'device_memory': 2 * 1200 + 2 * 7 * 64 + 2 * 2 * 64}
  on_gpu = roofline.work_of_accelerate(HAND, device_is_host=False, **kw)
  assert on_gpu['prefill'].bytes['host_device'] == 400 + 400
  assert on_gpu['prefill'].flops == hand_work()['prefill'].flops


# ---- probes --------------------------------------------------------------------------------------
def test_disk_probe_reads_the_whole_file_and_removes_it(tmp_path, monkeypatch):
  reads = []
  preadv = os.preadv

  def spy(fd, buffers, offset):
    n = preadv(fd, buffers, offset)
    reads.append((offset, n))
    return n

  monkeypatch.setattr(os, 'preadv', spy)
  probe = roofline.disk_bandwidth(str(tmp_path), file_bytes=8 * 2**20 + 4096,
                                  chunk_bytes=2**20, threads=3)
  assert probe.read_bw > 0 and probe.write_bw > 0
  assert probe.file_bytes == 8 * 2**20 + 4096 and probe.threads == 3
  assert isinstance(probe.o_direct, bool) and (probe.note == '') is probe.o_direct
  timed = sorted(reads)
  assert [o for o, _ in timed] == [i * 2**20 for i in range(9)]
  assert sum(n for _, n in timed) == probe.file_bytes  # the last chunk is 4 KiB
  assert list(tmp_path.iterdir()) == []


def test_disk_probe_falls_back_to_buffered_reads_where_o_direct_is_refused(tmp_path, monkeypatch):
  real_open = os.open

  def refuse_direct(path, flags, *args):
    if flags & getattr(os, 'O_DIRECT', 0):
      raise OSError(errno.EINVAL, 'Invalid argument')
    return real_open(path, flags, *args)

  monkeypatch.setattr(os, 'open', refuse_direct)
  probe = roofline.disk_bandwidth(str(tmp_path), file_bytes=2**20, chunk_bytes=2**18, threads=2)
  assert probe.o_direct is False and probe.read_bw > 0
  assert 'EINVAL' in probe.note and 'page cache' in probe.note


def test_disk_probe_errors_name_the_value(tmp_path):
  with pytest.raises(FlexjaxError, match='chunk_bytes=1000'):
    roofline.disk_bandwidth(str(tmp_path), file_bytes=2**20, chunk_bytes=1000)
  with pytest.raises(FlexjaxError, match='does not exist'):
    roofline.disk_bandwidth(str(tmp_path / 'missing'), file_bytes=2**20)
  with pytest.raises(FlexjaxError, match='lower --file_gib'):
    roofline.disk_bandwidth(str(tmp_path), file_bytes=2**60)


def test_the_matmul_size_grows_to_the_target_time_without_overshooting_it():
  """A matmul whose run takes (n / 1024)^3 * 40 ms: n grows from 512 to the size whose run
  first takes 50 ms, not doubled past it to 2048 (320 ms a run)."""
  import time
  sizes = []

  def run_at(n):
    sizes.append(n)
    return lambda: time.sleep((n / 1024) ** 3 * 0.04)

  rate, n = roofline._grow_and_time(run_at, start_n=512, target_s=0.05)
  assert sizes[0] == 512 and sizes == sorted(sizes) and all(s % 256 == 0 for s in sizes[1:])
  assert (n / 1024) ** 3 * 0.04 >= 0.05 and n < 2048, sizes
  assert rate == pytest.approx(2 * n**3 / ((n / 1024) ** 3 * 0.04), rel=0.3)


def test_measure_rates_on_small_sizes(tmp_path):
  rates = roofline.measure_rates(folder=str(tmp_path), file_bytes=2**20, chunk_bytes=2**18,
                                 matmul_max_n=128, copy_bytes=2**20)
  assert rates['matmul_n'] == {'float32': {'jax': 128}}
  assert rates['matmul_flops']['float32']['jax'] > 0
  assert rates['host_device_bw'] > 0 and rates['host_device_method'].startswith('memcpy')
  assert rates['disk_read_bw'] > 0 and rates['disk']['file_bytes'] == 2**20
  text = roofline.format_rates(rates)
  assert 'matmul float32: jax' in text and 'disk read' in text and 'o_direct=' in text


# ---- suite records -------------------------------------------------------------------------------
TINY = {'name': 'tiny', 'num_layers': 2, 'hidden_size': 64, 'num_heads': 4, 'ffn_dim': 128,
        'vocab_size': 1000, 'max_positions': 128}


def test_suite_records_get_their_roofline(tmp_path):
  case = suite.check_case({**suite.DEFAULTS, 'name': 'fj', 'system': 'flexjax', 'model': TINY,
                           'prompt_len': 8, 'gen_len': 3, 'page_cache': 'warm',
                           'offload_dir': str(tmp_path), 'policy': {
                               'gpu_batch_size': 2, 'w_gpu_percent': 0, 'w_cpu_percent': 50}})
  records = suite.run_suite('t', [case], lambda _: None, isolate=False, log=lambda _: None,
                            rates=RATES)
  r = records[0]
  assert r['status'] == 'ok' and r['rates'] == RATES
  assert r['roofline_s'] == pytest.approx(r['roofline']['total']['roofline_s'])
  assert r['roofline_fraction'] == pytest.approx(r['roofline_s'] / r['latency_s'])
  assert r['roofline']['decode']['bytes']['disk_read'] > 0  # half the weights on disk
  assert r['roofline']['rates']['compute_flops'] == 1000


def test_flexjax_rows_alone_are_held_to_torchs_rate_too(tmp_path):
  """The roofline takes the faster framework's matmul rate: a suite of flexjax rows alone times
  torch's matmuls too wherever torch is installed, as a suite with its peers does."""
  import importlib.util
  assert importlib.util.find_spec('torch') is not None  # installed with the test extras
  alone = [{'system': 'flexjax', 'compute_dtype': 'float32', 'offload_dir': str(tmp_path)}]
  cmd = suite.rates_command(alone, folder=None, file_gib=0.5, output=tmp_path / 'r.json')
  assert '--torch' in cmd and '--notorch' not in cmd
  assert f'--folder={tmp_path}' in cmd and '--dtypes=float32' in cmd


def test_accelerate_and_failed_records():
  record = {'system': 'accelerate', 'status': 'ok', 'spec': {'model': TINY}, 'prompt_len': 8,
            'gen_len': 3, 'num_prompts': 2, 'compute_dtype': 'float32',
            'weight_storage_dtype': 'float16', 'device': 'cpu', 'prefill_s': 1.0, 'decode_s': 2.0,
            'peak_bytes': {'device': 0, 'host': 1000, 'disk': 4000}}
  r = suite.with_roofline(record, RATES)
  assert r['roofline']['decode']['bytes']['disk_read'] == 2 * 2000
  assert r['roofline']['decode']['bytes']['host_device'] == 0
  failed = suite.with_roofline({'system': 'flexjax', 'status': 'failed'}, RATES)
  assert failed['roofline_fraction'] is None and failed['rates'] == RATES
  assert suite.with_roofline(record, None) is record


def test_rendered_rates_name_the_cpu_they_were_measured_on(tmp_path):
  """Records carry the CPU's model and vector extensions (matmul rates depend on them); the
  roofline table's rates line names them, and records without them still render."""
  from tools import benchlib
  machine = benchlib.machine_info()
  assert set(machine['cpu_vector_flags']) <= set(hardware.VECTOR_FLAGS)
  with open('/proc/cpuinfo') as f:
    flags = next(line for line in f if line.startswith('flags')).split(':', 1)[1].split()
  assert machine['cpu_vector_flags'] == [f for f in hardware.VECTOR_FLAGS if f in flags]
  record = suite.with_roofline(
      {'system': 'accelerate', 'status': 'ok', 'spec': {'model': TINY}, 'prompt_len': 8,
       'gen_len': 3, 'num_prompts': 2, 'compute_dtype': 'float32', 'case': 'acc',
       'weight_storage_dtype': 'float16', 'device': 'cpu', 'prefill_s': 1.0, 'decode_s': 2.0,
       'peak_bytes': {'device': 0, 'host': 1000, 'disk': 4000}, 'run_id': 'r1',
       'machine': {'cpu_model': 'Some CPU', 'cpu_vector_flags': ['avx2', 'avx512f']}}, RATES)
  assert '(measured now, on Some CPU (avx2 avx512f)):' in suite.render_roofline([record])
  older = {**record, 'machine': {'cpu_model': None}}
  assert '(measured now):' in suite.render_roofline([older])
