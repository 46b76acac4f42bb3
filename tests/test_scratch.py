"""Folders owned while a process lives; what killed processes left is removed (flexjax.scratch)."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from flexjax import scratch

REPO = Path(__file__).resolve().parents[1]
HOLDER = '''
import sys, time
from flexjax import scratch
claim = scratch.claim(sys.argv[1], sys.argv[2])
(claim.path / 'data.bin').write_bytes(b'x' * (1 << 20))
print(claim.path, flush=True)
time.sleep(600)
'''


class Holder:
  """Another process holding a claimed folder with 1 MiB in it, until kill()."""

  def __init__(self, parent: Path, prefix: str = 'flexjax-test-'):
    self.proc = subprocess.Popen([sys.executable, '-c', HOLDER, str(parent), prefix],
                                 cwd=REPO, stdout=subprocess.PIPE, text=True,
                                 env=dict(os.environ, JAX_PLATFORMS='cpu'))
    self.path = Path(self.proc.stdout.readline().strip())
    assert self.path.is_dir(), 'the holder did not claim its folder'

  def kill(self) -> None:
    self.proc.send_signal(signal.SIGKILL)
    self.proc.wait()
    self.proc.stdout.close()


def test_a_killed_processs_folder_is_removed_and_a_live_ones_kept(tmp_path, capfd):
  live, killed = Holder(tmp_path), Holder(tmp_path)
  users = tmp_path / 'results'  # the user's own folder, and one that looks like scratch
  users.mkdir()
  (users / 'keep.txt').write_text('mine')
  lookalike = tmp_path / 'flexjax-offload-mine'
  lookalike.mkdir()
  try:
    killed.kill()
    assert killed.path.is_dir()  # a killed process cleans up nothing
    removed = scratch.sweep(tmp_path)
    assert [r.path for r in removed] == [killed.path] and not killed.path.exists()
    assert removed[0].nbytes >= 1 << 20  # the space it held, counted
    assert 'removed 1 folder' in capfd.readouterr().err
    assert live.path.is_dir() and (live.path / 'data.bin').is_file()
    assert (users / 'keep.txt').read_text() == 'mine' and lookalike.is_dir()
  finally:
    live.kill()
  assert [r.path for r in scratch.sweep(tmp_path, report=False)] == [live.path]
  assert sorted(p.name for p in tmp_path.iterdir()) == ['flexjax-offload-mine', 'results']


def test_this_processs_own_claim_is_kept_until_released(tmp_path):
  with scratch.claim(tmp_path, 'mine-') as claim:
    assert claim.owned
    (claim.path / 'sub').mkdir()
    (claim.path / 'sub' / 'a.bin').write_bytes(b'1' * 100)
    assert scratch.sweep(tmp_path) == []  # a second open of the owner file cannot lock it
    assert claim.path.is_dir()
  assert not claim.path.exists()


def test_a_disowned_folder_is_never_swept(tmp_path):
  claim = scratch.claim(tmp_path, 'done-')
  (claim.path / 'result.bin').write_bytes(b'2')
  claim.disown()
  assert not (claim.path / scratch.OWNER).exists()
  assert scratch.sweep(tmp_path) == []
  final = tmp_path / 'final'
  os.rename(claim.path, final)
  claim.release()  # nothing left where it was
  assert (final / 'result.bin').read_bytes() == b'2'
  unused = scratch.claim(tmp_path, 'lost-')  # disowned, then not renamed (another won): removed
  (unused.path / 'result.bin').write_bytes(b'3')
  unused.disown()
  unused.release()
  assert not unused.path.exists()


def _write_layout(parent: Path) -> None:
  from flexjax import stream
  entry = stream.Entry(offset=0, shape=(4,), dtype='float32')
  stream.write_layout(parent / 'layout', {'s0': {'w': entry}}, {'format': 'test'},
                      read_stage=lambda _: {'w': np.arange(4, dtype=np.float32)},
                      pack=lambda a: a, progress=False)


def _write_checkpoint(parent: Path) -> None:
  from flexjax.checkpoint import CheckpointWriter
  from flexjax.config import ModelConfig
  cfg = ModelConfig(name='t', num_layers=1, hidden_size=8, num_heads=2, ffn_dim=16,
                    vocab_size=50, max_positions=16)
  with pytest.raises(RuntimeError, match='missing stages'):  # a claim is made, then let go
    with CheckpointWriter(parent / 'ckpt', cfg, 'float32'):
      pass


def _offload_folder(parent: Path) -> None:
  import jax
  from flexjax.storage import Storage
  with Storage(jax.devices('cpu')[0], offload_dir=parent) as storage:
    assert storage.run_dir.parent == parent


def _disk_probe(parent: Path) -> None:
  from flexjax import hardware
  hardware._disk_rates(np.zeros(1 << 16, np.uint8), str(parent))


@pytest.mark.parametrize('use', [_write_layout, _write_checkpoint, _offload_folder, _disk_probe],
                         ids=['layout', 'checkpoint', 'offload', 'disk-probe'])
def test_every_writer_of_scratch_folders_removes_what_killed_runs_left(use, tmp_path):
  killed = Holder(tmp_path, '.layout.partial-')
  killed.kill()
  use(tmp_path)
  assert not killed.path.exists()
  assert not [p for p in tmp_path.iterdir() if p.name.startswith('.') or 'flexjax-' in p.name]


PENDING_HOLDER = '''
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_CREAT | os.O_RDWR)
fcntl.flock(fd, fcntl.LOCK_EX)
print('locked', flush=True)
time.sleep(600)
'''


def test_staging_folders_are_removed_unless_their_claimer_holds_them(tmp_path, capfd):
  """What a process killed in a claim's or a removal's few unowned moments leaves (a staging
  folder: empty, its pending owner file unlocked, or files whose owner file went) is removed;
  one whose pending owner file a live process holds is kept, as is the user's lookalike."""
  left = {'empty': [], 'pending': [scratch.PENDING], 'emptied': ['data.bin']}
  for name, files in left.items():
    (tmp_path / f'{scratch.STAGING}{name}').mkdir()
    for f in files:
      (tmp_path / f'{scratch.STAGING}{name}' / f).write_bytes(b'y' * 8192)
  held = tmp_path / f'{scratch.STAGING}held'
  held.mkdir()
  holder = subprocess.Popen([sys.executable, '-c', PENDING_HOLDER, str(held / scratch.PENDING)],
                            stdout=subprocess.PIPE, text=True)
  lookalike = tmp_path / 'flexjax-offload-mine'
  lookalike.mkdir()
  try:
    assert holder.stdout.readline().strip() == 'locked'
    removed = scratch.sweep(tmp_path)
    assert sorted(r.path.name for r in removed) == [f'{scratch.STAGING}emptied',
                                                    f'{scratch.STAGING}pending']
    assert 'removed 2 folders' in capfd.readouterr().err  # (the empty one is not news)
    assert sorted(p.name for p in tmp_path.iterdir()) == [held.name, lookalike.name]
    assert [p.name for p in held.iterdir()] == [scratch.PENDING]
  finally:
    holder.kill()
    holder.wait()
    holder.stdout.close()
  scratch.sweep(tmp_path, report=False)
  assert [p.name for p in tmp_path.iterdir()] == [lookalike.name]


