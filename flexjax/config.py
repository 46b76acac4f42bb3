"""Model configuration: frozen OPT and LLaMA-family shapes, published presets, byte sizes."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Mapping

import numpy as np

from flexjax.errors import FlexjaxError

# Parameter shapes are nested dicts ending in tuples: {'q': {'weight': (h, h), 'bias': (h,)}, ...}.
ShapeTree = dict[str, Any]

DTYPES = ('float32', 'float16', 'bfloat16')

FAMILIES = ('opt', 'llama')

# rope_type -> the keys its scaling needs (besides rope_type), as in HF configs.
ROPE_TYPES = {
    'linear': ('factor',),
    'llama3': ('factor', 'low_freq_factor', 'high_freq_factor', 'original_max_position_embeddings'),
}


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
  """Shapes and constants of a decoder: OPT (family 'opt') or LLaMA-style (family 'llama':
  RMSNorm, rotary positions, SwiGLU MLP, grouped-query attention, no biases).

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
  family: str = 'opt'  # 'opt' | 'llama'
  num_kv_heads: int | None = None  # None: num_heads (grouped-query attention when fewer)
  head_dim_override: int | None = None  # a head width declared by the config; None: hidden/heads
  rope_theta: float = 10000.0
  rope_scaling: tuple | None = None  # sorted (key, value) pairs incl. 'rope_type'; None: default
  rms_norm_eps: float = 1e-6
  tie_word_embeddings: bool = True  # the LM head reuses the token embedding (always, for OPT)

  def __post_init__(self):
    if isinstance(self.rope_scaling, (dict, list)):  # from JSON or an HF dict: made hashable
      scaling = self.rope_scaling
      items = scaling.items() if isinstance(scaling, dict) else scaling
      object.__setattr__(self, 'rope_scaling', tuple(sorted((str(k), v) for k, v in items)))
    self._check_shapes()
    self._check_family()

  def _check_shapes(self):
    for field in ('num_layers', 'hidden_size', 'num_heads', 'ffn_dim', 'vocab_size',
                  'max_positions'):
      value = getattr(self, field)
      if not isinstance(value, int) or value <= 0:
        raise FlexjaxError(f'{field}={value!r} in model {self.name!r} must be a positive integer')
    if self.head_dim_override is None and self.hidden_size % self.num_heads:
      raise FlexjaxError(f'hidden_size={self.hidden_size} must be divisible by '
                         f'num_heads={self.num_heads} (model {self.name!r})')
    if self.head_dim_override is not None and self.head_dim_override <= 0:
      raise FlexjaxError(f'head_dim_override={self.head_dim_override} must be positive or None')
    kv = self.num_kv_heads
    if kv is not None and (not isinstance(kv, int) or kv <= 0 or self.num_heads % kv):
      raise FlexjaxError(f'num_kv_heads={kv!r} must be a positive divisor of '
                         f'num_heads={self.num_heads} (model {self.name!r})')
    if self.word_embed_proj_dim is not None and self.word_embed_proj_dim <= 0:
      raise FlexjaxError(f'word_embed_proj_dim={self.word_embed_proj_dim} must be positive')

  def _check_family(self):
    if self.family not in FAMILIES:
      raise FlexjaxError(f'family={self.family!r} is not supported; use one of '
                         f'{", ".join(FAMILIES)}')
    if self.family == 'opt':
      if self.kv_heads != self.num_heads or self.head_dim_override is not None:
        raise FlexjaxError(f'model {self.name!r}: OPT has no grouped-query attention or head '
                           'width of its own; leave num_kv_heads and head_dim_override None')
      return
    if self.word_embed_proj_dim is not None:
      raise FlexjaxError(f'word_embed_proj_dim={self.word_embed_proj_dim} is OPT-only; leave it '
                         f'None for the llama family (model {self.name!r})')
    if self.rope_theta <= 0:
      raise FlexjaxError(f'rope_theta={self.rope_theta} must be positive (model {self.name!r})')
    scaling = dict(self.rope_scaling or ())
    kind = scaling.get('rope_type')
    if self.rope_scaling is not None and kind not in ROPE_TYPES:
      raise FlexjaxError(f'rope_type={kind!r} is not supported; use one of '
                         f'{", ".join(ROPE_TYPES)} or no rope scaling (model {self.name!r})')
    missing = [k for k in ROPE_TYPES.get(kind, ()) if k not in scaling]
    if missing:
      raise FlexjaxError(f'rope scaling {kind!r} lacks {", ".join(missing)}; add them to '
                         f'rope_scaling (model {self.name!r})')

  # ---- derived shapes -------------------------------------------------------------------------
  @property
  def head_dim(self) -> int:
    return self.head_dim_override or self.hidden_size // self.num_heads

  @property
  def kv_heads(self) -> int:
    return self.num_kv_heads or self.num_heads

  @property
  def q_dim(self) -> int:
    """Width of the attention's queries (and of its output before the projection)."""
    return self.num_heads * self.head_dim

  @property
  def kv_dim(self) -> int:
    """Width of one token's K (or V) in one layer: what a KV cache row holds."""
    return self.kv_heads * self.head_dim

  @property
  def head_uses_tokens(self) -> bool:
    """Whether the LM head is the token embedding (tied), rather than its own matrix."""
    return self.family == 'opt' or self.tie_word_embeddings

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
    shapes = {'weight': (n_out, n_in)}
    if bias and self.enable_bias:
      shapes['bias'] = (n_out,)
    return shapes

  def layer_shapes(self) -> ShapeTree:
    """Parameter shapes of one decoder layer. Matrices are 'weight's [out, in] as HF and GGUF
    store them: products of few rows run fastest that way on XLA:CPU (model.linear), and
    quantization along the last axis groups inputs, as GGUF's Q4_1 does (its blocks can then be
    kept as they are)."""
    h, f = self.hidden_size, self.ffn_dim
    if self.family == 'llama':
      return {'attn_norm': {'scale': (h,)}, 'q': {'weight': (self.q_dim, h)},
              'k': {'weight': (self.kv_dim, h)}, 'v': {'weight': (self.kv_dim, h)},
              'o': {'weight': (h, self.q_dim)}, 'mlp_norm': {'scale': (h,)},
              'gate': {'weight': (f, h)}, 'up': {'weight': (f, h)}, 'down': {'weight': (h, f)}}
    shapes = {name: self._dense_shapes(h, h) for name in ('q', 'k', 'v', 'o')}
    shapes['fc1'] = self._dense_shapes(h, f)
    shapes['fc2'] = self._dense_shapes(f, h)
    if self.layer_norm_affine:
      shapes['attn_ln'] = self._norm_shapes()
      shapes['mlp_ln'] = self._norm_shapes()
    return shapes

  def embed_shapes(self) -> ShapeTree:
    """Input side besides the token embedding: OPT's learned positions (with its offset of 2)
    and project_in; nothing for the llama family (rotary positions have no parameters)."""
    if self.family == 'llama':
      return {}
    shapes: ShapeTree = {'positions': (self.max_positions + 2, self.hidden_size)}
    if self.has_projection:
      shapes['project_in'] = {'weight': (self.hidden_size, self.embed_dim)}
    return shapes

  def head_shapes(self) -> ShapeTree:
    """Output side, besides the tied token embedding: final LayerNorm and project_out (OPT);
    final RMSNorm and, when untied, lm_head [vocab, hidden] as HF stores it (llama)."""
    if self.family == 'llama':
      shapes = {'final_norm': {'scale': (self.hidden_size,)}}
      return shapes if self.tie_word_embeddings else {
          **shapes, 'lm_head': (self.vocab_size, self.hidden_size)}
    shapes: ShapeTree = {}
    if self.has_final_layer_norm and self.layer_norm_affine:
      shapes['final_ln'] = self._norm_shapes()
    if self.has_projection:
      shapes['project_out'] = {'weight': (self.embed_dim, self.hidden_size)}
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
    """Bytes of one layer's K and V for `batch` sequences of `seq_len` (paper: 4·b·s·h1 in fp16;
    with grouped-query attention the KV heads' width, not h1)."""
    return 2 * batch * seq_len * self.kv_dim * itemsize

  def hidden_bytes(self, batch: int, seq_len: int, itemsize: int = 2) -> int:
    """Bytes of the hidden states passed between layers (paper: 2·b·s·h1 in fp16)."""
    return batch * seq_len * self.hidden_size * itemsize

  # ---- construction ---------------------------------------------------------------------------
  @classmethod
  def from_hf_config(cls, hf: Mapping[str, Any], name: str | None = None) -> 'ModelConfig':
    """Builds a config from the fields of a Hugging Face `config.json` (model_type 'opt',
    'llama' or 'mistral'). Mistral's sliding window caps max_positions: flexjax attends to the
    whole sequence, which equals windowed attention only up to the window."""
    model_type = hf.get('model_type', 'opt')
    if model_type in ('llama', 'mistral'):
      return cls._from_hf_llama(hf, name)
    if model_type != 'opt':
      raise FlexjaxError(f'model_type={model_type!r} in config.json is not supported; '
                         'flexjax runs model_type "opt", "llama" and "mistral"')
    return cls._from_hf_opt(hf, name)

  @classmethod
  def _from_hf_opt(cls, hf: Mapping[str, Any], name: str | None) -> 'ModelConfig':
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
  def _from_hf_llama(cls, hf: Mapping[str, Any], name: str | None) -> 'ModelConfig':
    model_type = hf['model_type']
    activation = hf.get('hidden_act', 'silu')
    if activation != 'silu':
      raise FlexjaxError(f'hidden_act={activation!r} is not supported; {model_type} uses "silu"')
    if hf.get('attention_bias') or hf.get('mlp_bias'):
      raise FlexjaxError(f'{model_type} with attention_bias/mlp_bias is not supported; flexjax '
                         'runs LLaMA-family models without biases')
    try:
      max_positions = int(hf.get('max_position_embeddings', 2048))
      if hf.get('sliding_window') is not None:
        max_positions = min(max_positions, int(hf['sliding_window']))
      eos = _first(hf.get('eos_token_id'), 2)
      theta, scaling = _rope_fields(hf)
      return cls(
          name=name or hf.get('_name_or_path') or f'{model_type}-custom',
          family='llama',
          num_layers=int(hf['num_hidden_layers']),
          hidden_size=int(hf['hidden_size']),
          num_heads=int(hf['num_attention_heads']),
          num_kv_heads=int(hf.get('num_key_value_heads') or hf['num_attention_heads']),
          head_dim_override=_declared_head_dim(hf),
          ffn_dim=int(hf['intermediate_size']),
          vocab_size=int(hf['vocab_size']),
          max_positions=max_positions,
          enable_bias=False,
          rope_theta=theta,
          rope_scaling=scaling,
          rms_norm_eps=float(hf.get('rms_norm_eps', 1e-6)),
          tie_word_embeddings=bool(hf.get('tie_word_embeddings', False)),
          pad_token_id=_first(hf.get('pad_token_id'), eos),
          bos_token_id=_first(hf.get('bos_token_id'), 1),
          eos_token_id=eos,
      )
    except KeyError as e:
      raise FlexjaxError(f'config.json lacks the field {e.args[0]!r}; is it a {model_type} '
                         'config?') from None

  @classmethod
  def from_hf_config_file(cls, path: str | os.PathLike, name: str | None = None) -> 'ModelConfig':
    try:
      with open(path) as f:
        hf = json.load(f)
    except FileNotFoundError:
      raise FlexjaxError(f'config file {str(path)!r} does not exist; give the folder of a Hugging '
                         'Face checkpoint (config.json beside its weight files)') from None
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


