"""LLaMA family: parity with transformers' Llama/Mistral in fp32, config import, rotary scaling."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from conftest import (PROMPTS, assert_decode_steps_match, assert_prefill_matches, left_pad,
                      llama_logits)
from flexjax import plan as plan_lib
from flexjax.config import ModelConfig, preset
from flexjax.engine import GenerationConfig
from flexjax.errors import FlexjaxError
from flexjax.model import llama
from flexjax.policy import Policy


def test_rms_norm_matches_torch():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(3, 5, 24)).astype(np.float32) * 3 + 1
  scale = rng.normal(size=24).astype(np.float32)
  ours = llama.rms_norm(jnp.asarray(scale), jnp.asarray(x), 1e-5)
  ref = torch.nn.functional.rms_norm(torch.tensor(x), (24,), torch.tensor(scale), eps=1e-5)
  np.testing.assert_allclose(np.asarray(ours), ref.numpy(), atol=1e-6, rtol=0)


def test_decode_positions_count_real_cached_tokens():
  mask = jnp.array([[0, 0, 1, 1, 0], [1, 1, 1, 1, 0]], bool)
  np.testing.assert_array_equal(np.asarray(llama.decode_positions(mask)), [2, 4])


def test_prefill_logits_match_transformers(tiny_llama):
  assert_prefill_matches(tiny_llama, llama_logits)


def test_every_decode_step_logits_match_transformers(tiny_llama):
  assert_decode_steps_match(tiny_llama, llama_logits)


def test_greedy_tokens_match_transformers_generate(gqa_llama):
  ids, mask = left_pad(PROMPTS)
  with torch.no_grad():
    theirs = gqa_llama.torch_model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                                            max_new_tokens=5, min_new_tokens=5, pad_token_id=1)
  ours = gqa_llama.engine(policy=Policy(gpu_batch_size=4)).generate(
      PROMPTS, GenerationConfig(gen_len=5, stop_at_eos=False))
  np.testing.assert_array_equal(ours.tokens, theirs[:, ids.shape[1]:].numpy())


def _hf(**kw):
  base = dict(model_type='llama', hidden_size=64, num_attention_heads=8, num_hidden_layers=2,
              intermediate_size=128, vocab_size=500)
  return {**base, **kw}


def test_from_hf_config_reads_llama_fields():
  cfg = ModelConfig.from_hf_config(_hf(num_key_value_heads=2, eos_token_id=[7, 9],
                                       rope_theta=5e5, rope_scaling=None, head_dim=16,
                                       tie_word_embeddings=True, rms_norm_eps=1e-5))
  assert (cfg.family, cfg.kv_heads, cfg.head_dim, cfg.kv_dim, cfg.q_dim) == ('llama', 2, 16, 32,
                                                                             128)
  assert (cfg.eos_token_id, cfg.pad_token_id, cfg.rope_theta) == (7, 7, 5e5)
  assert cfg.tie_word_embeddings and cfg.rope_scaling is None
  assert 'lm_head' not in cfg.head_shapes()
  newer = ModelConfig.from_hf_config(_hf(rope_parameters={
      'rope_theta': 1e4, 'rope_type': 'linear', 'factor': 2.0}))
  assert dict(newer.rope_scaling) == {'rope_type': 'linear', 'factor': 2.0}
  assert ModelConfig.from_dict(newer.to_dict()) == newer  # JSON round trip stays hashable
  mistral = ModelConfig.from_hf_config(_hf(model_type='mistral', sliding_window=512,
                                           max_position_embeddings=4096))
  assert mistral.max_positions == 512


@pytest.mark.parametrize('fields, message', [
    (dict(rope_scaling={'rope_type': 'yarn', 'factor': 4.0}), "rope_type='yarn'"),
    (dict(rope_scaling={'rope_type': 'llama3', 'factor': 4.0}), 'lacks'),
    (dict(num_key_value_heads=3), 'num_kv_heads=3'),
    (dict(hidden_act='gelu'), "hidden_act='gelu'"),
])
def test_from_hf_config_rejects_what_flexjax_cannot_run(fields, message):
  with pytest.raises(FlexjaxError, match=message) as info:
    ModelConfig.from_hf_config(_hf(**fields))
  assert '\n' not in str(info.value)


def test_llama3_rope_scaling_keeps_short_and_divides_long_wavelengths():
  cfg = ModelConfig.from_hf_config(_hf(rope_theta=5e5, rope_scaling={
      'rope_type': 'llama3', 'factor': 8.0, 'low_freq_factor': 1.0, 'high_freq_factor': 4.0,
      'original_max_position_embeddings': 64}))
  plain = llama.inverse_frequencies(dataclasses.replace(cfg, rope_scaling=None))
  scaled = llama.inverse_frequencies(cfg)
  wavelen = 2 * np.pi / plain
  np.testing.assert_array_equal(scaled[wavelen < 16], plain[wavelen < 16])
  np.testing.assert_allclose(scaled[wavelen > 64], plain[wavelen > 64] / 8, rtol=1e-6)


def _rope_cfg(**kw):
  return dataclasses.replace(ModelConfig.from_hf_config(_hf(rope_theta=1e4, head_dim=16)), **kw)


def test_rotation_from_its_table_equals_the_computed_rotation():
  """The looked-up cos and sin give the rotation the step computes (float32, within 2e-6);
  padding's position -1 gives finite values; past the table's size the step computes them."""
  cfg = _rope_cfg()
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(3, 40, 8, 16)).astype(np.float32))
  positions = jnp.asarray(rng.integers(0, 40, size=(3, 40)), jnp.int32).at[0, :5].set(-1)
  looked_up = np.asarray(llama.rotate(x, positions, cfg, 40))
  computed = np.asarray(llama.rotate(x, positions, cfg))
  real = np.asarray(positions) >= 0
  np.testing.assert_allclose(looked_up[real], computed[real], rtol=0, atol=2e-6)
  assert np.isfinite(looked_up).all()
  np.testing.assert_array_equal(  # at position 0 the rotation is the identity
      looked_up[np.asarray(positions) == 0], np.asarray(x)[np.asarray(positions) == 0])
  table = llama.rotary_table(cfg, 40)
  assert table.shape == (2, 40, 16) and table.dtype == np.float32
  long = llama.ROTARY_TABLE_ENTRIES // 16 + 1
  np.testing.assert_array_equal(np.asarray(llama.rotate(x, positions, cfg, long)), computed)


@pytest.mark.parametrize('step', ['prefill', 'decode'])
def test_a_layer_step_computes_no_sines_or_cosines(step):
  """A layer step looks its positions' cos and sin up in a table made as it is traced: the
  compiled step has no trigonometric op left (XLA:CPU had fused them into the rotation and
  computed them again for every head: 11 of a SmolLM2 prompt step's ~145 ms)."""
  import functools
  import jax
  cfg = _rope_cfg(num_kv_heads=2)
  from flexjax.model import params as params_lib
  params = params_lib.dummy_stage(cfg, params_lib.layer_name(0), np.float16, 0)
  x = jnp.zeros((2, 1 if step == 'decode' else 12, cfg.hidden_size), jnp.float32)
  if step == 'prefill':
    fn = functools.partial(llama.decoder_prefill, cfg=cfg, compute_dtype=jnp.float32,
                           cache_dtype=jnp.float32)
    args = (params, x, jnp.ones((2, 12), bool))
  else:
    cache = jnp.zeros((2, 12, cfg.kv_dim), jnp.float32)
    fn = functools.partial(llama.decoder_decode, cfg=cfg, compute_dtype=jnp.float32,
                           cache_dtype=jnp.float32)
    args = (params, x, cache, cache, jnp.ones((2, 12), bool))
  text = jax.jit(fn).lower(*args).compile().as_text()
  assert ' cosine(' not in text and ' sine(' not in text


def test_presets_have_published_sizes():
  params = {'llama-2-7b': 6.74e9, 'llama-2-70b': 68.98e9, 'llama-3-8b': 8.03e9,
            'mistral-7b': 7.24e9, 'smollm2-135m': 134.5e6}
  for name, count in params.items():
    assert preset(name).model_weight_bytes(1) == pytest.approx(count, rel=0.005), name
  assert preset('meta-llama/llama-3-8b').kv_dim == 1024


def test_grouped_query_attention_shrinks_the_planned_cache():
  """The plan's cache rows (what the plan, the cost model and the search charge per token) hold
  the KV heads only: a quarter of the MHA model's with 8 heads and 2 KV heads."""
  mha = ModelConfig(name='mha', family='llama', num_layers=2, hidden_size=256, num_heads=8,
                    num_kv_heads=8, ffn_dim=128, vocab_size=1000, max_positions=256)
  gqa = dataclasses.replace(mha, name='gqa', num_kv_heads=2)
  assert 4 * gqa.kv_cache_bytes(8, 100) == mha.kv_cache_bytes(8, 100)
  sizes = plan_lib.Itemsizes(2, 4, 2)
  for policy in (Policy(), Policy(compress_cache=True)):
    rows = [plan_lib.cache_row_bytes(c, policy, sizes) for c in (mha, gqa)]
    assert rows[1] * 4 == rows[0], (policy.compress_cache, rows)
  assert plan_lib.cache_row_bytes(gqa, Policy(), sizes) == 2 * 64


@pytest.mark.parametrize('template', [True, False])
def test_tokenizer_adds_bos_as_transformers_does(tmp_path, template):
  """A Llama-style tokenizer.json whose post-processor prepends <s>, and one without (SmolLM2):
  flexjax's ids equal transformers' with its default add_special_tokens."""
  import tokenizers
  import transformers
  from flexjax.tokenizer import Tokenizer
  tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token='<unk>'))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = tokenizers.decoders.ByteLevel()
  tok.train_from_iterator(['Paris is the capital city of France.'] * 10, tokenizers.trainers.
                          BpeTrainer(vocab_size=300, special_tokens=['<unk>', '<s>', '</s>']))
  if template:
    tok.post_processor = tokenizers.processors.TemplateProcessing(
        single='<s> $A', special_tokens=[('<s>', 1)])
  tok.save(str(tmp_path / 'tokenizer.json'))
  theirs = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / 'tokenizer.json'))
  cfg = ModelConfig.from_hf_config(_hf(bos_token_id=1, eos_token_id=2))
  ours = Tokenizer.for_model(tmp_path, cfg)
  text = 'Paris is the capital'
  assert ours.encode(text) == theirs(text)['input_ids']
  assert ours.encode(text)[0] == 1 if template else ours.encode(text)[0] != 1
  assert ours.decode(ours.encode(text)) == text
