"""What placing weights leaves resident, as the kernel reports it: a plan counts the buffers
alive, so memory the engine freed must leave the process."""

import ctypes
import ctypes.util
import subprocess
import sys

import pytest

MIB = 2**20

# Builds an engine (dummy opt-125m weights, all on the device) and prints the RSS a trim of
# glibc's heaps would still return: the freed memory placement left resident.
SCRIPT = '''
from flexjax import memwatch
from flexjax.config import preset
from flexjax.engine import Engine
from flexjax.policy import Policy
from flexjax.weights import DummyWeights

engine = Engine(DummyWeights(preset('opt-125m')), policy=Policy(gpu_batch_size=8))
before = memwatch.current_rss()
memwatch.return_free_memory()
print(before - memwatch.current_rss())
engine.close()
'''


def _glibc() -> bool:
  name = ctypes.util.find_library('c')
  return bool(name) and hasattr(ctypes.CDLL(name), 'malloc_trim')


@pytest.mark.skipif(not _glibc(), reason='the heaps measured are glibc\'s')
def test_placing_weights_leaves_no_freed_memory_resident():
  """Without the trim after placement glibc keeps 27 MiB here (180 MiB for opt-1.3b) that no
  plan counts."""
  done = subprocess.run([sys.executable, '-c', SCRIPT], capture_output=True, text=True,
                        timeout=300)
  assert done.returncode == 0, done.stderr[-2000:]
  assert int(done.stdout.strip().splitlines()[-1]) < 4 * MIB