def _first(value: Any, default: int) -> int:
  """A token id from an HF config field: None -> default; a list (several EOS ids) -> its
  first entry (flexjax stops at one EOS id)."""
  if isinstance(value, (list, tuple)):
    value = value[0] if value else None
  return default if value is None else int(value)


def _declared_head_dim(hf: Mapping[str, Any]) -> int | None:
  """head_dim when config.json declares one that differs from hidden_size / heads."""
  declared = hf.get('head_dim')
  implied = int(hf['hidden_size']) // int(hf['num_attention_heads'])
  return None if declared in (None, implied) else int(declared)


def _rope_fields(hf: Mapping[str, Any]) -> tuple[float, tuple | None]:
  """(rope_theta, rope_scaling) from `rope_scaling` + `rope_theta` or from `rope_parameters`
  (newer transformers); scaling None for the default rotary embedding."""
  params = dict(hf.get('rope_parameters') or hf.get('rope_scaling') or {})
  theta = float(params.pop('rope_theta', hf.get('rope_theta', 10000.0)))
  kind = params.pop('rope_type', params.pop('type', 'default'))
  if kind == 'default':
    return theta, None
  return theta, tuple(sorted({**params, 'rope_type': kind}.items()))


def _count(shapes: ShapeTree) -> int:
  total = 0
  for value in shapes.values():
    total += _count(value) if isinstance(value, dict) else int(np.prod(value))
  return total


