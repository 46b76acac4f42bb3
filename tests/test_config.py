"""Model configs: published shapes, HF config loading, and the paper's byte formulas."""

import pytest

from flexjax.config import PRESETS, ModelConfig, preset
from flexjax.errors import FlexjaxError

PUBLISHED = {  # layers, hidden, heads, ffn (Zhang et al. 2022)
    'opt-125m': (12, 768, 12, 3072), 'opt-350m': (24, 1024, 16, 4096),
    'opt-1.3b': (24, 2048, 32, 8192), 'opt-2.7b': (32, 2560, 32, 10240),
    'opt-6.7b': (32, 4096, 32, 16384), 'opt-13b': (40, 5120, 40, 20480),
    'opt-30b': (48, 7168, 56, 28672), 'opt-66b': (64, 9216, 72, 36864),
    'opt-175b': (96, 12288, 96, 49152),
}


@pytest.mark.parametrize('name', list(PUBLISHED))
def test_presets_have_published_shapes(name):
  c = preset(name)
  assert (c.num_layers, c.hidden_size, c.num_heads, c.ffn_dim) == PUBLISHED[name]
  assert c.vocab_size == 50272 and c.max_positions == 2048 and c.head_dim * c.num_heads == c.hidden_size


def test_350m_is_post_layer_norm_with_projections():
  c = preset('facebook/opt-350m')
  assert not c.do_layer_norm_before and c.embed_dim == 512 and c.has_projection
  assert 'project_in' in c.embed_shapes() and 'project_out' in c.head_shapes()
  assert 'final_ln' not in c.head_shapes()


@pytest.mark.parametrize('name', list(PUBLISHED))
def test_layer_bytes_follow_the_paper_formula(name):
  c = preset(name)
  h1, h2 = c.hidden_size, c.ffn_dim
  # paper: 8·h1² + 4·h1·h2 bytes in fp16; plus biases (4·h1 + h2 + h1) and two LayerNorms (4·h1)
  assert c.layer_weight_bytes(2) == 8 * h1 * h1 + 4 * h1 * h2 + 2 * (9 * h1 + h2)
  assert c.kv_cache_bytes(batch=3, seq_len=7, itemsize=2) == 4 * 3 * 7 * h1
  assert c.hidden_bytes(batch=3, seq_len=7, itemsize=2) == 2 * 3 * 7 * h1


def test_opt175b_weights_take_the_papers_325_gb():
  layers_only = preset('opt-175b').num_layers * preset('opt-175b').layer_weight_bytes(2)
  assert abs(layers_only / 2**30 - 325) < 3


def test_from_hf_config_reads_opt_fields():
  c = ModelConfig.from_hf_config({
      'model_type': 'opt', 'hidden_size': 1024, 'num_hidden_layers': 24, 'ffn_dim': 4096,
      'num_attention_heads': 16, 'vocab_size': 50272, 'max_position_embeddings': 2048,
      'word_embed_proj_dim': 512, 'do_layer_norm_before': False, 'activation_function': 'relu'},
      name='opt-350m')
  assert c == PRESETS['opt-350m']


@pytest.mark.parametrize('hf,message', [
    ({'model_type': 'gpt2'}, "model_type='gpt2'"),
    ({'model_type': 'opt', 'activation_function': 'gelu'}, "activation_function='gelu'"),
    ({'model_type': 'opt', 'hidden_size': 64}, "lacks the field 'num_hidden_layers'"),
    ({'hidden_size': 64, 'num_hidden_layers': 2, 'ffn_dim': 8, 'num_attention_heads': 5,
      'vocab_size': 10}, 'hidden_size=64 must be divisible by num_heads=5'),
])
def test_bad_hf_configs_are_refused(hf, message):
  with pytest.raises(FlexjaxError, match=message):
    ModelConfig.from_hf_config(hf)


def test_unknown_preset_names_the_choices():
  with pytest.raises(FlexjaxError, match="unknown model 'opt-7b'.*opt-6.7b"):
    preset('opt-7b')
