"""Log-probabilities of the generated tokens (GenerationConfig.logprobs and top_logprobs,
--logprobs, --top_logprobs, a job row's "logprobs" and "top_logprobs"): the model's own
distribution at each chosen token and its most likely ones, on every placement."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from conftest import PROMPTS, hf_logits, left_pad
from flexjax.checkpoint import Checkpoint
from flexjax.engine import Engine, GenerationConfig
from flexjax.errors import FlexjaxError
from flexjax.policy import Policy
from flexjax.run import RunConfig, run

GEN = GenerationConfig(gen_len=6, stop_at_eos=False, logprobs=True)
# two placements whose runs the all-device run's log-probabilities are checked against
OFFLOADED = [
    Policy(gpu_batch_size=4, w_gpu_percent=0, w_cpu_percent=0, cache_gpu_percent=0,
           cache_cpu_percent=0, act_gpu_percent=0, act_cpu_percent=50),
    Policy(gpu_batch_size=2, num_gpu_batches=2, w_gpu_percent=0, w_cpu_percent=50,
           cache_gpu_percent=0, cache_cpu_percent=50, cpu_attention=True, overlap=False)]
OFFLOADED_IDS = ['everything_on_disk', 'split_cpu_attention']


def log_softmax_at(logits: np.ndarray, tokens: np.ndarray) -> np.ndarray:
  """log softmax(logits)[token] in float64: logits [..., vocab], tokens [...]."""
  x = logits.astype(np.float64)
  x = x - x.max(-1, keepdims=True)
  x = x - np.log(np.exp(x).sum(-1, keepdims=True))
  return np.take_along_axis(x, tokens[..., None], -1)[..., 0]


def test_greedy_tokens_log_probabilities_are_transformers_log_softmax(pre_ln):
  result = pre_ln.engine(policy=Policy(gpu_batch_size=4)).generate(PROMPTS, GEN)
  ids, mask = left_pad(PROMPTS)
  s, gen_len = ids.shape[1], GEN.gen_len
  full_ids = torch.cat([ids, torch.tensor(result.tokens[:, :-1])], dim=1)
  full_mask = torch.cat([mask, torch.ones(len(PROMPTS), gen_len - 1, dtype=mask.dtype)], dim=1)
  ref = hf_logits(pre_ln.torch_model, full_ids, full_mask)[:, s - 1:]
  expected = log_softmax_at(ref, result.tokens)
  assert result.token_logprobs.shape == (len(PROMPTS), gen_len)
  assert result.token_logprobs.dtype == np.float32
  np.testing.assert_allclose(result.token_logprobs, expected, atol=1e-4, rtol=0)
  assert (result.token_logprobs < 0).all()


def test_each_steps_most_likely_tokens_are_transformers_top_k(pre_ln):
  """top_logprobs=k: each step's k most likely tokens, most likely first, with their log
  probabilities (transformers' log softmax there); greedy: the first is the token chosen."""
  gen = GenerationConfig(gen_len=6, stop_at_eos=False, top_logprobs=3)
  result = pre_ln.engine(policy=Policy(gpu_batch_size=4)).generate(PROMPTS, gen)
  ids, mask = left_pad(PROMPTS)
  s = ids.shape[1]
  full_ids = torch.cat([ids, torch.tensor(result.tokens[:, :-1])], dim=1)
  full_mask = torch.cat([mask, torch.ones(len(PROMPTS), 5, dtype=mask.dtype)], dim=1)
  ref = torch.log_softmax(torch.tensor(hf_logits(pre_ln.torch_model, full_ids, full_mask)
                                       [:, s - 1:]), -1)
  values, top = torch.topk(ref, 3, dim=-1)
  assert result.top_ids.shape == result.top_logprobs.shape == (len(PROMPTS), 6, 3)
  assert result.top_ids.dtype == np.int32 and result.top_logprobs.dtype == np.float32
  np.testing.assert_array_equal(result.top_ids, top.numpy())
  np.testing.assert_allclose(result.top_logprobs, values.numpy(), atol=1e-4, rtol=0)
  np.testing.assert_array_equal(result.top_ids[..., 0], result.tokens)
  np.testing.assert_array_equal(result.top_logprobs[..., 0], result.token_logprobs)
  assert (np.diff(result.top_logprobs, axis=-1) <= 0).all()
  with pytest.raises(FlexjaxError, match=r'top_logprobs=21 must be an integer in \[0, 20\]'):
    GenerationConfig(top_logprobs=21)


def test_sampled_tokens_log_probabilities_are_the_models_before_temperature(pre_ln):
  """Under temperature and top-p, each sampled token's log-probability is the untempered
  softmax of its step's logits; asking for them changes no sample."""
  gen = GenerationConfig(gen_len=6, stop_at_eos=False, temperature=0.7, top_p=0.9, seed=3,
                         logprobs=True)
  with Engine(Checkpoint(pre_ln.ckpt_dir), policy=Policy(gpu_batch_size=4)) as engine:
    result = engine.generate(PROMPTS, gen, return_logits=True)
    plain = engine.generate(PROMPTS, GenerationConfig(gen_len=6, stop_at_eos=False,
                                                      temperature=0.7, top_p=0.9, seed=3))
  np.testing.assert_array_equal(result.tokens, plain.tokens)
  assert plain.token_logprobs is None
  np.testing.assert_allclose(result.token_logprobs, log_softmax_at(result.logits, result.tokens),
                             atol=1e-5, rtol=0)
  tempered = log_softmax_at(result.logits / 0.7, result.tokens)
  assert np.abs(result.token_logprobs - tempered).max() > 1e-2  # a different distribution


@pytest.mark.parametrize('policy', OFFLOADED, ids=OFFLOADED_IDS)
def test_offloaded_runs_give_the_all_device_runs_log_probabilities(pre_ln, tmp_path, policy):
  with Engine(Checkpoint(pre_ln.ckpt_dir), policy=Policy(gpu_batch_size=4)) as engine:
    reference = engine.generate(PROMPTS, GEN)
  with Engine(Checkpoint(pre_ln.ckpt_dir), policy=policy, offload_dir=str(tmp_path)) as engine:
    result = engine.generate(PROMPTS, GEN)
  np.testing.assert_array_equal(result.tokens, reference.tokens)
  if policy.gpu_batch_size == 4 and not policy.cpu_attention:  # the same products: lossless
    np.testing.assert_array_equal(result.token_logprobs, reference.token_logprobs)
  np.testing.assert_allclose(result.token_logprobs, reference.token_logprobs, atol=1e-5, rtol=0)


def test_a_finished_rows_later_log_probabilities_are_zeros(pre_ln):
  with Engine(Checkpoint(pre_ln.ckpt_dir), policy=Policy(gpu_batch_size=4)) as engine:
    result = engine.generate(PROMPTS, GEN, limits=[2, 6, 3, 6])
  lp = result.token_logprobs
  assert (lp[0, :2] < 0).all() and (lp[0, 2:] == 0).all()
  assert (lp[2, :3] < 0).all() and (lp[2, 3:] == 0).all()
  assert (lp[1] < 0).all() and (lp[3] < 0).all()


FORCED = np.array([[7, 9, 11, 13, 15, 17], [40, 41, 42, 43, 44, 45], [5, 5, 5, 5, 5, 5],
                   [90, 3, 77, 12, 60, 8]], np.int32)


def test_forced_tokens_log_probabilities_are_transformers_scores_of_them(pre_ln):
  """With forced_tokens the head step scores the given tokens (no logits returned): each is
  transformers' log softmax of prompt + forced continuation at its position, the top ones are
  the model's own most likely, and the tokens emitted are the forced ones."""
  gen = GenerationConfig(gen_len=6, stop_at_eos=False, top_logprobs=2)
  with Engine(Checkpoint(pre_ln.ckpt_dir), policy=Policy(gpu_batch_size=4)) as engine:
    result = engine.generate(PROMPTS, gen, forced_tokens=FORCED)
    with_logits = engine.generate(PROMPTS, gen, forced_tokens=FORCED, return_logits=True)
  assert result.logits is None
  np.testing.assert_array_equal(result.tokens, FORCED)
  ids, mask = left_pad(PROMPTS)
  s = ids.shape[1]
  full_ids = torch.cat([ids, torch.tensor(FORCED[:, :-1])], dim=1)
  full_mask = torch.cat([mask, torch.ones(len(PROMPTS), 5, dtype=mask.dtype)], dim=1)
  ref = hf_logits(pre_ln.torch_model, full_ids, full_mask)[:, s - 1:]
  np.testing.assert_allclose(result.token_logprobs, log_softmax_at(ref, FORCED), atol=1e-4,
                             rtol=0)
  np.testing.assert_array_equal(result.top_ids[..., 0], ref.argmax(-1))
  # the same run returning its logits: the head's scores are those logits' log softmax
  np.testing.assert_array_equal(with_logits.token_logprobs, result.token_logprobs)
  np.testing.assert_allclose(result.token_logprobs, log_softmax_at(with_logits.logits, FORCED),
                             atol=1e-5, rtol=0)
  assert not (result.top_ids[..., 0] == FORCED).all()  # the scores are not the model's choice


@pytest.mark.parametrize('policy', OFFLOADED, ids=OFFLOADED_IDS)
def test_offloaded_runs_score_forced_tokens_as_the_all_device_run(pre_ln, tmp_path, policy):
  gen = GenerationConfig(gen_len=6, stop_at_eos=False, logprobs=True)
  with Engine(Checkpoint(pre_ln.ckpt_dir), policy=Policy(gpu_batch_size=4)) as engine:
    reference = engine.generate(PROMPTS, gen, forced_tokens=FORCED)
  with Engine(Checkpoint(pre_ln.ckpt_dir), policy=policy, offload_dir=str(tmp_path)) as engine:
    result = engine.generate(PROMPTS, gen, forced_tokens=FORCED)
  if policy.gpu_batch_size == 4 and not policy.cpu_attention:  # the same products: lossless
    np.testing.assert_array_equal(result.token_logprobs, reference.token_logprobs)
  np.testing.assert_allclose(result.token_logprobs, reference.token_logprobs, atol=1e-5, rtol=0)


def test_job_rows_ask_for_log_probabilities_one_by_one(pre_ln, tmp_path):
  """A row with "logprobs": true gets one per output token (cut with its tokens at a stop
  string); a row without gets none; a bad value is the row's error; --logprobs asks for every
  row's."""
  rows = [{'id': 'lp', 'prompt': 'Paris is the capital', 'max_new_tokens': 8, 'logprobs': True},
          {'id': 'plain', 'prompt': 'Paris is the capital', 'max_new_tokens': 8},
          {'id': 'short', 'tokens': [2, 50, 60], 'max_new_tokens': 3, 'logprobs': True},
          {'id': 'bad', 'tokens': [2, 5], 'logprobs': 'yes'},
          {'id': 'top', 'tokens': [2, 50, 60], 'max_new_tokens': 3, 'top_logprobs': 2},
          {'id': 'too-many', 'tokens': [2, 5], 'top_logprobs': 50},
          {'id': 'vague', 'tokens': [2, 5], 'top_logprobs': 2.5}]
  path = tmp_path / 'rows.jsonl'
  path.write_text(''.join(json.dumps(r) + '\n' for r in rows))

  def job(name, **kw):
    rc = RunConfig(model=None, weights='checkpoint', checkpoint=str(pre_ln.ckpt_dir),
                   input=str(path), output=str(tmp_path / name),
                   policy=Policy(gpu_batch_size=4), progress=False, **kw)
    run(rc)
    return {r['id']: r for r in map(json.loads, (tmp_path / name).read_text().splitlines())}

  got = job('out.jsonl')
  assert len(got['lp']['logprobs']) == len(got['lp']['output_tokens']) == 8
  assert all(v < 0 for v in got['lp']['logprobs'])
  assert len(got['short']['logprobs']) == len(got['short']['output_tokens']) == 3
  assert 'logprobs' not in got['plain']
  assert got['plain']['output_tokens'] == got['lp']['output_tokens']
  assert '"logprobs" is \'yes\'; it must be true or false' in got['bad']['error']
  assert '"top_logprobs" 50 must be an integer in [0, 20]' in got['too-many']['error']
  assert '"top_logprobs" is 2.5; it must be an integer' in got['vague']['error']
  assert 'top_logprobs' not in got['lp'] and 'top_logprobs' not in got['short']
  # top_logprobs gives logprobs too; its steps' first token is the greedy token
  assert got['top']['output_tokens'] == got['short']['output_tokens']
  assert got['top']['logprobs'] == got['short']['logprobs']
  top = got['top']['top_logprobs']
  assert [len(step) for step in top] == [2, 2, 2]
  assert [step[0] for step in top] == [list(p) for p in zip(got['top']['output_tokens'],
                                                            got['top']['logprobs'])]
  # the same greedy tokens' log-probabilities, whatever else the block asked for
  with Engine(Checkpoint(pre_ln.ckpt_dir), policy=Policy(gpu_batch_size=1)) as engine:
    alone = engine.generate([[2, 50, 60]], GenerationConfig(gen_len=3, logprobs=True))
  np.testing.assert_allclose(got['short']['logprobs'], alone.token_logprobs[0], atol=1e-5)

  text = got['lp']['output']
  stop = text[len(text) // 2:len(text) // 2 + 2]
  path.write_text(json.dumps({'id': 'cut', 'prompt': 'Paris is the capital',
                              'max_new_tokens': 8, 'stop': stop}) + '\n')
  cut = job('cut.jsonl', generation=GenerationConfig(gen_len=8, logprobs=True))['cut']
  assert cut['finish_reason'] == 'stop'
  n = len(cut['output_tokens'])
  assert n < 8 and cut['logprobs'] == got['lp']['logprobs'][:n]


def test_a_jobs_plan_counts_the_heaviest_head_its_rows_run(pre_ln, tmp_path):
  """A job is planned for its rows' heaviest head step (sampling with top-p, the top tokens'
  log-probabilities), not the flags' greedy one: with a device budget between the two plans
  the job is refused in one line before any row is written (planned for the greedy head it
  wrote the greedy rows' block, then stopped at the sampled row's)."""
  greedy = [{'id': f'g{i}', 'tokens': [2, 10 + i, 20], 'max_new_tokens': 3} for i in range(4)]
  heavy = greedy[:3] + [{'id': 'h', 'tokens': [2, 11, 20], 'max_new_tokens': 3,
                         'temperature': 0.8, 'top_p': 0.9, 'top_logprobs': 20}]

  def job(rows, name, **kw):
    path = tmp_path / f'{name}.jsonl'
    path.write_text(''.join(json.dumps(r) + '\n' for r in rows))
    rc = RunConfig(model=None, weights='checkpoint', checkpoint=str(pre_ln.ckpt_dir),
                   input=str(path), output=str(tmp_path / f'{name}-out.jsonl'),
                   policy=Policy(gpu_batch_size=4), progress=False, **kw)
    return run(rc)

  light_peak = job(greedy, 'light', dry_run=True)['planned_device_peak_bytes']
  heavy_peak = job(heavy, 'heavy', dry_run=True)['planned_device_peak_bytes']
  assert heavy_peak > light_peak
  budgets = {'device': (light_peak + heavy_peak) // 2, 'host': None, 'disk': None}
  assert job(greedy, 'light', budgets=budgets)['rows_generated'] == 4
  with pytest.raises(FlexjaxError, match='on the device tier but --gpu_mem allows'):
    job(heavy, 'heavy', budgets=budgets)
  assert not (tmp_path / 'heavy-out.jsonl').exists()
