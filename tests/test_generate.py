"""Generation: batched greedy equals transformers and single-prompt runs; sampling; EOS."""

import dataclasses

import numpy as np
import pytest

from conftest import PROMPTS, left_pad
from flexjax.checkpoint import Checkpoint
from flexjax.engine import Engine, GenerationConfig, pad_prompts
from flexjax.errors import FlexjaxError
from flexjax.policy import Policy


def hf_generate(model, prompts, gen_len, eos_token_id=2):
  ids, mask = left_pad(prompts)
  out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=gen_len,
                       do_sample=False, pad_token_id=1, eos_token_id=eos_token_id)
  new = out[:, ids.shape[1]:].numpy()
  return np.pad(new, ((0, 0), (0, gen_len - new.shape[1])), constant_values=1)


def test_batched_greedy_equals_transformers_generate(tiny):
  result = tiny.engine(policy=Policy(gpu_batch_size=4)).generate(PROMPTS,
                                                                   GenerationConfig(gen_len=10))
  np.testing.assert_array_equal(result.tokens, hf_generate(tiny.torch_model, PROMPTS, 10))


def test_batched_greedy_equals_each_prompt_alone(pre_ln):
  """(One model: every shape's batched run is checked against transformers above.)"""
  batched = pre_ln.engine(policy=Policy(gpu_batch_size=3)).generate(PROMPTS,
                                                                     GenerationConfig(gen_len=8))
  engine = pre_ln.engine(policy=Policy(gpu_batch_size=1))
  for i, prompt in enumerate(PROMPTS):
    alone = engine.generate([prompt], GenerationConfig(gen_len=8))
    np.testing.assert_array_equal(batched.tokens[i], alone.tokens[0])


def test_eos_stops_a_row_and_pads_the_rest(pre_ln):
  ckpt = Checkpoint(pre_ln.ckpt_dir)
  policy = Policy(gpu_batch_size=4)
  free = Engine(ckpt, policy=policy).generate(PROMPTS, GenerationConfig(gen_len=8,
                                                                        stop_at_eos=False))
  row = free.tokens[0].tolist()
  stop = next(t for t in range(1, 8) if row[t] not in row[:t])  # first new token after step 0
  eos = row[stop]  # make it the end of sequence
  ckpt.config = dataclasses.replace(ckpt.config, eos_token_id=eos)
  result = Engine(ckpt, policy=policy).generate(PROMPTS, GenerationConfig(gen_len=8))
  np.testing.assert_array_equal(result.tokens, hf_generate(pre_ln.torch_model, PROMPTS, 8, eos))
  assert result.sequences[0].tolist() == row[:stop + 1]
  assert (result.tokens[0, stop + 1:] == ckpt.config.pad_token_id).all()


def test_sampling_is_seeded_and_varies(pre_ln):
  engine = pre_ln.engine(policy=Policy(gpu_batch_size=4))
  sample = lambda seed: engine.generate(
      PROMPTS, GenerationConfig(gen_len=12, temperature=1.5, seed=seed, stop_at_eos=False)).tokens
  np.testing.assert_array_equal(sample(1), sample(1))
  assert (sample(1) != sample(2)).any()
  greedy = engine.generate(PROMPTS, GenerationConfig(gen_len=12, stop_at_eos=False)).tokens
  nucleus_of_one = engine.generate(PROMPTS, GenerationConfig(
      gen_len=12, temperature=1.0, top_p=1e-6, stop_at_eos=False)).tokens
  np.testing.assert_array_equal(nucleus_of_one, greedy)


def test_throughput_follows_the_paper_definition(pre_ln):
  result = pre_ln.engine(policy=Policy(gpu_batch_size=2)).generate(
      PROMPTS, GenerationConfig(gen_len=5, stop_at_eos=False))
  assert result.generated_tokens == len(PROMPTS) * 5
  assert result.prefill_s > 0 and result.decode_s > 0
  assert result.total_throughput == pytest.approx(20 / (result.prefill_s + result.decode_s))
  assert result.prefill_throughput == pytest.approx(4 * 7 / result.prefill_s)
  assert result.decode_throughput == pytest.approx(4 * 4 / result.decode_s)


def test_partial_last_batch_and_padding(pre_ln):
  full = pre_ln.engine(policy=Policy(gpu_batch_size=4)).generate(PROMPTS,
                                                                  GenerationConfig(gen_len=4))
  partial = pre_ln.engine(policy=Policy(gpu_batch_size=3)).generate(PROMPTS,
                                                                     GenerationConfig(gen_len=4))
  np.testing.assert_array_equal(full.tokens, partial.tokens)
  tokens, mask = pad_prompts([[5, 6], [7]], 3, pad_id=1)
  np.testing.assert_array_equal(tokens, [[1, 5, 6], [1, 1, 7]])
  np.testing.assert_array_equal(mask, [[0, 1, 1], [0, 0, 1]])


def test_too_long_for_the_positions_is_refused(pre_ln):
  with pytest.raises(FlexjaxError, match='positions'):
    pre_ln.engine().generate([[2] * 60], GenerationConfig(gen_len=10))


def test_token_ids_outside_the_vocabulary_are_refused(pre_ln):
  """The device's gather would clamp them to other tokens without a word."""
  gen = GenerationConfig(gen_len=2)
  engine = pre_ln.engine()
  vocab = engine.config.vocab_size
  for prompts, says in (([[2, 5], [2, vocab]], f'prompt 1 holds token id {vocab}; ids must lie'),
                        ([[2, 5], []], 'prompt 1 is empty; each prompt needs at least one token'),
                        ([[2, -1]], 'prompt 0 holds token id -1'),
                        ([[2, 3.5]], 'prompt 0 is not a list of integer token ids'),
                        ([np.array([[2, 3]])], 'prompt 0 is not a list')):
    with pytest.raises(FlexjaxError, match=says):
      engine.generate(prompts, gen)
  with pytest.raises(FlexjaxError, match='forced_tokens\\[0\\] holds token id'):
    engine.generate([[2, 5]], gen, forced_tokens=[[3, vocab + 7]])
  assert engine.generate([np.array([2, 5], np.int64)], gen).sequences[0].shape == (2,)


@pytest.mark.parametrize('field,value', [('gen_len', 0), ('top_p', 0.0), ('temperature', -1.0),
                                         ('temperature', float('nan'))])
def test_generation_config_rejects_bad_values(field, value):
  with pytest.raises(FlexjaxError, match=f'{field}={value}'):
    GenerationConfig(**{field: value})
