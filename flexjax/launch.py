"""Pipelined generation over processes: python -m flexjax.launch --num_processes=N <flags>.

Locally (no --process_id) it starts N processes on this machine, coordinator on a free localhost
port, one pipeline stage each (flexjax.pipeline); stage 0 prints the report. A watchdog stops
every other stage once one exits with an error and names it in one line. On several hosts,
start one process per host with --coordinator=host:port --num_processes=N --process_id=i.
"""

import functools
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

from absl import app
from absl import flags

from flexjax import flags as flags_lib
from flexjax import hardware
from flexjax import scratch
from flexjax.errors import FlexjaxError, flags_parser
from flexjax.stopping import StopWatch, signals_held

_GRACE_S = 5  # a stage told to stop gets this long before it is killed
_BECAUSE_OF_OTHERS = 3  # a stage's exit code when it stops because another stage cannot run


def define_launch_flags(fv: flags.FlagValues = flags.FLAGS) -> None:
  f = dict(flag_values=fv)
  flags.DEFINE_integer('num_processes', 1, 'Pipeline stages: processes, one device each.',
                       lower_bound=1, **f)
  flags.DEFINE_integer('process_id', None, 'This process\'s stage (multi-host; unset: start '
                       'every stage on this machine).', lower_bound=0, **f)
  flags.DEFINE_string('coordinator', None, 'host:port of process 0\'s coordinator (multi-host).',
                      **f)
  flags.DEFINE_integer('processes_per_host', 1, 'Stages on each host: they share its RAM and '
                       'disk where --cpu_mem/--disk_mem are not given (a local launch sets it).',
                       lower_bound=1, **f)
  flags.DEFINE_bool('stage_process', False, 'Run the stage in this process (the launcher starts '
                    'each stage as a child with this set, and reports its failure in one line).',
                    **f)
  flags.DEFINE_integer('stage_timeout', 60, 'Seconds a stage waits for the others to start, '
                       'and for a silent one before it gives up.', lower_bound=5, **f)


def main(argv, stop: StopWatch | None = None) -> int:
  from flexjax.main import interrupted, kept
  try:
    flags_lib.use_stop_grace(stop)
  except FlexjaxError as e:
    print(f'flexjax: error: {e}', file=sys.stderr)
    return 2
  if stop is not None:
    stop.kept = functools.partial(kept, flags.FLAGS.input, flags.FLAGS.output)
  try:
    return _main(argv)
  except KeyboardInterrupt:  # the stages were stopped; a job's synced outputs stay
    print(interrupted(flags.FLAGS.input, flags.FLAGS.output), file=sys.stderr)
    return 130


def _main(argv) -> int:
  if len(argv) > 1:
    print(f'flexjax: error: unexpected arguments {argv[1:]}; every option is a --flag',
          file=sys.stderr)
    return 2
  fv = flags.FLAGS
  flags_lib.quiet_library_logs()
  if fv.process_id is None:
    if fv.coordinator:
      print('flexjax: error: --coordinator needs --process_id (one process per host); leave '
            'both out to start every stage on this machine', file=sys.stderr)
      return 2
    try:
      _check_stages(fv.num_processes)
    except FlexjaxError as e:
      print(f'flexjax: error: {e}', file=sys.stderr)
      return 2
    return launch_local(fv.num_processes, _passed_flags(sys.argv[1:]), fv.stage_timeout)
  if fv.process_id >= fv.num_processes or not fv.coordinator:
    print(f'flexjax: error: --process_id={fv.process_id} needs --coordinator=host:port and '
          f'must be below --num_processes={fv.num_processes}', file=sys.stderr)
    return 2
  if fv.stage_process:
    return run_stage_process(fv)
  try:
    _check_coordinator(fv.coordinator, fv.process_id, fv.stage_timeout)
    _check_stages(fv.num_processes)
  except FlexjaxError as e:
    print(f'flexjax: error: {e}', file=sys.stderr)
    return 2
  return supervise(fv.process_id, fv.num_processes, sys.argv[1:])


