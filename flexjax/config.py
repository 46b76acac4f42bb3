"""Model configuration: frozen OPT shapes, presets for every published size, byte-size formulas."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Mapping

import numpy as np

from flexjax.errors import FlexjaxError

# Parameter shapes are nested dicts ending in tuples: {'q': {'kernel': (h, h), 'bias': (h,)}, ...}.
ShapeTree = dict[str, Any]

DTYPES = ('float32', 'float16', 'bfloat16')


def np_dtype(name: str) -> np.dtype:
  """Maps a dtype name ('float32', 'float16', 'bfloat16') to a numpy dtype."""
  if name not in DTYPES:
    raise FlexjaxError(f'dtype={name!r} is not supported; use one of {", ".join(DTYPES)}')
  if name == 'bfloat16':
    import ml_dtypes  # a jax dependency; gives numpy a bfloat16 type
    return np.dtype(ml_dtypes.bfloat16)
  return np.dtype(name)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Shapes and constants of an OPT decoder.

  The byte formulas follow the FlexGen paper: one layer's weights take 8·h1² + 4·h1·h2 bytes in
  fp16 (plus the biases and LayerNorms, which the paper ignores), the KV cache 4·b·s·h1 bytes per
  layer, and the hidden states 2·b·s·h1 bytes.
  """

  name: str
  num_layers: int
  hidden_size: int
  num_heads: int
  ffn_dim: int
  vocab_size: int = 50272
  max_positions: int = 2048
  word_embed_proj_dim: int | None = None  # None: equal to hidden_size
  do_layer_norm_before: bool = True
  final_layer_norm: bool = True  # only used when do_layer_norm_before (as in OPT)
  enable_bias: bool = True
  layer_norm_affine: bool = True
  layer_norm_eps: float = 1e-5
  pad_token_id: int = 1
  bos_token_id: int = 2
  eos_token_id: int = 2

  def __post_init__(self):
    for field in ('num_layers', 'hidden_size', 'num_heads', 'ffn_dim', 'vocab_size',
                  'max_positions'):
      value = getattr(self, field)
      if not isinstance(value, int) or value <= 0:
        raise FlexjaxError(f'{field}={value!r} in model {self.name!r} must be a positive integer')
    if self.hidden_size % self.num_heads:
      raise FlexjaxError(f'hidden_size={self.hidden_size} must be divisible by '
                         f'num_heads={self.num_heads} (model {self.name!r})')
    if self.word_embed_proj_dim is not None and self.word_embed_proj_dim <= 0:
      raise FlexjaxError(f'word_embed_proj_dim={self.word_embed_proj_dim} must be positive')

  # ---- derived shapes -------------------------------------------------------------------------
  @property
  def head_dim(self) -> int:
    return self.hidden_size // self.num_heads

  @property
  def embed_dim(self) -> int:
    """Width of the token embedding (OPT-350m: 512, projected to hidden_size)."""
    return self.word_embed_proj_dim or self.hidden_size

  @property
  def has_projection(self) -> bool:
    return self.embed_dim != self.hidden_size

  @property
  def has_final_layer_norm(self) -> bool:
    return self.do_layer_norm_before and self.final_layer_norm

  def _norm_shapes(self) -> ShapeTree:
    h = self.hidden_size
    return {'scale': (h,), 'bias': (h,)} if self.layer_norm_affine else {}

  def _dense_shapes(self, n_in: int, n_out: int, bias: bool = True) -> ShapeTree:
    shapes = {'kernel': (n_in, n_out)}
    if bias and self.enable_bias:
      shapes['bias'] = (n_out,)
    return shapes

  def layer_shapes(self) -> ShapeTree:
    """Parameter shapes of one decoder layer; kernels are [in, out]."""
    h, f = self.hidden_size, self.ffn_dim
    shapes = {name: self._dense_shapes(h, h) for name in ('q', 'k', 'v', 'o')}
    shapes['fc1'] = self._dense_shapes(h, f)
    shapes['fc2'] = self._dense_shapes(f, h)
    if self.layer_norm_affine:
      shapes['attn_ln'] = self._norm_shapes()
      shapes['mlp_ln'] = self._norm_shapes()
    return shapes

  def embed_shapes(self) -> ShapeTree:
    """Input side: token and learned position embeddings (positions carry OPT's offset of 2)."""
    shapes: ShapeTree = {'positions': (self.max_positions + 2, self.hidden_size)}
    if self.has_projection:
      shapes['project_in'] = {'kernel': (self.embed_dim, self.hidden_size)}
    return shapes

  def head_shapes(self) -> ShapeTree:
    """Output side, besides the tied token embedding: final LayerNorm and project_out."""
    shapes: ShapeTree = {}
    if self.has_final_layer_norm and self.layer_norm_affine:
      shapes['final_ln'] = self._norm_shapes()
    if self.has_projection:
      shapes['project_out'] = {'kernel': (self.hidden_size, self.embed_dim)}
    return shapes

  def tokens_shape(self) -> tuple[int, int]:
    return (self.vocab_size, self.embed_dim)

  # ---- byte sizes -------------------------------------------------------------------------------
  @property
  def layer_param_count(self) -> int:
    return _count(self.layer_shapes())

  def layer_weight_bytes(self, itemsize: int = 2) -> int:
    """Bytes of one decoder layer's weights (paper: 8·h1² + 4·h1·h2 in fp16, plus O(h) terms)."""
    return self.layer_param_count * itemsize

  def embedding_weight_bytes(self, itemsize: int = 2) -> int:
    """Bytes of the token/position embeddings, projections and final LayerNorm."""
    count = (_count(self.embed_shapes()) + _count(self.head_shapes())
             + self.vocab_size * self.embed_dim)
    return count * itemsize

  def model_weight_bytes(self, itemsize: int = 2) -> int:
    return self.num_layers * self.layer_weight_bytes(itemsize) + self.embedding_weight_bytes(itemsize)

  def kv_cache_bytes(self, batch: int, seq_len: int, itemsize: int = 2) -> int:
    """Bytes of one layer's K and V for `batch` sequences of `seq_len` (paper: 4·b·s·h1 in fp16)."""
    return 2 * batch * seq_len * self.hidden_size * itemsize

  def hidden_bytes(self, batch: int, seq_len: int, itemsize: int = 2) -> int:
    """Bytes of the hidden states passed between layers (paper: 2·b·s·h1 in fp16)."""
    return batch * seq_len * self.hidden_size * itemsize

  # ---- construction ---------------------------------------------------------------------------
  @classmethod
  def from_hf_config(cls, hf: Mapping[str, Any], name: str | None = None) -> 'ModelConfig':
    """Builds a config from the fields of a Hugging Face OPT `config.json`."""
    model_type = hf.get('model_type', 'opt')
    if model_type != 'opt':
      raise FlexjaxError(f'model_type={model_type!r} in config.json is not supported; '
                         'flexjax runs OPT models (model_type "opt")')
    activation = hf.get('activation_function', 'relu')
    if activation != 'relu':
      raise FlexjaxError(f'activation_function={activation!r} is not supported; OPT uses "relu"')
    try:
      hidden = int(hf['hidden_size'])
      proj = int(hf.get('word_embed_proj_dim') or hidden)
      return cls(
          name=name or hf.get('_name_or_path') or 'opt-custom',
          num_layers=int(hf['num_hidden_layers']),
          hidden_size=hidden,
          num_heads=int(hf['num_attention_heads']),
          ffn_dim=int(hf['ffn_dim']),
          vocab_size=int(hf['vocab_size']),
          max_positions=int(hf.get('max_position_embeddings', 2048)),
          word_embed_proj_dim=None if proj == hidden else proj,
          do_layer_norm_before=bool(hf.get('do_layer_norm_before', True)),
          final_layer_norm=not bool(hf.get('_remove_final_layer_norm', False)),
          enable_bias=bool(hf.get('enable_bias', True)),
          layer_norm_affine=bool(hf.get('layer_norm_elementwise_affine', True)),
          pad_token_id=int(hf.get('pad_token_id', 1)),
          bos_token_id=int(hf.get('bos_token_id', 2)),
          eos_token_id=int(hf.get('eos_token_id', 2)),
      )
    except KeyError as e:
      raise FlexjaxError(f'config.json lacks the field {e.args[0]!r}; is it an OPT config?') from None

  @classmethod
  def from_hf_config_file(cls, path: str | os.PathLike, name: str | None = None) -> 'ModelConfig':
    try:
      with open(path) as f:
        hf = json.load(f)
    except FileNotFoundError:
      raise FlexjaxError(f'config file {str(path)!r} does not exist') from None
    except json.JSONDecodeError as e:
      raise FlexjaxError(f'config file {str(path)!r} is not valid JSON ({e.msg}, line {e.lineno})'
                         ) from None
    return cls.from_hf_config(hf, name=name)

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> 'ModelConfig':
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - known)
    if unknown:
      raise FlexjaxError(f'unknown model config fields {unknown}; known: {sorted(known)}')
    return cls(**d)


