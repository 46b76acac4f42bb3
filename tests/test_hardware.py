"""Backend choices made from the platform: the default compute dtype, and the CPU backend kept
beside the accelerator when JAX_PLATFORMS names only the latter; the engine's step overhead;
the measured profile."""

import math
import re
import time

import jax
import pytest

from flexjax import cost_model
from flexjax import flags as flags_lib
from flexjax import hardware
from flexjax import plan as plan_lib
from flexjax.config import ModelConfig
from flexjax.engine import Engine
from flexjax.errors import FlexjaxError
from flexjax.policy import Policy
from flexjax.weights import DummyWeights


@pytest.mark.parametrize('platform,dtype', [('gpu', 'float16'), ('cuda', 'float16'),
                                            ('rocm', 'float16'), ('cpu', 'float32')])
def test_default_compute_dtype_follows_the_platform(platform, dtype):
  assert hardware.default_compute_dtype(platform) == dtype


def test_engine_and_flags_leave_the_dtype_to_the_device(tmp_path):
  fv = flags_lib.flags.FlagValues()
  flags_lib.define_flags(fv)
  fv(['flexjax'])
  assert flags_lib.run_config_from_flags(fv).compute_dtype is None
  cfg = ModelConfig(name='dtype', num_layers=1, hidden_size=32, num_heads=4, ffn_dim=64,
                    vocab_size=100, max_positions=16)
  with Engine(DummyWeights(cfg, 'float16'), offload_dir=str(tmp_path)) as engine:
    assert engine.device.platform == 'cpu'
    assert (engine.compute_dtype, engine.cache_dtype) == ('float32', 'float32')
    assert engine.steps.compute.name == 'float32'
  with Engine(DummyWeights(cfg, 'float16'), compute_dtype='float16',
              offload_dir=str(tmp_path)) as engine:
    assert (engine.compute_dtype, engine.cache_dtype) == ('float16', 'float16')


@pytest.mark.parametrize('platforms,wanted', [
    ('cuda', 'cuda,cpu'), ('gpu', 'gpu,cpu'), ('rocm', 'rocm,cpu'), ('cuda,cpu', 'cuda,cpu'),
    ('cpu', 'cpu'), (' cuda , tpu ', 'cuda,tpu,cpu'), ('cpu,cuda', 'cpu,cuda'), (None, None),
    ('', '')])
def test_the_cpu_platform_is_added_to_jax_platforms(platforms, wanted):
  assert hardware.with_cpu_platform(platforms) == wanted


@pytest.fixture
def jax_platforms():
  """Sets jax_platforms for a test (the backends are already up: nothing is started)."""
  before = jax.config.jax_platforms
  yield lambda value: jax.config.update('jax_platforms', value)
  jax.config.update('jax_platforms', before)


def test_a_missing_cpu_backend_is_named_with_its_fix(monkeypatch, jax_platforms):
  def local_devices(process_index=None, backend=None):
    raise RuntimeError(f'Unknown backend {backend}')
  monkeypatch.setattr(jax, 'local_devices', local_devices)
  jax_platforms('cuda')
  with pytest.raises(FlexjaxError, match=r"JAX_PLATFORMS='cuda'.*JAX_PLATFORMS=cuda,cpu") as e:
    hardware.cpu_device()
  assert '\n' not in str(e.value)
  jax_platforms('cuda,cpu')
  with pytest.raises(RuntimeError, match='Unknown backend cpu'):  # another failure: as it is
    hardware.cpu_device()


def test_include_cpu_platform_updates_jax_platforms(jax_platforms):
  jax_platforms('cuda')
  hardware.include_cpu_platform()
  assert jax.config.jax_platforms == 'cuda,cpu'
  jax_platforms(None)
  hardware.include_cpu_platform()
  assert jax.config.jax_platforms is None


def test_step_overhead_is_measured_on_the_engine():
  """The engine's own time per layer step (a model too small for its products to count) is
  positive and far below a real layer's products on any machine (tens of milliseconds)."""
  seconds = hardware.step_overhead(num_layers=2, gpu_batches=2, gen_len=3)
  assert 0 < seconds < 0.01