def _check_coordinator(address: str, process_id: int, timeout: int) -> None:
  """Stage 0 can serve at the address; another stage reaches it within the timeout (the
  distributed runtime aborts the process, with a native stack trace, on either failure)."""
  host, _, port = address.rpartition(':')
  if not host or not port.isdigit():
    raise FlexjaxError(f'--coordinator={address!r} must be host:port, e.g. 10.0.0.1:4000')
  if process_id == 0:
    with socket.socket() as s:
      s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
      try:
        s.bind(('', int(port)))
      except OSError as e:
        raise FlexjaxError(f'stage 0 cannot serve the coordinator on port {port} ({e.strerror}); '
                           'choose a free port in --coordinator') from None
    return
  deadline = time.monotonic() + timeout
  while True:
    try:
      socket.create_connection((host, int(port)), timeout=2).close()
      return
    except OSError:
      if time.monotonic() > deadline:
        raise FlexjaxError(f'stage {process_id} cannot reach the coordinator {address} within '
                           f'--stage_timeout={timeout} s; start stage 0 with the same '
                           '--coordinator on that host, or check the address') from None
      time.sleep(0.5)


def supervise(process_id: int, n: int, args: list[str]) -> int:
  """Runs this host's stage as a child and reports its failure in one line."""
  log = tempfile.TemporaryFile('w+')
  procs = []
  try:
    with signals_held():  # a stop signal comes once the stage is in procs, and stops it
      procs.append(subprocess.Popen(
          [sys.executable, '-m', 'flexjax.launch', *args, '--stage_process'], stderr=log))
    code = procs[0].wait()
  except (KeyboardInterrupt, SystemExit):  # Ctrl-C, SIGTERM, SIGHUP: the stage unwinds too
    _stop(procs)
    raise
  finally:
    for proc in procs:
      if proc.poll() is None:
        proc.kill()
        proc.wait()
    _sweep_after_kills(procs)
  try:
    if code == 0:
      _forward(log)
      return 0
    print(f'flexjax: error: pipeline stage {process_id} of {n} stopped: '
          f'{_reason(log, code)}', file=sys.stderr)
    return 2 if code in (2, _BECAUSE_OF_OTHERS) else 1
  finally:
    log.close()


def _check_stages(n: int) -> None:
  """The flags, the paths, the prompts and the split of the model over n stages, before any
  stage starts."""
  from flexjax import pipeline
  from flexjax import run as run_lib
  from flexjax import stage_run
  rc = flags_lib.run_config_from_flags()
  stage_run.check_config(rc, flags.FLAGS.report_json)
  source, tokenizer = run_lib.load_weights(rc)
  if rc.prompt_file:
    run_lib.load_prompts(rc.prompt_file, source.config, tokenizer, chat=rc.chat)
  pipeline.split_layers(source.config, n)


def run_stage_process(fv) -> int:
  """One stage: joins the distributed runtime, runs, and (process 0) prints the report."""
  import jax
  from flexjax import run as run_lib
  from flexjax import stage_run
  from flexjax.job import write_atomically
  from flexjax.main import table
  hardware.include_cpu_platform()
  jax.config.update('jax_cpu_collectives_implementation', 'gloo')
  try:
    rc = flags_lib.run_config_from_flags()
    run_lib.check_paths(rc, fv.report_json)
    run_lib.use_compile_cache(fv.compile_cache, rc.weights_cache)  # before anything compiles
    jax.distributed.initialize(coordinator_address=fv.coordinator,
                               num_processes=fv.num_processes, process_id=fv.process_id,
                               initialization_timeout=fv.stage_timeout,
                               heartbeat_timeout_seconds=fv.stage_timeout // 2,
                               shutdown_timeout_seconds=fv.stage_timeout)
    report = stage_run.run_stage(rc, fv.num_processes, fv.process_id, fv.processes_per_host)
  except FlexjaxError as e:
    print(f'flexjax: error: {e}', file=sys.stderr, flush=True)
    # Without jax's shutdown barrier, which would wait for the other stages.
    os._exit(_BECAUSE_OF_OTHERS if isinstance(e, stage_run.OtherStageFailed) else 2)
  if report is not None:
    print(table(report), flush=True)
    if fv.report_json:
      try:
        write_atomically(fv.report_json, json.dumps(report, indent=1) + '\n')
      except FlexjaxError as e:
        print(f'flexjax: error: {e}', file=sys.stderr, flush=True)
        return 2
  return 0


