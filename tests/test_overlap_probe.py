"""tools/overlap_probe.py: the three phases measured on small sizes, the efficiency's arithmetic,
and one-line errors."""

import subprocess
import sys

import pytest

from flexjax.errors import FlexjaxError
from tools import overlap_probe


def test_the_phases_count_their_work_and_leave_nothing_behind(tmp_path):
  r = overlap_probe.measure(str(tmp_path), file_bytes=1, seconds=0.3, rows=2, out_dim=64,
                            in_dim=32, threads=1)
  assert r['file_bytes'] == overlap_probe.CHUNK  # at least one request
  assert r['compute']['ms_per_product'] > 0 and r['compute']['read_gbps'] is None
  assert r['read']['read_gbps'] > 0 and r['read']['ms_per_product'] is None
  assert r['both']['ms_per_product'] > 0 and r['both']['read_gbps'] > 0
  assert r['overlap_efficiency'] > 0
  assert set(r['both']['cpu']) == {'user', 'system', 'iowait', 'idle', 'steal'}
  assert sum(r['both']['cpu'].values()) == pytest.approx(1.0, abs=0.01)
  assert list(tmp_path.iterdir()) == []  # the probe's file and folder are removed
  assert 'overlap efficiency' in overlap_probe.format_result(r)


def test_efficiency_is_one_when_both_run_at_their_own_speed_and_half_when_they_take_turns():
  compute, read = {'ms_per_product': 10.0}, {'read_gbps': 1.0}
  side_by_side = {'seconds': 1.0, 'ms_per_product': 10.0, 'read_gbps': 1.0}
  turns = {'seconds': 1.0, 'ms_per_product': 20.0, 'read_gbps': 0.5}
  assert overlap_probe.overlap_efficiency(compute, read, side_by_side) == 1.0
  assert overlap_probe.overlap_efficiency(compute, read, turns) == 0.5
  assert overlap_probe.overlap_efficiency(compute, read, {**turns, 'read_gbps': None}) is None


def test_cpu_shares_are_the_differences_of_proc_stat():
  before = dict.fromkeys(overlap_probe._CPU_FIELDS, 0)
  after = {**before, 'user': 60, 'steal': 30, 'idle': 10}
  assert overlap_probe.cpu_shares(before, after) == {
      'user': 0.6, 'system': 0.0, 'iowait': 0.0, 'idle': 0.1, 'steal': 0.3}
  assert overlap_probe.cpu_shares(None, after) == {}


def test_bad_sizes_and_folders_are_one_line_errors(tmp_path):
  with pytest.raises(FlexjaxError, match='seconds=0'):
    overlap_probe.measure(str(tmp_path), file_bytes=1, seconds=0)
  done = subprocess.run([sys.executable, '-m', 'tools.overlap_probe',
                         f'--folder={tmp_path / "missing"}'], capture_output=True, text=True,
                        timeout=120)
  assert done.returncode == 2
  assert done.stderr.strip().splitlines()[-1].startswith('overlap_probe: error: --folder=')
  assert 'Traceback' not in done.stderr
