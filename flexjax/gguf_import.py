"""Reading GGUF files (llama.cpp's format): Llama metadata, tensors and tokenizer in HF's terms.

A GGUF holds a model's config as metadata (`llama.block_count`, ...), its tensors under
llama.cpp's names, often quantized (Q4_1, Q8_0, ...), and its tokenizer as vocabulary, merges and
special ids. `GGUFFile` turns those into what a Hugging Face Llama directory holds: a config.json
dict, tensors by HF name (dequantized, Q/K rows back in HF's rotary layout) and tokenizer files
written with the `tokenizers` package, so one conversion core serves both sources.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import numpy as np

from flexjax.errors import FlexjaxError

GGUF_MAGIC = b'GGUF'

# GGUF metadata key (after '<arch>.') -> HF config.json field.
_CONFIG_KEYS = {
    'block_count': 'num_hidden_layers',
    'embedding_length': 'hidden_size',
    'feed_forward_length': 'intermediate_size',
    'attention.head_count': 'num_attention_heads',
    'attention.head_count_kv': 'num_key_value_heads',
    'attention.layer_norm_rms_epsilon': 'rms_norm_eps',
    'rope.freq_base': 'rope_theta',
    'context_length': 'max_position_embeddings',
    'attention.key_length': 'head_dim',
}
_REQUIRED = ('block_count', 'embedding_length', 'feed_forward_length', 'attention.head_count')

# GGUF tensor name -> HF tensor name; '{}' is the layer index.
_GLOBAL_TENSORS = {
    'token_embd.weight': 'model.embed_tokens.weight',
    'output_norm.weight': 'model.norm.weight',
    'output.weight': 'lm_head.weight',
}
_LAYER_TENSORS = {
    'attn_norm.weight': 'input_layernorm.weight',
    'attn_q.weight': 'self_attn.q_proj.weight',
    'attn_k.weight': 'self_attn.k_proj.weight',
    'attn_v.weight': 'self_attn.v_proj.weight',
    'attn_output.weight': 'self_attn.o_proj.weight',
    'ffn_gate.weight': 'mlp.gate_proj.weight',
    'ffn_up.weight': 'mlp.up_proj.weight',
    'ffn_down.weight': 'mlp.down_proj.weight',
    'ffn_norm.weight': 'post_attention_layernorm.weight',
}
_LAYER_NAME = re.compile(r'blk\.(\d+)\.(.+)')

# tokenizer.ggml.pre -> split applied before the byte-level step ('digits': one digit a piece).
_PRE_TOKENIZERS = {'default': (), 'gpt-2': (), 'gpt2': (), 'smollm': ('digits',)}
_CONTROL = 3  # tokenizer.ggml.token_type of special tokens (<|im_start|>, <|endoftext|>, ...)
_USER_DEFINED = 4


def is_gguf(path: str | os.PathLike) -> bool:
  """True when `path` is a file starting with the GGUF magic bytes."""
  path = Path(path)
  if not path.is_file():
    return False
  with open(path, 'rb') as f:
    return f.read(4) == GGUF_MAGIC


class GGUFFile:
  """A Llama-architecture GGUF file seen as an HF checkpoint: `config`, `get(name)`, tokenizer."""

  def __init__(self, path: str | os.PathLike):
    import gguf

    self.path = Path(path)
    if not is_gguf(self.path):
      raise FlexjaxError(f'{str(path)!r} is not a GGUF file (no GGUF magic bytes); give a .gguf '
                         'file (HF folders convert with --hf_dir)')
    try:
      self._reader = gguf.GGUFReader(self.path)
    except Exception as e:  # the reader raises several types for damaged files
      raise FlexjaxError(f'{str(path)!r} cannot be read as GGUF ({type(e).__name__}: '
                         f'{str(e).splitlines()[0][:200] if str(e) else ""}); download it '
                         'again') from None
    self.arch = self.metadata('general.architecture')
    if self.arch != 'llama':
      raise FlexjaxError(f'{str(path)!r} has general.architecture={self.arch!r}; flexjax reads '
                         'GGUF files of the llama architecture (Llama, Mistral, SmolLM)')
    self._tensors = {t.name: t for t in self._reader.tensors}
    self._hf_names = {_hf_tensor_name(name): name for name in self._tensors}
    self.config = self._hf_config()

  def metadata(self, key: str, default: Any = None) -> Any:
    """The value of a metadata key (strings, numbers, lists), or `default` when absent."""
    field = self._reader.fields.get(key)
    return default if field is None else field.contents()

  def _hf_config(self) -> dict[str, Any]:
    """An HF `config.json` dict for a LlamaForCausalLM equal to the file's model."""
    prefix = f'{self.arch}.'
    missing = [k for k in _REQUIRED if self.metadata(prefix + k) is None]
    if missing:
      raise FlexjaxError(f'{str(self.path)!r} lacks the metadata {prefix}{missing[0]}; the file '
                         'is incomplete, convert it again with llama.cpp')
    config: dict[str, Any] = {'model_type': 'llama', 'architectures': ['LlamaForCausalLM'],
                              'hidden_act': 'silu', 'attention_bias': False, 'mlp_bias': False}
    for key, field in _CONFIG_KEYS.items():
      value = self.metadata(prefix + key)
      if value is not None:
        config[field] = value
    config.setdefault('num_key_value_heads', config['num_attention_heads'])
    config.setdefault('rms_norm_eps', 1e-5)
    config.setdefault('rope_theta', 10000.0)
    config['rope_theta'] = float(config['rope_theta'])
    config['rms_norm_eps'] = float(config['rms_norm_eps'])
    embedding = self._tensors.get('token_embd.weight')  # ggml shape [hidden, vocab]
    config['vocab_size'] = (int(embedding.shape[1]) if embedding is not None
                            else self.metadata(prefix + 'vocab_size'))
    config['tie_word_embeddings'] = 'output.weight' not in self._tensors
    config['rope_scaling'] = self._rope_scaling(prefix)
    for name, key in (('bos_token_id', 'bos_token_id'), ('eos_token_id', 'eos_token_id'),
                      ('pad_token_id', 'padding_token_id')):
      value = self.metadata(f'tokenizer.ggml.{key}')
      if value is not None:
        config[name] = int(value)
    name = self.metadata('general.name')
    if name:
      config['_name_or_path'] = str(name)
    return config

  def _rope_scaling(self, prefix: str) -> dict[str, Any] | None:
    kind = self.metadata(prefix + 'rope.scaling.type')
    if kind in (None, 'none'):
      return None
    if kind != 'linear':
      raise FlexjaxError(f'{str(self.path)!r} has {prefix}rope.scaling.type={kind!r}; flexjax '
                         'reads GGUF rope scaling of type "linear" only, use a file without it')
    return {'rope_type': 'linear', 'factor': float(self.metadata(prefix + 'rope.scaling.factor'))}

  def tensor_types(self) -> dict[str, str]:
    """GGUF tensor name -> its ggml type name ('F32', 'Q4_1', ...)."""
    return {name: t.tensor_type.name for name, t in self._tensors.items()}

  def names(self) -> list[str]:
    """HF names of the file's tensors."""
    return sorted(self._hf_names)

  def get(self, hf_name: str) -> np.ndarray:
    """The tensor named `hf_name` in HF's layout ([out, in] for Linear weights), float32."""
    if hf_name not in self._hf_names:
      raise FlexjaxError(f'{str(self.path)!r} has no tensor for {hf_name!r}; is it a complete '
                         'llama GGUF?')
    return self._hf_rows(hf_name, self._dequantized(self._tensors[self._hf_names[hf_name]]))

  def packed(self, hf_name: str, config) -> np.ndarray | None:
    """The tensor's own quantized values as flexjax's packed byte rows (quant.py) in HF's row
    order, when its GGUF type is the same kind as `config` (a quant.QuantConfig); else None.

    Q4_1 is flexjax's 4-bit format in groups of 32 along a row: a block of 32 values holds a
    float16 scale d and minimum m and 16 bytes of 4-bit q (value = d * q + m), values 0-15 in
    the low nibbles and 16-31 in the high ones. flexjax packs neighbours (2i, 2i + 1) into a
    byte and puts a row's minimums, then its scales, after its values, so the blocks are
    rearranged without touching a value: no second rounding.
    """
    import gguf

    tensor = self._tensors.get(self._hf_names.get(hf_name, ''))
    if (tensor is None or tensor.tensor_type != gguf.GGMLQuantizationType.Q4_1
        or (config.bits, config.group_size) != (4, 32)):
      return None
    rows = int(tensor.shape[-1]) if len(tensor.shape) > 1 else 1
    blocks = np.asarray(tensor.data).reshape(rows, -1, 20)  # [rows, groups, d | m | qs]
    qs = blocks[..., 4:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # [rows, groups, 32] in value order
    values = (q[..., 0::2] | (q[..., 1::2] << 4)).reshape(rows, -1)
    data = np.concatenate([values, blocks[..., 2:4].reshape(rows, -1),
                           blocks[..., 0:2].reshape(rows, -1)], axis=-1)
    return self._hf_rows(hf_name, data.astype(np.uint8))

  def _hf_rows(self, hf_name: str, rows: np.ndarray) -> np.ndarray:
    """Rows of a Q or K projection back in HF's rotary order (others as they are)."""
    heads = {'self_attn.q_proj.weight': self.config['num_attention_heads'],
             'self_attn.k_proj.weight': self.config['num_key_value_heads']}
    for suffix, num_heads in heads.items():
      if hf_name.endswith(suffix):
        return unpermute_rotary_rows(rows, num_heads)
    return rows

  def _dequantized(self, tensor) -> np.ndarray:
    import gguf

    shape = tuple(int(n) for n in reversed(tensor.shape))  # ggml lists the fastest axis first
    kind = tensor.tensor_type
    if kind in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16,
                gguf.GGMLQuantizationType.BF16):
      values = np.asarray(tensor.data)
      if kind == gguf.GGMLQuantizationType.BF16:
        values = (values.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
      return np.asarray(values, np.float32).reshape(shape)
    try:
      return np.asarray(gguf.quants.dequantize(tensor.data, kind), np.float32).reshape(shape)
    except NotImplementedError:
      raise FlexjaxError(f'{str(self.path)!r}: tensor {tensor.name!r} has type {kind.name}, which '
                         'the gguf package cannot dequantize; requantize the file to Q8_0, '
                         'Q4_1 or F16 with llama-quantize') from None

  # ---- tokenizer ------------------------------------------------------------------------------
  def has_tokenizer(self) -> bool:
    return self.metadata('tokenizer.ggml.model') is not None

  def write_tokenizer(self, folder: str | os.PathLike) -> list[Path]:
    """Writes tokenizer.json and tokenizer_config.json (special tokens, chat template)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = self._build_tokenizer()
    tokenizer.save(str(folder / 'tokenizer.json'))
    (folder / 'tokenizer_config.json').write_text(
        json.dumps(self._tokenizer_config(), indent=2, ensure_ascii=False) + '\n')
    return [folder / 'tokenizer.json', folder / 'tokenizer_config.json']

  def _build_tokenizer(self):
    """A byte-level BPE `tokenizers.Tokenizer` from the file's vocabulary and merges."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    kind = self.metadata('tokenizer.ggml.model')
    if kind != 'gpt2':
      raise FlexjaxError(f'{str(self.path)!r} has tokenizer.ggml.model={kind!r}; flexjax reads '
                         'byte-level BPE tokenizers ("gpt2") from GGUF files; convert with '
                         '--tokenizer_dir=<HF folder with tokenizer.json> instead')
    pre = self.metadata('tokenizer.ggml.pre', 'default')
    if pre not in _PRE_TOKENIZERS:
      raise FlexjaxError(f'{str(self.path)!r} has tokenizer.ggml.pre={pre!r}, whose text '
                         f'splitting flexjax does not know (known: {", ".join(_PRE_TOKENIZERS)});'
                         ' convert with --tokenizer_dir=<HF folder with tokenizer.json>')
    tokens = self.metadata('tokenizer.ggml.tokens')
    merges = [tuple(m.split(' ', 1)) for m in self.metadata('tokenizer.ggml.merges', [])]
    vocab = {token: index for index, token in enumerate(tokens)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=None,
                                     fuse_unk=False, byte_fallback=False))
    steps = [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    if 'digits' in _PRE_TOKENIZERS[pre]:
      steps.insert(0, pre_tokenizers.Digits(individual_digits=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(steps)
    tokenizer.decoder = decoders.ByteLevel()
    types = self.metadata('tokenizer.ggml.token_type') or [1] * len(tokens)
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                  for t, kind in zip(tokens, types) if kind == _CONTROL])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False)
                          for t, kind in zip(tokens, types) if kind == _USER_DEFINED])
    return tokenizer

  def _tokenizer_config(self) -> dict[str, Any]:
    tokens = self.metadata('tokenizer.ggml.tokens')
    config: dict[str, Any] = {
        'tokenizer_class': 'PreTrainedTokenizerFast',
        'add_bos_token': bool(self.metadata('tokenizer.ggml.add_bos_token', False)),
        'add_eos_token': bool(self.metadata('tokenizer.ggml.add_eos_token', False)),
        'model_max_length': int(self.config.get('max_position_embeddings', 2048)),
    }
    for name, key in (('bos', 'bos_token_id'), ('eos', 'eos_token_id'),
                      ('unk', 'unknown_token_id'), ('pad', 'padding_token_id')):
      index = self.metadata(f'tokenizer.ggml.{key}')
      if index is not None:
        config[f'{name}_token'] = tokens[int(index)]
        config[f'{name}_token_id'] = int(index)
    template = self.metadata('tokenizer.chat_template')
    if template:
      config['chat_template'] = template
    return config