def _passed_flags(args: list[str]) -> list[str]:
  """The command line's flags for the stages, less those the launcher sets per stage."""
  own = ('--num_processes', '--process_id', '--coordinator', '--processes_per_host',
         '--stage_process', '--nostage_process')
  return [a for a in args if not a.startswith(own)]


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def launch_local(n: int, args: list[str], timeout: int) -> int:
  """Starts n stages on this machine and waits for them; once one fails, stops the rest."""
  port = _free_port()
  logs, procs = [], []
  try:
    for i in range(n):
      logs.append(tempfile.TemporaryFile('w+'))
      with signals_held():  # a stop signal comes once the stage is in procs, and stops it
        procs.append(subprocess.Popen(
            [sys.executable, '-m', 'flexjax.launch', *args, f'--num_processes={n}',
             f'--process_id={i}', f'--coordinator=127.0.0.1:{port}',
             f'--processes_per_host={n}', f'--stage_timeout={timeout}', '--stage_process'],
            stdout=None if i == 0 else subprocess.DEVNULL, stderr=logs[i]))
    failed = None
    while failed is None and any(p.poll() is None for p in procs):
      failed = next((i for i, p in enumerate(procs) if p.poll() not in (None, 0)), None)
      time.sleep(0.1)
    if failed is None:
      failed = next((i for i, p in enumerate(procs) if p.returncode), None)
    if failed is None:
      _forward(logs[0])
      return 0
    if procs[failed].returncode == _BECAUSE_OF_OTHERS:  # the stage that names the reason
      failed = _own_failure(procs, failed)
    _stop(procs)
    code = procs[failed].returncode
    reason = _reason(logs[failed], code)
    print(f'flexjax: error: pipeline stage {failed} of {n} failed: {reason}; the other stages '
          'were stopped', file=sys.stderr)
    return 2 if code == 2 else 1
  except (KeyboardInterrupt, SystemExit):  # Ctrl-C, SIGTERM, SIGHUP: each stage unwinds too
    _stop(procs)
    raise
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
    for log in logs:
      log.close()
    _sweep_after_kills(procs)


def _own_failure(procs, failed: int) -> int:
  """The stage that failed on its own, once every stage has exited (within the grace time),
  else `failed`."""
  deadline = time.monotonic() + _GRACE_S
  while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
    time.sleep(0.05)
  return next((i for i, p in enumerate(procs)
               if p.returncode not in (None, 0, _BECAUSE_OF_OTHERS)), failed)


def _stop(procs) -> None:
  for p in procs:
    if p.poll() is None:
      p.send_signal(signal.SIGTERM)
  deadline = time.monotonic() + _GRACE_S
  for p in procs:
    try:
      p.wait(max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
      p.kill()
      p.wait()


def _sweep_after_kills(procs) -> None:
  """A stage killed (by a signal, or by _stop where its unwinding waited on the others in a
  collective) left its offload folder: removed once no stage holds it, not by the next run."""
  if any(p.returncode is not None and p.returncode < 0 for p in procs):
    scratch.sweep(scratch.offload_parent(flags.FLAGS.offload_dir), report=False)


def _lines(log) -> list[str]:
  log.seek(0)
  return [line.rstrip('\n') for line in log.read().splitlines() if line.strip()]


def _reason(log, code: int) -> str:
  """Why a stage ended: its own one-line error, the distributed runtime's verdict, a signal,
  or its last line of output."""
  lines = _lines(log)
  own = _last_error(log)
  if own is not None and any(line.startswith('flexjax: error: ') for line in lines):
    return own
  if any('distributed service detected fatal errors' in line for line in lines):  # it aborts
    if any('CoordinationService/RegisterTask' in line for line in lines):  # while joining
      return ('the other stages did not all join within --stage_timeout: one refused its flags '
              'or inputs (see its terminal) or was not started')
    return ('the distributed runtime lost another stage (it exited, or its host cannot be '
            'reached)')
  if code < 0:
    return f'killed by signal {-code}'
  return own or f'exit code {code}'


def _last_error(log) -> str | None:
  """A stage's own one-line error, else its last line of output."""
  lines = _lines(log)
  errors = [line for line in lines if line.startswith('flexjax: error: ')]
  if errors:
    return errors[-1][len('flexjax: error: '):]
  return lines[-1].strip() if lines else None


def _forward(log) -> None:
  """Stage 0's messages of its own (not the collectives' connection chatter)."""
  for line in _lines(log):
    if line.startswith('flexjax'):
      print(line, file=sys.stderr)


def entry() -> None:
  stop = StopWatch()  # a stage whose step never finishes still ends (flexjax.stopping)
  flags_lib.define_flags()
  define_launch_flags()
  app.run(functools.partial(main, stop=stop), flags_parser=flags_parser('flexjax'))


if __name__ == '__main__':
  entry()
