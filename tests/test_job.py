"""Batch jobs (--input/--output): bucketing, per-row parameters, bad rows, and resuming after
kill -9 or Ctrl-C with no row lost or written twice."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import interruptible
from flexjax import job as job_lib
from flexjax.errors import FlexjaxError
from flexjax.policy import Policy
from flexjax.run import RunConfig, run

REPO = Path(__file__).resolve().parents[1]


def write_rows(path: Path, rows: list) -> Path:
  path.write_text(''.join((r if isinstance(r, str) else json.dumps(r)) + '\n' for r in rows))
  return path


def mixed_rows(n: int, seed: int = 0, *, sampled: bool = False) -> list[dict]:
  """Token-id rows of mixed prompt lengths (3..40) and output lengths (1..12)."""
  rng = np.random.default_rng(seed)
  rows = []
  for i in range(n):
    length = int(rng.choice([3, 5, 9, 14, 22, 40]))
    row = {'id': f'row-{i}', 'tokens': [2] + rng.integers(4, 400, length - 1).tolist(),
           'max_new_tokens': int(rng.choice([1, 4, 12]))}
    if sampled and i % 3 == 0:
      row.update(temperature=0.8, top_p=0.9)
    rows.append(row)
  return rows


def run_job(ckpt, tmp_path, input_path, name='out.jsonl', **kw):
  rc = RunConfig(model=None, weights='checkpoint', checkpoint=str(ckpt), input=str(input_path),
                 output=str(tmp_path / name), policy=kw.pop('policy', Policy(gpu_batch_size=2)),
                 progress=False, **kw)
  report = run(rc)
  lines = [json.loads(line) for line in (tmp_path / name).read_text().splitlines()]
  return report, {r['id']: r for r in lines}


def test_bucketing_pads_less_and_gives_the_same_outputs(pre_ln, tmp_path):
  rows = write_rows(tmp_path / 'rows.jsonl', mixed_rows(16))
  bucketed, by_id = run_job(pre_ln.ckpt_dir, tmp_path, rows, 'new/b.jsonl')  # folder made
  flat, flat_by_id = run_job(pre_ln.ckpt_dir, tmp_path, rows, 'f.jsonl', bucket=False)
  assert by_id.keys() == flat_by_id.keys() and len(by_id) == 16
  for key, record in by_id.items():
    assert record['output_tokens'] == flat_by_id[key]['output_tokens'], key
    assert record['error'] is None and record['finish_reason'] in ('eos', 'length')
  assert bucketed['padding_efficiency'] > flat['padding_efficiency']
  assert bucketed['useful_tokens'] == flat['useful_tokens']
  assert bucketed['padded_tokens'] < flat['padded_tokens']
  full = bucketed['padding_efficiency_full_length']
  assert full == flat['padding_efficiency_full_length']  # counted from the rows, both ways
  assert full['bucketed'] > full['unbucketed']
  # efficiency = useful / padded tokens (Table 25), and both throughputs are reported
  assert bucketed['padding_efficiency'] == pytest.approx(
      bucketed['useful_tokens'] / bucketed['padded_tokens'], abs=1e-4)
  assert bucketed['actual_tok_s'] < bucketed['padded_tok_s']
  assert not (tmp_path / 'new' / 'b.jsonl.progress').exists()  # a complete job leaves none


def test_rows_get_their_own_lengths_seeds_and_stop_strings(pre_ln, tmp_path):
  long_rows = [{'id': 'a', 'prompt': 'Paris is the capital', 'max_new_tokens': 10},
               {'id': 'b', 'prompt': 'The quick brown fox', 'max_new_tokens': 10,
                'temperature': 1.0, 'seed': 7}]
  _, full = run_job(pre_ln.ckpt_dir, tmp_path, write_rows(tmp_path / 'l.jsonl', long_rows), 'l')
  text = full['a']['output']
  assert len(full['a']['output_tokens']) == 10 and len(text) > 4
  stop = text[len(text) // 2:len(text) // 2 + 2]
  cut = text.find(stop)
  rows = [{'id': 'a', 'prompt': 'Paris is the capital', 'max_new_tokens': 3},
          {'id': 'a-stop', 'prompt': 'Paris is the capital', 'max_new_tokens': 10, 'stop': stop},
          {'id': 'filler', 'tokens': [2, 50, 60, 70, 80, 90, 100, 110], 'temperature': 1.0},
          {'id': 'b', 'prompt': 'The quick brown fox', 'max_new_tokens': 10, 'temperature': 1.0,
           'seed': 7}]
  _, got = run_job(pre_ln.ckpt_dir, tmp_path, write_rows(tmp_path / 's.jsonl', rows), 's')
  assert got['a']['output_tokens'] == full['a']['output_tokens'][:3]
  assert got['a']['finish_reason'] == 'length'
  assert got['a-stop']['output'] == text[:cut] and got['a-stop']['finish_reason'] == 'stop'
  kept = got['a-stop']['output_tokens']
  assert kept == full['a']['output_tokens'][:len(kept)] and len(kept) < 10
  # a sampled row with its own seed gives the same tokens batched with another row or alone
  assert got['b']['output_tokens'] == full['b']['output_tokens']


def test_bad_rows_are_written_with_their_error_and_the_job_goes_on(pre_ln, tmp_path):
  good = {'id': 'ok', 'tokens': [2, 11, 12, 13], 'max_new_tokens': 2}
  rows = [good, 'not json', {'id': 'empty', 'prompt': '  '}, {'id': 'none'},
          {'id': 'long', 'tokens': [2] * 60, 'max_new_tokens': 10},
          {'id': 'hot', 'tokens': [2, 5], 'temperature': -1},
          {'id': 'p', 'tokens': [2, 5], 'top_p': 1.5},
          {'id': 'n', 'tokens': [2, 5], 'max_new_tokens': 0},
          {'id': 'vocab', 'tokens': [2, 5000]},
          {'id': 'typo', 'tokens': [2, 5], 'max_tokens': 3},
          {'id': 'ok', 'tokens': [2, 5]},
          {'id': 'seed', 'tokens': [2, 5], 'seed': -4},
          {'id': 'nan', 'tokens': [2, 5], 'temperature': float('nan')},  # json writes NaN
          {'id': 'float', 'tokens': [2, 5], 'max_new_tokens': 8.0}]
  report, got = run_job(pre_ln.ckpt_dir, tmp_path, write_rows(tmp_path / 'r.jsonl', rows))
  assert report['rows'] == 14 and report['bad_rows'] == 13 and report['rows_generated'] == 1
  assert got['ok']['error'] is None and len(got['ok']['output_tokens']) == 2
  errors = {key: r['error'] for key, r in got.items() if key != 'ok'}
  assert len(errors) == 12  # the repeated id 'ok' is reported under its id, after the first
  expected = {2: 'not JSON', 'empty': '"prompt" must be a non-empty string',
              'none': 'exactly one of "prompt"', 'long': 'positions but',
              'hot': '"temperature"', 'p': '"top_p"', 'n': '"max_new_tokens" is 0',
              'vocab': '[0, 1000)', 'typo': "unknown field 'max_tokens'", 'seed': '"seed" is -4',
              'nan': '"temperature" nan must be a finite number',
              'float': '"max_new_tokens" is 8.0; it must be an integer, written without'}
  for key, needle in expected.items():
    assert needle in errors[key], (key, errors[key])
  lines = (tmp_path / 'out.jsonl').read_text().splitlines()
  assert sum('repeats line 1' in line for line in lines) == 1


def test_unusable_paths_are_refused_before_any_work(pre_ln, tmp_path):
  rows = write_rows(tmp_path / 'rows.jsonl', mixed_rows(2))
  binary = tmp_path / 'bin.jsonl'
  binary.write_bytes(b'{"tokens": [2]}\n\xff\xfe\x00')
  cases = [(dict(input=str(tmp_path)), 'is a folder'),
           (dict(input=str(binary)), 'not UTF-8 text (byte 16, line 2)'),
           (dict(input=str(tmp_path / 'missing.jsonl')), 'does not exist'),
           (dict(output=str(tmp_path)), 'is a folder'),
           (dict(output=str(rows / 'out.jsonl')), 'is a file; give a folder'),
           (dict(checkpoint=str(rows)), 'is a file; give the checkpoint folder')]
  for change, needle in cases:
    kw = dict(model=None, weights='checkpoint', checkpoint=str(pre_ln.ckpt_dir),
              input=str(rows), output=str(tmp_path / 'out.jsonl'), progress=False)
    with pytest.raises(FlexjaxError, match=None) as e:
      run(RunConfig(**{**kw, **change}))
    assert needle in str(e.value) and '\n' not in str(e.value), (change, str(e.value))
  assert not (tmp_path / 'out.jsonl').exists()


def test_a_finished_or_foreign_output_is_never_overwritten(pre_ln, tmp_path):
  rows = write_rows(tmp_path / 'rows.jsonl', mixed_rows(3))
  run_job(pre_ln.ckpt_dir, tmp_path, rows)
  before = (tmp_path / 'out.jsonl').read_bytes()
  with pytest.raises(FlexjaxError, match='already exists; remove it or choose another'):
    run_job(pre_ln.ckpt_dir, tmp_path, rows)
  # an interrupted run of another job (other input) in the way
  (tmp_path / 'out.jsonl.progress').write_text(json.dumps(
      {'format': job_lib.FORMAT, 'job': 'other', 'policy': None, 'bytes': 0, 'rows': 0,
       'done': []}))
  with pytest.raises(FlexjaxError, match='interrupted run of another job'):
    run_job(pre_ln.ckpt_dir, tmp_path, rows)
  assert (tmp_path / 'out.jsonl').read_bytes() == before


# ---- kill -9, Ctrl-C -----------------------------------------------------------------------------
def job_command(ckpt, rows: Path, out: Path) -> list[str]:
  return [sys.executable, '-m', 'flexjax.main', '--weights=checkpoint', f'--checkpoint={ckpt}',
          f'--input={rows}', f'--output={out}', '--gpu_batch_size=2', '--noprogress']


def stuck_after(command: list[str], out: Path, lines: int, grace_s: float) -> list[str]:
  """`python -m flexjax.main ARGS` as a run whose main thread hangs in native code, as on a step
  that never finishes (a mutex it holds locked again), at its first step once `out` has `lines`
  lines; it then makes `out`.stuck. It stops with `grace_s` of grace, given as --stop_grace_s
  (flexjax.stopping)."""
  python, flag, module, *args = command
  assert (flag, module) == ('-m', 'flexjax.main'), command
  return [python, '-c', f'''
import ctypes, sys
from pathlib import Path
from flexjax import executor, main
compute, out = executor.Executor._compute, Path({str(out)!r})
mutex, libc = ctypes.create_string_buffer(64), ctypes.CDLL(None)
def hung(self, *args, **kwargs):
  if out.exists() and out.read_bytes().count(b"\\n") >= {lines}:
    out.with_name(out.name + ".stuck").touch()
    libc.pthread_mutex_lock(mutex)
    libc.pthread_mutex_lock(mutex)
  return compute(self, *args, **kwargs)
executor.Executor._compute = hung
sys.argv = {[module, *args, f'--stop_grace_s={grace_s:g}']!r}
main.entry()
''']


def test_a_stopped_jobs_last_line_says_what_its_output_holds_as_it_stops(tmp_path):
  """Read from the files when the stop comes: a Ctrl-C landing after the job's last block (as
  its processes end) says the job ended, not that it can be resumed."""
  from flexjax.main import kept
  out = tmp_path / 'out.jsonl'
  resume = f'; {str(out)!r} keeps the rows written so far: run the same command again to resume'
  assert kept(None, str(out)) == '' and kept('rows.jsonl', None) == ''
  assert kept('rows.jsonl', str(out)) == resume  # nothing written yet: the same command starts it
  out.write_text('')
  assert kept('rows.jsonl', str(out)) == resume
  out.write_text('{"id": "r0"}\n')
  progress = out.with_name('out.jsonl.progress')
  progress.write_text('{}')
  assert kept('rows.jsonl', str(out)) == resume
  progress.unlink()  # the job's end
  assert kept('rows.jsonl', str(out)) == f'; the job had ended: {str(out)!r} holds all its rows'


def run_killed(cmd: list[str], out: Path, after_lines: int | None,
               sig: int = signal.SIGKILL, stuck: bool = False) -> bool:
  """Starts the job and sends it `sig` (kill -9) once the output has after_lines lines (None: as
  soon as its progress file exists), or, `stuck`, once it is stuck in a step after that many
  (then SIGTERM, which it answers after its grace time). Returns whether it was stopped before finishing."""
  env = dict(os.environ, JAX_PLATFORMS='cpu')
  marker = out.with_name(out.name + '.progress')
  # Ctrl-C goes to a fresh job once it has made its progress file: its handler is in place, and
  # all of the job is still to run (a signal sent near the end can land as the process exits)
  assert sig != signal.SIGINT or (after_lines is None and not marker.exists())
  hung = out.with_name(out.name + '.stuck')
  assert not stuck or sig == signal.SIGTERM
  if stuck:
    cmd = stuck_after(cmd, out, after_lines, grace_s=2)
  proc = subprocess.Popen(interruptible(cmd) if sig == signal.SIGINT else cmd, env=env, cwd=REPO,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
  deadline = time.time() + 240
  kept = f"{str(out)!r} keeps the rows written so far: run the same command again to resume"
  while proc.poll() is None and time.time() < deadline:
    lines = out.read_bytes().count(b'\n') if out.exists() else 0
    if hung.exists() if stuck else (marker.exists() and (after_lines is None
                                                          or lines >= after_lines)):
      proc.send_signal(sig)
      _, err = proc.communicate(timeout=240)
      if sig == signal.SIGINT:  # one line; the run's folders removed on the way out
        assert proc.returncode == 130, err.decode()[-3000:]
        assert err.decode().splitlines()[-1] == f'flexjax: interrupted; {kept}', err.decode()
      if stuck:  # its unwinding waits on the step: ended by the watcher, in one line
        hung.unlink()
        assert proc.returncode == 128 + signal.SIGTERM, err.decode()[-3000:]
        assert err.decode().splitlines()[-1] == (
            'flexjax: stopped without its clean-up: it did not stop within 2 s of SIGTERM (a '
            'step that never finishes holds its clean-up); the next run removes the folders '
            f'this one leaves; {kept}'), err.decode()[-3000:]
      return True
    time.sleep(0.01)
  _, err = proc.communicate(timeout=240)
  assert proc.returncode == 0, err.decode()[-3000:]
  return False


def test_kill_9_at_any_point_loses_and_repeats_no_row(pre_ln, tmp_path):
  """With the KV cache and part of the weights on disk: every restart also removes the offload
  folders the killed runs left (flexjax.scratch). One run is stopped while stuck in a step (its
  main thread in native code that never returns): SIGTERM ends it after its grace time, and it
  leaves what a kill -9 would."""
  rows = write_rows(tmp_path / 'rows.jsonl', mixed_rows(10, seed=3, sampled=True)
                    + ['{"id": "broken"'])
  offload = tmp_path / 'offload'
  disk = ['--cache_gpu_percent=0', '--cache_cpu_percent=0', '--w_gpu_percent=40',
          '--w_cpu_percent=20', f'--offload_dir={offload}']
  reference = tmp_path / 'reference.jsonl'
  assert not run_killed(job_command(pre_ln.ckpt_dir, rows, reference) + disk, reference, 10**9)
  expected = reference.read_bytes()
  assert expected.count(b'\n') == 11
  assert not any(offload.iterdir())
  out = tmp_path / 'out.jsonl'
  cmd = job_command(pre_ln.ckpt_dir, rows, out) + disk
  kills = 0
  # Ctrl-C at start-up; stuck mid-job (the bad rows written first), then SIGTERM; kill -9 near
  # the end
  for after, sig, stuck in ((None, signal.SIGINT, False), (4, signal.SIGTERM, True),
                            (8, signal.SIGKILL, False)):
    killed = run_killed(cmd, out, after, sig, stuck)
    kills += killed
    if out.exists():  # what a killed run left is whole lines only up to its progress record
      state = json.loads(out.with_name('out.jsonl.progress').read_text())
      assert expected.startswith(out.read_bytes()[:state['bytes']])
    # each start removed the last killed run's folder; an interrupted run removed its own
    assert len(list(offload.iterdir())) <= (0 if sig == signal.SIGINT else 1)
  assert kills >= 2
  if killed:  # past its 8th line: its KV cache files are still there
    (left,) = offload.iterdir()
    assert any(p.suffix == '.bin' for p in left.iterdir())
  # a write torn by the kill, after the last recorded block: cut off on resume
  if out.with_name('out.jsonl.progress').exists():
    with open(out, 'ab') as f:
      f.write(b'{"id": "row-torn", "line"')
  assert not run_killed(cmd, out, 10**9)
  assert out.read_bytes() == expected  # no row lost, none twice, the same outputs in order
  assert not out.with_name('out.jsonl.progress').exists()
  assert not any(offload.iterdir())


def test_a_full_output_disk_is_one_line_and_the_job_resumes(pre_ln, tmp_path):
  """The output's writes fail part-way (a file size limit stands in for a full disk: the same
  failed write() to the job): one line naming the output, no traceback; the same command then
  finishes the job with the uninterrupted run's bytes."""
  rows = write_rows(tmp_path / 'rows.jsonl', mixed_rows(10, seed=8))
  _, reference = run_job(pre_ln.ckpt_dir, tmp_path, rows, 'reference.jsonl')
  expected = (tmp_path / 'reference.jsonl').read_bytes()
  assert len(expected) > 1500
  out = tmp_path / 'out.jsonl'
  cmd = job_command(pre_ln.ckpt_dir, rows, out)
  env = dict(os.environ, JAX_PLATFORMS='cpu')
  limited = [sys.executable, '-c', 'import os, resource, sys; '
             'resource.setrlimit(resource.RLIMIT_FSIZE, (1500, 1500)); '
             'os.execv(sys.executable, [sys.executable] + sys.argv[1:])', *cmd[1:]]
  full = subprocess.run(limited, env=env, cwd=REPO, capture_output=True, text=True, timeout=240)
  assert full.returncode == 2, full.stderr[-3000:]
  assert 'Traceback' not in full.stderr
  assert (f"flexjax: error: writing --output={str(out)!r} failed (File too large); free space "
          'there and run the same command again') in full.stderr
  state = json.loads(out.with_name('out.jsonl.progress').read_text())
  assert 0 < state['bytes'] <= 1500 and expected.startswith(out.read_bytes()[:state['bytes']])
  done = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=240)
  assert done.returncode == 0, done.stderr[-3000:]
  assert out.read_bytes() == expected


