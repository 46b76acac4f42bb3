"""tools/transfer_probe.py: each way of copying offloaded rows, timed, and its bytes checked."""

import json
import subprocess
import sys

import numpy as np

from tools import transfer_probe


def test_every_method_delivers_the_rows_and_is_timed():
  result = transfer_probe.measure(mib=2, repeats=1)
  assert result['bytes'] == 16 * 16 * 4096 * 2  # 2 MiB of [16, time, 4096] float16 rows
  # the CPU backend here offers pinned host memory: every method runs
  assert set(result['to_host']) == {'asarray', 'pinned+asarray', 'pinned+threads'}
  assert result['copy_threads'] == 1  # a CPU backend's cores compute
  assert set(result['to_device']) == {'fresh', 'reused', 'via pinned'}
  rates = [*result['to_host'].values(), *result['to_device'].values()]
  assert all(np.isfinite(rate) and rate > 0 for rate in rates)


def test_a_method_that_delivers_other_bytes_is_an_error(monkeypatch):
  real = transfer_probe._methods

  def one_corrupted(device, rows, storage, calls):
    methods = real(device, rows, storage, calls)
    methods['to_host']['asarray'] = lambda: np.zeros_like(rows)
    return methods

  monkeypatch.setattr(transfer_probe, '_methods', one_corrupted)
  try:
    transfer_probe.measure(mib=1, repeats=1)
  except RuntimeError as e:
    assert 'to_host by asarray delivered other bytes' in str(e)
  else:
    raise AssertionError('a corrupted copy passed')


def test_the_command_prints_json():
  done = subprocess.run([sys.executable, '-m', 'tools.transfer_probe', '--mib=1', '--repeats=1',
                         '--json'], capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stderr[-2000:]
  record = json.loads(done.stdout.splitlines()[-1])
  assert record['device'].startswith('cpu') and record['to_host']['asarray'] > 0
