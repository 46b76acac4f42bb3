"""Tiny random OPT and Llama/Mistral models saved by transformers, converted by flexjax: shared
test fixtures."""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip('torch')  # CI installs the test extras; this only guards bare installs
transformers = pytest.importorskip('transformers')

from flexjax.checkpoint import Checkpoint  # noqa: E402
from flexjax.engine import Engine, GenerationConfig  # noqa: E402
from flexjax.hf_import import convert  # noqa: E402
from flexjax.policy import Policy  # noqa: E402

# name -> OPTConfig fields. Shapes cover pre/post LayerNorm, project_in/out (350m style), an odd
# head count and vocabularies that are not multiples of 8.
TINY_SHAPES = {
    'pre_ln': dict(hidden_size=64, num_attention_heads=4, ffn_dim=128, num_hidden_layers=2,
                   vocab_size=1000),
    'post_ln_proj': dict(hidden_size=48, num_attention_heads=4, ffn_dim=96, num_hidden_layers=2,
                         vocab_size=1001, word_embed_proj_dim=32, do_layer_norm_before=False),
    'odd_heads': dict(hidden_size=40, num_attention_heads=5, ffn_dim=72, num_hidden_layers=3,
                      vocab_size=997),
}


# jax's persistent compilation cache for the whole test session, every process the tests start
# and each xdist worker included: the tiny models' steps compile once per session instead of
# once per test. Every entry is kept (no minimum compile time); the size bound turns on jax's
# file lock, so workers never read each other's half-written entries. Tests of compiles and of
# flexjax's own cache (--compile_cache) take it out of their processes' environment.
_COMPILE_CACHE_KEY = pytest.StashKey[str]()
TEST_COMPILE_CACHE = {'JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS': '0',
                      'JAX_COMPILATION_CACHE_MAX_SIZE': str(8 << 30)}


def pytest_configure(config):
  """The controlling process makes the folder and hands it on in the environment (the workers
  and the processes tests start read it as jax is imported); its own jax, imported with this
  file, is told directly."""
  if hasattr(config, 'workerinput') or 'JAX_COMPILATION_CACHE_DIR' in os.environ:
    return
  import jax
  folder = tempfile.mkdtemp(prefix='flexjax-tests-xla-')
  config.stash[_COMPILE_CACHE_KEY] = folder  # the process that made it removes it
  os.environ.update(TEST_COMPILE_CACHE, JAX_COMPILATION_CACHE_DIR=folder)
  jax.config.update('jax_compilation_cache_dir', folder)
  jax.config.update('jax_persistent_cache_min_compile_time_secs', 0)
  jax.config.update('jax_compilation_cache_max_size',
                    int(TEST_COMPILE_CACHE['JAX_COMPILATION_CACHE_MAX_SIZE']))


# The test files that take longest (most time first, as measured in CI's run): xdist hands whole
# files to its two workers in collection order, so these start first and the short files fill
# the end of the run on both workers, rather than one long file running alone at the end.
LONG_FILES = ('test_readme.py', 'test_fuzz_placement.py', 'test_cli.py', 'test_gguf.py',
              'test_memcheck.py', 'test_pipeline.py', 'test_dispatch.py', 'test_approx.py',
              'test_job.py', 'test_offload.py', 'test_search.py')


def pytest_collection_modifyitems(config, items):
  rank = {name: i for i, name in enumerate(LONG_FILES)}
  items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: files stay whole


def pytest_unconfigure(config):
  folder = config.stash.get(_COMPILE_CACHE_KEY, None)
  if folder:
    shutil.rmtree(folder, ignore_errors=True)


# Rates of a made-up machine for the roofline tools' tests (tools.roofline.measure_rates' form).
ROOFLINE_RATES = {
    'device': 'cpu:cpu', 'matmul_flops': {'float32': {'jax': 600.0, 'torch': 1000.0}},
    'matmul_n': {'float32': {'jax': 512, 'torch': 512}}, 'host_device_bw': 1000.0,
    'host_device_method': 'memcpy (numpy copyto)', 'disk_read_bw': 100.0, 'disk_write_bw': 50.0,
    'disk': {'folder': '/x', 'file_bytes': 2**30, 'o_direct': True, 'chunk_bytes': 2**24,
             'threads': 4, 'note': ''},
    'measured_at': 'now'}


def run_tool_cli(tool, argv: list[str], capsys):
  """A tools/ module's command line run in this process on `argv`: (exit status, captured
  output)."""
  from absl import flags
  fv = flags.FlagValues()
  tool.define_flags(fv)
  fv([tool.__name__.rsplit('.', 1)[-1]] + argv)
  return tool.run_cli(fv), capsys.readouterr()


def without_test_compile_cache(env: dict[str, str]) -> dict[str, str]:
  """A process environment without the session's compilation cache (jax's own settings)."""
  return {k: v for k, v in env.items()
          if k != 'JAX_COMPILATION_CACHE_DIR' and k not in TEST_COMPILE_CACHE}


