"""Pipeline scaling: throughput of 1, 2, 4... stages measured on this machine, and the cost
model's projection of the paper's Table 3 (OPT on 1-4 T4 machines).

  python -m tools.pipeline_scaling --stages=1,2,4 --output=scaling.jsonl   # measure here
  python -m tools.pipeline_scaling --project                               # Table 3 projected

Measured: each stage count runs `python -m flexjax.launch` on dummy weights with the same block
and the same RAM for resident weights per stage (--weights_gib); the rest of a stage's weights
stream from disk (page cache dropped), so every added stage moves weights a tier up. One JSON
line per stage count: the report (throughputs, each stage's policy and planned and measured
peaks) and the run's provenance.

Projected: every stage count splits the layers (flexjax.pipeline.split_layers), searches each
stage's policy on the paper's T4 machine (16 GB GPU, 208 GB RAM, 1.5 TB disk per stage) and
agrees on one block shape as a pipelined run does (flexjax.stage_run.best_shape).
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from flexjax import config as config_lib
from flexjax.errors import FlexjaxError
from tools import benchlib

PAPER_TABLE3 = {  # generation / decoding tok/s, prompt 512, gen 32 (1 and 4 T4 GPUs)
    'opt-6.7b': {1: (25.26, 38.28), 4: (201.12, 764.65)},
    'opt-30b': {1: (7.32, 11.52), 4: (23.61, 48.94)},
    'opt-175b': {1: (0.69, 0.83), 4: (2.33, 3.86)},
}
T4_BUDGETS = {'device': 16 * 10**9, 'host': 208 * 10**9, 'disk': 1500 * 10**9}


def define_flags(fv) -> None:
  from absl import flags
  f = dict(flag_values=fv)
  flags.DEFINE_list('stages', ['1', '2', '4'], 'Stage counts to measure.', **f)
  flags.register_validator('stages', lambda v: bool(v) and all(s.isdigit() and int(s) > 0
                                                               for s in v),
                           message='must be positive integers, e.g. --stages=1,2,4', **f)
  flags.DEFINE_string('model', 'opt-1.3b', 'Model shape (dummy weights).', **f)
  flags.DEFINE_float('weights_gib', 0.5, 'RAM for resident weights per stage (GiB).', **f)
  flags.DEFINE_integer('prompt_len', 32, 'Prompt length.', **f)
  flags.DEFINE_integer('gen_len', 8, 'New tokens.', **f)
  flags.DEFINE_integer('gpu_batch_size', 4, 'Sequences per micro-batch.', **f)
  flags.DEFINE_integer('num_gpu_batches', 4, 'Micro-batches per block.', **f)
  flags.DEFINE_string('output', None, 'JSONL file the measured lines are appended to.', **f)
  flags.DEFINE_string('render', None, 'Print the table of a JSONL file written by --output.', **f)
  flags.DEFINE_bool('project', False, 'Print the cost model\'s projection of Table 3.', **f)


# ---- measured on this machine --------------------------------------------------------------------
def weight_share(cfg: config_lib.ModelConfig, stages: int, weights_gib: float) -> float:
  """The percent of a stage's weights that fits weights_gib of RAM (the largest stage's)."""
  from flexjax.pipeline import split_layers
  largest = max(len(r) for r in split_layers(cfg, stages))
  stage_bytes = largest * cfg.layer_weight_bytes(2) + cfg.embedding_weight_bytes(2)
  return min(100.0, round(100 * weights_gib * 2**30 / stage_bytes, 1))


def measure(stages: int, fv, scratch: Path) -> dict[str, Any]:
  """One pipelined run of `stages` processes; its report and provenance."""
  cfg = config_lib.preset(fv.model)
  share = weight_share(cfg, stages, fv.weights_gib)
  report = scratch / f'report-{stages}.json'
  cmd = [sys.executable, '-m', 'flexjax.launch', f'--num_processes={stages}',
         f'--model={fv.model}', '--weights=dummy', '--dtype=float16', '--compute_dtype=float32',
         f'--prompt_len={fv.prompt_len}', f'--gen_len={fv.gen_len}',
         f'--gpu_batch_size={fv.gpu_batch_size}', f'--num_gpu_batches={fv.num_gpu_batches}',
         '--w_gpu_percent=0', f'--w_cpu_percent={share}', '--drop_page_cache', '--noprogress',
         '--stop_at_eos=false', f'--report_json={report}', '--stage_timeout=600',
         f'--offload_dir={scratch / "offload"}']
  proc = subprocess.run(cmd, capture_output=True, text=True)
  if proc.returncode:
    raise FlexjaxError(f'{stages} stages failed: {proc.stderr.strip().splitlines()[-1:]}')
  return {'tool': 'pipeline_scaling', 'stages': stages, 'weights_gib': fv.weights_gib,
          'w_cpu_percent': share, 'commit': benchlib.git_commit(),
          'machine': benchlib.machine_info(), 'time': benchlib.timestamp(),
          'report': json.loads(report.read_text())}


def render(records: list[dict[str, Any]]) -> str:
  lines = ['| stages | weights in RAM per stage | total tok/s | decode tok/s | x 1 stage (total / '
           'decode) | per stage: layers, measured / planned peak RSS GiB |',
           '|---:|---|---:|---:|---|---|']
  base = next((r['report'] for r in records if r['stages'] == 1), None)
  for r in sorted(records, key=lambda r: r['stages']):
    rep = r['report']
    ratio = '—' if base is None else (f'{rep["total_tok_s"] / base["total_tok_s"]:.2f} / '
                                      f'{rep["decode_tok_s"] / base["decode_tok_s"]:.2f}')
    stages = '; '.join(
        f'{rep[f"stage{q}"]["holds"]}: {rep[f"stage{q}"].get("measured_ram_peak_bytes", 0) / 2**30:.2f}'
        f' / {rep[f"stage{q}"].get("planned_ram_peak_bytes", 0) / 2**30:.2f}'
        for q in range(r['stages']))
    lines.append(f'| {r["stages"]} | {r["w_cpu_percent"]:g}% ({r["weights_gib"]:g} GiB) | '
                 f'{rep["total_tok_s"]:.2f} | {rep["decode_tok_s"]:.2f} | {ratio} | {stages} |')
  return '\n'.join(lines)


# ---- projected for the paper's machines ----------------------------------------------------------
def project(model: str, stages: int, *, prompt_len: int = 512, gen_len: int = 32,
            memo: dict | None = None) -> dict[str, Any]:
  """The predicted generation and decoding throughput of `model` over `stages` T4 machines."""
  from flexjax import plan as plan_lib
  from flexjax.hardware import t4_profile
  from flexjax.pipeline import split_layers
  from flexjax.search import search
  from flexjax.stage_run import best_shape, pipeline_seconds
  cfg = config_lib.preset(model)
  memo = {} if memo is None else memo
  counts = [len(r) for r in split_layers(cfg, stages)]

  def solve(layers: int, shape=None):
    key = (model, layers, shape)
    if key not in memo:
      stage_cfg = dataclasses.replace(cfg, num_layers=layers)
      planner = plan_lib.Planner.for_sizes(stage_cfg, plan_lib.Itemsizes(2, 2, 2),
                                           device_is_host=False)
      kw = {} if shape is None else dict(gpu_batch_sizes=[shape[0]], num_gpu_batches=[shape[1]])
      try:
        found = search(stage_cfg, t4_profile(), T4_BUDGETS, prompt_len=prompt_len,
                       gen_len=gen_len, sizes=planner.sizes, planner=planner, **kw)
        memo[key] = (found.policy, found.prediction)
      except FlexjaxError:
        memo[key] = None
    return memo[key]

  own = [solve(n) for n in counts]
  shapes = sorted({(p.gpu_batch_size, p.num_gpu_batches) for p, _ in own})
  table = [[(r is not None, r and r[1].prefill_s, r and r[1].decode_s)
            for r in (solve(n, shape) for shape in shapes)] for n in counts]
  j = best_shape(shapes, table, gen_len)
  gbs, nb = shapes[j]
  prefill, decode = pipeline_seconds([row[j][1] for row in table], [row[j][2] for row in table],
                                     nb)
  return {'model': model, 'stages': stages, 'layers': counts,
          'policies': [solve(n, shapes[j])[0].describe() for n in counts],
          'total_tok_s': gbs * nb * gen_len / (prefill + decode),
          'decode_tok_s': gbs * nb * (gen_len - 1) / decode}


def projection_table(max_stages: int = 4) -> str:
  memo: dict = {}
  lines = ['| model | stages | layers per stage | policy (largest stage) | projected total / '
           'decode tok/s | paper total / decode tok/s |', '|---|---:|---|---|---|---|']
  for model, paper in PAPER_TABLE3.items():
    for stages in range(1, max_stages + 1):
      r = project(model, stages, memo=memo)
      ref = paper.get(stages)
      lines.append(f'| {model} | {stages} | {"/".join(map(str, r["layers"]))} | '
                   f'{r["policies"][0]} | {r["total_tok_s"]:.2f} / {r["decode_tok_s"]:.2f} | '
                   f'{f"{ref[0]:g} / {ref[1]:g}" if ref else "—"} |')
  return '\n'.join(lines)


def run_cli(fv) -> int:
  try:
    if fv.project:
      print(projection_table())
      return 0
    if fv.render:
      print(render(benchlib.read_records(fv.render)))
      return 0
    records = []
    with tempfile.TemporaryDirectory(prefix='flexjax-scaling-') as scratch:
      for stages in (int(s) for s in fv.stages):
        record = measure(stages, fv, Path(scratch))
        records.append(record)
        if fv.output:
          with open(fv.output, 'a') as f:
            f.write(json.dumps(record) + '\n')
        print(f'{stages} stages: {record["report"]["total_tok_s"]} tok/s total, '
              f'{record["report"]["decode_tok_s"]} decode', flush=True)
    print(render(records))
    return 0
  except FlexjaxError as e:
    return benchlib.report_error('pipeline_scaling', e)


if __name__ == '__main__':
  benchlib.run_tool(define_flags, run_cli)
