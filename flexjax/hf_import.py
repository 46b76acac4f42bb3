"""Reading Hugging Face OPT and Llama/Mistral checkpoints: a mapping table per family from HF
names to flexjax stages, and the conversion core that any tensor source (safetensors, GGUF) feeds."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np

from flexjax import progress as progress_lib
from flexjax.config import ModelConfig, np_dtype
from flexjax.errors import FlexjaxError
from flexjax.model import params as params_lib

# flexjax path inside a stage -> HF name after the stage's prefix. HF Linear weights are
# [out, in], as flexjax stores them: every tensor is taken as it is.
_LAYER = {
    ('attn_ln', 'scale'): 'self_attn_layer_norm.weight',
    ('attn_ln', 'bias'): 'self_attn_layer_norm.bias',
    **{(ours, kind): f'self_attn.{theirs}.{kind}'
       for ours, theirs in (('q', 'q_proj'), ('k', 'k_proj'), ('v', 'v_proj'), ('o', 'out_proj'))
       for kind in ('weight', 'bias')},
    ('mlp_ln', 'scale'): 'final_layer_norm.weight',
    ('mlp_ln', 'bias'): 'final_layer_norm.bias',
    **{(fc, kind): f'{fc}.{kind}' for fc in ('fc1', 'fc2') for kind in ('weight', 'bias')},
}
_TOKENS = {('tokens',): 'embed_tokens.weight'}
_EMBED = {
    ('positions',): 'embed_positions.weight',
    ('project_in', 'weight'): 'project_in.weight',
}
_HEAD = {
    ('final_ln', 'scale'): 'final_layer_norm.weight',
    ('final_ln', 'bias'): 'final_layer_norm.bias',
    ('project_out', 'weight'): 'project_out.weight',
}
_OPT_ENDS = {'tokens': _TOKENS, 'embed': _EMBED, 'head': _HEAD}

# The llama family (Llama, Mistral, SmolLM2): full HF names, matrices kept [out, in] (flexjax's
# 'weight'). Tied models have no lm_head.weight.
_LLAMA_LAYER = {
    ('attn_norm', 'scale'): 'input_layernorm.weight',
    **{(ours, 'weight'): f'self_attn.{ours}_proj.weight' for ours in 'qkvo'},
    ('mlp_norm', 'scale'): 'post_attention_layernorm.weight',
    **{(ours, 'weight'): f'mlp.{ours}_proj.weight' for ours in ('gate', 'up', 'down')},
}
_LLAMA_ENDS = {
    'tokens': {('tokens',): 'model.embed_tokens.weight'},
    'embed': {},
    'head': {('final_norm', 'scale'): 'model.norm.weight',
             ('lm_head',): 'lm_head.weight'},  # [vocab, hidden], as flexjax stores it
}

TOKENIZER_FILES = ('tokenizer.json', 'vocab.json', 'merges.txt', 'tokenizer_config.json',
                   'special_tokens_map.json', 'added_tokens.json')

_SAFETENSORS_DTYPES = {'F32': 'float32', 'F16': 'float16', 'BF16': 'bfloat16', 'F64': 'float64',
                       'I64': 'int64', 'I32': 'int32', 'U8': 'uint8', 'BOOL': 'bool'}


def hf_name(stage: str, path: tuple[str, ...]) -> str:
  """The HF tensor name (without 'model.') of a flexjax parameter of the OPT family."""
  if stage.startswith('layer_'):
    return f'decoder.layers.{int(stage[6:])}.{_LAYER[path]}'
  return f'decoder.{_OPT_ENDS[stage][path]}'


def hf_key(cfg: ModelConfig, stage: str, path: tuple[str, ...]) -> str:
  """The full HF tensor name (e.g. 'model.layers.0.self_attn.q_proj.weight') of a flexjax
  parameter of either family."""
  if cfg.family == 'opt':
    return f'model.{hf_name(stage, path)}'
  if stage.startswith('layer_'):
    return f'model.layers.{int(stage[6:])}.{_LLAMA_LAYER[path]}'
  return _LLAMA_ENDS[stage][path]


def read_stage(cfg: ModelConfig, get: Callable[[str], np.ndarray], stage: str,
               dtype: np.dtype) -> params_lib.HostParams:
  """One flexjax stage from HF-named tensors (get(full HF name) -> array as HF stores it),
  shape-checked against cfg and cast to dtype."""

  def fetch(path: tuple[str, ...], shape: tuple[int, ...]) -> np.ndarray:
    name = hf_key(cfg, stage, path)
    value = get(name)
    if value.shape != shape:
      raise FlexjaxError(f'{name} has shape {value.shape} but the config implies {shape}; the '
                         f'config and the weights disagree')
    return np.ascontiguousarray(value, dtype=dtype)

  return params_lib.map_shapes(fetch, params_lib.stage_shapes(cfg, stage))


def convert_tensors(cfg: ModelConfig, get: Callable[[str], np.ndarray],
                    output: str | os.PathLike, *, dtype: str,
                    tokenizer_files: Iterable[str | os.PathLike] = (), overwrite: bool = False,
                    progress: bool = False, reads_from: Iterable[str | os.PathLike] = ()) -> Path:
  """Writes a flexjax checkpoint from any source of HF-named tensors, one stage in memory at a
  time: the conversion core under `convert` (HF folders) and GGUF import.

  Args:
    cfg: the model's config (ModelConfig.from_hf_config of its HF config, say).
    get: full HF tensor name (e.g. 'model.embed_tokens.weight', 'lm_head.weight') -> numpy
      array in HF's layout (Linear weights [out, in]); called once per tensor flexjax stores
      (lm_head.weight only for untied embeddings).
    output: the checkpoint folder to create.
    dtype: stored dtype, 'float32', 'float16' or 'bfloat16'.
    tokenizer_files: files copied into the checkpoint's tokenizer folder (tokenizer.json, ...).
    reads_from: the source's files and folders, which `output` may not be or hold.
  Returns:
    The checkpoint path (complete: written to a temporary directory, then renamed).
  """
  from flexjax.checkpoint import CheckpointWriter  # orbax is only needed for writing

  target = np_dtype(dtype)
  names = params_lib.stage_names(cfg)
  files = [Path(f) for f in tokenizer_files]
  with CheckpointWriter(output, cfg, dtype, overwrite=overwrite,
                        reads_from=[*reads_from, *files]) as writer:
    with progress_lib.bar(len(names), f'converting {cfg.name}', unit='stage',
                          show=progress) as bar:
      for stage in names:
        writer.write_stage(stage, read_stage(cfg, get, stage, target))
        bar.update(1)
    if files:
      writer.tokenizer_dir.mkdir()
      for path in files:
        (writer.tokenizer_dir / path.name).write_bytes(path.read_bytes())
  return writer.path


class _SafetensorsFile:
  """Lazy, zero-copy reader of one .safetensors file (any dtype, bfloat16 included)."""

  def __init__(self, path: Path):
    self.path = path
    try:
      with open(path, 'rb') as f:
        (header_len,) = struct.unpack('<Q', f.read(8))
        self.header = json.loads(f.read(header_len))
    except (struct.error, json.JSONDecodeError, UnicodeDecodeError, MemoryError, OverflowError):
      raise FlexjaxError(f'{str(path)!r} is not a valid safetensors file (bad header); '
                         'download or save it again') from None
    self.header.pop('__metadata__', None)
    self.data_start = 8 + header_len

  def keys(self):
    return self.header.keys()

  def get(self, key: str) -> np.ndarray:
    info = self.header[key]
    if info['dtype'] not in _SAFETENSORS_DTYPES:
      raise FlexjaxError(f'{self.path}: tensor {key!r} has dtype {info["dtype"]}, which flexjax '
                         f'does not read; use one of {", ".join(_SAFETENSORS_DTYPES)}')
    name = _SAFETENSORS_DTYPES[info['dtype']]
    dtype = np_dtype(name) if name == 'bfloat16' else np.dtype(name)
    begin, end = info['data_offsets']
    shape = tuple(info['shape'])
    if end - begin != int(np.prod(shape)) * dtype.itemsize:
      raise FlexjaxError(f'{self.path}: tensor {key!r} holds {end - begin} bytes, not the '
                         f'{shape} x {dtype} its header states; the file is corrupt')
    try:
      return np.memmap(self.path, dtype=dtype, mode='r', offset=self.data_start + begin,
                       shape=shape)
    except ValueError as e:  # file shorter than its header says
      raise FlexjaxError(f'{self.path}: tensor {key!r} cannot be read ({e}); the file is '
                         'truncated or corrupt') from None


class HFCheckpoint:
  """Tensors of an HF OPT, Llama or Mistral directory (config.json + *.safetensors, or
  pytorch_model*.bin).

  Names are accepted with or without the 'model.' prefix.
  """

  def __init__(self, hf_dir: str | os.PathLike):
    self.dir = Path(hf_dir)
    if not self.dir.is_dir():
      raise FlexjaxError(f'--hf_dir={str(hf_dir)!r} is not a directory; give the folder that holds '
                         'config.json and the weight files')
    self.config = ModelConfig.from_hf_config_file(self.dir / 'config.json',
                                                  name=self.dir.name)
    self._readers: dict[str, Callable[[], np.ndarray]] = {}
    safetensors = sorted(self.dir.glob('*.safetensors'))
    bins = sorted(self.dir.glob('pytorch_model*.bin'))
    if safetensors:
      for path in safetensors:
        f = _SafetensorsFile(path)
        for key in f.keys():
          self._add(key, lambda f=f, key=key: f.get(key))
    elif bins:
      for path in bins:
        state = _torch_load(path)
        for key in state:
          self._add(key, lambda state=state, key=key: _torch_to_numpy(state[key]))
    else:
      raise FlexjaxError(f'no *.safetensors or pytorch_model*.bin files in {str(self.dir)!r}')

  def _add(self, key: str, reader: Callable[[], np.ndarray]) -> None:
    self._readers[key.removeprefix('model.')] = reader

  def source_dtype(self) -> str:
    dtype = self.tensor(hf_key(self.config, 'tokens', ('tokens',))).dtype
    return 'bfloat16' if dtype == np_dtype('bfloat16') else str(dtype)

  def tensor(self, name: str) -> np.ndarray:
    """The tensor `name`, given with or without the 'model.' prefix."""
    name = name.removeprefix('model.')
    if name not in self._readers:
      raise FlexjaxError(f'{str(self.dir)!r} has no tensor {name!r} (nor model.{name}); is it a '
                         f'complete {self.config.family} checkpoint?')
    return self._readers[name]()

  def read_stage(self, stage: str, dtype: np.dtype) -> params_lib.HostParams:
    """One flexjax stage from the HF tensors, shape-checked and cast to dtype."""
    return read_stage(self.config, self.tensor, stage, dtype)

  def stages(self, dtype: np.dtype) -> Iterator[tuple[str, params_lib.HostParams]]:
    for stage in params_lib.stage_names(self.config):
      yield stage, self.read_stage(stage, dtype)

  def tokenizer_files(self) -> list[Path]:
    return [self.dir / name for name in TOKENIZER_FILES if (self.dir / name).is_file()]


def _torch_load(path: Path):
  try:
    import torch
  except ImportError:
    raise FlexjaxError(f'{str(path)!r} is a PyTorch file and needs torch installed; install torch '
                       'or convert the checkpoint to safetensors') from None
  try:
    return torch.load(path, map_location='cpu', mmap=True, weights_only=True)
  except Exception as e:  # torch raises many types for damaged files
    raise FlexjaxError(f'{str(path)!r} cannot be read by torch ({type(e).__name__}: '
                       f'{str(e).splitlines()[0][:200] if str(e) else ""})') from None


def _torch_to_numpy(t) -> np.ndarray:
  import torch
  if t.dtype == torch.bfloat16:
    return t.view(torch.int16).numpy().view(np_dtype('bfloat16'))
  return t.numpy()


def convert(hf_dir: str | os.PathLike, output: str | os.PathLike, *, dtype: str = 'source',
            overwrite: bool = False, progress: bool = False) -> Path:
  """Converts an HF OPT/Llama/Mistral directory into a flexjax checkpoint (convert_tensors over
  its tensors and tokenizer files).

  Args:
    dtype: 'source' keeps the checkpoint's dtype; or 'float32', 'float16', 'bfloat16'.
  Returns:
    The checkpoint path (complete: written to a temporary directory, then renamed).
  """
  hf = HFCheckpoint(hf_dir)
  return convert_tensors(hf.config, hf.tensor, output,
                         dtype=hf.source_dtype() if dtype == 'source' else dtype,
                         tokenizer_files=hf.tokenizer_files(), overwrite=overwrite,
                         progress=progress, reads_from=[hf_dir])
