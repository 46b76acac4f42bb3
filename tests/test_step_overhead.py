"""tools/step_overhead.py: the engine's time per decode step of a model too narrow to compute."""

import subprocess
import sys

from tools import step_overhead


def test_every_repeat_is_timed_and_the_best_is_reported():
  result = step_overhead.measure(layers=2, width=16, rows=2, prompt_len=4, gen_len=4, repeats=2)
  assert result['device'].startswith('cpu') and len(result['decode_ms_per_step']) == 2
  assert result['best_ms_per_step'] == min(result['decode_ms_per_step']) > 0
  assert result['best_ms_per_layer_step'] == result['best_ms_per_step'] / 4  # and embed, head


def test_a_generation_past_the_model_is_one_line():
  done = subprocess.run([sys.executable, '-m', 'tools.step_overhead', '--prompt_len=2000',
                         '--gen_len=100', '--layers=1', '--repeats=1'],
                        capture_output=True, text=True, timeout=300)
  assert done.returncode == 2
  assert done.stderr.strip().splitlines()[-1].startswith('step_overhead: error:')
  assert 'Traceback' not in done.stderr