def convert(path: str | os.PathLike, output: str | os.PathLike, *, dtype: str = 'float32',
            tokenizer_dir: str | os.PathLike | None = None, overwrite: bool = False,
            progress: bool = False) -> Path:
  """Converts a llama GGUF file into a flexjax checkpoint (weights and tokenizer).

  Args:
    dtype: stored dtype. 'float32' (the default, also for 'source') keeps the dequantized values
      exactly, as transformers dequantizes them; 'float16'/'bfloat16' round them.
    tokenizer_dir: an HF folder whose tokenizer files (tokenizer.json, ...) are used instead of
      the tokenizer built from the file's vocabulary.
  Returns:
    The checkpoint path (complete: written to a temporary directory, then renamed).
  """
  import tempfile

  from flexjax.config import ModelConfig
  from flexjax.hf_import import convert_tensors

  source = GGUFFile(path)
  cfg = ModelConfig.from_hf_config(source.config, name=Path(path).name.removesuffix('.gguf'))
  with tempfile.TemporaryDirectory(prefix='flexjax-gguf-tokenizer-') as folder:
    if tokenizer_dir is not None:
      files = _tokenizer_files(Path(tokenizer_dir))
    else:
      files = source.write_tokenizer(folder) if source.has_tokenizer() else []
    path = convert_tensors(cfg, source.get, output,
                           dtype='float32' if dtype == 'source' else dtype,
                           tokenizer_files=files, overwrite=overwrite, progress=progress,
                           reads_from=[p for p in (path, tokenizer_dir) if p is not None])
  write_kept_layout(source, path, progress=progress)
  return path


