"""How a process ends once it is told to stop (SIGTERM, Ctrl-C, SIGHUP), even when a step never
finishes.

The signal is answered in the main thread: SIGTERM and SIGHUP exit, Ctrl-C raises
KeyboardInterrupt, and the unwinding removes the run's folders (a job's synced rows stay). But
Python runs signal handlers only between bytecodes of the main thread: a main thread waiting in
native code on a step that never finishes (a hung XLA computation) never runs the handler, and
an unwinding that waits on such a step never ends. So a watcher thread hears every signal too
(through the wakeup descriptor the interpreter writes each caught signal's number to, from
whatever thread the kernel interrupted) and ends the process itself when the main thread has not
done so within the grace time, or at once on a second signal. Such an exit is what a `kill -9`
leaves, which every run is built to survive: a job's output keeps its complete blocks (the rest
is cut off on resume) and the next run removes the folders left behind (flexjax.scratch).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import select
import signal
import sys
import threading
import time
from typing import Callable

STOP_GRACE_S = 30.0  # how long the main thread may take to unwind after the first signal
STOPPING = {signal.SIGINT: 'Ctrl-C', signal.SIGTERM: 'SIGTERM', signal.SIGHUP: 'SIGHUP'}


@contextlib.contextmanager
def signals_held():
  """Holds the main thread's answer to a stop signal back while the block runs, and gives it as
  the block ends: a child process started in the block (subprocess.Popen, which returns only
  once the child runs the new program) is never left running unknown to its parent, as it would
  be were Ctrl-C to raise inside Popen. (The watcher thread still hears the signal at once.)"""
  came = []
  held = {s: signal.getsignal(s) for s in STOPPING
          if signal.getsignal(s) not in (signal.SIG_IGN, None)}
  for signum in held:
    signal.signal(signum, lambda signum, frame: came.append((signum, frame)))
  try:
    yield
  finally:
    for signum, handler in held.items():
      signal.signal(signum, handler)
    if came:
      signum, frame = came[0]
      if callable(held[signum]):
        held[signum](signum, frame)
      else:  # the default action, now that it is back
        signal.raise_signal(signum)


def _exit_on_signal(signum, frame) -> None:
  del frame
  sys.exit(128 + signum)  # unwinds like Ctrl-C, so the offload folder and temp files go too


class StopWatch:
  """Installs the main thread's handlers of SIGTERM and SIGHUP (the terminal closed: without
  one the process would die where it stands, leaving its offload folder for the next run to
  remove; left ignored under nohup) and the watcher thread (call in the main thread, before
  anything starts threads of its own). `kept` is called when the watcher ends the process: the
  end of its line, what the user keeps (set once the run knows, e.g. a job's output, and read
  then: the job may have ended meanwhile)."""

  def __init__(self, grace_s: float = STOP_GRACE_S):
    self.grace_s = grace_s
    self.kept: Callable[[], str] = str  # '' until the run knows
    signal.signal(signal.SIGTERM, _exit_on_signal)
    if signal.getsignal(signal.SIGHUP) == signal.SIG_DFL:
      signal.signal(signal.SIGHUP, _exit_on_signal)
    read, write = os.pipe()
    for fd in read, write:
      fcntl.fcntl(fd, fcntl.F_SETFD, fcntl.FD_CLOEXEC)
    os.set_blocking(write, False)  # the interpreter's writes from a signal handler never block
    signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    threading.Thread(target=self._watch, args=(read,), name='flexjax-stop', daemon=True).start()

  def _watch(self, read: int) -> None:
    first, deadline = None, None
    while True:
      timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
      if not select.select([read], [], [], timeout)[0]:
        self._end(first, f'it did not stop within {self.grace_s:g} s of {STOPPING[first]} (a '
                  'step that never finishes holds its clean-up)')
      for signum in os.read(read, 64):
        if signum not in STOPPING:
          continue
        if first is not None:
          self._end(signum, f'{STOPPING[signum]} again while it stopped')
        first, deadline = signum, time.monotonic() + self.grace_s

  def _end(self, signum: int, why: str) -> None:
    """Ends the process now, without the main thread's unwinding."""
    line = (f'flexjax: stopped without its clean-up: {why}; the next run removes the folders '
            f'this one leaves{self.kept()}\n')
    os.write(2, line.encode())
    os._exit(128 + signum)