def check_measured_profile(profile: hardware.HardwareProfile, folder) -> None:
  """A profile measured on this machine: every rate measured (batched products at some of the
  products' row counts) and finite; saved and loaded whole; a search over it predicts finite
  times."""
  assert 1 in profile.bmm_flops and set(profile.bmm_flops) <= set(profile.mm_flops)
  rates = [profile.ctog_bw, profile.gtoc_bw, profile.dtoc_bw, profile.ctod_bw, profile.cpu_flops,
           profile.prefill_attention_flops, *profile.mm_flops.values(),
           *profile.bmm_flops.values()]
  assert all(0 < r < math.inf for r in rates)
  assert profile.copies_share_compute and 0 <= profile.disk_overlap <= 1
  profile.save(folder / 'hw.json')
  assert hardware.HardwareProfile.load(folder / 'hw.json') == profile
  cfg = ModelConfig(name='measured', num_layers=2, hidden_size=64, num_heads=4, ffn_dim=128,
                    vocab_size=512, max_positions=64)
  sizes = plan_lib.Itemsizes(storage=2, compute=4, cache=4)
  got = cost_model.predict(cfg, Policy(gpu_batch_size=4, cache_gpu_percent=0,
                                       cache_cpu_percent=100, cpu_attention=True),
                           profile, sizes, prompt_len=16, gen_len=8)
  assert 0 < got.prefill_s < math.inf and 0 < got.decode_s < math.inf


def test_measuring_this_machine_gives_a_profile_the_cost_model_takes(tmp_path):
  """hardware.measure at the quick sizes (python -m tools.profile_hw --quick)."""
  profile = hardware.measure(jax.devices()[0], quick=True, scratch_dir=str(tmp_path))
  assert sorted(profile.mm_flops) == [1, 16, 256] and sorted(profile.bmm_flops) == [1, 16, 256]
  check_measured_profile(profile, tmp_path)


def test_profile_hw_refuses_an_output_it_cannot_write_before_measuring(tmp_path):
  import subprocess
  import sys
  from pathlib import Path
  blocker = tmp_path / 'file'
  blocker.write_text('')
  for output, says in ((blocker / 'sub' / 'x.json', 'cannot be written'), (tmp_path, 'is a folder')):
    proc = subprocess.run([sys.executable, '-m', 'tools.profile_hw', f'--output={output}'],
                          capture_output=True, text=True, timeout=60,
                          cwd=Path(__file__).resolve().parent.parent)
    assert proc.returncode != 0 and says in proc.stderr, proc.stderr
    assert f'flag --output={output}: ' in proc.stderr  # absl's parse error names flag and value
    assert 'measuring' not in proc.stderr and not proc.stdout  # refused before any work


@pytest.mark.parametrize('field, value, says', [
    ('ctog_bw', 0.0, 'ctog_bw=0.0 is not a positive rate'),
    ('mm_flops', {'1': 1e9, '8': float('nan')}, 'mm_flops[8]=nan'),
    ('bmm_flops', {}, 'bmm_flops is empty'),
    ('disk_overlap', 1.5, 'disk_overlap=1.5 must lie in [0, 1]')])
def test_a_profile_with_a_rate_the_cost_model_cannot_use_is_refused(tmp_path, field, value, says):
  """A profile file edited by hand, or measured with nothing to move (profile_hw's --size_mb=0
  had written zero bandwidths, and a run with it divided by zero), is one error naming the field,
  before any search."""
  import json
  import subprocess
  import sys
  from pathlib import Path
  profile = json.loads(hardware.t4_profile().to_json())
  profile[field] = value
  path = tmp_path / 'edited.json'
  path.write_text(json.dumps(profile))
  with pytest.raises(FlexjaxError, match=re.escape(says)):
    hardware.HardwareProfile.load(path)
  proc = subprocess.run([sys.executable, '-m', 'flexjax.main', '--model=opt-125m',
                         '--weights=dummy', '--policy=auto', f'--hw_profile={path}', '--dry_run',
                         '--noprogress'],
                        capture_output=True, text=True, timeout=120,
                        cwd=Path(__file__).resolve().parent.parent)
  lines = [line for line in proc.stderr.splitlines() if line.strip()]
  assert proc.returncode == 2 and len(lines) == 1 and says in lines[0], proc.stderr
  assert str(path) in lines[0] and 'Traceback' not in proc.stderr