def kept_policy():
  """The weight compression that keeps Q4_1 blocks as they are: 4 bits in groups of 32."""
  from flexjax.policy import Policy
  return Policy(compress_weight=True, compress_bits=4, compress_group_size=32)


def write_kept_layout(source: GGUFFile, checkpoint: str | os.PathLike, *,
                      progress: bool = False) -> bool:
  """When the file has Q4_1 matrices, writes the checkpoint's streaming layout for 4-bit weights
  in groups of 32 (what --compress_weight --compress_group_size=32 reads) from the file's own
  blocks, so a compressed run uses the GGUF's values, not a second rounding of them. Matrices of
  other types are quantized from their dequantized values. Returns whether it wrote one."""
  import functools

  import jax

  from flexjax import hardware
  from flexjax import quant as quant_lib
  from flexjax.checkpoint import Checkpoint
  from flexjax.placement import cpu_quantizer, open_layout

  if 'Q4_1' not in source.tensor_types().values():
    return False
  policy = kept_policy()
  quantize = jax.jit(functools.partial(quant_lib.quantize, config=policy.quant))
  kept = _KeptBlocks(Checkpoint(checkpoint), source, policy.quant)
  open_layout(kept, policy, cpu_quantizer(quantize, hardware.cpu_device()), cache_dir=None,
              progress=progress).close()
  return True