@dataclasses.dataclass
class TinyModel:
  name: str
  hf_dir: Path
  ckpt_dir: Path
  torch_model: object

  def engine(self, **kw) -> Engine:
    return Engine(Checkpoint(self.ckpt_dir), **kw)


def quantize(x, config):
  """quant.quantize compiled once per shape, as the engine's steps run it (called op by op,
  each jnp operation would compile on its own)."""
  import jax

  from flexjax import quant
  return jax.jit(quant.quantize, static_argnames='config')(x, config)


def dequantize(data, dim, config):
  """quant.dequantize compiled once per shape (see `quantize`)."""
  import jax

  from flexjax import quant
  return jax.jit(quant.dequantize, static_argnames=('dim', 'config'))(data, dim, config)


def make_hf_model(shape: dict, seed: int = 0):
  """A random OPTForCausalLM whose every parameter (biases, LayerNorms) is non-trivial."""
  torch.manual_seed(seed)
  config = transformers.OPTConfig(max_position_embeddings=64, pad_token_id=1, bos_token_id=2,
                                  eos_token_id=2, **shape)
  model = transformers.OPTForCausalLM(config).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if 'layer_norm' in name and name.endswith('weight'):
        p.copy_(1 + 0.1 * torch.randn_like(p))
      else:
        p.copy_(0.08 * torch.randn_like(p))
  return model


def save_tokenizer(directory: Path) -> None:
  """A small byte-level BPE tokenizer (vocab.json + merges.txt), trained on a few sentences."""
  import tokenizers
  tok = tokenizers.ByteLevelBPETokenizer()
  text = ['Paris is the capital city of France.', 'The quick brown fox jumps over the lazy dog.',
          'flexjax streams weights layer by layer.'] * 20
  tok.train_from_iterator(text, vocab_size=400, min_frequency=1, show_progress=False,
                          special_tokens=['<s>', '<pad>', '</s>', '<unk>'])
  tok.save_model(str(directory))


@pytest.fixture(scope='session', params=list(TINY_SHAPES))
def tiny(request, tmp_path_factory) -> TinyModel:
  """Each tiny shape: HF directory (safetensors + tokenizer) and its fp32 flexjax checkpoint."""
  root = tmp_path_factory.mktemp(request.param)
  model = make_hf_model(TINY_SHAPES[request.param])
  model.save_pretrained(root / 'hf')
  save_tokenizer(root / 'hf')
  convert(root / 'hf', root / 'ckpt', dtype='float32', progress=False)
  return TinyModel(request.param, root / 'hf', root / 'ckpt', model)


@pytest.fixture(scope='session')
def pre_ln(tmp_path_factory) -> TinyModel:
  """The pre-LN tiny model alone, for tests that need one model."""
  root = tmp_path_factory.mktemp('pre_ln_single')
  model = make_hf_model(TINY_SHAPES['pre_ln'])
  model.save_pretrained(root / 'hf')
  save_tokenizer(root / 'hf')
  convert(root / 'hf', root / 'ckpt', dtype='float32', progress=False)
  return TinyModel('pre_ln', root / 'hf', root / 'ckpt', model)


# name -> (transformers class, config fields). GQA ratios 4/2, 6/1 and 4/4, tied and untied
# embeddings, Llama 3 rope scaling, a Mistral; odd vocabularies, all above PROMPTS' ids.
_LLAMA3_ROPE = {'rope_type': 'llama3', 'factor': 8.0, 'low_freq_factor': 1.0,
                'high_freq_factor': 4.0, 'original_max_position_embeddings': 16}
LLAMA_SHAPES = {
    'gqa_4_2': ('LlamaForCausalLM', dict(hidden_size=32, num_attention_heads=4,
                                         num_key_value_heads=2, intermediate_size=72,
                                         vocab_size=1000)),
    'mqa_6_1_tied': ('LlamaForCausalLM', dict(hidden_size=48, num_attention_heads=6,
                                              num_key_value_heads=1, intermediate_size=80,
                                              vocab_size=1003, tie_word_embeddings=True)),
    'mha_llama3_rope': ('LlamaForCausalLM', dict(hidden_size=40, num_attention_heads=4,
                                                 num_key_value_heads=4, intermediate_size=56,
                                                 vocab_size=997, rope_theta=500000.0,
                                                 rope_scaling=_LLAMA3_ROPE)),
    'mistral': ('MistralForCausalLM', dict(hidden_size=32, num_attention_heads=4,
                                           num_key_value_heads=2, intermediate_size=64,
                                           vocab_size=1001, sliding_window=None)),
}


def make_hf_llama(name: str, seed: int = 0):
  """A random Llama/Mistral model (norm scales near 1, matrices 0.08-scaled noise)."""
  cls, fields = LLAMA_SHAPES[name]
  torch.manual_seed(seed)
  config_cls = getattr(transformers, cls.replace('ForCausalLM', 'Config'))
  config = config_cls(num_hidden_layers=2, max_position_embeddings=64, bos_token_id=2,
                      eos_token_id=2, pad_token_id=1, **fields)
  model = getattr(transformers, cls)(config).eval()
  with torch.no_grad():
    for param_name, p in model.named_parameters():
      p.copy_(1 + 0.1 * torch.randn_like(p) if 'norm' in param_name else 0.08 * torch.randn_like(p))
  return model