def _opt(name, layers, hidden, heads, ffn, **kw) -> ModelConfig:
  return ModelConfig(name=name, num_layers=layers, hidden_size=hidden, num_heads=heads,
                     ffn_dim=ffn, **kw)


def _llama(name, layers, hidden, heads, kv_heads, ffn, vocab, **kw) -> ModelConfig:
  defaults = dict(rms_norm_eps=1e-5, tie_word_embeddings=False, enable_bias=False,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0, max_positions=4096)
  return ModelConfig(name=name, family='llama', num_layers=layers, hidden_size=hidden,
                     num_heads=heads, num_kv_heads=kv_heads, ffn_dim=ffn, vocab_size=vocab,
                     **{**defaults, **kw})


_LLAMA3 = dict(rope_theta=500000.0, max_positions=8192, bos_token_id=128000,
               eos_token_id=128001, pad_token_id=128001)

# Published OPT shapes (Zhang et al. 2022, Table 1; the Hugging Face configs) and LLaMA-family
# shapes (the Hugging Face configs of meta-llama/Llama-2-*-hf, Meta-Llama-3-*, Mistral-7B-v0.1
# with its 4096-token sliding window as the length, SmolLM2-135M).
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
        _llama('llama-2-7b', 32, 4096, 32, 32, 11008, 32000),
        _llama('llama-2-13b', 40, 5120, 40, 40, 13824, 32000),
        _llama('llama-2-70b', 80, 8192, 64, 8, 28672, 32000),
        _llama('llama-3-8b', 32, 4096, 32, 8, 14336, 128256, **_LLAMA3),
        _llama('llama-3-70b', 80, 8192, 64, 8, 28672, 128256, **_LLAMA3),
        _llama('mistral-7b', 32, 4096, 32, 8, 14336, 32000),
        _llama('smollm2-135m', 30, 576, 9, 3, 1536, 49152, rope_theta=100000.0,
               tie_word_embeddings=True, max_positions=8192, bos_token_id=0, eos_token_id=0,
               pad_token_id=0),
    )
}


def preset(name: str) -> ModelConfig:
  """Returns the preset `name` ('opt-125m' ... 'opt-175b', 'llama-2-7b', ..., 'smollm2-135m';
  an organisation prefix such as 'facebook/' is accepted)."""
  key = name.lower().rsplit('/', 1)[-1]
  if key not in PRESETS:
    raise FlexjaxError(f'unknown model {name!r}; choose one of {", ".join(PRESETS)} '
                       'or pass --checkpoint with a converted model')
  return PRESETS[key]
