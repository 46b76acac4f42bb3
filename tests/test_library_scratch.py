"""What XLA:CPU's library fusions allocate beside XLA's own buffers (flexjax/library_scratch.py),
against the peak RSS the kernel reports for a fresh process running the step
(tools/step_memory.py)."""

import json
import subprocess
import sys

import pytest

MIB = 2**20
WIDE = json.dumps(dict(name='wide', num_layers=1, hidden_size=1024, num_heads=16, ffn_dim=16384,
                       vocab_size=100, max_positions=1024))


def _measure(dtype: str) -> dict:
  """One prefill layer step of 8 x 512 rows in a fresh process."""
  done = subprocess.run([sys.executable, '-m', 'tools.step_memory', f'--model_json={WIDE}',
                         '--rows=8', '--prompt_len=512', f'--dtype={dtype}'],
                        capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-2000:]
  return json.loads(done.stdout.strip().splitlines()[-2])


@pytest.mark.parametrize('dtype', ['bfloat16', 'float32'])
def test_library_fusions_memory_is_counted_and_bounds_the_measured_peak(dtype):
  """bfloat16: XLA:CPU's YNNPACK graph fusion of out-projection to fc2 keeps its products'
  results in tensors of its own; float32 (oneDNN's products): the packed matrices (fc1 alone is
  64 MiB) and oneDNN's working buffers. Either way the step's peak RSS exceeds XLA's bytes by
  tens of MiB, and the counted bytes cover it (a few MiB of allocator rounding allowed)."""
  got = _measure(dtype)
  assert got['onednn'] == (dtype == 'float32'), got
  assert got['library'] >= 48 * MIB, got
  assert got['counted'] == got['xla'] + got['library'], got
  assert got['rss'] > got['xla'] + 32 * MIB, got  # what XLA's analysis alone would miss
  assert got['rss'] <= got['counted'] + 4 * MIB, got


def test_step_memory_tool_names_a_bad_model_in_one_line():
  done = subprocess.run([sys.executable, '-m', 'tools.step_memory', '--model_json={"x": 1}'],
                        capture_output=True, text=True, timeout=120)
  assert done.returncode == 2
  assert done.stderr.strip().splitlines()[-1].startswith('step_memory: error: --model_json=')
