"""Random placements against the all-device run: draws a small model, prompts, a generation
config, approximations and a policy at random, runs the same prompts once with everything on the
device and once with the drawn policy, and compares the two.

  python -m tools.fuzz_placement --draws=200 --seed=0
  python -m tools.fuzz_placement --draws=50 --seed=7 --output=fuzz.jsonl
  python -m tools.fuzz_placement --draws=50 --mode=job
  python -m tools.fuzz_placement --draws=20 --mode=pipeline
  python -m tools.fuzz_placement --draws=10 --mode=pipeline_job

Both runs use the same approximations (int4 weights or cache, sparse attention) and compute
dtype, so every difference comes from where tensors live and in which order the block schedule
computes them: the tokens must be equal and the logits equal within float32 rounding (four
bfloat16 ulps where the compute dtype is bfloat16). Exit status 1 when any draw differs.

--mode=job draws a batch job instead (JSONL rows with their own lengths, sampling and seeds,
some of them bad; bucketed or not) over a checkpoint of the drawn model, runs it through the
command line's path (flexjax.run with --input/--output) under the drawn policy and with the
same block shape all on the device, and compares the two outputs line by line.

--mode=pipeline splits the drawn model's layers over 2-3 processes (flexjax.launch, every stage
under the drawn policy) and compares their generated tokens with one process's, everything on
the device; --mode=pipeline_job runs a drawn batch job that way and compares its output lines
with the one-process job's on the device.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from absl import app, flags

from flexjax.errors import flags_parser

# largest |logit difference| / max |logit| allowed per compute dtype: float32 rounding of
# products summed in another order; four bfloat16 ulps (products of other row counts and
# attention on the CPU backend round bfloat16 at other points, and sparse attention may then
# keep the other of two near-equal positions: up to 3.1 ulps of the largest logit in 76
# bfloat16 draws)
TOLERANCE = {'float32': 1e-5, 'bfloat16': 2.0**-5}
# float32 with a quantized KV cache: the cache's codes are rounded from computed values, and a
# value that float32 rounding of other row counts (or of the offloaded rows' attention program)
# moves across a rounding boundary takes the next code, one quantization step away; the
# difference then grows through the later layers (seed 3830: 4.7e-5 of the largest logit
# between the all-device runs at 13x1 and 4x3, the same draw without the quantized cache 3.6e-7)
QUANTIZED_CACHE_TOLERANCE = 1e-4


@dataclasses.dataclass(frozen=True)
class Case:
  """One draw: a model shape, prompts (token ids), generation, approximations and a policy."""

  seed: int
  model: dict[str, Any]  # ModelConfig fields
  prompts: tuple[tuple[int, ...], ...]
  generation: dict[str, Any]  # GenerationConfig fields
  approx: dict[str, Any]  # Policy fields of section 5's approximations
  policy: dict[str, Any]  # Policy fields of placement and schedule
  compute_dtype: str
  weight_dtype: str  # the weights' storage dtype
  calls: dict[str, Any]  # Engine.generate's per-row arguments: limits, pad_to, forced_tokens
  io_threads: int
  rows: tuple[str, ...] = ()  # a batch job's input lines (--mode=job); prompts unused then
  bucket: bool = True  # the job's blocks padded to length buckets
  stages: int = 0  # pipeline stages (--mode=pipeline), one process each; 0: one process
  top_logprobs: int = 0  # each step's most likely tokens' log-probabilities (and the tokens')


def draw_model(rng: random.Random) -> dict[str, Any]:
  """An OPT (pre- or post-LayerNorm, with or without a projected embedding) or a Llama
  (grouped-query, tied or untied head) shape of 1-3 layers."""
  family = rng.choice(['opt', 'opt', 'llama'])
  heads = rng.choice([1, 2, 3, 4, 5, 6])
  fields = dict(name=f'fuzz-{family}', num_layers=rng.choice([1, 2, 3]),
                hidden_size=heads * rng.choice([4, 8, 16]), num_heads=heads,
                ffn_dim=rng.choice([16, 24, 40, 72, 128]),
                vocab_size=rng.choice([257, 500, 1001]), max_positions=128, family=family)
  if family == 'opt':
    fields['do_layer_norm_before'] = rng.random() < 0.7
    if rng.random() < 0.25:
      fields['word_embed_proj_dim'] = rng.choice([8, 16, 24])
  else:
    fields['num_kv_heads'] = rng.choice([d for d in range(1, heads + 1) if heads % d == 0])
    fields['enable_bias'] = False
    fields['tie_word_embeddings'] = rng.random() < 0.5
    fields['rope_theta'] = rng.choice([10000.0, 500000.0])
  return fields


def draw_policy(rng: random.Random) -> dict[str, Any]:
  """Batch shape, every tier split (whole tiers, round and arbitrary percents), schedule."""
  policy: dict[str, Any] = dict(gpu_batch_size=rng.choice([1, 2, 3, 4, 8]),
                                num_gpu_batches=rng.choice([1, 1, 2, 3]))
  for kind in ('w', 'cache', 'act'):
    gpu = rng.choice([0, 0, 10, 25, 50, 75, 100, round(rng.uniform(0, 100), 3)])
    cpu = min(100 - gpu, rng.choice([0, 25, 50, 100 - gpu, round(rng.uniform(0, 100 - gpu), 3)]))
    policy[f'{kind}_gpu_percent'] = gpu
    policy[f'{kind}_cpu_percent'] = cpu
  policy['overlap'] = rng.random() < 0.8
  policy['cpu_attention'] = rng.random() < 0.3
  policy['placement'] = 'flexgen' if rng.random() < 0.2 else 'exact'
  return policy


def draw_approx(rng: random.Random) -> dict[str, Any]:
  approx: dict[str, Any] = {}
  if rng.random() < 0.25:
    approx['compress_weight'] = True
  if rng.random() < 0.25:
    approx['compress_cache'] = True
  if approx and rng.random() < 0.5:
    approx['compress_group_size'] = rng.choice([16, 32])
  if rng.random() < 0.15:
    approx['attn_sparsity'] = rng.choice([0.25, 0.5])
  return approx


def draw_case(seed: int) -> Case:
  rng = random.Random(seed)
  model = draw_model(rng)
  prompts = tuple((2,) + tuple(rng.randint(3, model['vocab_size'] - 1)
                               for _ in range(rng.randint(0, 20)))
                  for _ in range(rng.randint(1, 14)))
  generation = dict(gen_len=rng.randint(1, 8), temperature=rng.choice([0.0, 0.0, 0.8]),
                    top_p=rng.choice([1.0, 0.9]), seed=rng.randint(0, 5),
                    stop_at_eos=rng.random() < 0.5)
  approx = draw_approx(rng)
  policy = draw_policy(rng)
  compute_dtype = 'bfloat16' if rng.random() < 0.1 else 'float32'
  weight_dtype = rng.choice(['float32', 'float32', 'float16'])
  calls: dict[str, Any] = {}
  gen_len = generation['gen_len']
  if rng.random() < 0.3:
    calls['limits'] = [rng.randint(1, gen_len) for _ in prompts]
  if rng.random() < 0.2:
    calls['pad_to'] = max(map(len, prompts)) + rng.randint(0, 9)
  if rng.random() < 0.15:
    calls['forced_tokens'] = [[rng.randint(3, model['vocab_size'] - 1) for _ in range(gen_len)]
                              for _ in prompts]
  asks = random.Random(f'logprobs-{seed}')  # (a stream of its own: the rest as before)
  top_logprobs = asks.choice([0, 0, 1, 3])
  return Case(seed, model, prompts, generation, approx, policy, compute_dtype, weight_dtype,
              calls, rng.choice([1, 2, 3, 4]), top_logprobs=top_logprobs)


def draw_job_case(seed: int) -> Case:
  """draw_case(seed)'s model, policy, approximations and dtypes, with a batch job's rows."""
  case = draw_case(seed)
  rng = random.Random(f'job-{seed}')
  asks = random.Random(f'job-logprobs-{seed}')  # (a stream of its own: the rest as before)
  vocab = case.model['vocab_size']
  sampled = rng.random() < 0.4
  rows = []
  for i in range(rng.randint(1, 16)):
    row: dict[str, Any] = {'id': f'r{i}', 'tokens': [2] + [rng.randint(3, vocab - 1)
                                                          for _ in range(rng.randint(0, 30))]}
    if rng.random() < 0.7:
      row['max_new_tokens'] = rng.randint(1, 8)
    if sampled and rng.random() < 0.5:
      row.update(temperature=0.8, top_p=rng.choice([1.0, 0.9]))
    if rng.random() < 0.3:
      row['seed'] = rng.randint(0, 9)
    ask = asks.random()
    if ask < 0.25:
      row['logprobs'] = True
    elif ask < 0.4:
      row['top_logprobs'] = asks.randint(1, 3)
    rows.append(json.dumps(row))
  if rng.random() < 0.3:  # a bad row: written with its error, the job goes on
    bad = rng.choice(['{"id": "broken"', json.dumps({'id': 'empty', 'tokens': []}),
                      json.dumps({'id': 'long', 'tokens': [2] * (case.model['max_positions'] + 1)})])
    rows.insert(rng.randint(0, len(rows)), bad)
  return dataclasses.replace(case, prompts=(), calls={}, rows=tuple(rows),
                             bucket=rng.random() < 0.7)


def draw_pipeline_case(seed: int) -> Case:
  """draw_case(seed) with 2-3 pipeline stages, at least one decoder layer each (the command
  line's prompts: no per-row limits, padding or forced tokens)."""
  case = draw_case(seed)
  rng = random.Random(f'pipeline-{seed}')
  stages = rng.choice([2, 2, 3])
  model = dict(case.model, num_layers=rng.randint(stages, 4))
  return dataclasses.replace(case, model=model, calls={}, stages=stages)


def draw_pipeline_job_case(seed: int) -> Case:
  """draw_job_case(seed) through 2-3 pipeline stages, at least one decoder layer each."""
  case = draw_job_case(seed)
  rng = random.Random(f'pipeline-job-{seed}')
  stages = rng.choice([2, 2, 3])
  return dataclasses.replace(case, model=dict(case.model, num_layers=rng.randint(stages, 4)),
                             stages=stages)


def generate(case: Case, policy: dict[str, Any], offload_dir: str, *, weights_cache: str,
             weight_seed: int | None = None):
  """The case's prompts generated under `policy` (with the case's approximations), and the
  prompts' logits from Engine.score (every position, the stages run one after another) where
  the case has no approximation (score keeps no cache and reads weights as placed)."""
  from flexjax.config import ModelConfig
  from flexjax.engine import Engine, GenerationConfig, pad_prompts
  from flexjax.policy import Policy
  from flexjax.weights import DummyWeights
  weights = DummyWeights(ModelConfig(**case.model), dtype=case.weight_dtype,
                         seed=case.seed if weight_seed is None else weight_seed)
  with Engine(weights, policy=Policy(**policy, **case.approx), compute_dtype=case.compute_dtype,
              offload_dir=offload_dir, weights_cache=weights_cache,
              io_threads=case.io_threads) as engine:
    gen = GenerationConfig(**case.generation, top_logprobs=case.top_logprobs)
    result = engine.generate([list(p) for p in case.prompts], gen, return_logits=True,
                             **case.calls)
    if case.approx:
      return result, None
    tokens, mask = pad_prompts(case.prompts, max(map(len, case.prompts)),
                               engine.config.pad_token_id)
    return result, engine.score(tokens, mask) * mask[..., None]  # padding's logits: no value


def compare(reference, result, compute_dtype: str, *,
            quantized_cache: bool = False) -> dict[str, Any]:
  """Tokens equal, and the generated and scored logits (and the log-probabilities where the
  case asks for them: the tokens' and the top ones') within the dtype's tolerance of the
  reference's largest logit (QUANTIZED_CACHE_TOLERANCE's in float32 with a quantized cache,
  where it is larger). reference, result: generate()'s pairs."""
  (ref, ref_scores), (out, out_scores) = reference, result
  same_tokens = bool(np.array_equal(ref.tokens, out.tokens))
  diffs = {'logit_diff': _diff(ref.logits, out.logits)}
  if ref.token_logprobs is not None:  # a log softmax: its error is the logits' at most twice
    diffs['logprob_diff'] = max(_diff(a, b) for a, b in (
        (ref.token_logprobs, out.token_logprobs), (ref.top_logprobs, out.top_logprobs)))
  if ref_scores is not None:
    diffs['score_diff'] = _diff(ref_scores, out_scores)
  scale = float(np.max(np.abs(ref.logits)))
  relative = TOLERANCE[compute_dtype]
  if quantized_cache:
    relative = max(relative, QUANTIZED_CACHE_TOLERANCE)
  tolerance = relative * max(scale, 1e-3)
  return {'same_tokens': same_tokens, **diffs, 'logit_scale': scale,
          'ok': same_tokens and all(d <= tolerance * (2 if k == 'logprob_diff' else 1)
                                    for k, d in diffs.items())}


def _diff(a: np.ndarray, b: np.ndarray) -> float:
  return float(np.max(np.abs(a - b))) if a.shape == b.shape else float('inf')


def run_job(case: Case, policy: dict[str, Any], folder: Path, name: str) -> list[dict]:
  """The case's job run under `policy` through flexjax.run over the checkpoint in `folder`;
  its output lines."""
  from flexjax.engine import GenerationConfig
  from flexjax.policy import Policy
  from flexjax.run import RunConfig, run
  output = folder / f'{name}.jsonl'
  run(RunConfig(model=None, weights='checkpoint', checkpoint=str(folder / 'ckpt'),
                input=str(folder / 'rows.jsonl'), output=str(output),
                policy=Policy(**policy, **case.approx), compute_dtype=case.compute_dtype,
                generation=GenerationConfig(**case.generation), offload_dir=str(folder / 'off'),
                io_threads=case.io_threads, bucket=case.bucket, progress=False))
  return [json.loads(line) for line in output.read_text().splitlines()]


def write_checkpoint(case: Case, path: Path) -> None:
  """The case's dummy weights (its storage dtype and seed) as a checkpoint."""
  from flexjax.checkpoint import write_source
  from flexjax.config import ModelConfig
  from flexjax.weights import DummyWeights
  write_source(DummyWeights(ModelConfig(**case.model), dtype=case.weight_dtype, seed=case.seed),
               path)


def run_job_case(case: Case) -> dict[str, Any]:
  """The job under the drawn policy against the same block shape all on the device: every
  output line equal; the offload folder left empty."""
  shape = {k: case.policy[k] for k in ('gpu_batch_size', 'num_gpu_batches')}
  with tempfile.TemporaryDirectory(prefix='flexjax-fuzz-job-') as tmp:
    folder = Path(tmp)
    write_checkpoint(case, folder / 'ckpt')
    (folder / 'rows.jsonl').write_text(''.join(line + '\n' for line in case.rows))
    (folder / 'off').mkdir()
    reference = run_job(case, shape, folder, 'reference')
    result = run_job(case, case.policy, folder, 'result')
    left = sorted(p.name for p in (folder / 'off').iterdir())
  differ = differing_lines(reference, result, case)
  same = not differ and len(reference) == len(result) == len(case.rows)
  return {**dataclasses.asdict(case), 'same_outputs': same, 'differing_rows': differ,
          'left_in_offload_dir': left, 'ok': same and not left}


def differing_lines(reference: list[dict], result: list[dict], case: Case) -> list:
  """The ids of the job's output lines that differ: in anything but their log-probabilities,
  or in those by more than the dtype's tolerance (`compare`'s, relative to the largest of the
  line's, doubled: a log-probability is a logit less the log of a sum). The top tokens'
  values are compared in their order, which ties do not change, and not their ids."""
  relative = TOLERANCE[case.compute_dtype]
  if case.approx.get('compress_cache'):
    relative = max(relative, QUANTIZED_CACHE_TOLERANCE)
  differ = []
  for ref, out in zip(reference, result):
    ref, out = dict(ref), dict(out)
    values = [[_top_values(line.pop('top_logprobs', None)), line.pop('logprobs', None)]
              for line in (ref, out)]
    (ref_top, ref_lp), (out_top, out_lp) = values
    same = ref == out and (ref_lp is None) == (out_lp is None) and (
        (ref_top is None) == (out_top is None))
    for a, b in ((ref_lp, out_lp), (ref_top, out_top)):
      if same and a is not None:
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        tolerance = 2 * relative * max(1.0, float(np.abs(a).max(initial=0)))
        same = a.shape == b.shape and bool(np.all(np.abs(a - b) <= tolerance))
    if not same:
      differ.append(ref.get('id'))
  return differ


def _top_values(top: list | None) -> list | None:
  return None if top is None else [[value for _, value in step] for step in top]


def command_line(case: Case, policy: dict[str, Any]) -> list[str]:
  """flexjax.main's flags for the case's generation, approximations, dtype and `policy`."""
  args = []
  for name, value in {**case.generation, **case.approx, **policy}.items():
    if isinstance(value, bool):
      args.append(f'--{"" if value else "no"}{name}')
    else:
      args.append(f'--{name}={value}')
  return args + [f'--compute_dtype={case.compute_dtype}', f'--io_threads={case.io_threads}']


def run_pipeline_case(case: Case) -> dict[str, Any]:
  """The prompts (or the job's rows) through case.stages processes under the drawn policy
  against one process with everything on the device (a job: the same block shape): equal
  generated tokens (a job: equal output lines); each stage's peak RSS (the kernel's) within its
  plan; every stage's offload folder left empty."""
  from flexjax.engine import GenerationConfig
  from flexjax.policy import Policy
  from flexjax.run import RunConfig, run
  with tempfile.TemporaryDirectory(prefix='flexjax-fuzz-pipeline-') as tmp:
    folder = Path(tmp)
    write_checkpoint(case, folder / 'ckpt')
    (folder / 'off').mkdir()
    if case.rows:
      (folder / 'rows.jsonl').write_text(''.join(line + '\n' for line in case.rows))
      shape = {k: case.policy[k] for k in ('gpu_batch_size', 'num_gpu_batches')}
      expected = run_job(case, shape, folder, 'reference')
      given = [f'--input={folder / "rows.jsonl"}', f'--{"" if case.bucket else "no"}bucket']
    else:
      prompts = folder / 'prompts.jsonl'
      prompts.write_text(''.join(json.dumps({'tokens': list(p)}) + '\n' for p in case.prompts))
      run(RunConfig(model=None, weights='checkpoint', checkpoint=str(folder / 'ckpt'),
                    prompt_file=str(prompts), progress=False,
                    output=str(folder / 'reference.jsonl'),
                    policy=Policy(gpu_batch_size=len(case.prompts), **case.approx),
                    compute_dtype=case.compute_dtype,
                    generation=GenerationConfig(**case.generation), io_threads=case.io_threads))
      expected = [json.loads(line)['output_tokens']
                  for line in (folder / 'reference.jsonl').read_text().splitlines()]
      given = [f'--prompt_file={prompts}']
    cmd = [sys.executable, '-m', 'flexjax.launch', f'--num_processes={case.stages}',
           '--weights=checkpoint', f'--checkpoint={folder / "ckpt"}', *given,
           f'--output={folder / "result.jsonl"}', f'--offload_dir={folder / "off"}',
           f'--report_json={folder / "report.json"}', '--noprogress',
           *command_line(case, case.policy)]
    proc = _run_group(cmd, timeout=600)
    result = None
    if (folder / 'result.jsonl').exists():
      lines = [json.loads(line) for line in (folder / 'result.jsonl').read_text().splitlines()]
      result = lines if case.rows else [line['output_tokens'] for line in lines]
    left = sorted(str(p.relative_to(folder / 'off')) for p in (folder / 'off').rglob('*'))
    report = (json.loads((folder / 'report.json').read_text())
              if (folder / 'report.json').exists() else {})
  if case.rows and result is not None:  # output lines: log-probabilities within tolerance
    same = (proc.returncode == 0 and len(result) == len(expected)
            and not differing_lines(expected, result, case))
  else:
    same = proc.returncode == 0 and result == expected
  peaks = [[report[f'stage{q}'].get(f'{kind}_ram_peak_bytes') for kind in ('planned', 'measured')]
           for q in range(case.stages) if f'stage{q}' in report]
  # a job of bad rows only runs no stage: nothing to measure
  generated = not case.rows or report.get('rows_generated', 0) > 0
  within = not generated or (len(peaks) == case.stages
                             and all(None not in p and p[1] <= p[0] for p in peaks))
  return {**dataclasses.asdict(case), 'same_tokens': same, 'returncode': proc.returncode,
          'stderr': proc.stderr[-2000:] if proc.returncode else '', 'tokens': result,
          'stage_ram_peaks': peaks, 'within_plans': within, 'left_in_offload_dir': left,
          'ok': same and within and not left}


def _run_group(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
  """`cmd` in a process group of its own (the launcher and its stages); a group still running
  after `timeout` seconds is killed whole and its draw fails, the fuzz goes on."""
  with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                        start_new_session=True, cwd=Path(__file__).resolve().parents[1]) as proc:
    try:
      out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
      os.killpg(proc.pid, signal.SIGKILL)
      out, err = proc.communicate()
      return subprocess.CompletedProcess(cmd, -signal.SIGKILL, out,
                                         f'{err}\nno result after {timeout} s')
  return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def run_case(case: Case) -> dict[str, Any]:
  """The drawn policy against everything on the device; the offload folder left empty. The
  draw's weight layouts live in a folder of its own, removed with it."""
  if case.stages:
    return run_pipeline_case(case)
  if case.rows:
    return run_job_case(case)
  with (tempfile.TemporaryDirectory(prefix='flexjax-fuzz-') as tmp,
        tempfile.TemporaryDirectory(prefix='flexjax-fuzz-layouts-') as layouts):
    reference = generate(case, {'gpu_batch_size': len(case.prompts)}, tmp, weights_cache=layouts)
    result = generate(case, case.policy, tmp, weights_cache=layouts)
    left = sorted(p.name for p in Path(tmp).iterdir())
  row = {**dataclasses.asdict(case),
         **compare(reference, result, case.compute_dtype,
                   quantized_cache=bool(case.approx.get('compress_cache'))),
         'left_in_offload_dir': left}
  row['ok'] = row['ok'] and not left
  return row


def describe(row: dict[str, Any]) -> str:
  """One line on a draw's verdict."""
  if row['stages']:
    if row['returncode']:
      return f'{row["stages"]} stages failed (exit {row["returncode"]})'
    ratios = ', '.join(f'{planned / measured:.2f}' if planned and measured else '?'
                       for planned, measured in row['stage_ram_peaks'])
    return (f'{row["stages"]} stages, {"outputs" if row["rows"] else "tokens"} '
            f'{"equal" if row["same_tokens"] else "differ"}, '
            f'planned / measured RSS per stage {ratios}')
  if row['rows']:
    return (f'outputs of {len(row["rows"])} rows '
            + ('equal' if row['same_outputs'] else f'differ in {row["differing_rows"]}'))
  return (f'tokens {"equal" if row["same_tokens"] else "differ"}, logits within '
          f'{row["logit_diff"]:.2e} of {row["logit_scale"]:.2e}'
          + (f', scores within {row["score_diff"]:.2e}' if 'score_diff' in row else '')
          + (f', log-probabilities within {row["logprob_diff"]:.2e}'
             if 'logprob_diff' in row else ''))


def define_flags(fv: flags.FlagValues) -> None:
  flags.DEFINE_integer('draws', 100, 'Cases to draw.', lower_bound=1, flag_values=fv)
  flags.DEFINE_integer('seed', 0, 'Seed of the first draw; draw i uses seed + i.',
                       lower_bound=0, flag_values=fv)
  flags.DEFINE_string('output', None, 'Append one JSON line per draw here.', flag_values=fv)
  flags.DEFINE_enum('mode', 'generate', ['generate', 'job', 'pipeline', 'pipeline_job'],
                    'generate: prompts through Engine.generate (and Engine.score); job: a batch '
                    'job\'s rows through --input/--output; pipeline: prompts through 2-3 '
                    'processes (flexjax.launch); pipeline_job: a batch job through 2-3 '
                    'processes.', flag_values=fv)


def main(argv) -> None:
  del argv
  from flexjax import flags as flags_lib
  flags_lib.quiet_library_logs()
  fv = flags.FLAGS
  bad = 0
  for seed in range(fv.seed, fv.seed + fv.draws):
    draw = dict(generate=draw_case, job=draw_job_case, pipeline=draw_pipeline_case,
                pipeline_job=draw_pipeline_job_case)[fv.mode]
    row = run_case(draw(seed))
    bad += not row['ok']
    print(f'seed {seed}: {"ok" if row["ok"] else "DIFFERS"} ({describe(row)})'
          + ('' if row['ok'] else f'\n  {json.dumps(row)}'), flush=True)
    if fv.output:
      with open(fv.output, 'a') as f:
        f.write(json.dumps(row) + '\n')
  print(f'{fv.draws - bad} of {fv.draws} draws reproduce the all-device run')
  if bad:
    sys.exit(1)


if __name__ == '__main__':
  from tools import benchlib
  define_flags(flags.FLAGS)
  benchlib.check_output_flags(flags.FLAGS)
  app.run(main, flags_parser=flags_parser())
