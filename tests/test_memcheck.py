"""Reality checks: the memory the system measures for a run (peak RSS above the idle process,
from the kernel) never exceeds the execution plan's peak, in fresh processes."""

import subprocess
import sys

import pytest

from tools import memcheck


@pytest.mark.parametrize('name', memcheck.CI_CASES)
def test_measured_peak_never_exceeds_the_plan(name):
  row = memcheck.run_case(name)
  assert row['tier'] == 'ram'  # CPU backend: device and host tiers are one RAM
  assert 0 < row['measured'] <= row['planned'], row


def test_a_policy_over_its_ram_budget_is_refused_before_any_work():
  """The prefill-heavy case needs ~4.4 GiB; under a 2 GiB RAM budget it is refused with the
  tier, the need and the budget, in one line, before weights are read."""
  argv = [sys.executable, '-m', 'flexjax.main', *memcheck.COMMON,
          *memcheck.CASES['prefill_heavy'], '--cpu_mem=2']
  done = subprocess.run(argv, capture_output=True, text=True, timeout=600)
  assert done.returncode == 2
  lines = done.stderr.strip().splitlines()
  assert len(lines) == 1, done.stderr
  assert 'on the RAM (device and host tiers together)' in lines[0]
  assert '--cpu_mem allows 2.00 GiB' in lines[0] and 'largest: ' in lines[0]
