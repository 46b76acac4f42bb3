"""Pipeline parallelism over local processes on jax.distributed: tokens equal a single process's,
layers split by cost, and a dead stage stops the others with one line."""

import fcntl
import json
import os
import pty
import signal
import struct
import subprocess
import sys
import termios
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import PROMPTS, TINY_SHAPES, interruptible, make_hf_model
from flexjax import config as config_lib
from flexjax.checkpoint import Checkpoint
from flexjax.engine import Engine, GenerationConfig
from flexjax.errors import FlexjaxError
from flexjax.hf_import import convert
from flexjax.pipeline import micro_batch_groups, split_layers, tick_schedule
from flexjax.policy import Policy

ROOT = Path(__file__).resolve().parents[1]
CPU_PROFILE = str(ROOT / 'configs' / 'hw' / 'cpu-2core.json')
OFFLOADED = ['--w_gpu_percent=0', '--w_cpu_percent=50', '--cache_gpu_percent=0',
             '--cache_cpu_percent=100']


@pytest.fixture(scope='module')
def four_layers(tmp_path_factory) -> Path:
  """A tiny pre-LN OPT of four decoder layers (a layer or more for each of three stages)."""
  root = tmp_path_factory.mktemp('pipeline')
  make_hf_model(dict(TINY_SHAPES['pre_ln'], num_hidden_layers=4)).save_pretrained(root / 'hf')
  convert(root / 'hf', root / 'ckpt', dtype='float32', progress=False)
  return root / 'ckpt'


def launch(ckpt: Path, tmp_path: Path, n: int, *extra: str, gen_len: int = 6):
  prompts = tmp_path / 'prompts.jsonl'
  prompts.write_text(''.join(json.dumps({'tokens': p}) + '\n' for p in PROMPTS))
  out = tmp_path / f'out-{n}.jsonl'
  report = tmp_path / 'reports' / f'report-{n}.json'  # its folder is made
  cmd = [sys.executable, '-m', 'flexjax.launch', f'--num_processes={n}', '--weights=checkpoint',
         f'--checkpoint={ckpt}', f'--prompt_file={prompts}', f'--gen_len={gen_len}',
         '--gpu_batch_size=2', '--num_gpu_batches=2', '--noprogress', f'--output={out}',
         f'--report_json={report}', *extra]
  proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr[-2000:]
  # stdout is the report alone (the collectives' connection notice goes to the stage's log)
  assert proc.stdout.lstrip().startswith('model: '), proc.stdout[:300]
  tokens = [json.loads(line)['output_tokens'] for line in out.read_text().splitlines()]
  return tokens, json.loads(report.read_text())


def single(ckpt: Path, policy: Policy, gen_len: int = 6):
  return single_result(ckpt, policy, gen_len)[0]


def single_result(ckpt: Path, policy: Policy, gen_len: int = 6):
  """(one process's sequences, its result with each step's two most likely tokens)."""
  with Engine(Checkpoint(ckpt), policy=policy) as engine:
    result = engine.generate(PROMPTS, GenerationConfig(gen_len=gen_len, top_logprobs=2))
  return [seq.tolist() for seq in result.sequences], result


# slow: the three offloaded stages below run micro-batches in groups too (3 groups of 2), the
# searched stage policies and README's launches run two stages
@pytest.mark.slow
def test_two_stages_equal_one_process(four_layers, tmp_path):
  tokens, report = launch(four_layers, tmp_path, 2, '--num_gpu_batches=4')  # 2 groups of 2
  assert tokens == single(four_layers, Policy(gpu_batch_size=2, num_gpu_batches=4))
  assert report['pipeline_stages'] == 2
  assert report['stage0']['holds'] == 'embed + layers 0-1'
  assert report['stage1']['holds'] == 'layers 2-3 + head'
  for stage in ('stage0', 'stage1'):
    assert report[stage]['planned_ram_peak_bytes'] > 0
    assert report[stage]['measured_ram_peak_bytes'] > 0


