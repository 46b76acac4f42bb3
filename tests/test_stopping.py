"""A process told to stop ends, also when its main thread waits in native code that never returns
(a hung step): flexjax.stopping's watcher, in a small process of its own. The engine's runs with
it: tests/test_job.py's kill test stops a job stuck in a step."""

import signal
import subprocess
import sys
import time

import pytest

# The main thread waits on a mutex it already holds: native code that no signal interrupts, so
# Python's own handler never runs. 'stuck' waits so, and its clean-up does too (as a run's waits
# on its hung step), wherever the signal lands; 'clean' waits in Python (interruptible) and
# unwinds at once. Ctrl-C is turned back on where the tests run with it ignored (a shell's
# background jobs), SIGHUP where they run under nohup.
PROGRAM = '''
import ctypes, signal, sys, threading
from flexjax.stopping import StopWatch
signal.signal(signal.SIGINT, signal.default_int_handler)  # where started with it ignored
# SIGHUP as a terminal's process has it, or as under nohup (the tests may run under nohup)
signal.signal(signal.SIGHUP, signal.SIG_IGN if sys.argv[3:] == ['nohup'] else signal.SIG_DFL)
stop = StopWatch(float(sys.argv[1]))
stop.kept = lambda: '; what the run kept'
mutex = ctypes.create_string_buffer(64)  # a default pthread mutex, zeroed
libc = ctypes.CDLL(None)
libc.pthread_mutex_lock(mutex)
try:
  print('ready', flush=True)
  if sys.argv[2] == 'stuck':
    libc.pthread_mutex_lock(mutex)
  else:
    threading.Event().wait()
finally:
  print('unwound', flush=True)
  if sys.argv[2] == 'stuck':
    libc.pthread_mutex_lock(mutex)
'''


def stopped(grace_s: float, how: str, *signals: int,
            nohup: bool = False) -> tuple[int, str, str, float]:
  """Runs PROGRAM (as under nohup: SIGHUP ignored), sends `signals` half a second apart once it
  is ready; returns its exit code, stdout, stderr and the seconds from the first signal to its
  end."""
  proc = subprocess.Popen([sys.executable, '-c', PROGRAM, str(grace_s), how,
                           *(['nohup'] if nohup else [])],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  assert proc.stdout.readline() == 'ready\n'
  start = time.monotonic()
  for n, sig in enumerate(signals):
    if n:
      time.sleep(0.5)
    proc.send_signal(sig)
  out, err = proc.communicate(timeout=60)
  return proc.returncode, out, err, time.monotonic() - start


def test_a_stuck_process_ends_its_grace_time_after_sigterm():
  code, out, err, seconds = stopped(1.5, 'stuck', signal.SIGTERM)
  assert code == 128 + signal.SIGTERM
  assert err.splitlines() == [
      'flexjax: stopped without its clean-up: it did not stop within 1.5 s of SIGTERM (a step '
      'that never finishes holds its clean-up); the next run removes the folders this one '
      'leaves; what the run kept']
  assert 1.5 <= seconds < 10


def test_a_second_ctrl_c_ends_a_stuck_process_at_once():
  code, out, err, seconds = stopped(60, 'stuck', signal.SIGINT, signal.SIGINT)
  assert code == 128 + signal.SIGINT
  assert err.splitlines() == [
      'flexjax: stopped without its clean-up: Ctrl-C again while it stopped; the next run '
      'removes the folders this one leaves; what the run kept']
  assert seconds < 30  # not the grace time


@pytest.mark.parametrize('sig', [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_a_process_that_unwinds_is_left_to_unwind(sig):
  """SIGHUP (the terminal closed) unwinds as SIGTERM does."""
  code, out, err, seconds = stopped(1, 'clean', sig)
  assert 'unwound' in out
  assert 'flexjax: stopped' not in err
  if sig != signal.SIGINT:
    assert code == 128 + sig and not err
  else:  # KeyboardInterrupt's own exit
    assert 'KeyboardInterrupt' in err


def test_sighup_stays_ignored_under_nohup():
  """A SIGHUP ignored where the process started (nohup) is not answered: the process runs on,
  until SIGTERM."""
  code, out, err, seconds = stopped(1, 'clean', signal.SIGHUP, signal.SIGHUP, signal.SIGTERM,
                                    nohup=True)
  assert code == 128 + signal.SIGTERM and 'unwound' in out and not err
  assert seconds >= 1  # the two SIGHUPs half a second apart changed nothing


HELD = '''
import signal, subprocess, sys
from flexjax.stopping import signals_held
signal.signal(signal.SIGINT, signal.default_int_handler)
signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
for signum in signal.SIGINT, signal.SIGTERM:
  child = None
  try:
    with signals_held():
      signal.raise_signal(signum)
      child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])
      print('started', flush=True)
  except (KeyboardInterrupt, SystemExit) as e:
    child.kill()
    print(type(e).__name__, child.wait(), flush=True)
print(signal.getsignal(signal.SIGINT) is signal.default_int_handler, flush=True)
'''


def test_a_stop_signal_during_a_childs_start_comes_once_the_child_is_known():
  """flexjax.launch starts its stages under signals_held: a Ctrl-C or SIGTERM landing inside
  Popen is answered as the block ends, with the child in hand to stop (not left running)."""
  done = subprocess.run([sys.executable, '-c', HELD], capture_output=True, text=True,
                        timeout=60)
  assert done.returncode == 0, done.stderr[-2000:]
  assert done.stdout.split('\n') == ['started', 'KeyboardInterrupt -9', 'started',
                                      'SystemExit -9', 'True', '']