def test_a_resumed_job_keeps_its_layouts_policies_and_elsewhere_its_blocks():
  """The policies a job recorded per number of stages: a run on a recorded layout takes its
  stage's policy whole; on another layout, the flags' policy with the recorded block shape and
  approximations (its placement still to choose); a fresh job chooses freely."""
  import dataclasses
  first = Policy(gpu_batch_size=3, num_gpu_batches=2, w_gpu_percent=40, w_cpu_percent=60,
                 compress_cache=True, attn_sparsity=0.5)
  second = dataclasses.replace(first, w_gpu_percent=0, w_cpu_percent=100, cpu_attention=True)
  recorded = {'2': [dataclasses.asdict(first), dataclasses.asdict(second)]}
  flags_policy = Policy(gpu_batch_size=8, w_gpu_percent=10, w_cpu_percent=20, overlap=False)
  assert job_lib.resumed_policy(recorded, stages=2, stage=1, template=flags_policy) == (
      second, True)
  kept, final = job_lib.resumed_policy(recorded, stages=1, stage=0, template=flags_policy)
  assert not final and kept == dataclasses.replace(
      flags_policy, gpu_batch_size=3, num_gpu_batches=2, compress_cache=True, attn_sparsity=0.5)
  assert job_lib.resumed_policy({}, stages=1, stage=0, template=flags_policy) == (None, False)