class _KeptBlocks:
  """A converted checkpoint as a weight source whose matrices are the GGUF's own packed rows
  where the file's type matches `config` (stream.py writes uint8 rows as they are)."""

  def __init__(self, checkpoint, source: GGUFFile, config):
    self._checkpoint, self._source, self._config = checkpoint, source, config
    self.config, self.dtype = checkpoint.config, checkpoint.dtype

  def fingerprint(self) -> str:
    return self._checkpoint.fingerprint()

  def stream_folder(self, cache_dir: Path) -> Path:
    return self._checkpoint.stream_folder(cache_dir)

  def read(self, stage: str):
    from flexjax.hf_import import hf_key
    from flexjax.model import params as params_lib

    packed = {}
    for path in params_lib.flatten(params_lib.stage_shapes(self.config, stage)):
      rows = self._source.packed(hf_key(self.config, stage, path), self._config)
      if rows is not None:
        packed[path] = rows
    # the checkpoint's float values only where the file's blocks are not kept
    rest = params_lib.flatten(self._checkpoint.read(stage, skip=set(packed)))
    return params_lib.unflatten({**rest, **packed})


def _tokenizer_files(folder: Path) -> list[Path]:
  from flexjax.hf_import import TOKENIZER_FILES
  files = [folder / name for name in TOKENIZER_FILES if (folder / name).is_file()]
  if not files:
    raise FlexjaxError(f'--tokenizer_dir={str(folder)!r} holds none of {", ".join(TOKENIZER_FILES)}'
                       '; give the HF folder of the model\'s tokenizer')
  return files