def test_three_stages_offloaded_equal_one_process(four_layers, tmp_path):
  """Six GPU batches of one row in three groups of two (each stage busy with its own group); the
  last batches of the block are short of prompts. The last stage's log-probabilities of the
  tokens and of each step's two most likely reach stage 0's output."""
  tokens, report = launch(four_layers, tmp_path, 3, *OFFLOADED, '--gpu_batch_size=1',
                          '--num_gpu_batches=6', '--top_logprobs=2')
  policy = Policy(gpu_batch_size=1, num_gpu_batches=6, w_gpu_percent=0, w_cpu_percent=50,
                  cache_gpu_percent=0, cache_cpu_percent=100)
  expected, result = single_result(four_layers, policy)
  assert tokens == expected
  lines = [json.loads(line) for line in (tmp_path / 'out-3.jsonl').read_text().splitlines()]
  for i, (line, seq) in enumerate(zip(lines, expected)):
    one = result.logprob_fields(i, len(seq))
    np.testing.assert_allclose(line['logprobs'], one['logprobs'], atol=1e-5, rtol=0)
    assert all(v < 0 for v in line['logprobs'])
    assert [[t for t, _ in step] for step in line['top_logprobs']] == [
        [t for t, _ in step] for step in one['top_logprobs']]
    np.testing.assert_allclose([[v for _, v in step] for step in line['top_logprobs']],
                               [[v for _, v in step] for step in one['top_logprobs']],
                               atol=1e-5, rtol=0)
  assert report['pipeline_stages'] == 3
  assert [report[f'stage{q}']['holds'] for q in range(3)] == [
      'embed + layers 0-0', 'layers 1-2', 'layers 3-3 + head']
  assert report['stage1']['planned_disk_peak_bytes'] > 0  # half the weights stream from disk
  for q in range(3):
    assert report[f'stage{q}']['measured_ram_peak_bytes'] > 0
    assert report[f'stage{q}']['policy'].startswith('1x6 ')


def test_the_common_block_shape_is_ranked_by_the_runs_own_sequences():
  """Two stages that fit both shapes: 4 rows in 2.4 s beat 2 rows in 2.0 s, unless the run has
  only two sequences (half of the 4-row block would be padding)."""
  from flexjax.stage_run import best_shape
  shapes = [(2, 1), (4, 1)]
  stages = [[(True, 0.5, 0.5), (True, 0.6, 0.6)]] * 2
  assert best_shape(shapes, stages, 8) == 1
  assert best_shape(shapes, stages, 8, num_sequences=2) == 0
  assert best_shape(shapes, stages, 8, num_sequences=4) == 1


def test_searched_stage_policies_share_one_block_shape(four_layers, tmp_path):
  """--policy=auto: each stage searches its own layers within its budgets, the stages run one
  block shape, and the tokens equal one process's with that shape."""
  tokens, report = launch(four_layers, tmp_path, 2, '--policy=auto', f'--hw_profile={CPU_PROFILE}',
                          '--max_block_size=4', '--cpu_mem=2')
  shapes = {report[f'stage{q}']['policy'].split()[0] for q in range(2)}
  assert len(shapes) == 1, report
  gbs, nb = (int(v) for v in shapes.pop().split('x'))
  assert gbs * nb <= 4 and report['predicted_total_tok_s'] > 0
  assert tokens == single(four_layers, Policy(gpu_batch_size=gbs, num_gpu_batches=nb))


def test_a_stage_over_its_budget_is_refused_before_any_stage_allocates(four_layers, tmp_path):
  offload = tmp_path / 'offload'
  offload.mkdir()
  cmd = [sys.executable, '-m', 'flexjax.launch', '--num_processes=2', '--weights=checkpoint',
         f'--checkpoint={four_layers}', '--prompt_len=8', '--gen_len=4', '--noprogress',
         '--gpu_batch_size=64', '--cache_gpu_percent=0', '--cache_cpu_percent=0',
         '--cpu_mem=0.02', f'--offload_dir={offload}']
  proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert proc.returncode == 2, proc.stderr
  lines = proc.stderr.strip().splitlines()
  assert len(lines) == 1, proc.stderr
  assert lines[0].startswith('flexjax: error: pipeline stage 0 of 2 failed: stage 0 (embed + '
                             'layers 0-1): '), lines[0]
  assert '--cpu_mem' in lines[0]
  assert not any(offload.rglob('*'))  # no stage created its cache or hidden-state files