def test_a_claimed_folder_has_its_name_and_owner_file_only_and_leaves_nothing(tmp_path):
  """No staging folder, nor a pending owner file, stays beside or in a claimed folder."""
  with scratch.claim(tmp_path, 'mine-') as claim:
    assert claim.path.name.startswith('mine-') and claim.owned
    assert sorted(p.name for p in tmp_path.iterdir()) == [claim.path.name]
    assert [p.name for p in claim.path.iterdir()] == [scratch.OWNER]
  assert list(tmp_path.iterdir()) == []


def test_without_flock_a_claim_works_and_a_sweep_touches_nothing(tmp_path, monkeypatch):
  """A filesystem without flock: the folder is made and removed all the same, unowned; a sweep
  judges nothing there, and leaves no pending owner file in a staging folder it cannot lock."""
  def no_flock(fd, operation):
    raise OSError(errno.ENOLCK, 'No locks available')
  monkeypatch.setattr(scratch.fcntl, 'flock', no_flock)
  stranded = tmp_path / f'{scratch.STAGING}left'  # a claim killed here: no sweep can judge it
  stranded.mkdir()
  with scratch.claim(tmp_path, 'mine-') as claim:
    assert not claim.owned and claim.path.name.startswith('mine-')
    assert list(claim.path.iterdir()) == []
    assert scratch.sweep(tmp_path) == []
    assert claim.path.is_dir() and list(stranded.iterdir()) == []
  assert [p.name for p in tmp_path.iterdir()] == [stranded.name]


CHURNER = '''
import sys
from flexjax import scratch
while True:
  with scratch.claim(sys.argv[1], 'flexjax-churn-', report=False) as claim:
    (claim.path / 'data.bin').write_bytes(b'x' * 4096)
'''
SWEEPER = '''
import sys
from flexjax import scratch
while True:
  scratch.sweep(sys.argv[1], report=False)
'''


def test_processes_killed_anywhere_in_a_claim_or_its_removal_leave_nothing_a_sweep_keeps(
    tmp_path):
  """Processes that claim and release folders in a loop, killed at random moments (in mkdtemp,
  before the owner file is locked, between the owner file going and the folder going), beside
  a process sweeping the same folder all the while: none fails, and once all are dead one
  sweep leaves the parent empty."""
  rng = np.random.default_rng(7)
  env = dict(os.environ, JAX_PLATFORMS='cpu')
  sweeper = subprocess.Popen([sys.executable, '-c', SWEEPER, str(tmp_path)], cwd=REPO, env=env,
                             stderr=subprocess.PIPE, text=True)
  try:
    for _ in range(12):
      churner = subprocess.Popen([sys.executable, '-c', CHURNER, str(tmp_path)], cwd=REPO,
                                 env=env, stderr=subprocess.PIPE, text=True)
      try:
        churner.wait(timeout=0.5 + rng.uniform(0, 0.3))
      except subprocess.TimeoutExpired:
        churner.send_signal(signal.SIGKILL)
        churner.wait()
      err = churner.stderr.read()
      churner.stderr.close()
      assert churner.returncode == -signal.SIGKILL, err  # it ran until it was killed
    assert sweeper.poll() is None, sweeper.stderr.read()
  finally:
    sweeper.kill()
    sweeper.wait()
    sweeper.stderr.close()
  scratch.sweep(tmp_path, report=False)
  assert sorted(p.name for p in tmp_path.iterdir()) == []