def test_derived_seeds_and_buckets():
  assert job_lib.derived_seed(0, 'a') == job_lib.derived_seed(0, 'a')
  assert job_lib.derived_seed(0, 'a') != job_lib.derived_seed(1, 'a')
  assert [job_lib.bucket_length(n) for n in (1, 8, 9, 64, 65, 100, 129, 1000)] == [
      8, 8, 16, 64, 72, 104, 144, 1024]
  assert all(n <= job_lib.bucket_length(n) <= 1.125 * n + 8 for n in range(1, 3000))
  rows = [job_lib.Row(i, i, (2,) * n, 4, (), 0.0, 1.0, 0) for i, n in enumerate((60, 3, 61))]
  blocks = job_lib.plan_blocks(rows, 2, bucket=True, max_positions=64)
  # longest first; buckets that would pass the model's 64 positions shrink back to the rows'
  # own lengths
  assert [(len(b.rows), b.pad_to, b.gen_len) for b in blocks] == [(2, 61, 4), (1, 8, 8)]
  assert [r.line for r in blocks[0].rows] == [0, 2]  # input order within a bucket
  short = [job_lib.Row(i, i, (2,) * n, 3, (), 0.0, 1.0, 0) for i, n in enumerate((5, 9, 4))]
  assert [(b.pad_to, b.gen_len) for b in job_lib.plan_blocks(
      short, 2, bucket=True, max_positions=64)] == [(16, 8), (8, 8)]
  assert [(b.pad_to, b.gen_len) for b in job_lib.plan_blocks(
      short, 2, bucket=False, max_positions=64)] == [(9, 3), (9, 3)]


