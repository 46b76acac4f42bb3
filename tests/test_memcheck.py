"""Reality checks: the memory the system measures for a run (peak RSS above the idle process,
from the kernel) never exceeds the execution plan's peak, in fresh processes."""

import json
import os
import subprocess
import sys

import pytest

from tools import memcheck


@pytest.mark.parametrize('name', [*memcheck.CI_CASES, *(
    pytest.param(name, marks=pytest.mark.slow) for name in memcheck.SLOW_CI_CASES)])
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


def _first_auto_run(tmp_path, *extra):
  """`--policy=auto` on a machine without a cached profile: the run measures the machine."""
  env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / 'cache'))
  report = tmp_path / 'report.json'
  argv = [sys.executable, '-m', 'flexjax.main', *memcheck.COMMON, '--model=opt-125m',
          '--prompt_len=32', '--gen_len=2', '--policy=auto', '--noprogress',
          f'--offload_dir={tmp_path}', f'--report_json={report}', *extra]
  done = subprocess.run(argv, capture_output=True, text=True, timeout=900, env=env)
  profiles = list((tmp_path / 'cache').glob('flexjax/hw-*.json'))
  return done, report, profiles


@pytest.mark.slow  # the whole measurement (4-5 min beside the other test worker)
def test_a_first_auto_run_measures_the_machine_within_its_plan(tmp_path):
  """Measuring the machine for the cost model is part of the run's memory: its peak RSS,
  probe included (it once held 2.6 GiB, past a 2 GiB budget), stays within the plan, whose
  probe phase the report's planned peak covers; the profile it keeps is one the cost model
  takes."""
  from flexjax.hardware import HardwareProfile
  from test_hardware import check_measured_profile
  done, report, profiles = _first_auto_run(tmp_path, '--cpu_mem=3')
  assert done.returncode == 0, done.stderr[-2000:]
  assert len(profiles) == 1
  check_measured_profile(HardwareProfile.load(profiles[0]), tmp_path)
  row = json.loads(report.read_text())
  assert 0 < row['measured_ram_peak_bytes'] <= row['planned_ram_peak_bytes'], row


def test_a_machine_measurement_past_the_budget_is_refused_before_it_starts(tmp_path):
  done, _, profiles = _first_auto_run(tmp_path, '--cpu_mem=0.5')
  assert done.returncode == 2
  lines = done.stderr.strip().splitlines()
  assert len(lines) == 1, done.stderr
  assert lines[0].startswith('flexjax: error: measuring this machine for --policy=auto needs ')
  assert '--cpu_mem allows 512.00 MiB' in lines[0] and '--hw_profile=FILE' in lines[0]
  assert not profiles


def test_random_cases_are_valid_runs_of_every_kind():
  """`tools.memcheck --random` draws flags flexjax accepts (each parses into a run
  configuration), with searched and manual policies and every option among them."""
  import random

  from absl import flags

  from flexjax import flags as flags_lib
  rng = random.Random(0)
  drawn = [memcheck.random_case(rng) for _ in range(200)]
  for case in drawn:
    fv = flags.FlagValues()
    flags_lib.define_flags(fv)
    job = ['--input=rows.jsonl', '--output=out.jsonl'] if case.job else []
    fv(['flexjax', *memcheck.COMMON, *case.flags, *job])
    rc = flags_lib.run_config_from_flags(fv)
    assert rc.policy_mode in ('auto', 'manual')
    assert (rc.input is not None) is case.job
  assert any(c.job for c in drawn) and not all(c.job for c in drawn)
  assert any(c.job and '--policy=auto' in c.flags for c in drawn)
  every = {flag.split('=')[0] for case in drawn for flag in case.flags}
  assert {'--policy', '--compress_weight', '--compress_cache', '--cpu_attention', '--nooverlap',
          '--attn_sparsity', '--placement', '--compute_dtype', '--act_gpu_percent'} <= every