def test_a_killed_stage_stops_the_others(four_layers, tmp_path):
  """With the KV cache on disk: the killed stage's offload folder, and the other's where it
  is killed in turn while it waits on the first, are removed by the launcher."""
  offload = tmp_path / 'offload'
  cmd = [sys.executable, '-m', 'flexjax.launch', '--num_processes=2', '--weights=checkpoint',
         f'--checkpoint={four_layers}', '--prompt_len=8', '--gen_len=50', '--noprogress',
         '--stop_at_eos=false', '--num_prompts=64', '--gpu_batch_size=1',
         '--num_gpu_batches=4', '--cache_gpu_percent=0', '--cache_cpu_percent=0',
         f'--offload_dir={offload}']
  launcher = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              text=True)
  try:
    stage1 = None
    deadline = time.monotonic() + 60
    while stage1 is None and time.monotonic() < deadline:
      stage1 = next((pid for pid in _children(launcher.pid)
                     if '--process_id=1' in _cmdline(pid)), None)
      time.sleep(0.2)
    assert stage1 is not None
    while time.monotonic() < deadline and len(list(offload.glob('*'))) < 2:
      time.sleep(0.1)  # both stages hold their cache: generating
    assert len(list(offload.glob('*'))) == 2
    os.kill(stage1, signal.SIGKILL)
    killed = time.monotonic()
    _, err = launcher.communicate(timeout=60)
    assert time.monotonic() - killed < 60
  finally:
    if launcher.poll() is None:
      launcher.kill()
  assert launcher.returncode == 1
  lines = err.strip().splitlines()
  assert len(lines) == 1, err
  assert lines[0].startswith('flexjax: error: pipeline stage 1 of 2 failed: killed by signal 9')
  left = {str(p.relative_to(offload)) for p in offload.rglob('*')}
  assert not left, left