def test_a_second_run_while_the_first_writes_is_refused_and_the_first_finishes(pre_ln, tmp_path):
  """A job started again while it still runs (another terminal, a scheduler's retry) is refused
  in one line, touching nothing; the first run's output is whole. A run refused after taking a
  fresh output leaves no file, and an empty output without a progress file starts afresh."""
  rows = write_rows(tmp_path / 'rows.jsonl', mixed_rows(10, seed=5))
  out = tmp_path / 'out.jsonl'
  marker = out.with_name('out.jsonl.progress')
  first = subprocess.Popen(job_command(pre_ln.ckpt_dir, rows, out) + ['--gpu_batch_size=1'],
                           env=dict(os.environ, JAX_PLATFORMS='cpu'), cwd=REPO,
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
  try:
    deadline = time.time() + 240
    while not marker.exists() and first.poll() is None and time.time() < deadline:
      time.sleep(0.01)
    assert first.poll() is None, first.stderr.read().decode()[-3000:]
    with pytest.raises(FlexjaxError, match=(
        rf"^--output='{out}' is being written by another flexjax run that is still going; wait "
        'for it to end')):
      run_job(pre_ln.ckpt_dir, tmp_path, rows)
    assert first.wait(timeout=240) == 0, first.stderr.read().decode()[-3000:]
  finally:
    if first.poll() is None:
      first.kill()
  ids = [json.loads(line)['id'] for line in out.read_text().splitlines()]
  assert sorted(ids) == sorted(f'row-{i}' for i in range(10)) and not marker.exists()
  # refused after taking the output (its plan exceeds the RAM budget): no file left
  rows = write_rows(tmp_path / 'rows.jsonl', mixed_rows(2))
  with pytest.raises(FlexjaxError, match='--cpu_mem allows 1.00 MiB'):
    run_job(pre_ln.ckpt_dir, tmp_path, rows, 'made/for/it.jsonl', budgets={'host': 2**20})
  assert not (tmp_path / 'made').exists()  # nor the folders made for it
  fresh = tmp_path / 'fresh.jsonl'
  fresh.write_bytes(b'')
  _, lines = run_job(pre_ln.ckpt_dir, tmp_path, rows, 'fresh.jsonl')
  assert sorted(lines) == ['row-0', 'row-1']


def test_a_failed_write_names_the_fix_for_its_cause(tmp_path):
  """A full disk or a file size limit: free space; anything else (a read-only or failing disk,
  permissions): make it writable or choose another --output. Either way the same command resumes."""
  import errno
  output = job_lib.JobOutput(str(tmp_path / 'out.jsonl'), 'job')
  for code, fix in ((errno.ENOSPC, 'free space there'), (errno.EFBIG, 'free space there'),
                    (errno.EROFS, 'make it writable there (or choose another --output)'),
                    (errno.EIO, 'make it writable there (or choose another --output)')):
    message = str(output._failed(OSError(code, os.strerror(code))))
    assert message == (f"writing --output={str(tmp_path / 'out.jsonl')!r} failed "
                       f'({os.strerror(code)}); {fix} and run the same command again: the job '
                       'resumes after its last complete block'), message


def test_the_claimed_output_is_the_file_written_and_the_lock_outlives_it(tmp_path):
  """open() writes through the claimed descriptor: the blocks land in the file claim() locked,
  and the lock holds until release(), after the writing file is closed."""
  import fcntl
  path = tmp_path / 'out.jsonl'
  output = job_lib.JobOutput(str(path), 'job')
  output.claim()
  try:
    output.open([Policy(gpu_batch_size=2)])
    output.write_block(0, [{'id': 'a'}, {'id': 'b'}])
    output.close()
    assert path.read_bytes() == b'{"id": "a"}\n{"id": "b"}\n'
    with open(path, 'rb') as other:
      with pytest.raises(BlockingIOError):
        fcntl.flock(other.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
  finally:
    output.release()
  with open(path, 'rb') as other:
    fcntl.flock(other.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)  # let go