def _count(shapes: ShapeTree) -> int:
  total = 0
  for value in shapes.values():
    total += _count(value) if isinstance(value, dict) else int(np.prod(value))
  return total


def _opt(name, layers, hidden, heads, ffn, **kw) -> ModelConfig:
  return ModelConfig(name=name, num_layers=layers, hidden_size=hidden, num_heads=heads,
                     ffn_dim=ffn, **kw)


# Published OPT shapes (Zhang et al. 2022, Table 1; the Hugging Face configs).
PRESETS: Mapping[str, ModelConfig] = {
    c.name: c for c in (
        _opt('opt-125m', 12, 768, 12, 3072),
        _opt('opt-350m', 24, 1024, 16, 4096, word_embed_proj_dim=512, do_layer_norm_before=False),
        _opt('opt-1.3b', 24, 2048, 32, 8192),
        _opt('opt-2.7b', 32, 2560, 32, 10240),
        _opt('opt-6.7b', 32, 4096, 32, 16384),
        _opt('opt-13b', 40, 5120, 40, 20480),
        _opt('opt-30b', 48, 7168, 56, 28672),
        _opt('opt-66b', 64, 9216, 72, 36864),
        _opt('opt-175b', 96, 12288, 96, 49152),
    )
}


def preset(name: str) -> ModelConfig:
  """Returns the preset `name` ('opt-125m' ... 'opt-175b'; 'facebook/' prefix accepted)."""
  key = name.lower().removeprefix('facebook/')
  if key not in PRESETS:
    raise FlexjaxError(f'unknown model {name!r}; choose one of {", ".join(PRESETS)} '
                       'or pass --checkpoint with a converted model')
  return PRESETS[key]
