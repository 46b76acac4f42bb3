"""Placements drawn at random reproduce the all-device run (tools/fuzz_placement.py)."""

import dataclasses
import json
import tempfile

import pytest

from tools import fuzz_placement

# three draws that between them cover every kind of run, each with two or more layers and three
# or more new tokens (test_the_draws_cover_every_kind_of_run); `python -m tools.fuzz_placement`
# draws many more
SEEDS = (204, 214, 246)
# earlier draws, run with -m slow (8, 9 and 13 differed while a finished row's logits depended on
# its block)
SLOW_SEEDS = (0, 2, 5, 6, 8, 9, 13, 14, 63, 161)


# two batch jobs that between them put every tier on disk, bucketed and not, with bad and sampled
# rows, each of four or more rows on two or more layers (`python -m tools.fuzz_placement
# --mode=job` draws more); earlier draws run with -m slow
JOB_SEEDS = (86, 262)
SLOW_JOB_SEEDS = (7, 19, 26, 29, 149)

# a pipeline of three processes, every tier partly on disk, no overlap, CPU attention, FlexGen's
# placement, sampled (`python -m tools.fuzz_placement --mode=pipeline` draws more). Run with -m
# slow (90 s in CI): each stage's placement is what the drawn placements above check in one
# process, and tests/test_pipeline.py runs three offloaded stages against one process.
PIPELINE_SEED = 103


def tiers_on_disk(policies) -> set[str]:
  """The kinds of tensor ('w', 'cache', 'act') some of the policies put partly on disk."""
  return {kind for x in policies for kind in ('w', 'cache', 'act')
          if x[f'{kind}_gpu_percent'] + x[f'{kind}_cpu_percent'] < 100}


@pytest.mark.parametrize('seed', [*SEEDS, *(pytest.param(s, marks=pytest.mark.slow)
                                            for s in SLOW_SEEDS)])
def test_a_drawn_placement_reproduces_the_all_device_run(seed):
  row = fuzz_placement.run_case(fuzz_placement.draw_case(seed))
  assert row['same_tokens'], row
  assert row['ok'], row


def test_the_draws_cover_every_kind_of_run():
  cases = [fuzz_placement.draw_case(s) for s in SEEDS]
  p = [c.policy for c in cases]
  assert all(c.model['num_layers'] >= 2 and c.generation['gen_len'] >= 3 for c in cases)
  assert {c.model['family'] for c in cases} == {'opt', 'llama'}
  assert tiers_on_disk(p) == {'w', 'cache', 'act'}  # weights, cache, hidden states
  assert any(x['cpu_attention'] for x in p) and any(not x['overlap'] for x in p)
  assert any(x['placement'] == 'flexgen' for x in p)
  assert any(x['num_gpu_batches'] > 1 for x in p)
  assert any(c.approx.get('compress_weight') for c in cases)
  assert any(c.approx.get('compress_cache') for c in cases)
  assert any(c.approx.get('attn_sparsity') for c in cases)
  assert any(c.compute_dtype == 'bfloat16' for c in cases)
  assert any(c.generation['temperature'] > 0 for c in cases)
  assert any(c.generation['stop_at_eos'] for c in cases)
  assert any(c.weight_dtype == 'float16' for c in cases)
  for call in ('limits', 'pad_to', 'forced_tokens'):
    assert any(call in c.calls for c in cases), call
  assert any(len(c.prompts) % (x['gpu_batch_size'] * x['num_gpu_batches'])
             for c, x in zip(cases, p))  # a last block short of rows


def test_the_comparison_tells_other_weights_apart():
  case = fuzz_placement.draw_case(25)  # one layer, one prompt, four new tokens: a cheap draw
  with tempfile.TemporaryDirectory() as tmp, tempfile.TemporaryDirectory() as layouts:
    reference = fuzz_placement.generate(case, case.policy, tmp, weights_cache=layouts)
    other = fuzz_placement.generate(case, case.policy, tmp, weights_cache=layouts,
                                    weight_seed=case.seed + 1)
  assert fuzz_placement.compare(reference, reference, 'float32')['ok']
  verdict = fuzz_placement.compare(reference, other, 'float32')
  assert not verdict['ok'] and verdict['logit_diff'] > 1e-3 and verdict['score_diff'] > 1e-3
  # the quantized cache's wider bound still tells them apart
  assert not fuzz_placement.compare(reference, other, 'float32', quantized_cache=True)['ok']


@pytest.mark.parametrize('seed', [*JOB_SEEDS, *(pytest.param(s, marks=pytest.mark.slow)
                                                for s in SLOW_JOB_SEEDS)])
def test_a_drawn_job_reproduces_the_all_device_job(seed):
  row = fuzz_placement.run_case(fuzz_placement.draw_job_case(seed))
  assert row['same_outputs'], row
  assert row['ok'], row


