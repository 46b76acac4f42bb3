"""Orbax checkpoints of flexjax models (OPT and the llama family), written stage by stage and
restored one stage at a time.

A checkpoint is a directory holding one orbax PyTree checkpoint per stage ('tokens', 'embed',
'layer_000' ... , 'head'), the tokenizer files under 'tokenizer/', and 'flexjax.json', which
records the model config and is written last. A checkpoint is assembled in a hidden sibling
directory and renamed into place only when complete, so an interrupted write leaves nothing that
looks like a checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterable

import numpy as np

from flexjax.config import ModelConfig, np_dtype
from flexjax import scratch
from flexjax import stream as stream_lib
from flexjax.errors import FlexjaxError
from flexjax.model import params as params_lib

FORMAT = 'flexjax-v3'
META_FILE = 'flexjax.json'
TOKENIZER_DIR = 'tokenizer'
STREAM_DIR = 'stream'  # streaming layouts of the weights (flexjax.stream), one per variant


class CheckpointWriter:
  """Writes a checkpoint stage by stage; use as a context manager.

  On success the temporary directory is renamed to `path`; on any exception it is removed and
  `path` is left as it was.
  """

  def __init__(self, path: str | os.PathLike, cfg: ModelConfig, dtype: str, *,
               overwrite: bool = False, reads_from: Iterable[str | os.PathLike] = ()):
    """reads_from: the files and folders the writer's stages come from, which `path` may be
    neither, nor hold: replacing it would delete them."""
    self.path = Path(path).absolute()
    self.cfg = cfg
    self.dtype = dtype
    self.overwrite = overwrite
    for source in map(Path, reads_from):
      where, read = self.path.resolve(), source.resolve()
      if where == read or where in read.parents:
        raise FlexjaxError(f'output {str(self.path)!r} {"is" if where == read else "holds"} the '
                           f'source {str(source)!r}, which writing the checkpoint there would '
                           'delete; choose another output path')
    if self.path.exists() and not overwrite:
      raise FlexjaxError(f'output {str(self.path)!r} already exists; choose another path or pass '
                         '--overwrite')
    # before any stage is read: the folder beside which the checkpoint is written
    scratch.check_writable(self.path.parent, f'output {str(self.path)!r} (its folder)')
    self._partial: scratch.Claim | None = None
    self._written: list[str] = []
    import orbax.checkpoint as ocp  # here, not at the top: dummy-weight runs start without it
    self._checkpointer = ocp.PyTreeCheckpointer()

  def __enter__(self) -> 'CheckpointWriter':
    # owned while written: a conversion killed here leaves a folder the next one removes
    self._partial = scratch.claim(self.path.parent, f'.{self.path.name}.partial-')
    return self

  def __exit__(self, exc_type, exc, tb) -> None:
    assert self._partial is not None
    try:
      if exc_type is None:
        self._commit()
    finally:
      self._partial.release()

  @property
  def _tmp(self) -> Path:
    assert self._partial is not None, 'use CheckpointWriter as a context manager'
    return self._partial.path

  @property
  def tokenizer_dir(self) -> Path:
    return self._tmp / TOKENIZER_DIR

  def write_stage(self, stage: str, tree: params_lib.HostParams) -> None:
    """Saves one stage; its shapes must match the config."""
    _check_shapes(self.cfg, stage, {k: v.shape for k, v in params_lib.flatten(tree).items()},
                  source='written tree')
    if tree:
      self._checkpointer.save(self._tmp / stage, tree)
    self._written.append(stage)

  def _commit(self) -> None:
    missing = [s for s in params_lib.stage_names(self.cfg) if s not in self._written]
    if missing:
      raise RuntimeError(f'checkpoint is missing stages {missing}')
    has_tokenizer = self.tokenizer_dir.is_dir() and any(self.tokenizer_dir.iterdir())
    meta = {'format': FORMAT, 'dtype': self.dtype, 'model': self.cfg.to_dict(),
            'tokenizer': TOKENIZER_DIR if has_tokenizer else None}
    (self._tmp / META_FILE).write_text(json.dumps(meta, indent=2) + '\n')
    if self.path.exists() and not self.overwrite:  # made meanwhile: another conversion's
      raise self._appeared()
    self._partial.disown()  # complete: from here on the user's data, never swept
    if self.path.exists():  # overwrite: move the old one aside only now, then drop it
      old = Path(tempfile.mkdtemp(prefix=f'.{self.path.name}.old-', dir=self.path.parent))
      os.rename(self.path, old / 'ckpt')
      os.rename(self._tmp, self.path)
      shutil.rmtree(old, ignore_errors=True)
    else:
      try:
        os.rename(self._tmp, self.path)  # never over a folder that holds anything
      except OSError:
        if not self.path.exists():
          raise
        raise self._appeared() from None

  def _appeared(self) -> FlexjaxError:
    return FlexjaxError(f'output {str(self.path)!r} appeared while this checkpoint was written '
                        '(another conversion to the same path?) and was left as it is; choose '
                        'another path or pass --overwrite')


def write_source(source: Any, path: str | os.PathLike, *, overwrite: bool = False) -> Path:
  """Writes every stage of a weight source (its `config`, `dtype` and `read(stage)`: dummy
  weights, say) as a checkpoint at `path`; returns the path."""
  with CheckpointWriter(path, source.config, source.dtype, overwrite=overwrite) as writer:
    for stage in params_lib.stage_names(source.config):
      writer.write_stage(stage, source.read(stage))
  return writer.path


class Checkpoint:
  """A complete checkpoint on disk; reads one stage at a time as host numpy arrays."""

  def __init__(self, path: str | os.PathLike):
    self.path = Path(path).absolute()  # orbax reads relative paths as missing
    if not self.path.is_dir():
      raise FlexjaxError(f'checkpoint {str(path)!r} does not exist; convert one with '
                         '`python -m tools.convert_hf --hf_dir=... --output=...` or use '
                         '--weights=dummy')
    meta_path = self.path / META_FILE
    if not meta_path.is_file():
      raise FlexjaxError(f'checkpoint {str(path)!r} is incomplete or not a flexjax checkpoint '
                         f'(no {META_FILE}); convert it again')
    try:
      meta = json.loads(meta_path.read_text())
      if meta.get('format') != FORMAT:
        raise FlexjaxError(f'checkpoint {str(path)!r} has format {meta.get("format")!r}, '
                           f'expected {FORMAT!r}; convert it again')
      self.config = ModelConfig.from_dict(meta['model'])
      self.dtype: str = meta['dtype']
      np_dtype(self.dtype)
    except (json.JSONDecodeError, KeyError, TypeError) as e:
      raise FlexjaxError(f'checkpoint {str(path)!r} has a corrupt {META_FILE} ({e}); convert it '
                         'again') from None
    self.tokenizer_path = (self.path / meta['tokenizer']) if meta.get('tokenizer') else None
    import orbax.checkpoint as ocp  # here, not at the top: dummy-weight runs start without it
    self._checkpointer = ocp.PyTreeCheckpointer()
    for stage in params_lib.stage_names(self.config):
      _check_shapes(self.config, stage, self._stored_shapes(stage),
                    source=f'checkpoint {str(path)!r}')

  def fingerprint(self) -> str:
    """Changes when the checkpoint is written again (its metadata file is replaced last)."""
    stat = (self.path / META_FILE).stat()
    text = f'{self.path.absolute()}:{stat.st_mtime_ns}:{stat.st_size}:{stat.st_ino}'
    return hashlib.sha256(text.encode()).hexdigest()[:16]

  def stream_folder(self, cache_dir: Path) -> Path:
    """Inside the checkpoint when it is writable (removed with it), else in the cache folder,
    one folder per checkpoint path: a checkpoint written again replaces its layouts there (their
    index records the fingerprint they were written from) instead of adding more."""
    inside = self.path / STREAM_DIR
    if stream_lib.writable(inside):
      return inside
    where = hashlib.sha256(str(self.path.absolute()).encode()).hexdigest()[:16]
    return Path(cache_dir) / 'checkpoints' / f'{self.path.name}-{where}'

  def _stored_shapes(self, stage: str) -> dict[tuple[str, ...], tuple[int, ...]]:
    stage_dir = self.path / stage
    if not stage_dir.exists():
      return {}
    try:
      tree = self._checkpointer.metadata(stage_dir).item_metadata.tree
    except Exception as e:  # orbax raises many types for damaged files
      raise FlexjaxError(f'checkpoint stage {str(stage_dir)!r} is unreadable '
                         f'({_first_line(e)}); convert the checkpoint again') from None
    return {k: tuple(v.shape) for k, v in params_lib.flatten(_to_dict(tree)).items()}

  def read(self, stage: str, skip=frozenset()) -> params_lib.HostParams:
    """Restores one stage ('tokens', 'embed', 'layer_007', 'head') as host numpy arrays, but
    for the tensor paths in `skip`.

    The arrays are read with tensorstore from the stage's orbax (OCDBT) files, every read
    waited for even when one fails: a damaged file is one error, with no read left running."""
    keys = [k for k in params_lib.flatten(params_lib.stage_shapes(self.config, stage))
            if k not in skip]
    if not keys:
      return {}
    try:
      arrays = _read_arrays(self.path / stage, keys)
    except Exception as e:  # tensorstore raises several types for damaged files
      raise FlexjaxError(f'checkpoint stage {str(self.path / stage)!r} is unreadable '
                         f'({_first_line(e)}); convert the checkpoint again') from None
    return params_lib.unflatten(arrays)


def _read_arrays(stage_dir: Path, keys: list[tuple[str, ...]]) -> dict[tuple[str, ...], Any]:
  """The arrays of an orbax OCDBT checkpoint (named by their tree keys joined with '.'), read
  concurrently; raises the first failure once every read has finished."""
  import tensorstore as ts

  base = {'driver': 'ocdbt', 'base': f'file://{stage_dir.absolute()}/'}
  reads, failures = {}, []
  for key in keys:
    try:
      reads[key] = _open_array(ts, base, '.'.join(key)).read()
    except Exception as e:
      failures.append(e)
      break
  arrays = {}
  for key, future in reads.items():
    try:
      arrays[key] = np.asarray(future.result())
    except Exception as e:
      failures.append(e)
  if failures:
    raise failures[0]
  return arrays


def _open_array(ts, kvstore: dict, name: str):
  """An array of the checkpoint, stored as zarr (orbax's default) or zarr3."""
  try:
    return ts.open({'driver': 'zarr', 'kvstore': {**kvstore, 'path': name}}, open=True).result()
  except ValueError:
    return ts.open({'driver': 'zarr3', 'kvstore': {**kvstore, 'path': name}},
                   open=True).result()


def _to_dict(tree: Any) -> Any:
  if isinstance(tree, dict) or hasattr(tree, 'items'):
    return {k: _to_dict(v) for k, v in tree.items()}
  return tree


def _first_line(e: Exception) -> str:
  text = str(e).strip().splitlines()
  return f'{type(e).__name__}: {text[0] if text else ""}'[:300]


def _check_shapes(cfg: ModelConfig, stage: str, got: dict[tuple[str, ...], tuple[int, ...]],
                  source: str) -> None:
  """Raises a one-line error when the stored shapes of a stage differ from the config's."""
  want = params_lib.flatten(params_lib.stage_shapes(cfg, stage))
  for key in sorted(set(want) | set(got)):
    name = f'{stage}/{"/".join(key)}'
    if key not in got:
      raise FlexjaxError(f'{source} lacks {name} (shape {want[key]}) required by model '
                         f'{cfg.name!r}; convert the checkpoint again')
    if key not in want:
      raise FlexjaxError(f'{source} has {name} that model {cfg.name!r} does not use; the config '
                         'and the weights disagree')
    if tuple(got[key]) != tuple(want[key]):
      raise FlexjaxError(f'{source}: {name} has shape {tuple(got[key])} but model {cfg.name!r} '
                         f'expects {tuple(want[key])}; the config and the weights disagree')