def test_a_profile_is_cached_per_machine_cores_jax_build_and_disk(tmp_path, monkeypatch):
  """The cached profile (what --policy=auto plans with when no --hw_profile is given) is found
  again for this machine and offload disk, also for an offload folder not yet made, and not for
  a process allowed fewer cores or an offload folder on another filesystem."""
  import os
  import subprocess
  import sys
  from flexjax import run
  device = jax.devices()[0]
  key = hardware.machine_key(device, str(tmp_path))
  with open('/proc/cpuinfo') as f:
    model = next(line for line in f if line.startswith('model name')).split(':', 1)[1].strip()
  assert key['cpu_model'] == model and key['cores'] == len(os.sched_getaffinity(0))
  assert key['disk'] == os.stat(tmp_path).st_dev and key['jax'] == jax.__version__
  assert hardware.machine_key(device, str(tmp_path / 'not' / 'made')) == key

  monkeypatch.setenv('XDG_CACHE_HOME', str(tmp_path / 'cache'))
  assert run.resolve_profile(None, device, measure_if_missing=False, scratch_dir=str(tmp_path)) is None
  hardware.t4_profile().save(run.profile_cache(device, str(tmp_path)))
  found = run.resolve_profile(None, device, measure_if_missing=False, scratch_dir=str(tmp_path))
  assert found == hardware.t4_profile()

  if len(os.sched_getaffinity(0)) > 1:  # a process allowed one of this machine's cores
    one_core = subprocess.run(
        [sys.executable, '-c', 'import os, sys; '
         'os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); '
         'import jax; from flexjax import run; '
         'print(run.profile_cache(jax.devices()[0], sys.argv[1]))', str(tmp_path)],
        capture_output=True, text=True, timeout=120, check=True)
    assert one_core.stdout.strip().startswith(str(tmp_path / 'cache' / 'flexjax' / 'hw-cpu-'))
    assert one_core.stdout.strip() != str(run.profile_cache(device, str(tmp_path)))

  shm = '/dev/shm'
  if os.path.isdir(shm) and os.stat(shm).st_dev != os.stat(tmp_path).st_dev:
    assert run.resolve_profile(None, device, measure_if_missing=False, scratch_dir=shm) is None


def test_a_process_measuring_this_machine_makes_the_others_wait_and_share_its_profile(
    tmp_path, monkeypatch, capsys):
  """While another process measures (its lock on the profile folder), a run needing the
  profile waits and then takes the one it cached instead of measuring beside it."""
  import fcntl
  import os
  import threading
  from flexjax import run
  monkeypatch.setenv('XDG_CACHE_HOME', str(tmp_path / 'cache'))
  device = jax.devices()[0]
  cache = run.profile_cache(device, str(tmp_path))
  cache.parent.mkdir(parents=True)
  other = os.open(cache.parent, os.O_RDONLY)  # another open of the folder: another process's
  fcntl.flock(other, fcntl.LOCK_EX)

  def finish_measuring():
    time.sleep(1.0)
    hardware.t4_profile().save(cache)
    os.close(other)

  done = threading.Thread(target=finish_measuring)
  done.start()
  start = time.monotonic()
  profile = run.measure_profile(device, scratch_dir=str(tmp_path), progress=False)
  done.join()
  assert profile == hardware.t4_profile() and time.monotonic() - start >= 0.9
  err = capsys.readouterr().err
  assert 'waiting for another process measuring this machine' in err
  assert 'measuring this machine for' not in err