def test_the_job_draws_cover_every_kind_of_job():
  cases = [fuzz_placement.draw_job_case(s) for s in JOB_SEEDS]
  p = [c.policy for c in cases]
  assert all(len(c.rows) >= 4 and c.model['num_layers'] >= 2 for c in cases)
  rows = [[json.loads(r) for r in c.rows if r.startswith('{') and r.endswith('}')] for c in cases]
  assert tiers_on_disk(p) == {'w', 'cache', 'act'}
  assert any(c.bucket for c in cases) and any(not c.bucket for c in cases)
  assert any(len(r) < len(c.rows) or any(not x['tokens'] or len(x['tokens']) > 128 for x in r)
             for c, r in zip(cases, rows))  # a bad row
  assert any(x.get('temperature') for r in rows for x in r)
  assert any(x.get('logprobs') for r in rows for x in r)
  assert any(x.get('top_logprobs') for r in rows for x in r)


def test_job_lines_differ_by_their_log_probabilities_only_beyond_the_tolerance():
  case = fuzz_placement.draw_job_case(86)  # float32, no quantized cache
  assert case.compute_dtype == 'float32' and not case.approx.get('compress_cache')
  line = {'id': 'a', 'output_tokens': [5, 6], 'logprobs': [-6.5, -7.25],
          'top_logprobs': [[[5, -6.5], [9, -6.75]], [[6, -7.25], [3, -7.5]]]}

  def changed(**fields):
    return [dict(line, **fields)]

  assert fuzz_placement.differing_lines([line], [dict(line)], case) == []
  near = changed(logprobs=[-6.5 + 1e-6, -7.25],
                 top_logprobs=[[[5, -6.5], [3, -6.75 - 1e-6]], [[6, -7.25], [3, -7.5]]])
  assert fuzz_placement.differing_lines([line], near, case) == []  # (a tie's ids may swap)
  for far in (changed(logprobs=[-6.5, -7.2]), changed(output_tokens=[5, 7]),
              changed(top_logprobs=[[[5, -6.5], [9, -6.7]], [[6, -7.25], [3, -7.5]]])):
    assert fuzz_placement.differing_lines([line], far, case) == ['a']
  without = dict(line)
  del without['logprobs']
  assert fuzz_placement.differing_lines([line], [without], case) == ['a']


def test_a_jobs_outputs_tell_other_weights_apart(tmp_path):
  case = fuzz_placement.draw_job_case(26)
  outputs = []
  for seed in (case.seed, case.seed + 1):
    folder = tmp_path / str(seed)
    folder.mkdir()
    fuzz_placement.write_checkpoint(dataclasses.replace(case, seed=seed), folder / 'ckpt')
    (folder / 'rows.jsonl').write_text(''.join(line + '\n' for line in case.rows))
    outputs.append(fuzz_placement.run_job(case, case.policy, folder, 'out'))
  assert [r['id'] for r in outputs[0]] == [r['id'] for r in outputs[1]]
  assert any(a['output_tokens'] != b['output_tokens'] for a, b in zip(*outputs))


@pytest.mark.slow
def test_a_drawn_pipeline_reproduces_one_process():
  case = fuzz_placement.draw_pipeline_case(PIPELINE_SEED)
  assert case.stages == 3 and tiers_on_disk([case.policy]) == {'w', 'cache', 'act'}
  assert not case.policy['overlap'] and case.generation['temperature'] > 0
  row = fuzz_placement.run_case(case)
  assert row['same_tokens'], row['stderr']
  assert len(row['tokens']) == len(case.prompts) and any(row['tokens']), row
  assert row['within_plans'] and row['ok'], row


# a batch job through three processes: every tier partly on disk, int4 weights and cache, bad and
# sampled rows, bucketed (`python -m tools.fuzz_placement --mode=pipeline_job` draws more). Run
# with -m slow (about a minute): tests/test_pipeline.py runs a job through two stages, resumed.
PIPELINE_JOB_SEED = 72


@pytest.mark.slow
def test_a_drawn_pipeline_job_writes_the_one_process_jobs_lines():
  case = fuzz_placement.draw_pipeline_job_case(PIPELINE_JOB_SEED)
  assert case.stages == 3 and tiers_on_disk([case.policy]) == {'w', 'cache', 'act'}
  assert case.approx.get('compress_weight') and case.approx.get('compress_cache') and case.bucket
  assert any('temperature' in r for r in case.rows)
  assert any(not r.startswith('{"id": "r') for r in case.rows)  # a bad row
  row = fuzz_placement.run_case(case)
  assert row['same_tokens'], row['stderr']
  assert len(row['tokens']) == len(case.rows) and row['within_plans'] and row['ok'], row