def _hf_tensor_name(gguf_name: str) -> str:
  """The HF name of a GGUF tensor name; unknown names are kept (and later refused if used)."""
  if gguf_name in _GLOBAL_TENSORS:
    return _GLOBAL_TENSORS[gguf_name]
  match = _LAYER_NAME.fullmatch(gguf_name)
  if match and match.group(2) in _LAYER_TENSORS:
    return f'model.layers.{int(match.group(1))}.{_LAYER_TENSORS[match.group(2)]}'
  return gguf_name


def unpermute_rotary_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
  """Undoes llama.cpp's row order of a Q or K projection ([heads * head_dim, in]).

  HF rotates the two halves of each head (dims i and i + head_dim/2 form a pair); llama.cpp pairs
  neighbouring dims (2i, 2i + 1), so its converter interleaves each head's two halves. This puts
  row 2i + j of a head back at row j * head_dim/2 + i.
  """
  rows = weight.shape[0]
  if rows % (2 * num_heads):
    raise FlexjaxError(f'a Q/K projection with {rows} rows cannot hold {num_heads} heads of even '
                       'size; the GGUF metadata and its tensors disagree')
  half = rows // num_heads // 2
  return (weight.reshape(num_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2)
          .reshape(weight.shape))


def permute_rotary_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
  """HF's Q/K row order -> llama.cpp's (the inverse of `unpermute_rotary_rows`)."""
  half = weight.shape[0] // num_heads // 2
  return (weight.reshape(num_heads, 2, half, *weight.shape[1:]).swapaxes(1, 2)
          .reshape(weight.shape))
