"""Tests of tools/peer_flexgen.py: FlexGen's command, its log, the offline tokenizer (no GPU)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import subprocess
import sys

import pytest

from flexjax.errors import FlexjaxError
from flexjax.policy import Policy
from tools import peer_flexgen

OFFLOADING = Policy(gpu_batch_size=48, num_gpu_batches=3, w_gpu_percent=20, w_cpu_percent=80,
                    cache_gpu_percent=0, cache_cpu_percent=100, act_gpu_percent=0,
                    act_cpu_percent=100, cpu_attention=True)


def command(policy: Policy = OFFLOADING, model: str = 'opt-6.7b', **kw) -> list[str]:
  args = {'prompt_len': 512, 'gen_len': 32, 'cut_gen_len': 8, 'offload_dir': '/tmp/off',
          'log_file': '/tmp/f.log', 'python': 'PY'}
  return peer_flexgen.flexgen_command(model, policy, **{**args, **kw})


def test_model_names_cover_flexgen_opt_models():
  assert peer_flexgen.MODEL_NAMES['opt-1.3b'] == 'facebook/opt-1.3b'
  assert len(peer_flexgen.MODEL_NAMES) == 9


def test_command_of_an_offloading_policy():
  assert command() == [
      'PY', '-m', 'flexgen.flex_opt', '--model', 'facebook/opt-6.7b', '--path', '_DUMMY_',
      '--offload-dir', '/tmp/off', '--prompt-len', '512', '--gen-len', '32',
      '--cut-gen-len', '8', '--gpu-batch-size', '48', '--num-gpu-batches', '3',
      '--percent', '20', '80', '0', '100', '0', '100', '--overlap', 'True',
      '--attn-sparsity', '1.0', '--cpu-cache-compute', '--log-file', '/tmp/f.log',
      '--verbose', '1']


def test_command_options():
  policy = dataclasses.replace(OFFLOADING, compress_weight=True, overlap=False,
                               cpu_attention=False, attn_sparsity=0.1)
  cmd = command(policy, cut_gen_len=None)
  assert '--compress-weight' in cmd and '--compress-cache' not in cmd
  assert '--cpu-cache-compute' not in cmd and '--cut-gen-len' not in cmd
  assert cmd[cmd.index('--overlap') + 1] == 'False'
  assert cmd[cmd.index('--attn-sparsity') + 1] == '0.1'
  cache = command(dataclasses.replace(OFFLOADING, compress_cache=True))
  assert '--compress-cache' in cache and '--compress-weight' not in cache
  # Percents that are integers up to float noise become ints; bits are ignored uncompressed.
  noisy = dataclasses.replace(OFFLOADING, w_gpu_percent=20 + 1e-9, w_cpu_percent=80 - 1e-9,
                              compress_bits=8)
  assert command(noisy) == command()


@pytest.mark.parametrize('model, policy, kw, words', [
    ('opt-7b', OFFLOADING, {}, ['opt-7b', 'opt-6.7b']),
    ('opt-6.7b', dataclasses.replace(OFFLOADING, compress_weight=True, compress_bits=8), {},
     ['compress_bits=8', '4 bits']),
    ('opt-6.7b', dataclasses.replace(OFFLOADING, compress_cache=True, compress_group_size=32), {},
     ['compress_group_size=32', 'groups of 64']),
    ('opt-6.7b', dataclasses.replace(OFFLOADING, w_gpu_percent=12.3, w_cpu_percent=80), {},
     ['w_gpu_percent=12.3', 'use 12']),
    ('opt-6.7b', dataclasses.replace(OFFLOADING, compress_cache=True, attn_sparsity=0.5), {},
     ['attn_sparsity=0.5', 'compress_cache']),
    ('opt-6.7b', dataclasses.replace(OFFLOADING, act_gpu_percent=50, act_cpu_percent=50), {},
     ['act_gpu_percent=50']),
    ('opt-6.7b', OFFLOADING, {'cut_gen_len': 3}, ['cut_gen_len=3']),
    ('opt-6.7b', OFFLOADING, {'cut_gen_len': 32}, ['cut_gen_len=32']),
    ('opt-6.7b', OFFLOADING, {'prompt_len': 4}, ['prompt_len=4']),
    ('opt-6.7b', OFFLOADING, {'gen_len': 1, 'cut_gen_len': None}, ['gen_len=1']),
    ('opt-6.7b', OFFLOADING, {'prompt_len': 2000, 'gen_len': 100}, ['prompt_len=2000']),
])
def test_command_refuses_what_flexgen_cannot_run(model, policy, kw, words):
  with pytest.raises(FlexjaxError) as e:
    command(policy, model, **kw)
  message = str(e.value)
  assert '\n' not in message
  for word in words:
    assert word in message


def _record(gpu_gb, projected, prefill, decode, total):
  return ('model size: 12.386 GB\tcache size: 2.250 GB\thidden size (p): 0.094 GB\n'
          f'peak gpu mem: {gpu_gb:.3f} GB\tprojected: {projected}\n'
          f'prefill latency: {prefill[0]:.3f} s\tprefill throughput: {prefill[1]:.3f} token/s\n'
          f'decode latency: {decode[0]:.3f} s\tdecode throughput: {decode[1]:.3f} token/s\n'
          f'total latency: {total[0]:.3f} s\ttotal throughput: {total[1]:.3f} token/s\n')


FIRST = _record(5.5, False, (10.0, 7372.8), (90.0, 49.6), (100.0, 46.08))
SECOND = _record(3.25, True, (12.5, 5898.24), (300.25, 14.866), (312.75, 14.734))


def test_parse_log_takes_the_last_record():
  assert peer_flexgen.parse_log(FIRST + SECOND) == {
      'prefill_s': 12.5, 'decode_s': 300.25, 'total_s': 312.75, 'prefill_tok_s': 5898.24,
      'decode_tok_s': 14.866, 'total_tok_s': 14.734, 'gpu_peak_bytes': round(3.25 * 2**30),
      'projected': True}
  assert peer_flexgen.parse_log(FIRST)['projected'] is False


def test_parse_log_refuses_a_log_without_a_complete_record():
  truncated = SECOND[:SECOND.index('decode throughput')]
  for text in ('', truncated, truncated.replace('prefill', 'decode')):
    with pytest.raises(FlexjaxError, match='no complete record'):
      peer_flexgen.parse_log(text)
  # A truncated later record leaves the last complete one.
  assert peer_flexgen.parse_log(FIRST + truncated)['total_s'] == 100.0


_LOAD_TOKENIZER = '''
import json
from transformers import AutoTokenizer
tok = AutoTokenizer.from_pretrained("facebook/opt-30b", padding_side="left")
out = tok(["Paris is the capital city of"], padding="max_length", max_length=16)
print(json.dumps({"ids": out.input_ids, "mask": out.attention_mask, "pad": tok.pad_token_id,
                  "bos": tok.bos_token_id, "eos": tok.eos_token_id}))
'''


def test_tokenizer_cache_loads_offline_and_pads(tmp_path):
  pytest.importorskip('transformers')
  peer_flexgen.write_tokenizer_cache(tmp_path)
  repo = tmp_path / 'hub' / 'models--facebook--opt-30b'
  commit = (repo / 'refs' / 'main').read_text()
  assert len(commit) == 40 and int(commit, 16) >= 0
  assert (repo / 'snapshots' / commit / 'tokenizer.json').is_file()
  done = subprocess.run([sys.executable, '-c', _LOAD_TOKENIZER], capture_output=True, text=True,
                        env=peer_flexgen.hf_offline_env(tmp_path), timeout=300, check=False)
  assert done.returncode == 0, done.stderr[-2000:]
  out = json.loads(done.stdout.strip().splitlines()[-1])
  assert (out['pad'], out['bos'], out['eos']) == (1, 2, 2)
  ids, mask = out['ids'][0], out['mask'][0]
  assert len(ids) == 16
  assert ids[:9] == [1] * 9 and mask == [0] * 9 + [1] * 7  # left padding
  assert ids[9] == 2 and 3 not in ids[10:]  # BOS, then known words (no <unk>)
  assert len(set(ids[10:])) == 6


def test_offline_env_points_every_cache_at_hf_home(tmp_path):
  env = peer_flexgen.hf_offline_env(tmp_path, {'PATH': '/bin', 'HF_HUB_CACHE': '/x',
                                               'TRANSFORMERS_CACHE': '/y'})
  assert env == {'PATH': '/bin', 'HF_HOME': str(tmp_path), 'HF_HUB_OFFLINE': '1',
                 'TRANSFORMERS_OFFLINE': '1'}


def test_check_available_names_the_missing_piece():
  if importlib.util.find_spec('flexgen') is None:
    with pytest.raises(FlexjaxError, match=r'flexgen.*pip install flexgen==0\.1\.8'):
      peer_flexgen.check_available()
    return
  torch = pytest.importorskip('torch')
  if torch.cuda.is_available():
    peer_flexgen.check_available()
  else:
    with pytest.raises(FlexjaxError, match='FlexGen needs a CUDA GPU'):
      peer_flexgen.check_available()


def test_run_flexgen_validates_before_needing_flexgen(tmp_path):
  bad = dataclasses.replace(OFFLOADING, w_gpu_percent=12.3)
  with pytest.raises(FlexjaxError, match='w_gpu_percent=12.3'):
    peer_flexgen.run_flexgen('opt-6.7b', bad, prompt_len=512, gen_len=32, projected_gen_len=8,
                             offload_dir=str(tmp_path))


def test_failed_command_reports_its_last_stderr_line(tmp_path):
  script = 'import sys; sys.stderr.write("Traceback\\nAssertionError: Not implemented\\n"); exit(3)'
  with pytest.raises(FlexjaxError, match='status 3: AssertionError: Not implemented'):
    peer_flexgen._run_checked([sys.executable, '-c', script], env={}, cwd=tmp_path,
                              timeout_s=60)
  with pytest.raises(FlexjaxError, match='timeout_s=0.5'):
    peer_flexgen._run_checked([sys.executable, '-c', 'import time; time.sleep(30)'], env={},
                              cwd=tmp_path, timeout_s=0.5)
