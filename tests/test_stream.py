"""The disk reader (diskio) and the streaming weight layout (stream): read in place, written once,
atomically, and a full disk is a one-line error."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from flexjax import diskio, stream
from flexjax.checkpoint import Checkpoint, write_source
from flexjax.config import ModelConfig
from flexjax.engine import Engine, GenerationConfig
from flexjax.errors import FlexjaxError
from flexjax.model import params as params_lib
from flexjax.policy import Policy
from flexjax.weights import DummyWeights

ROOT = Path(__file__).resolve().parents[1]
TINY = ModelConfig(name='tiny-stream', num_layers=2, hidden_size=64, num_heads=4, ffn_dim=128,
                   vocab_size=1000, max_positions=64)
ON_DISK = Policy(gpu_batch_size=2, w_gpu_percent=0, w_cpu_percent=0)
PROMPTS = [[2, 10, 11, 12], [2, 40, 41]]


def _random_file(path: Path, nbytes: int) -> bytes:
  data = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8).tobytes()
  path.write_bytes(data)
  return data


def test_reader_fills_aligned_buffers_in_chunks(tmp_path):
  data = _random_file(tmp_path / 'f.bin', 5 * diskio.BLOCK)
  file = diskio.DiskFile(tmp_path / 'f.bin')
  reader = diskio.Reader(threads=3, chunk=diskio.BLOCK)  # 4 requests for 4 blocks
  try:
    out = diskio.aligned_buffer(4 * diskio.BLOCK)
    futures = reader.read(file, diskio.BLOCK, out)
    assert len(futures) == 4
    diskio.wait(futures)
    assert out.tobytes() == data[diskio.BLOCK:]
  finally:
    reader.close()
    file.close()


def test_a_read_direct_io_refuses_is_retried_buffered(tmp_path):
  data = _random_file(tmp_path / 'f.bin', 3 * diskio.BLOCK)
  file = diskio.DiskFile(tmp_path / 'f.bin')
  raw = np.empty(diskio.BLOCK + 1, np.uint8)
  unaligned = raw[1:] if raw.ctypes.data % 2 == 0 else raw[:-1]  # never 4 KiB-aligned
  file.read_into(memoryview(unaligned), 100)  # unaligned offset, length and buffer
  assert unaligned.tobytes() == data[100:100 + diskio.BLOCK]
  assert not file.direct  # reported, and the handle now reads buffered
  file.close()


def test_layout_is_written_once_and_runs_copy_nothing(tmp_path):
  cache, offload = tmp_path / 'cache', tmp_path / 'offload'
  gen = GenerationConfig(gen_len=3)
  with Engine(DummyWeights(TINY, 'float32'), policy=ON_DISK, weights_cache=str(cache),
              offload_dir=str(offload)) as engine:
    first = engine.generate(PROMPTS, gen)
    folder = engine.layout.folder
  files = {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in folder.iterdir()}
  assert sorted(p.name for p in files) == ['embed.bin', 'head.bin', 'index.json',
                                           'layer_000.bin', 'layer_001.bin', 'tokens.bin']
  with Engine(DummyWeights(TINY, 'float32'), policy=ON_DISK, weights_cache=str(cache),
              offload_dir=str(offload)) as engine:
    assert not offload.exists()  # nothing of the weights is copied into the run's folder
    second = engine.generate(PROMPTS, gen)
  assert {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in folder.iterdir()} == files
  assert [p.name for p in folder.parent.iterdir()] == [folder.name]  # no partial folders
  np.testing.assert_array_equal(first.tokens, second.tokens)
  assert second.bytes_moved['weights_disk'] > 0


def test_layout_reads_reproduce_the_source(tmp_path):
  source = DummyWeights(TINY, 'float16', seed=3)
  layout = stream.ensure_layout(source, packs=lambda shape: False, pack=None, packed_shape=None,
                                variant='float16', cache_dir=tmp_path)
  try:
    for stage in ('tokens', 'layer_001', 'head'):
      for path, want in params_lib.flatten(source.read(stage)).items():
        got = layout.tensor(stage, path).read()
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got, want)
        assert layout.tensor(stage, path).offset % diskio.BLOCK == 0
  finally:
    layout.close()


def test_an_interrupted_write_leaves_nothing(tmp_path):
  def failing(stage):
    if stage == 'layer_001':
      raise KeyboardInterrupt
    return {'w': np.ones((4, 4), np.float32)}

  shapes = {'layer_000': {('w',): (4, 4)}, 'layer_001': {('w',): (4, 4)}}
  index = stream.plan_layout(shapes, np.dtype(np.float32), pack=lambda s: False,
                             packed_shape=None)
  with pytest.raises(KeyboardInterrupt):
    stream.write_layout(tmp_path / 'float32', index, {'format': stream.FORMAT},
                        read_stage=failing, pack=None, progress=False)
  assert list(tmp_path.iterdir()) == []


def test_a_changed_source_gets_a_new_layout(tmp_path):
  kw = dict(packs=lambda shape: False, pack=None, packed_shape=None, variant='float32',
            cache_dir=tmp_path)
  a = stream.ensure_layout(DummyWeights(TINY, 'float32', seed=0), **kw)
  b = stream.ensure_layout(DummyWeights(TINY, 'float32', seed=1), **kw)
  assert a.folder != b.folder
  assert not np.array_equal(a.tensor('tokens', ('tokens',)).read(),
                            b.tensor('tokens', ('tokens',)).read())
  a.close()
  b.close()


def test_a_run_waits_for_another_writing_the_layout_and_reads_its_layout(tmp_path, capsys):
  """While another process writes the layout (its lock on the layouts' folder), a run needing
  it waits, then reads the one written instead of writing a second."""
  import fcntl
  import threading
  import time
  kw = dict(packs=lambda shape: False, pack=None, packed_shape=None, variant='float32',
            cache_dir=tmp_path)
  source = DummyWeights(TINY, 'float32', seed=0)
  parent = source.stream_folder(tmp_path)
  parent.mkdir(parents=True)
  other = os.open(parent, os.O_RDONLY)  # another open of the folder: another process's
  fcntl.flock(other, fcntl.LOCK_EX)
  written = []

  def write_it():  # as that process: a layout written elsewhere, put in place whole
    time.sleep(0.5)
    made = stream.ensure_layout(source, **{**kw, 'cache_dir': tmp_path / 'elsewhere'})
    made.close()
    target = parent / made.folder.name
    shutil.copytree(made.folder, parent / '.copy')
    os.rename(parent / '.copy', target)
    written.append(os.stat(target / stream.INDEX).st_ino)
    os.close(other)

  writer = threading.Thread(target=write_it)
  writer.start()
  waited = stream.ensure_layout(source, **kw)
  writer.join()
  try:
    assert os.stat(waited.folder / stream.INDEX).st_ino == written[0]  # not written again
    np.testing.assert_array_equal(waited.tensor('tokens', ('tokens',)).read(),
                                  source.read('tokens')['tokens'])
  finally:
    waited.close()
  assert 'waiting for another process writing the weight layout' in capsys.readouterr().err


def test_a_stale_layout_is_replaced(tmp_path):
  """A layout of another format (or of weights since rewritten) in the folder a run reads is
  removed and written again, before the new one needs its disk space."""
  kw = dict(packs=lambda shape: False, pack=None, packed_shape=None, variant='float32',
            cache_dir=tmp_path)
  source = DummyWeights(TINY, 'float32', seed=0)
  first = stream.ensure_layout(source, **kw)
  folder, want = first.folder, first.tensor('tokens', ('tokens',)).read()
  first.close()
  index = json.loads((folder / stream.INDEX).read_text())
  (folder / stream.INDEX).write_text(json.dumps({**index, 'format': 'flexjax-stream-v0'}))
  (folder / 'tokens.bin').write_bytes(b'stale')
  again = stream.ensure_layout(source, **kw)
  assert again.folder == folder
  np.testing.assert_array_equal(again.tensor('tokens', ('tokens',)).read(), want)
  again.close()
  assert sorted(p.name for p in folder.parent.iterdir()) == [folder.name]


@pytest.mark.parametrize('damage', ['cut', 'removed', 'grown'])
def test_a_layout_whose_file_was_cut_or_removed_is_written_again(tmp_path, damage):
  """A stage file of another size than its index gives (cut short, removed, appended to) makes
  the layout stale: the next open writes it again rather than failing mid-run."""
  kw = dict(packs=lambda shape: False, pack=None, packed_shape=None, variant='float32',
            cache_dir=tmp_path)
  source = DummyWeights(TINY, 'float32', seed=0)
  first = stream.ensure_layout(source, **kw)
  folder = first.folder
  want = {path: first.tensor('layer_001', path).read()
          for path in params_lib.flatten(source.read('layer_001'))}
  first.close()
  target = folder / 'layer_001.bin'
  if damage == 'cut':
    os.truncate(target, diskio.BLOCK)
  elif damage == 'removed':
    target.unlink()
  else:
    with open(target, 'ab') as f:
      f.write(b'x')
  assert not stream.layout_matches(folder, {'format': stream.FORMAT})
  again = stream.ensure_layout(source, **kw)
  try:
    for path, array in want.items():
      np.testing.assert_array_equal(again.tensor('layer_001', path).read(), array)
  finally:
    again.close()
  assert stream.layout_matches(folder, {'format': stream.FORMAT})
  assert sorted(p.name for p in folder.parent.iterdir()) == [folder.name]


def test_a_stale_layout_that_cannot_be_removed_is_a_one_line_error(tmp_path, monkeypatch):
  kw = dict(packs=lambda shape: False, pack=None, packed_shape=None, variant='float32',
            cache_dir=tmp_path)
  source = DummyWeights(TINY, 'float32', seed=0)
  layout = stream.ensure_layout(source, **kw)
  folder = layout.folder
  layout.close()
  index = json.loads((folder / stream.INDEX).read_text())
  (folder / stream.INDEX).write_text(json.dumps({**index, 'format': 'flexjax-stream-v0'}))

  def refuse(*args):
    raise PermissionError(13, 'Permission denied')

  monkeypatch.setattr(stream.os, 'rename', refuse)
  with pytest.raises(FlexjaxError) as e:
    stream.ensure_layout(source, **kw)
  assert '\n' not in str(e.value)
  assert f"{str(folder)!r} is stale and cannot be replaced (Permission denied)" in str(e.value)
  assert '--weights_cache' in str(e.value)
  assert sorted(p.name for p in folder.parent.iterdir()) == [folder.name]  # no aside left


def test_a_read_only_checkpoint_written_again_replaces_its_cached_layout(tmp_path, monkeypatch):
  """Layouts of a checkpoint the run cannot write into go to the cache folder, one folder per
  checkpoint path: rewriting the checkpoint replaces that layout rather than adding one."""
  monkeypatch.setattr(stream, 'writable', lambda folder: False)
  kw = dict(packs=lambda shape: False, pack=None, packed_shape=None, variant='float32',
            cache_dir=tmp_path / 'cache')
  path = tmp_path / 'ckpt'
  values = []
  for seed in (0, 1):
    write_source(DummyWeights(TINY, 'float32', seed=seed), path, overwrite=True)
    layout = stream.ensure_layout(Checkpoint(path), **kw)
    assert layout.folder.parent.parent == tmp_path / 'cache' / 'checkpoints'
    values.append(layout.tensor('tokens', ('tokens',)).read())
    layout.close()
  np.testing.assert_array_equal(values[1], DummyWeights(TINY, 'float32', seed=1).read(
      'tokens')['tokens'])
  assert not np.array_equal(values[0], values[1])
  assert len(list((tmp_path / 'cache' / 'checkpoints').iterdir())) == 1


def _main(args: list[str], env: dict, limit: int | None = None) -> subprocess.CompletedProcess:
  """flexjax.main in a child process; with `limit`, its files cannot grow past that many bytes
  (a full disk as far as it can tell: Python ignores SIGXFSZ, so writes fail with EFBIG)."""
  launch = ('import resource, runpy, sys; '
            + (f'resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit})); ' if limit else '')
            + f'sys.argv = {["flexjax.main", *args]!r}; '
            'runpy.run_module("flexjax.main", run_name="__main__")')
  return subprocess.run([sys.executable, '-c', launch], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=600)


@pytest.mark.parametrize('what', ['layout', 'offload'])
def test_a_full_disk_is_a_one_line_error_before_any_work(tmp_path, what):
  cache, offload = tmp_path / 'cache', tmp_path / 'offload'
  env = dict(os.environ, JAX_PLATFORMS='cpu', FLEXJAX_CACHE=str(cache))
  args = ['--model=opt-125m', '--w_gpu_percent=0', '--w_cpu_percent=0', '--prompt_len=256',
          '--gen_len=2', '--gpu_batch_size=8', f'--offload_dir={offload}']
  if what == 'offload':  # the layout exists; the run's KV cache files do not fit
    args += ['--cache_gpu_percent=0', '--cache_cpu_percent=0']
    assert _main(args[:3] + ['--prompt_len=8', '--gen_len=1'], env).returncode == 0
  proc = _main(args, env, limit=4 << 20)
  assert proc.returncode == 2, proc.stderr[-2000:]
  lines = proc.stderr.strip().splitlines()
  assert 'Traceback' not in proc.stderr
  assert lines[-1].startswith('flexjax: error: cannot reserve'), lines[-1]
  folder = cache if what == 'layout' else offload
  assert str(folder) in lines[-1]
  assert ('--weights_cache' if what == 'layout' else '--offload_dir') in lines[-1]
  if what == 'layout':
    assert not any(p.name.endswith('.bin') for p in cache.rglob('*'))  # nothing half-written
  else:
    assert not offload.exists() or list(offload.iterdir()) == []


def test_io_threads_are_validated():
  with pytest.raises(FlexjaxError, match='io_threads=0 must be between 1 and 16'):
    diskio.Reader(threads=0)


def test_float16_weights_from_disk_give_the_all_device_logits(tmp_path):
  """float16 weights computed in float32: read from disk into reused staging buffers (which a
  CPU backend computes on in place), cast tile by tile at the products: every token's logits
  equal those of the same weights resident on the device, over more stages than buffers."""
  gen = GenerationConfig(gen_len=6)
  source = DummyWeights(TINY, 'float16', seed=5)
  runs = {}
  for name, policy in (('device', Policy(gpu_batch_size=2)), ('disk', ON_DISK)):
    with Engine(source, policy=policy, weights_cache=str(tmp_path / 'cache'),
                offload_dir=str(tmp_path / name), compute_dtype='float32') as engine:
      runs[name] = engine.generate(PROMPTS, gen, return_logits=True)
  assert runs['disk'].bytes_moved['weights_disk'] > 0
  np.testing.assert_array_equal(runs['disk'].tokens, runs['device'].tokens)
  np.testing.assert_array_equal(runs['disk'].logits, runs['device'].logits)