def test_across_hosts_a_killed_stage_stops_the_other_with_one_line(four_layers, tmp_path):
  """Each host's launcher runs its stage as a child: when the other host's stage dies, the
  distributed runtime aborts this one, and its launcher says so in one line. The killed stage's
  offload folder (its KV cache) is removed by its host's launcher."""
  import socket
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    port = s.getsockname()[1]
  hosts = [subprocess.Popen(
      [sys.executable, '-m', 'flexjax.launch', '--num_processes=2', f'--process_id={i}',
       f'--coordinator=127.0.0.1:{port}', '--stage_timeout=20', '--weights=checkpoint',
       f'--checkpoint={four_layers}', '--prompt_len=8', '--gen_len=50', '--noprogress',
       '--stop_at_eos=false', '--num_prompts=64', '--gpu_batch_size=1', '--num_gpu_batches=4',
       '--cache_gpu_percent=0', '--cache_cpu_percent=0', f'--offload_dir={tmp_path / str(i)}'],
      cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for i in (0, 1)]
  try:
    stage1 = None
    deadline = time.monotonic() + 60
    while stage1 is None and time.monotonic() < deadline:
      stage1 = next(iter(_children(hosts[1].pid)), None)
      time.sleep(0.2)
    assert stage1 is not None and '--stage_process' in _cmdline(stage1)
    while time.monotonic() < deadline and not any((tmp_path / '1').glob('*')):
      time.sleep(0.1)  # it holds its cache: generating
    assert any((tmp_path / '1').glob('*'))
    os.kill(stage1, signal.SIGKILL)
    killed = time.monotonic()
    _, err0 = hosts[0].communicate(timeout=90)
    _, err1 = hosts[1].communicate(timeout=30)
    assert time.monotonic() - killed < 90
  finally:
    for h in hosts:
      if h.poll() is None:
        h.kill()
  assert err1.strip() == 'flexjax: error: pipeline stage 1 of 2 stopped: killed by signal 9'
  lines = err0.strip().splitlines()
  assert hosts[0].returncode != 0 and len(lines) == 1, err0
  assert lines[0].startswith('flexjax: error: pipeline stage 0 of 2 stopped: '), lines[0]
  assert not any((tmp_path / '1').iterdir())


def test_stages_given_other_jobs_stop_with_one_line_before_any_row(four_layers, tmp_path):
  """Across hosts each stage names its own input: stages that would run other rows (or the
  same rows with other flags) stop, each with one line, and nothing is written."""
  import socket
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    port = s.getsockname()[1]
  inputs = [tmp_path / 'a.jsonl', tmp_path / 'b.jsonl']
  inputs[0].write_text('{"tokens": [2, 5, 6]}\n')
  inputs[1].write_text('{"tokens": [2, 5, 7]}\n')
  hosts = [subprocess.Popen(
      [sys.executable, '-m', 'flexjax.launch', '--num_processes=2', f'--process_id={i}',
       f'--coordinator=127.0.0.1:{port}', '--stage_timeout=20', '--weights=checkpoint',
       f'--checkpoint={four_layers}', f'--input={inputs[i]}', f'--output={tmp_path}/out{i}.jsonl',
       '--gen_len=2', '--noprogress', '--gpu_batch_size=1', '--num_gpu_batches=1'],
      cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in (0, 1)]
  try:
    errors = [h.communicate(timeout=120)[1] for h in hosts]
  finally:
    for h in hosts:
      if h.poll() is None:
        h.kill()
  for i, (h, err) in enumerate(zip(hosts, errors)):
    assert h.returncode != 0 and err.count('\n') == 1, err
    assert 'stage 1 reads another job' in err, err
  assert 'give every stage the same input file and flags' in errors[1]
  assert sorted(p.name for p in tmp_path.iterdir()) == ['a.jsonl', 'b.jsonl']


def test_an_unreachable_coordinator_is_one_line(four_layers):
  cmd = [sys.executable, '-m', 'flexjax.launch', '--num_processes=2', '--process_id=1',
         '--coordinator=127.0.0.1:9', '--stage_timeout=5', '--weights=checkpoint',
         f'--checkpoint={four_layers}', '--prompt_len=4', '--gen_len=2', '--noprogress']
  proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
  assert proc.returncode == 2
  assert proc.stderr.count('\n') == 1 and 'cannot reach the coordinator 127.0.0.1:9' in (
      proc.stderr), proc.stderr


def test_a_stage_whose_others_never_join_stops_with_one_line(four_layers):
  """Stage 0 started by hand while stage 1 refused its input (or was never started): after
  --stage_timeout the distributed runtime aborts it, and its launcher says why in one line."""
  import socket
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    port = s.getsockname()[1]
  cmd = [sys.executable, '-m', 'flexjax.launch', '--num_processes=2', '--process_id=0',
         f'--coordinator=127.0.0.1:{port}', '--stage_timeout=5', '--weights=checkpoint',
         f'--checkpoint={four_layers}', '--prompt_len=4', '--gen_len=2', '--noprogress']
  proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert proc.returncode != 0
  assert proc.stderr == ('flexjax: error: pipeline stage 0 of 2 stopped: the other stages did '
                         'not all join within --stage_timeout: one refused its flags or inputs '
                         '(see its terminal) or was not started\n'), proc.stderr


def test_too_many_stages_is_one_line(four_layers, tmp_path):
  cmd = [sys.executable, '-m', 'flexjax.launch', '--num_processes=5', '--weights=checkpoint',
         f'--checkpoint={four_layers}', '--prompt_len=4', '--gen_len=2', '--noprogress']
  proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert proc.returncode == 2
  assert proc.stderr.count('\n') == 1 and 'needs at least one of the 4 decoder layers' in (
      proc.stderr), proc.stderr


@pytest.mark.parametrize('flag, says', [
    ('--prompt_file={tmp}/none.txt', 'does not exist; give a text file of prompts, one per line'),
    ('--report_json={tmp}/file/report.json', 'is a file; give a folder'),
    ('--input={tmp}/none.jsonl', 'does not exist; give a JSONL file'),
    ('--input={tmp}/file', 'needs --output=FILE.jsonl for the generations')])
def test_bad_paths_are_one_line_before_any_stage_starts(four_layers, tmp_path, flag, says):
  (tmp_path / 'file').write_text('')
  cmd = [sys.executable, '-m', 'flexjax.launch', '--num_processes=2', '--weights=checkpoint',
         f'--checkpoint={four_layers}', '--gen_len=2', '--noprogress',
         flag.format(tmp=tmp_path)]
  proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert proc.returncode == 2
  assert proc.stderr.count('\n') == 1 and says in proc.stderr, proc.stderr
  assert 'pipeline stage' not in proc.stderr  # refused by the launcher, no stage started


def test_a_job_through_two_stages_writes_the_one_process_jobs_bytes_and_resumes(
    four_layers, tmp_path):
  """A batch job (--input) through a pipeline: bad rows, mixed lengths and per-row limits,
  bucketed blocks, the output written by stage 0 block by block. Its writes failing part-way
  (a file size limit on every stage stands in for a full disk) stop both stages with one
  line, as does Ctrl-C to the launcher; one process then resumes the job after its last complete
  block (and stops at the last), the pipeline finishes it, and the output equals the
  uninterrupted one-process job's, byte for byte."""
  rng = np.random.default_rng(5)
  rows = [{'id': f'r{i}', 'tokens': [2] + rng.integers(4, 900, int(n) - 1).tolist(),
           'max_new_tokens': int(m), **({'logprobs': True} if i % 4 == 0 else {}),
           **({'top_logprobs': 2} if i % 5 == 0 else {})}
          for i, (n, m) in enumerate(zip(rng.choice([3, 6, 11, 20], 30),
                                         rng.choice([1, 3, 5], 30)))]
  lines = [json.dumps(r) for r in rows] + ['{"id": "broken"']
  rows_path = tmp_path / 'rows.jsonl'
  rows_path.write_text('\n'.join(lines) + '\n')
  common = ['--weights=checkpoint', f'--checkpoint={four_layers}', f'--input={rows_path}',
            '--gen_len=5', '--gpu_batch_size=2', '--num_gpu_batches=2', '--noprogress']
  reference = tmp_path / 'reference.jsonl'
  one = subprocess.run([sys.executable, '-m', 'flexjax.main', *common, f'--output={reference}'],
                       cwd=ROOT, capture_output=True, text=True, timeout=240)
  assert one.returncode == 0, one.stderr[-2000:]
  expected = reference.read_bytes()
  assert expected.count(b'\n') == 31 and len(expected) > 3000

  out = tmp_path / 'out.jsonl'
  launch_cmd = ['-m', 'flexjax.launch', '--num_processes=2', *common, f'--output={out}']

  def limited(nbytes: int, *argv: str):
    return subprocess.run(
        [sys.executable, '-c', 'import os, resource, sys; '
         f'resource.setrlimit(resource.RLIMIT_FSIZE, ({nbytes}, {nbytes})); '
         'os.execv(sys.executable, [sys.executable] + sys.argv[1:])', *argv],
        cwd=ROOT, capture_output=True, text=True, timeout=240)

  full = limited(1500, *launch_cmd)  # the progress file, with two stages' policies, fits
  assert full.returncode == 2, full.stderr[-3000:]
  assert 'Traceback' not in full.stderr and full.stderr.count('\n') == 1, full.stderr
  assert f"writing --output={str(out)!r} failed (File too large)" in full.stderr
  state = json.loads(out.with_name('out.jsonl.progress').read_text())
  assert 0 < state['bytes'] <= 1500 and expected.startswith(out.read_bytes()[:state['bytes']])
  # Ctrl-C to the launcher as its stages start (they write the pipeline's blocks within
  # milliseconds of each other, so one landing after the first can find the job ended, and its
  # line says so: tests/test_job.py): they stop, one line, whole blocks kept
  marker = out.with_name('out.jsonl.progress')
  proc = subprocess.Popen(interruptible([sys.executable, *launch_cmd]), cwd=ROOT,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
  deadline, stages = time.monotonic() + 120, []
  while (proc.poll() is None and time.monotonic() < deadline
         and not any('--process_id=1' in _cmdline(pid) for pid in stages)):
    stages = _children(proc.pid)
    time.sleep(0.01)
  proc.send_signal(signal.SIGINT)  # (as the launcher may still be in the second stage's start)
  _, err = proc.communicate(timeout=120)
  assert len(stages) == 2 and not any(map(_running, stages))  # none left running unknown
  assert proc.returncode == 130 and err.splitlines() == [
      f"flexjax: interrupted; {str(out)!r} keeps the rows written so far: run the same command "
      'again to resume'], err[-3000:]
  before, state = state, json.loads(marker.read_text())
  assert before['bytes'] <= state['bytes'] < len(expected)
  assert expected.startswith(out.read_bytes()[:state['bytes']])
  # one process takes the job up where the pipeline left it, and stops at its last block; it
  # keeps the job's block shape (its blocks) over the flags' and records its own policy
  further = limited(len(expected) - 1, '-m', 'flexjax.main', *common, f'--output={out}',
                    '--gpu_batch_size=4', '--num_gpu_batches=1')
  assert further.returncode == 2 and 'File too large' in further.stderr, further.stderr[-3000:]
  before, state = state, json.loads(out.with_name('out.jsonl.progress').read_text())
  assert before['bytes'] <= state['bytes'] < len(expected) and state['rows'] < 31
  assert expected.startswith(out.read_bytes()[:state['bytes']])
  (one,), (first, second) = state['policies']['1'], state['policies']['2']
  assert (one['gpu_batch_size'], one['num_gpu_batches']) == (2, 2) and first == second
  # each stage runs the policy recorded for it: stage 1's placement made another here
  second.update(w_gpu_percent=0, w_cpu_percent=100, cache_gpu_percent=0, cache_cpu_percent=100)
  out.with_name('out.jsonl.progress').write_text(json.dumps(state))

  # the pipeline finishes the job, its progress bar on the launcher's terminal
  report = tmp_path / 'report.json'
  terminal, stage_side = pty.openpty()
  fcntl.ioctl(stage_side, termios.TIOCSWINSZ, struct.pack('HHHH', 24, 100, 0, 0))  # 100 columns
  shown: list[bytes] = []

  def drain():
    while True:
      try:
        data = os.read(terminal, 4096)
      except OSError:  # every holder of the other end has closed it
        return
      if not data:
        return
      shown.append(data)

  reader = threading.Thread(target=drain)
  reader.start()
  try:
    done = subprocess.run([sys.executable, *launch_cmd, f'--report_json={report}', '--progress'],
                          cwd=ROOT, stdout=stage_side, stderr=subprocess.PIPE, text=True,
                          timeout=240)
  finally:
    os.close(stage_side)
    reader.join(timeout=30)
    os.close(terminal)
  assert done.returncode == 0, done.stderr[-3000:]
  screen = b''.join(shown).decode(errors='replace')
  assert 'generating' in screen and '30/30' in screen, screen[-2000:]
  assert out.read_bytes() == expected
  assert not out.with_name('out.jsonl.progress').exists()
  row = json.loads(report.read_text())
  assert row['resumed'] and row['rows_written_before'] == state['rows'] and row['bad_rows'] == 1
  assert row['rows_generated'] == 30 - (state['rows'] - 1)
  assert row['pipeline_stages'] == 2 and row['stage1']['holds'] == 'layers 2-3 + head'
  assert [row[f'stage{q}']['policy'] for q in range(2)] == [
      Policy(**first).describe(), Policy(**second).describe()]
  for stage in ('stage0', 'stage1'):  # each stage's peak RSS, from the kernel, within its plan
    assert 0 < row[stage]['measured_ram_peak_bytes'] <= row[stage]['planned_ram_peak_bytes']


def test_split_layers_balances_embedding_and_head():
  cfg = config_lib.preset('opt-30b')  # 48 layers; embedding ~ 0.14 of a layer
  assert [len(r) for r in split_layers(cfg, 4)] == [12, 12, 12, 12]
  tiny = config_lib.ModelConfig.from_hf_config(dict(
      model_type='opt', hidden_size=64, num_attention_heads=4, ffn_dim=128, num_hidden_layers=6,
      vocab_size=1000, max_position_embeddings=64, word_embed_proj_dim=64))
  split = split_layers(tiny, 3)  # the embedding weighs about a layer: the ends take fewer
  assert [len(r) for r in split] == [1, 4, 1] or [len(r) for r in split] == [2, 2, 2]
  assert [r.start for r in split] == sorted(r.start for r in split)
  assert sum(len(r) for r in split) == 6
  with pytest.raises(FlexjaxError, match='at least one'):
    split_layers(tiny, 7)


def test_micro_batches_form_a_group_per_stage():
  assert micro_batch_groups(4, 2) == [[0, 1], [2, 3]]
  assert micro_batch_groups(6, 3) == [[0, 1], [2, 3], [4, 5]]
  assert micro_batch_groups(2, 3) == [[0], [1]]  # fewer batches than stages: one each
  assert micro_batch_groups(5, 2) == [[0], [1], [2], [3], [4]]


def test_tick_schedule_respects_dependencies():
  m, tokens, nb = 3, 4, 2
  ticks = tick_schedule(m, tokens, nb)
  for p in range(m):
    assert ticks[p] == sorted(set(ticks[p]))  # one item per tick, in order
    for i in range(tokens * nb):
      if p:
        assert ticks[p][i] > ticks[p - 1][i]
      elif i >= nb:
        assert ticks[0][i] > ticks[m - 1][i - nb]
  assert ticks[1][0] == 1 and ticks[0][nb] == ticks[m - 1][0] + 1


def _children(pid: int) -> list[int]:
  out = []
  for task in Path(f'/proc/{pid}/task').iterdir():
    try:
      out += [int(c) for c in (task / 'children').read_text().split()]
    except OSError:  # a thread that ended while we looked
      pass
  return out


def _running(pid: int) -> bool:
  try:
    return Path(f'/proc/{pid}/stat').read_text().rpartition(')')[2].split()[0] != 'Z'
  except OSError:
    return False


def _cmdline(pid: int) -> str:
  try:
    return Path(f'/proc/{pid}/cmdline').read_text().replace('\0', ' ')
  except OSError:
    return ''
