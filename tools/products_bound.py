"""The least time a suite row's matrix products take on this machine, alone, and so the largest
roofline fraction any run of that row can reach with them.

  python -m tools.products_bound --records=suite.jsonl [--only=CASE,...] [--repeats=3]
      [--folder=/tmp] [--file_gib=1] [--rates=rates.json] [--output=bound.jsonl]

A suite row's roofline (tools.roofline) charges its FLOPs at the rate of a large square matmul.
A run multiplies other shapes: a decode step's products have as many rows as its GPU batch has
sequences (32 rows against 576-wide matrices for SmolLM2), and the libraries do not reach the
square rate there. For each flexjax record of a suite results file this tool times the products
of the row's own steps and nothing else: every matrix of a decoder layer and the LM head, with the
row's rows per step, on distinct copies of the weights (at least MIN_DISTINCT_BYTES of them, so
that they come from RAM as in a run, not from the cache), in two ways:

  jax    flexjax's products (flexjax.model.linear.dense: weights in their storage dtype, cast in
         the step), one jitted program per layer as a run dispatches them, compiled with XLA's
         own products and, for steps of linear.LIBRARY_ROWS float32 rows or more, with
         oneDNN's too (any model family), the faster kept
  torch  torch.nn.functional.linear on weights already in the compute dtype (no cast at all)

and with the rates measured in the same run (tools.roofline.measure_rates, torch's matmul
included; --rates reads a file of them instead) it gives per phase:

  products_s  the faster framework's time for the whole phase's products: prefill, every GPU
              batch's prompt through every layer and the head at its last position; decode,
              gen_len - 1 steps of every GPU batch through every layer and the head
  roofline_s  the row's roofline at these rates (tools.roofline.of_record)
  products_share_of_matmul_rate
              the products' FLOP rate over the roofline's (the square matmul's)
  bound       roofline_s / max(products_s, roofline_s): a run whose products alone take
              products_s reaches no more of its roofline. The total's bound is the phases'
              rooflines added over their max(...) added.
  fraction    the record's own measured times against the same roofline

Everything else a run does is left out, so that the bound stays an upper bound: attention,
norms, activations, rotary positions, sampling, transfers, the dispatch between layers, and the
dependence between a layer's products (here they are independent, free to run side by side).
"""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np

from tools import roofline
from tools.benchlib import jsonl_appender, read_records, report_error, run_tool

MIN_DISTINCT_BYTES = 256 * 2**20  # weights timed per pass: more than any CPU cache holds
FRAMEWORKS = ('jax', 'torch')


def phase_products(cfg, policy, *, prompt_len: int, gen_len: int) -> dict[str, dict[str, Any]]:
  """Per phase, the rows of a layer step's products and of a head step's, and how many of each
  the phase runs (the FLOPs tools.roofline.work counts, less attention)."""
  gpu_batches, rows = policy.num_gpu_batches, policy.gpu_batch_size
  return {
      'prefill': {'layer_rows': rows * prompt_len, 'head_rows': rows,
                  'layer_steps': gpu_batches * cfg.num_layers, 'head_steps': gpu_batches},
      'decode': {'layer_rows': rows, 'head_rows': rows,
                 'layer_steps': (gen_len - 1) * gpu_batches * cfg.num_layers,
                 'head_steps': (gen_len - 1) * gpu_batches},
  }


def products_flops(cfg, phase: dict[str, Any]) -> float:
  """FLOPs of one phase's products (2 per multiply-add)."""
  from flexjax.cost_model import layer_matmul_params
  return 2 * (phase['layer_steps'] * phase['layer_rows'] * layer_matmul_params(cfg)
              + phase['head_steps'] * phase['head_rows'] * math.prod(cfg.tokens_shape()))