def _tiny_llama(root: Path, name: str) -> TinyModel:
  model = make_hf_llama(name)
  model.save_pretrained(root / 'hf')
  convert(root / 'hf', root / 'ckpt', dtype='float32', progress=False)
  return TinyModel(name, root / 'hf', root / 'ckpt', model)


@pytest.fixture(scope='session', params=list(LLAMA_SHAPES))
def tiny_llama(request, tmp_path_factory) -> TinyModel:
  """Each tiny Llama/Mistral shape: HF directory (safetensors) and its fp32 flexjax checkpoint."""
  return _tiny_llama(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture(scope='session')
def gqa_llama(tmp_path_factory) -> TinyModel:
  """The 4-head, 2-KV-head tiny Llama alone, for tests that need one model."""
  return _tiny_llama(tmp_path_factory.mktemp('gqa_single'), 'gqa_4_2')


def llama_logits(model, ids, mask) -> np.ndarray:
  """transformers' logits of left-padded rows, with positions counting real tokens only (as its
  generate computes them from the attention mask)."""
  positions = (mask.cumsum(-1) - 1).clamp(min=0)
  with torch.no_grad():
    return model(input_ids=ids, attention_mask=mask, position_ids=positions).logits.numpy()


def interruptible(command: list[str]) -> list[str]:
  """`python -m MODULE ARGS...` as a command whose Ctrl-C raises KeyboardInterrupt also where it
  starts with SIGINT ignored: a shell's background jobs do (CI's runs among them), and Python
  keeps an ignored SIGINT, so the child turns it back on before running the module as `-m`
  would."""
  python, flag, module, *args = command
  assert flag == '-m', command
  return [python, '-c', 'import runpy, signal, sys; '
          'signal.signal(signal.SIGINT, signal.default_int_handler); '
          f'sys.argv = {[module, *args]!r}; runpy.run_module({module!r}, run_name="__main__")']


def left_pad(prompts: list[list[int]], pad_id: int = 1):
  """Left-padded torch inputs as transformers expects them."""
  s = max(map(len, prompts))
  ids = torch.tensor([[pad_id] * (s - len(p)) + p for p in prompts])
  mask = torch.tensor([[0] * (s - len(p)) + [1] * len(p) for p in prompts])
  return ids, mask


# Prompts of different lengths (BOS first), within every tiny vocabulary.
PROMPTS = [[2, 17, 400, 33, 9, 250, 71], [2, 5, 6], [2, 900, 11, 12, 13], [2, 44]]


def hf_logits(model, ids, mask) -> np.ndarray:
  with torch.no_grad():
    return model(input_ids=ids, attention_mask=mask).logits.numpy()


def assert_prefill_matches(model: TinyModel, reference) -> None:
  """The engine's prompt logits against reference(torch_model, ids, mask) at every real token,
  within 1e-4 (fp32)."""
  ids, mask = left_pad(PROMPTS)
  ref = reference(model.torch_model, ids, mask)
  ours = model.engine().score(ids.numpy(), mask.numpy().astype(bool))
  valid = mask.numpy().astype(bool)
  assert ours.shape == ref.shape
  np.testing.assert_allclose(ours[valid], ref[valid], atol=1e-4, rtol=0)


def assert_decode_steps_match(model: TinyModel, reference, gen_len: int = 6) -> None:
  """The engine's logits at every decode step (block of 4 sequences) against reference's on
  prompt + generated tokens in one pass (position s - 1 + t predicts step t), within 1e-4, and
  its greedy tokens equal to their argmax."""
  result = model.engine(policy=Policy(gpu_batch_size=4)).generate(
      PROMPTS, GenerationConfig(gen_len=gen_len, stop_at_eos=False), return_logits=True)
  ids, mask = left_pad(PROMPTS)
  s = ids.shape[1]
  full_ids = torch.cat([ids, torch.tensor(result.tokens[:, :-1])], dim=1)
  full_mask = torch.cat([mask, torch.ones(len(PROMPTS), gen_len - 1, dtype=mask.dtype)], dim=1)
  ref = reference(model.torch_model, full_ids, full_mask)[:, s - 1:]
  assert result.logits.shape == ref.shape
  np.testing.assert_allclose(result.logits, ref, atol=1e-4, rtol=0)
  np.testing.assert_array_equal(result.tokens, ref.argmax(-1))


@pytest.fixture(autouse=True, scope='session')
def weights_cache(tmp_path_factory):
  """Streaming layouts of dummy weights go to a folder of the test session (also for the
  processes tests start), not the user's cache."""
  patch = pytest.MonkeyPatch()
  patch.setenv('FLEXJAX_CACHE', str(tmp_path_factory.mktemp('weights-cache')))
  yield
  patch.undo()
