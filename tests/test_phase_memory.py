"""tools/phase_memory.py: the memory a run holds after each phase, read from the system."""

import json
import subprocess
import sys


def run_tool(*args):
  return subprocess.run([sys.executable, '-m', 'tools.phase_memory', *args], capture_output=True,
                        text=True, timeout=600)


def test_phases_read_from_the_system_and_the_plan_beside_them():
  done = run_tool('--rows=4', '--prompt_len=32', '--gen_len=2', '--json')
  assert done.returncode == 0, done.stderr[-2000:]
  record = json.loads(done.stdout.splitlines()[0])
  phases = {p['phase']: p for p in record['phases']}
  assert list(phases) == ['start', 'placed', 'compiled', 'generated']
  # opt-125m's weights are resident after placing: the kernel's RSS (a CPU backend) or the
  # device's bytes in use grew by at least the plan's resident weights (float16: ~250 MB)
  grown = max(phases['placed']['rss'] - phases['start']['rss'],
              phases['placed']['in_use'] - phases['start']['in_use'])
  assert grown >= 0.9 * 125e6 * 2
  assert all(p['rss_peak'] >= p['rss'] > 0 for p in phases.values())
  assert record['planned_device_peak'] == max(record['plan']['device'].values()) > 0
  assert 'planned device peak' in done.stdout


def test_a_bad_model_is_one_line():
  done = run_tool('--model=opt-0b')
  assert done.returncode != 0
  assert done.stderr.strip().splitlines()[-1].startswith("phase_memory: error: unknown model")