def distinct_layers(cfg, storage_itemsize: int) -> int:
  """Copies of a layer's weights timed per pass: MIN_DISTINCT_BYTES or more, at most the
  model's layers."""
  from flexjax.cost_model import layer_matmul_params
  layer_bytes = storage_itemsize * layer_matmul_params(cfg)
  return max(1, min(cfg.num_layers, -(-MIN_DISTINCT_BYTES // layer_bytes)))


def _best(run, repeats: int) -> float:
  run()  # compiles, faults in
  best = math.inf
  for _ in range(repeats):
    start = time.perf_counter()
    run()
    best = min(best, time.perf_counter() - start)
  return best


def time_products(cfg, *, rows: list[int], head_rows: list[int], storage_dtype: str,
                  compute_dtype: str, copies: int, repeats: int,
                  programs: list) -> dict[str, dict[str, dict[int, float]]]:
  """Seconds of one layer step's products at each of `rows`, and of one head step's at each of
  `head_rows`, per framework: {'jax' | 'torch': {'layer' | 'head': {rows: seconds}}}. A layer
  step is timed as the mean over a pass of `copies` distinct layers' weights (distinct_layers),
  each layer its own call.
  jax's time is the faster of XLA's own products and, where a run of that many rows may take
  them (linear.in_library), oneDNN's (linear.library_options), whatever the model's family.
  The compiled programs are appended to `programs`, which the caller frees after its later work
  (a oneDNN program freed right after its run can abort: linear.library_options)."""
  from flexjax.config import np_dtype
  from flexjax.cost_model import layer_matrices
  storage = np_dtype(storage_dtype)
  rng = np.random.default_rng(0)
  shapes = layer_matrices(cfg)
  layers = [[(rng.standard_normal(s, dtype=np.float32) * 0.02).astype(storage) for s in shapes]
            for _ in range(copies)]
  head = (rng.standard_normal(cfg.tokens_shape(), dtype=np.float32) * 0.02).astype(storage)
  inputs = {n: [rng.standard_normal((n, i), dtype=np.float32) for _, i in shapes]
            for n in rows}
  head_inputs = {n: rng.standard_normal((n, cfg.embed_dim), dtype=np.float32)
                 for n in head_rows}
  kw = dict(layers=layers, head=head, inputs=inputs, head_inputs=head_inputs,
            compute_dtype=compute_dtype, repeats=repeats)
  return {'jax': _time_jax(**kw, programs=programs), 'torch': _time_torch(**kw)}


def _time_jax(*, layers, head, inputs, head_inputs, compute_dtype: str, repeats: int,
              programs: list) -> dict[str, dict[int, float]]:
  import jax
  import jax.numpy as jnp

  from flexjax.model import linear
  compute = jnp.dtype(compute_dtype)
  product = lambda x, w: linear.dense(x, w, compute)  # noqa: E731
  products = lambda xs, ws: [product(x, w) for x, w in zip(xs, ws)]  # noqa: E731
  platform = jax.devices()[0].platform
  forms = {False: jax.jit(products), True: jax.jit(products,
                                                   compiler_options=linear.library_options())}
  head_step = jax.jit(product)
  programs.extend([*forms.values(), head_step])
  weights = [[jnp.asarray(w) for w in ws] for ws in layers]
  table = jnp.asarray(head)
  out: dict[str, dict[int, float]] = {'layer': {}, 'head': {}}
  for n, xs in inputs.items():
    xs = [jnp.asarray(x, compute) for x in xs]
    out['layer'][n] = min(
        _best(lambda: jax.block_until_ready([step(xs, ws) for ws in weights]), repeats)
        for library, step in forms.items()
        if not library or linear.in_library(platform, compute, n)) / len(weights)
  for n, x in head_inputs.items():
    x = jnp.asarray(x, compute)
    out['head'][n] = _best(lambda: head_step(x, table).block_until_ready(), repeats)
  return out


def _time_torch(*, layers, head, inputs, head_inputs, compute_dtype: str,
                repeats: int) -> dict[str, dict[int, float]]:
  import torch
  dtype = getattr(torch, compute_dtype)
  as_torch = lambda a: torch.from_numpy(np.asarray(a, np.float32)).to(dtype)  # noqa: E731
  f = torch.nn.functional.linear
  weights = [[as_torch(w) for w in ws] for ws in layers]
  table = as_torch(head)
  out: dict[str, dict[int, float]] = {'layer': {}, 'head': {}}
  with torch.inference_mode():
    for n, xs in inputs.items():
      xs = [as_torch(x) for x in xs]
      out['layer'][n] = _best(lambda: [[f(x, w) for x, w in zip(xs, ws)] for ws in weights],
                              repeats) / len(weights)
    for n, x in head_inputs.items():
      x = as_torch(x)
      out['head'][n] = _best(lambda: f(x, table), repeats)
  return out


def bound_of(roofline_s: dict[str, float], products_s: dict[str, float]) -> dict[str, float]:
  """Per phase and in total: the roofline over the least time the phase can take (the larger
  of its roofline and its products' time)."""
  least = {p: max(roofline_s[p], products_s[p]) for p in roofline.PHASES}
  out = {p: roofline_s[p] / least[p] for p in roofline.PHASES}
  out['total'] = (sum(roofline_s[p] for p in roofline.PHASES)
                  / sum(least[p] for p in roofline.PHASES))
  return out


def measure(record: dict[str, Any], rates: dict[str, Any], *, repeats: int,
            programs: list) -> dict[str, Any]:
  """The bound of one successful flexjax suite record (see the module doc); the compiled
  programs go to `programs` (time_products)."""
  from flexjax.config import np_dtype
  from flexjax.policy import Policy
  cfg = roofline.record_config(record)
  policy = Policy(**record['policy_fields'])
  compute, storage = roofline.record_dtypes(record)
  copies = distinct_layers(cfg, np_dtype(storage).itemsize)
  phases = phase_products(cfg, policy, prompt_len=record['prompt_len'],
                          gen_len=record['gen_len'])
  timed = time_products(cfg, rows=sorted({p['layer_rows'] for p in phases.values()}),
                        head_rows=sorted({p['head_rows'] for p in phases.values()}),
                        storage_dtype=storage, compute_dtype=compute, copies=copies,
                        repeats=repeats, programs=programs)
  by_framework = {
      fw: {name: p['layer_steps'] * timed[fw]['layer'][p['layer_rows']]
           + p['head_steps'] * timed[fw]['head'][p['head_rows']]
           for name, p in phases.items()}
      for fw in FRAMEWORKS}
  products_s = {p: min(by_framework[fw][p] for fw in FRAMEWORKS) for p in roofline.PHASES}
  line = roofline.of_record(record, rates)
  roofline_s = {p: line[p]['roofline_s'] for p in roofline.PHASES}
  flops = {name: products_flops(cfg, p) for name, p in phases.items()}
  return {
      'tool': 'products_bound', 'case': record['case'], 'model': cfg.name,
      'policy': record['policy'], 'compute_dtype': compute, 'weight_storage_dtype': storage,
      'prompt_len': record['prompt_len'], 'gen_len': record['gen_len'],
      'rows': {name: p['layer_rows'] for name, p in phases.items()},
      'distinct_layers': copies,
      'products_flops': flops,
      'products_s': by_framework, 'least_products_s': products_s,
      'products_share_of_matmul_rate': {
          p: flops[p] / products_s[p] / line['rates']['compute_flops'] for p in roofline.PHASES},
      'roofline_s': roofline_s,
      'roofline_bound_by': {p: line[p]['bound'] for p in roofline.PHASES},
      'bound': bound_of(roofline_s, products_s),
      'fraction': {**{p: line[p]['fraction'] for p in roofline.PHASES},
                   'total': line['total']['fraction']},
      'rates': line['rates'], 'rates_measured_at': rates.get('measured_at'),
  }


def format_line(r: dict[str, Any]) -> str:
  rows = []
  for phase in (*roofline.PHASES, 'total'):
    if phase == 'total':
      products = ''
      rl = sum(r['roofline_s'].values())
    else:
      products = ' / '.join(f'{r["products_s"][fw][phase]:.3f}' for fw in FRAMEWORKS)
      rl = r['roofline_s'][phase]
    fraction = r['fraction'][phase]
    rows.append(f'{r["case"] if phase == "prefill" else "":32s} {phase:8s} {products:>19s} '
                f'{rl:10.3f} {r["bound"][phase]:7.3f} '
                f'{"—" if fraction is None else f"{fraction:.3f}":>9s}')
  return '\n'.join(rows)


HEADER = (f'{"case":32s} {"phase":8s} {"products s jax/torch":>19s} {"roofline s":>10s} '
          f'{"bound":>7s} {"fraction":>9s}')


def define_flags(fv) -> None:
  from absl import flags
  f = dict(flag_values=fv)
  flags.DEFINE_string('records', None, 'A suite results file (tools.suite --output): the '
                      'bound of each of its successful flexjax records.', **f)
  flags.DEFINE_list('only', [], 'Only these cases of the file.', **f)
  flags.DEFINE_integer('repeats', 3, 'Timed passes per product shape (the best is kept).',
                       lower_bound=1, **f)
  flags.DEFINE_string('rates', None, 'Rates measured earlier (tools.roofline --output); '
                      'default: measured now, in this run.', **f)
  flags.DEFINE_string('folder', None, 'Folder on the disk to probe (default: the system temp '
                      'folder).', **f)
  flags.DEFINE_float('file_gib', 1.0, 'Size of the disk probe file in GiB.', lower_bound=1 / 1024,
                     **f)
  flags.DEFINE_string('output', None, 'Also append the records to this JSONL file.', **f)


def _selected(records: list[dict[str, Any]], only: list[str], path: str) -> list[dict[str, Any]]:
  from flexjax.errors import FlexjaxError
  usable = [r for r in records if r.get('tool') == 'suite' and r.get('system') == 'flexjax'
            and r.get('status') == 'ok']
  if only:
    known = {r['case'] for r in usable}
    missing = [case for case in only if case not in known]
    if missing:
      raise FlexjaxError(f'--only={",".join(missing)}: no successful flexjax record of that '
                         f'case in {path!r} (it has: {", ".join(sorted(known)) or "none"})')
    usable = [r for r in usable if r['case'] in only]
  if not usable:
    raise FlexjaxError(f'--records={path!r} holds no successful flexjax record; pass a file '
                       'written by python -m tools.suite --output')
  return usable


def run_cli(fv) -> int:
  import json
  from pathlib import Path

  from flexjax.errors import FlexjaxError
  try:
    if not fv.records:
      raise FlexjaxError('--records is required: a file written by python -m tools.suite '
                         '--output')
    chosen = _selected(read_records(fv.records, 'records'), fv.only, fv.records)
    if fv.rates:
      try:
        rates = json.loads(Path(fv.rates).read_text())
      except (OSError, json.JSONDecodeError) as e:
        raise FlexjaxError(f'--rates={fv.rates!r} could not be read as JSON ({e}); pass a '
                           'file written by python -m tools.roofline --output') from None
    else:
      dtypes = tuple(sorted({r.get('compute_dtype') or 'float32' for r in chosen}))
      rates = roofline.measure_rates(folder=fv.folder, dtypes=dtypes, torch=True,
                                     file_bytes=int(fv.file_gib * 2**30))
      print(roofline.format_rates(rates), flush=True)
    programs: list = []  # freed as the tool returns, after its output
    lines = [measure(r, rates, repeats=fv.repeats, programs=programs) for r in chosen]
  except (FlexjaxError, OSError) as e:
    return report_error('products_bound', e)
  print(HEADER)
  for line in lines:
    print(format_line(line))
  if fv.output:
    with jsonl_appender(fv.output) as emit:
      for line in lines:
        emit(line)
  return 0


if __name__ == '__main__':
  run_tool(define_flags, run_cli)
