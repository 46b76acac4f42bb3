"""tools/device_check.sh, the GPU checks in one command: its steps run in order within its time,
and everything it would run names flags, memcheck cases, tests and a suite that exist."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from absl import flags

from flexjax import flags as flags_lib
from tools import memcheck
from tools import step_overhead
from tools import suite
from tools import transfer_probe

ROOT = Path(__file__).resolve().parent.parent
STEPS = ['env', 'transfers', 'writeback', 'fp16', 'overhead', 'memcheck', 'phases', 'suite',
         'tests']


def run_recorded(tmp_path, seconds: int, sleep: float = 0,
                 steps: tuple[str, ...] = ()) -> tuple[list[str], list[list[str]]]:
  """Runs the script with a stand-in interpreter that records its arguments, sleeps `sleep`
  seconds and exits 0 (`steps`: those named alone): (steps.txt lines, each recorded argv)."""
  calls = tmp_path / 'calls.jsonl'
  fake = tmp_path / 'python'
  fake.write_text('#!/usr/bin/env python3\nimport json, sys, time\n'
                  f'open({str(calls)!r}, "a").write(json.dumps(sys.argv[1:]) + "\\n")\n'
                  f'time.sleep({sleep})\n')
  fake.chmod(0o755)
  out = tmp_path / 'out'
  # from an empty folder: no FlexGen wheel to install there
  proc = subprocess.run(['bash', str(ROOT / 'tools/device_check.sh'), str(out), str(seconds),
                         *([','.join(steps)] if steps else [])],
                        cwd=tmp_path,
                        env={'PATH': '/usr/bin:/bin', 'PYTHON': str(fake)},
                        capture_output=True, text=True, timeout=60)
  assert proc.returncode == 0, proc.stderr
  argvs = [json.loads(line) for line in calls.read_text().splitlines()]
  return (out / 'steps.txt').read_text().splitlines(), argvs


def test_steps_run_in_order_and_hand_back_few_files(tmp_path):
  lines, argvs = run_recorded(tmp_path, 560)
  assert [line.split()[0] for line in lines[:-1]] == STEPS
  assert all(' rc=0 ' in line for line in lines[:-1])
  assert lines[-1].startswith('device check:')
  # the suite step gets what is left but the tests' share
  limit = int(lines[STEPS.index('suite')].split('(limit ')[1].split()[0])
  assert 560 - 120 - 5 <= limit <= 560 - 120
  # phases runs its tool twice; no render: the stand-in wrote no suite records
  assert len(argvs) == len(STEPS) + 1
  assert {p.name for p in (tmp_path / 'out').iterdir()} == {'steps.txt', 'log.txt'}


def test_a_short_total_skips_what_does_not_fit(tmp_path):
  lines, argvs = run_recorded(tmp_path, 13, sleep=4)
  assert lines[0].startswith('env rc=0')
  # what is left of the 13 s: a whole second may pass before the first step starts
  assert 12 <= int(lines[0].split('(limit ')[1].split()[0]) <= 13, lines[0]
  assert lines[1:-1] == [f'{name} skipped: no time left' for name in STEPS[1:]]
  assert len(argvs) == 1


def test_named_steps_run_alone_and_the_suite_keeps_no_share_for_tests(tmp_path):
  lines, argvs = run_recorded(tmp_path, 300, steps=('writeback', 'suite'))
  assert [line.split()[0] for line in lines[:-1]] == ['writeback', 'suite']
  limit = int(lines[1].split('(limit ')[1].split()[0])
  assert 300 - 5 <= limit <= 300
  assert [a[:2] for a in argvs] == [['-m', 'tools.transfer_probe'], ['-m', 'tools.suite']]
  proc = subprocess.run(['bash', str(ROOT / 'tools/device_check.sh'), str(tmp_path / 'x'), '60',
                         'env,gpu'], capture_output=True, text=True, timeout=60)
  assert proc.returncode == 2 and "unknown step 'gpu'" in proc.stdout


def test_what_it_runs_exists(tmp_path):
  _, argvs = run_recorded(tmp_path, 560)
  by_module = {a[1]: a[2:] for a in argvs if a[0] == '-m'}
  # flexjax.main's flags parse
  fv = flags.FlagValues()
  flags_lib.define_flags(fv)
  fv(['main', *by_module['flexjax.main']])
  assert fv.host_memory == 'pinned' and fv.w_cpu_percent == 70
  # memcheck's cases exist
  only = next(a for a in by_module['tools.memcheck'] if a.startswith('--only='))
  names = only.split('=', 1)[1].split(',')
  assert names and set(names) <= set(memcheck.CASES)
  # the suite file loads; each FlexGen row runs a policy a flexjax row runs
  path = next(a for a in by_module['tools.suite'] if a.startswith('--suite=')).split('=', 1)[1]
  _, cases = suite.load_suite(str(ROOT / path))
  assert {c['system'] for c in cases} == {'flexjax', 'flexgen'}
  flexjax_policies = [c['policy'] for c in cases if c['system'] == 'flexjax']
  for case in cases:
    if case['system'] == 'flexgen':
      assert case['policy'] in flexjax_policies
  # the transfer probe's flags parse
  probe = flags.FlagValues()
  transfer_probe.define_flags(probe)
  probe(['transfer_probe', *by_module['tools.transfer_probe']])
  assert probe.mib == 256
  # the step-overhead tool's defaults parse
  overhead = flags.FlagValues()
  step_overhead.define_flags(overhead)
  overhead(['step_overhead', *by_module['tools.step_overhead']])
  assert overhead.layers == 32
  # the phase tool runs once with jax's default allocator, once growing
  assert [a for a in argvs if a[:2] == ['-m', 'tools.phase_memory']] == [
      ['-m', 'tools.phase_memory']] * 2
  assert (ROOT / 'tools/phase_memory.py').is_file()
  # the test files exist
  tests = [a for a in by_module['pytest'] if a.endswith('.py')]
  assert tests and all((ROOT / t).is_file() for t in tests)
  # the inline programs compile
  for argv in argvs:
    if argv[0] == '-c':
      compile(argv[1], '<device_check>', 'exec')
