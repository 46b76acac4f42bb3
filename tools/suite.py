"""Benchmark suite: flexjax and its peers, case by case on one machine, as the FlexGen paper did.

  python -m tools.suite --suite=configs/bench/cpu.json --output=docs/results/suite_cpu.jsonl
  python -m tools.suite --suite=configs/bench/cpu.json --only=NAME,NAME --output=...
  python -m tools.suite --render=docs/results/suite_cpu.jsonl            # every table
  python -m tools.suite --plot=docs/results/suite_cpu.jsonl --plot_output=docs/frontier.png

A suite file (JSON) has "defaults" and "cases"; a case is the defaults updated by its own keys:
  name            unique; --only picks cases by it
  system          flexjax | accelerate | flexgen
  model           a flexjax preset (opt-125m ... opt-175b) or a dict of ModelConfig fields; dummy
                  weights of that shape
  prompt_len, gen_len, projected_gen_len (generate that many, extrapolate decode to gen_len)
  page_cache      warm | dropped (offloaded files dropped from the page cache at every access)
  gpu_mem, cpu_mem, disk_mem   budgets in GiB (flexjax: per tier; Accelerate: its max_memory for
                  the GPU and the CPU, the rest on disk); null: unlimited (free disk for auto)
  budget          label of the memory setting in tables (e.g. "2 GiB RAM")
  tables          which tables the case belongs to: peers, ablation, frontier
  label           the row's name in the ablation table (e.g. "no overlap")
  offload_dir     parent of the run's offload folders (default: the system temp folder)
  flexjax:  policy ("auto": the cost-model search, or a dict of Policy fields), fixed (Policy
            fields that "auto" keeps instead of searching, e.g. {"overlap": false}),
            max_block_size, hw_profile (paper-t4 or a profile JSON; default: this machine,
            measured once and cached), compute_dtype
  accelerate: batch_size, dtype it computes in (float32 | bfloat16 | float16; the checkpoint
            holds float16 like flexjax's weights), checkpoint_cache (folder);
            batch_sweep + match: run each batch size of the sweep and keep the fastest run whose
            peak RSS stays within that of the flexjax case named by match (tools/rss_match.py)
  flexgen:  policy as for flexjax, or "from:<case name>": the policy flexjax ran in that case

Each case runs in a fresh process (one engine, one model load; an untimed warm-up, then the timed
generation of one block) and appends one JSON line to --output: the case, commit, machine,
versions, policy, budgets, prefill/decode/total tok/s, latency (seconds per block), per-tier peak
bytes, projected yes/no, the per-part breakdown of runs without overlap, the cost model's
prediction, and status (ok, infeasible: no policy fits, failed: the error's last line,
none_fit: no run of a batch sweep stayed within its RSS limit).

Roofline (tools/roofline.py): before the first case the suite measures this machine's matmul rate
(per compute dtype, jax and torch), RAM->device copy and O_DIRECT disk read/write bandwidths in a
fresh process (in --roofline_dir, default the first case's offload folder), records them in every
row ("rates"), and gives every successful row "roofline" (per phase: FLOPs, bytes per link, the
bound, roofline and measured seconds), "roofline_s" and "roofline_fraction" = roofline time /
measured time. --noroofline skips this.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import importlib.util
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from absl import flags

from flexjax import config as config_lib
from flexjax import plan as plan_lib
from flexjax import scratch
from flexjax.engine import BREAKDOWN_PARTS
from flexjax.errors import FlexjaxError
from flexjax.policy import Policy
from tools import bench_offload
from tools import roofline as roofline_lib
from tools import rss_match
from tools.benchlib import (fmt_number, jsonl_appender, read_records, report_error, run_tool,
                            throughputs, timestamp)

SYSTEMS = ('flexjax', 'accelerate', 'flexgen')
TABLES = ('peers', 'ablation', 'frontier', 'stream')
CASE_KEYS = {
    'common': ('name', 'system', 'model', 'prompt_len', 'gen_len', 'projected_gen_len',
               'page_cache', 'gpu_mem', 'cpu_mem', 'disk_mem', 'budget', 'tables', 'label',
               'offload_dir'),
    'flexjax': ('policy', 'fixed', 'max_block_size', 'hw_profile', 'compute_dtype'),
    'accelerate': ('batch_size', 'dtype', 'checkpoint_cache', 'batch_sweep', 'match'),
    'flexgen': ('policy',),
}
DEFAULTS = {'prompt_len': 512, 'gen_len': 32, 'projected_gen_len': None, 'page_cache': 'dropped',
            'gpu_mem': None, 'cpu_mem': None, 'disk_mem': None, 'budget': '', 'tables': [],
            'label': '', 'offload_dir': None, 'policy': 'auto', 'fixed': {},
            'max_block_size': 1024, 'hw_profile': None, 'compute_dtype': 'float32',
            'batch_size': 8, 'dtype': 'float32',
            'checkpoint_cache': '~/.cache/flexjax/peer-checkpoints', 'batch_sweep': None,
            'match': None}


# ---- suite files ---------------------------------------------------------------------------------
def load_suite(path: str) -> tuple[str, list[dict[str, Any]]]:
  """The suite's name and its cases (defaults applied, every key checked)."""
  p = Path(path)
  try:
    spec = json.loads(p.read_text())
  except FileNotFoundError:
    raise FlexjaxError(f'--suite={path!r} does not exist; pass a suite JSON file such as '
                       'configs/bench/cpu.json') from None
  except json.JSONDecodeError as e:
    raise FlexjaxError(f'--suite={path!r} is not valid JSON ({e.msg}, line {e.lineno})') from None
  if not isinstance(spec, dict) or not isinstance(spec.get('cases'), list):
    raise FlexjaxError(f'--suite={path!r} needs an object with a "cases" list')
  defaults = spec.get('defaults', {})
  every_key = {key for keys in CASE_KEYS.values() for key in keys}
  unknown = sorted(set(defaults) - every_key)
  if unknown:
    raise FlexjaxError(f'--suite={path!r}: unknown default keys {unknown}; known: '
                       f'{sorted(every_key)}')
  cases = [check_case({**DEFAULTS, **defaults, **case}, own_keys=set(case))
           for case in spec['cases']]
  names = [case['name'] for case in cases]
  repeated = sorted({n for n in names if names.count(n) > 1})
  if repeated:
    raise FlexjaxError(f'case names {repeated} repeat in {path!r}; give every case its own name')
  systems = {case['name']: case['system'] for case in cases}
  for case in cases:
    if systems.get(case.get('match'), 'flexjax') != 'flexjax':
      raise FlexjaxError(f'case {case["name"]!r}: match={case["match"]!r} names a case of '
                         f'system {systems[case["match"]]}; name a flexjax case')
  return spec.get('name', p.stem), cases


def check_case(case: dict[str, Any], own_keys: set[str] | None = None) -> dict[str, Any]:
  """Validates one case (defaults applied; own_keys: those the case itself sets, which must all
  apply to its system); returns it with only its system's keys. Errors name the case and key."""
  name = case.get('name')
  if not name:
    raise FlexjaxError(f'a case has no "name": {json.dumps(case)[:120]}')
  system = case.get('system')
  if system not in SYSTEMS:
    raise FlexjaxError(f'case {name!r}: system={system!r}; use one of {", ".join(SYSTEMS)}')
  allowed = set(CASE_KEYS['common']) | set(CASE_KEYS[system])
  unknown = sorted((set(case) if own_keys is None else own_keys) - allowed - (
      set() if own_keys is not None else set(DEFAULTS)))
  if unknown:
    raise FlexjaxError(f'case {name!r}: unknown keys {unknown} for system {system!r}; known: '
                       f'{sorted(allowed)}')
  if 'model' not in case:
    raise FlexjaxError(f'case {name!r} has no "model"; give a preset such as "opt-1.3b"')
  model_config(case['model'])  # raises on an unknown model
  bad_tables = sorted(set(case['tables']) - set(TABLES))
  if bad_tables:
    raise FlexjaxError(f'case {name!r}: tables {bad_tables} are unknown; use {", ".join(TABLES)}')
  if case['page_cache'] not in ('warm', 'dropped'):
    raise FlexjaxError(f'case {name!r}: page_cache={case["page_cache"]!r}; use warm or dropped')
  policy = case.get('policy')
  if system == 'flexjax' and policy != 'auto' and not isinstance(policy, dict):
    raise FlexjaxError(f'case {name!r}: policy={policy!r}; use "auto" or a dict of Policy fields')
  if system == 'flexgen' and not (isinstance(policy, dict) or isinstance(policy, str)
                                  and policy.startswith('from:')):
    raise FlexjaxError(f'case {name!r}: FlexGen needs policy = a dict of Policy fields or '
                       '"from:<flexjax case name>"')
  if isinstance(policy, dict):
    _policy_from(policy, name)
  if system == 'flexjax':
    _policy_from(case['fixed'], name)
  if system == 'accelerate':
    rss_match.check_sweep(case)
  return {k: v for k, v in case.items() if k in allowed}


def _policy_from(fields: dict[str, Any], case: str, base: Policy = Policy()) -> Policy:
  if not isinstance(fields, dict):
    raise FlexjaxError(f'case {case!r}: {fields!r} should be a dict of Policy fields')
  known = {f.name for f in dataclasses.fields(Policy)}
  unknown = sorted(set(fields) - known)
  if unknown:
    raise FlexjaxError(f'case {case!r}: unknown Policy fields {unknown}; known: {sorted(known)}')
  return dataclasses.replace(base, **fields)


def model_config(model: str | dict[str, Any]) -> config_lib.ModelConfig:
  """A preset by name, or a custom shape from ModelConfig fields."""
  if isinstance(model, dict):
    return config_lib.ModelConfig.from_dict(model)
  return config_lib.preset(model)


def _model_name(model: str | dict[str, Any]) -> str:
  return model.get('name', 'custom') if isinstance(model, dict) else model


def budgets_of(case: dict[str, Any]) -> dict[str, int | None]:
  """The case's budgets in bytes per flexjax tier."""
  gib = lambda v: None if v is None else int(float(v) * 2**30)  # noqa: E731
  return {'device': gib(case['gpu_mem']), 'host': gib(case['cpu_mem']),
          'disk': gib(case['disk_mem'])}


# ---- one case ------------------------------------------------------------------------------------
def run_case(case: dict[str, Any], context: dict[str, Any]) -> dict[str, Any]:
  """Runs one case in this process. Returns its record (status 'infeasible' when no policy fits
  the budgets; other errors propagate)."""
  cfg = model_config(case['model'])
  bench_offload.check_lengths(cfg, prompt_len=case['prompt_len'], gen_len=case['gen_len'],
                              projected_gen_len=case['projected_gen_len'])
  runner = {'flexjax': _run_flexjax, 'accelerate': _run_accelerate,
            'flexgen': _run_flexgen}[case['system']]
  base = record_head(case, context)
  try:
    measured = runner(cfg, case)
  except FlexjaxError as e:
    if not str(e).startswith('no policy fits'):
      raise
    return {**base, 'status': 'infeasible', 'error': str(e), 'timestamp': timestamp()}
  record = {**base, **measured, 'status': 'ok'}
  record.update(throughputs(batch_size=record['num_prompts'], prompt_len=case['prompt_len'],
                            gen_len=case['gen_len'], prefill_s=record['prefill_s'],
                            decode_s=record['decode_s']))
  record['latency_s'] = record['prefill_s'] + record['decode_s']
  record['timestamp'] = timestamp()
  return record


def record_head(case: dict[str, Any], context: dict[str, Any]) -> dict[str, Any]:
  """The fields every record of a case has, whatever its outcome."""
  return {'tool': 'suite', 'case': case['name'], 'system': case['system'],
          'model': _model_name(case['model']), 'label': case['label'], 'budget': case['budget'],
          'tables': list(case['tables']), 'prompt_len': case['prompt_len'],
          'gen_len': case['gen_len'], 'page_cache': case['page_cache'],
          'budgets': budgets_of(case), 'spec': case, **context}


def flexjax_policy(cfg: config_lib.ModelConfig, case: dict[str, Any]):
  """The case's policy (searched for "auto"), the hardware profile, if any, and the planner
  its run is to use (None: the engine's own). Searched for this machine, the search plans with
  the run's own planner (its steps compiled on this device): on a GPU, XLA's memory there is not
  what a CPU compile of the same steps holds (opt-6.7b 16 x 512 in float16 on an H200: a policy
  chosen from the CPU's numbers needed 16.11 GiB of a 16 GiB budget in the run's plan)."""
  from flexjax import search
  from flexjax.hardware import HardwareProfile, t4_profile
  spec = case['hw_profile']
  profile = (t4_profile() if spec == 'paper-t4' else HardwareProfile.load(spec) if spec
             else None)
  fixed = case['fixed']
  if case['policy'] != 'auto':
    return _policy_from({**case['policy'], **fixed}, case['name']), profile, None
  planner = None
  if profile is None:  # this machine's, measured once and cached
    import jax
    from flexjax.run import resolve_profile
    profile = resolve_profile(None, jax.devices()[0], measure_if_missing=True,
                              scratch_dir=case['offload_dir'])
    planner = bench_offload.dummy_planner(cfg, case['compute_dtype'])
  budgets = budgets_of(case)
  if budgets['disk'] is None:
    budgets['disk'] = _free_disk(case['offload_dir'])
  sizes = _itemsizes(case)
  choices = {}
  for name, arg in (('cpu_attention', 'cpu_attention'), ('gpu_batch_size', 'gpu_batch_sizes'),
                    ('num_gpu_batches', 'num_gpu_batches')):
    if name in fixed:
      choices[arg] = (fixed[name],)
  found = search.search(cfg, profile, budgets, prompt_len=case['prompt_len'],
                        gen_len=case['gen_len'], sizes=sizes, planner=planner,
                        template=_policy_from(fixed, case['name']),
                        max_block_size=case['max_block_size'],
                        fixed_percents=[k for k in fixed if k in search.PERCENT_FIELDS],
                        **choices)
  return found.policy, profile, planner


def _itemsizes(case: dict[str, Any]) -> plan_lib.Itemsizes:
  return plan_lib.Itemsizes.of('float16', case['compute_dtype'], case['compute_dtype'])


def _free_disk(folder: str | None) -> int:
  import shutil
  return shutil.disk_usage(scratch.offload_parent(folder)).free


def _run_flexjax(cfg, case) -> dict[str, Any]:
  policy, profile, planner = flexjax_policy(cfg, case)
  record = bench_offload.run_case(
      cfg, policy, case='block', page_cache=case['page_cache'], prompt_len=case['prompt_len'],
      gen_len=case['gen_len'], projected_gen_len=case['projected_gen_len'],
      compute_dtype=case['compute_dtype'], offload_dir=case['offload_dir'],
      budgets=budgets_of(case), context={}, profile=profile, planner=planner)
  keep = ('num_prompts', 'measured_gen_len', 'projected', 'prefill_s', 'decode_s',
          'measured_decode_s', 'peak_bytes', 'planned_peak_bytes', 'host_peak_rss_bytes',
          'policy', 'policy_fields', 'compute_dtype', 'weight_storage_dtype', 'bytes_moved',
          'disk_weight_bytes', 'weight_loads_per_stage', 'predicted', 'device', 'breakdown',
          'weight_files_read_bw')
  return {'system_version': _flexjax_version(), **{k: record[k] for k in keep}}


def _flexjax_version() -> str:
  try:
    return importlib.metadata.version('flexjax')
  except importlib.metadata.PackageNotFoundError:
    return 'source'


def _run_accelerate(cfg, case) -> dict[str, Any]:
  from tools import peer_accelerate
  budgets = budgets_of(case)
  max_memory: dict[str | int, int] = {}
  if budgets['device'] is not None and _has_cuda():  # on a CPU, Accelerate's device is the CPU
    max_memory[0] = budgets['device']
  max_memory['cpu'] = budgets['host'] if budgets['host'] is not None else _free_ram()
  shape = hashlib.sha256(json.dumps(cfg.to_dict(), sort_keys=True).encode()).hexdigest()[:10]
  folder = Path(os.path.expanduser(case['checkpoint_cache'])) / f'{cfg.name}-{shape}-float16'
  return peer_accelerate.run_accelerate(
      cfg, batch_size=case['batch_size'], prompt_len=case['prompt_len'],
      gen_len=case['gen_len'], projected_gen_len=case['projected_gen_len'],
      max_memory=max_memory, checkpoint_dir=folder, offload_dir=case['offload_dir'],
      dtype=case['dtype'], page_cache=case['page_cache'])


def _has_cuda() -> bool:
  import torch
  return torch.cuda.is_available()


def _free_ram() -> int:
  from flexjax.memwatch import meminfo_bytes
  return meminfo_bytes('MemAvailable') or 0


def _run_flexgen(cfg, case) -> dict[str, Any]:
  from tools import peer_flexgen
  policy = _policy_from(case['policy'], case['name'])
  out = peer_flexgen.run_flexgen(
      cfg.name, policy, prompt_len=case['prompt_len'], gen_len=case['gen_len'],
      projected_gen_len=case['projected_gen_len'],
      offload_dir=str(scratch.offload_parent(case['offload_dir'])))
  return {**out, 'peak_bytes': {'device': out['gpu_peak_bytes']}}


def describe_case(case: dict[str, Any]) -> str:
  """What a case would run: flexjax's policy and prediction, a peer's batch."""
  cfg = model_config(case['model'])
  lengths = f'{case["prompt_len"]}+{case["gen_len"]}'
  if case['system'] == 'accelerate' and case.get('batch_sweep'):
    return (f'accelerate {cfg.name} {lengths}, batch sweep {sorted(case["batch_sweep"])}, '
            f'{case["dtype"]}: the fastest run within the peak RSS of {case["match"]!r}')
  if case['system'] == 'accelerate':
    return f'accelerate {cfg.name} {lengths}, batch {case["batch_size"]}, {case["dtype"]}'
  if case['system'] == 'flexgen':
    return f'flexgen {cfg.name} {lengths}, policy {case["policy"]}'
  try:
    policy, profile, _ = flexjax_policy(cfg, case)
  except FlexjaxError as e:
    return f'flexjax {cfg.name} {lengths}: {e}'
  text = f'flexjax {cfg.name} {lengths}, block {policy.block_size}: {policy.describe()}'
  if profile is not None:
    from flexjax import cost_model
    p = cost_model.predict(cfg, policy, profile, _itemsizes(case), prompt_len=case['prompt_len'],
                           gen_len=case['gen_len'])
    text += (f'; predicted {p.throughput:.2f} tok/s, block {p.prefill_s:.0f} s prefill + '
             f'{p.decode_s:.0f} s decode on {profile.name}')
  return text


# ---- the whole suite -----------------------------------------------------------------------------
def resolve(case: dict[str, Any], done: Sequence[dict[str, Any]]) -> dict[str, Any]:
  """Replaces policy "from:<case>" by the policy that case ran (from this run's records)."""
  policy = case.get('policy')
  if case['system'] != 'flexgen' or not isinstance(policy, str):
    return case
  source = policy.removeprefix('from:')
  for record in reversed(done):
    if record['case'] == source and record.get('status') == 'ok':
      return {**case, 'policy': record['policy_fields']}
  raise FlexjaxError(f'case {case["name"]!r} takes its policy from case {source!r}, which has not '
                     'run successfully before it; run both (--only) in that order')


def run_suite(suite_name: str, cases: Sequence[dict[str, Any]],
              emit: Callable[[dict[str, Any]], None], *, isolate: bool = True,
              log: Callable[[str], None] = print, previous: Sequence[dict[str, Any]] = (),
              rates: dict[str, Any] | None = None) -> list[dict[str, Any]]:
  """Runs the cases in order, each in its own process when `isolate`, emitting every record.
  A case that fails is recorded with status 'failed' and the suite goes on. `previous`: records
  already in the output (a batch sweep's match may be there); `rates`: roofline.measure_rates()
  of this run, which every record then carries with its roofline."""
  context = {**bench_offload.run_context(), 'suite': suite_name}
  done: list[dict[str, Any]] = []

  def run_one(case: dict[str, Any]) -> dict[str, Any]:
    try:
      return _run_isolated(case, context) if isolate else run_case(case, context)
    except FlexjaxError as e:
      return _failed(case, context, e)

  for case in cases:
    log(f'suite {suite_name}: case {case["name"]} ({case["system"]}, {case["model"]})')
    if case.get('batch_sweep'):
      record = _run_sweep(case, context, [*previous, *done],
                          lambda point: with_roofline(run_one(point), rates), log)
    else:
      try:
        record = run_one(resolve(case, done))
      except FlexjaxError as e:
        record = _failed(case, context, e)
    record = with_roofline(record, rates)
    emit(record)
    done.append(record)
  return done


def _failed(case: dict[str, Any], context: dict[str, Any], error: Exception) -> dict[str, Any]:
  return {**record_head(case, context), 'status': 'failed', 'error': str(error),
          'timestamp': timestamp()}


def _run_sweep(case, context, records, run, log) -> dict[str, Any]:
  """A batch-sweep case (tools/rss_match.py): its points, then the kept one's record."""
  head = record_head(case, context)
  try:
    target = rss_match.matched_record(case, records)
  except FlexjaxError as e:
    return _failed(case, context, e)
  limit = target['host_peak_rss_bytes']
  log(f'  batch sweep {sorted(case["batch_sweep"])} within the peak RSS of {target["case"]} '
      f'({limit / 2**30:.2f} GiB)')
  points = rss_match.run_points(case, limit=limit, run=run, log=log)
  return {**rss_match.sweep_record(case, head, points, target), 'timestamp': timestamp()}


def with_roofline(record: dict[str, Any], rates: dict[str, Any] | None) -> dict[str, Any]:
  """The record with the run's rates and, when it succeeded, its roofline (tools/roofline.py);
  without rates, the record unchanged."""
  if rates is None:
    return record
  out = {**record, 'rates': rates, 'roofline': None, 'roofline_s': None,
         'roofline_fraction': None}
  if record.get('status') != 'ok':
    return out
  try:
    bound = roofline_lib.of_record(record, rates)
  except (FlexjaxError, KeyError, TypeError, ValueError) as e:
    return {**out, 'roofline_error': f'{type(e).__name__}: {e}'}
  return {**out, 'roofline': bound, 'roofline_s': bound['total']['roofline_s'],
          'roofline_fraction': bound['total']['fraction']}


def measure_rates(cases: Sequence[dict[str, Any]], *, folder: str | None, file_gib: float,
                  log: Callable[[str], None] = print) -> dict[str, Any]:
  """The roofline's rates for these cases' compute dtypes, measured in a fresh process: jax's
  matmul rate, and torch's too wherever torch is installed (the roofline takes the faster, so a
  suite of flexjax rows alone is held to the same rate as one with its peers); the disk probe
  writes its file in `folder` (default: the first case's offload folder)."""
  with tempfile.TemporaryDirectory(prefix='flexjax-rates-') as tmp:
    out = Path(tmp) / 'rates.json'
    cmd = rates_command(cases, folder=folder, file_gib=file_gib, output=out)
    log(f'roofline: measuring rates ({" ".join(cmd[3:])})')
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env=_child_env())
    if proc.returncode != 0 or not out.is_file():
      lines = [line for line in proc.stdout.splitlines() if line.strip()] or ['no output']
      raise FlexjaxError(f'measuring the roofline rates failed ({lines[-1]}); fix that or pass '
                         '--noroofline')
    rates = json.loads(out.read_text())
  log('roofline: ' + roofline_lib.format_rates(rates).replace('\n', '; '))
  return rates


def rates_command(cases: Sequence[dict[str, Any]], *, folder: str | None, file_gib: float,
                  output: Path) -> list[str]:
  """The tools.roofline command that measures `measure_rates`' rates into `output`."""
  dtypes = sorted({c.get('compute_dtype') if c['system'] == 'flexjax' else
                   c.get('dtype') if c['system'] == 'accelerate' else 'float16' for c in cases})
  torch = (any(c['system'] != 'flexjax' for c in cases)
           or importlib.util.find_spec('torch') is not None)
  folder = folder or next((c['offload_dir'] for c in cases if c.get('offload_dir')), None)
  return [sys.executable, '-m', 'tools.roofline', f'--dtypes={",".join(dtypes)}',
          f'--file_gib={file_gib}', f'--output={output}', '--torch' if torch else '--notorch',
          *([f'--folder={folder}'] if folder else [])]


def _child_env() -> dict[str, str]:
  return dict(os.environ, PYTHONPATH=os.pathsep.join(
      [str(Path(__file__).resolve().parent.parent), os.environ.get('PYTHONPATH', '')]))


def _run_isolated(case: dict[str, Any], context: dict[str, Any]) -> dict[str, Any]:
  """Runs one case in a child process; its record comes back through a temporary file."""
  with tempfile.TemporaryDirectory(prefix='flexjax-suite-') as tmp:
    out = Path(tmp) / 'record.json'
    cmd = [sys.executable, '-m', 'tools.suite', f'--case_json={json.dumps(case)}',
           f'--context_json={json.dumps(context)}', f'--record_output={out}']
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env=_child_env())
    if proc.returncode != 0 or not out.is_file():
      lines = [line for line in proc.stdout.splitlines() if line.strip()]
      raise FlexjaxError(f'exit status {proc.returncode}: '
                         f'{lines[-1] if lines else "no output"}')
    return json.loads(out.read_text())


# ---- tables --------------------------------------------------------------------------------------
def _in_table(records: Iterable[dict[str, Any]], table: str) -> list[dict[str, Any]]:
  return [r for r in records if table in r.get('tables', ())]


def _tok_s(record: dict[str, Any] | None) -> str:
  if record is None:
    return '—'
  if record.get('status') == 'infeasible':
    return 'OOM'
  if record.get('status') == 'none_fit':
    return 'none fits'
  if record.get('status') != 'ok':
    return 'failed'
  value = record['total_tok_s']
  text = f'{value:.2f}' if value < 10 else fmt_number(value)
  return text + ('*' if record.get('projected') else '')


def render_peers(records: Sequence[dict[str, Any]]) -> str:
  """Table 2: per model, lengths and memory setting, each system's total tok/s, its batch and
  policy, flexjax's ratio to each peer and each system's roofline fraction. '*' marks decode
  time projected from fewer tokens."""
  rows: dict[tuple, dict[str, dict[str, Any]]] = {}
  for r in _in_table(records, 'peers'):
    key = (r['model'], r['prompt_len'], r['gen_len'], r.get('budget', ''))
    rows.setdefault(key, {})[r['system']] = r  # the last run of a system wins
  lines = ['| model | prompt+gen | memory | flexjax tok/s | Accelerate tok/s | FlexGen tok/s | '
           'flexjax / Accelerate | flexjax / FlexGen | flexjax block, policy | '
           'Accelerate batch | peak RSS GiB flexjax / Accelerate | '
           'roofline fraction flexjax / Accelerate / FlexGen |',
           '|---|---|---|---:|---:|---:|---:|---:|---|---:|---:|---:|']
  for (model, prompt_len, gen_len, budget), systems in rows.items():
    ours = systems.get('flexjax')
    cells = [model, f'{prompt_len}+{gen_len}', budget or '—']
    cells += [_tok_s(systems.get(s)) for s in SYSTEMS]
    cells += [_ratio(ours, systems.get('accelerate')), _ratio(ours, systems.get('flexgen'))]
    cells.append(f'{ours["num_prompts"]}: {ours["policy"]}' if ours and ours.get('status') == 'ok'
                 else '—')
    acc = systems.get('accelerate')
    cells.append(_peer_batch(acc))
    cells.append(' / '.join(_rss(systems.get(s)) for s in ('flexjax', 'accelerate')))
    cells.append(' / '.join(_roofline_cell(systems.get(s)) for s in SYSTEMS))
    lines.append('| ' + ' | '.join(cells) + ' |')
  return '\n'.join(lines)


def _peer_batch(record: dict[str, Any] | None) -> str:
  if not record or record.get('status') != 'ok':
    return '—'
  if record.get('sweep'):
    return f'{record["num_prompts"]} (of {[p["batch_size"] for p in record["sweep"]]}, RSS-matched)'
  return str(record['num_prompts'])


def _roofline_cell(record: dict[str, Any] | None) -> str:
  value = (record or {}).get('roofline_fraction')
  return '—' if value is None else f'{value:.2f}'


def _rss(record: dict[str, Any] | None) -> str:
  value = (record or {}).get('host_peak_rss_bytes')
  return '—' if value is None else f'{value / 2**30:.1f}'


def _ratio(a: dict[str, Any] | None, b: dict[str, Any] | None) -> str:
  if not (a and b and a.get('status') == 'ok' and b.get('status') == 'ok'):
    return '—'
  return f'{a["total_tok_s"] / b["total_tok_s"]:.2f}x'


def render_ablation(records: Sequence[dict[str, Any]]) -> str:
  """Table 4: a row per label, a column per (model, lengths, memory) setting."""
  settings: list[tuple] = []
  cells: dict[tuple, dict[str, dict[str, Any]]] = {}
  for r in _in_table(records, 'ablation'):
    setting = (r['model'], r['prompt_len'], r['gen_len'], r.get('budget', ''))
    if setting not in settings:
      settings.append(setting)
    cells.setdefault(r['label'] or r['case'], {})[setting] = r
  head = [f'{m} {p}+{g}' + (f', {b}' if b else '') for m, p, g, b in settings]
  lines = ['| ' + ' | '.join(['ablation', *head]) + ' |',
           '|---|' + '---:|' * len(settings)]
  for label, row in cells.items():
    values = []
    for s in settings:
      r = row.get(s)
      detail = f' ({r["num_prompts"]}: {r["policy"]})' if r and r.get('status') == 'ok' else ''
      values.append(_tok_s(r) + detail)
    lines.append('| ' + ' | '.join([label, *values]) + ' |')
  return '\n'.join(lines)


def render_breakdown(records: Sequence[dict[str, Any]]) -> str:
  """Table 8: for each run without overlap, seconds per phase in each part of the work."""
  lines = ['| case | phase | total s | ' + ' | '.join(p.replace('_', ' ') + ' s'
                                                    for p in BREAKDOWN_PARTS) + ' | other s |',
           '|---|---|' + '---:|' * (len(BREAKDOWN_PARTS) + 2)]
  for r in records:
    breakdown = r.get('breakdown')
    if not breakdown:
      continue
    for phase in ('prefill', 'decode'):
      parts = breakdown[phase]
      other = parts['total'] - sum(parts[p] for p in BREAKDOWN_PARTS)
      note = f' ({r["measured_gen_len"] - 1} steps measured)' if (
          phase == 'decode' and r.get('projected')) else ''
      lines.append('| ' + ' | '.join(
          [f'{r["case"]} ({r["model"]}, {r.get("num_prompts")} seqs)', phase + note,
           f'{parts["total"]:.2f}', *(f'{parts[p]:.2f}' for p in BREAKDOWN_PARTS),
           f'{other:.2f}']) + ' |')
  return '\n'.join(lines)


def frontier_runs(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
  """Every successful run of the frontier table: a row, or each point of a batch sweep."""
  keys = ('system', 'case', 'num_prompts', 'latency_s', 'total_tok_s', 'host_peak_rss_bytes',
          'projected', 'status')
  runs = []
  for r in _in_table(records, 'frontier'):
    if r.get('sweep') is not None:
      runs += [{'system': r['system'], 'case': f'{r["case"]} (batch {p["batch_size"]})',
                'num_prompts': p['batch_size'], **{k: p.get(k) for k in keys[3:]}}
               for p in r['sweep'] if p.get('status') == 'ok']
    elif r.get('status') == 'ok':
      runs.append({k: r.get(k) for k in keys})
  return runs


def frontier(records: Sequence[dict[str, Any]]) -> dict[str, list[tuple[float, float]]]:
  """Per system, the (latency s, total tok/s) points of its frontier-table runs that no other run
  of that system beats on both (lower latency and higher throughput), by latency."""
  points: dict[str, list[tuple[float, float]]] = {}
  for r in frontier_runs(records):
    points.setdefault(r['system'], []).append((r['latency_s'], r['total_tok_s']))
  out = {}
  for system, pts in points.items():
    best, kept = -math.inf, []
    for latency, tok_s in sorted(pts, key=lambda p: (p[0], -p[1])):
      if tok_s > best:
        kept.append((latency, tok_s))
        best = tok_s
    out[system] = kept
  return out


def render_frontier(records: Sequence[dict[str, Any]]) -> str:
  lines = ['| system | case | block / batch | latency s | total tok/s | peak RSS GiB | '
           'on frontier |',
           '|---|---|---:|---:|---:|---:|---|']
  front = frontier(records)
  for r in frontier_runs(records):
    on = (r['latency_s'], r['total_tok_s']) in front.get(r['system'], [])
    lines.append(f'| {r["system"]} | {r["case"]} | {r["num_prompts"]} | {r["latency_s"]:,.1f} | '
                 f'{_tok_s(r)} | {_rss(r)} | {"yes" if on else ""} |')
  return '\n'.join(lines)


def _cpu_text(machine: dict[str, Any]) -> str:
  """', on <cpu model> (<vector flags>)' where the record says (older records do not)."""
  if not machine.get('cpu_model'):
    return ''
  flags = machine.get('cpu_vector_flags')
  return f', on {machine["cpu_model"]}' + (f' ({" ".join(flags)})' if flags else '')


def render_roofline(records: Sequence[dict[str, Any]]) -> str:
  """Per successful row with a roofline: roofline / measured seconds of each phase, what bounds
  it (compute or a link), and the fraction of the roofline reached; then the rates used."""
  lines = ['| case | system | block / batch | prefill s: roofline / measured (bound) | '
           'decode s: roofline / measured (bound) | total s: roofline / measured | '
           'roofline fraction prefill / decode / total |',
           '|---|---|---:|---:|---:|---:|---:|']
  rates, machines = {}, {}
  for r in records:
    bound = r.get('roofline')
    if not bound:
      continue
    rates.setdefault(r.get('run_id'), r['rates'])
    machines.setdefault(r.get('run_id'), r.get('machine') or {})

    def cell(phase):
      b = bound[phase]
      return (f'{b["roofline_s"]:,.1f} / {b["measured_s"]:,.1f}'
              + (f' ({b["bound"].replace("_", " ")})' if 'bound' in b else ''))

    fractions = ' / '.join('—' if bound[p]['fraction'] is None else f'{bound[p]["fraction"]:.2f}'
                           for p in ('prefill', 'decode', 'total'))
    lines.append(f'| {r["case"]} | {r["system"]} | {r["num_prompts"]} | {cell("prefill")} | '
                 f'{cell("decode")} | {cell("total")} | {fractions} |')
  lines += [f'\nRates of run {run_id} (measured {used.get("measured_at", "?")}'
            + _cpu_text(machines[run_id]) + '): '
            + roofline_lib.format_rates(used).replace('\n', '; ') for run_id, used in rates.items()]
  return '\n'.join(lines)


def render_stream(records: Sequence[dict[str, Any]]) -> str:
  """Per flexjax row that read weights from disk while decoding: the weight stream (disk bytes
  over measured decode time) against the O_DIRECT disk read rate measured in the same suite run,
  and what bounds its decode on the roofline (a compute-bound decode cannot keep the disk busy)."""
  lines = ['| case | block | policy | decode weights from disk GB / step | decode s / step | '
           'weight stream GB/s | O_DIRECT disk GB/s (same run) | stream / disk | decode bound |',
           '|---|---:|---|---:|---:|---:|---:|---:|---|']
  for r in records:
    disk = (r.get('disk_weight_bytes') or {}).get('decode', 0)
    if r.get('system') != 'flexjax' or r.get('status') != 'ok' or not disk or not r.get('rates'):
      continue
    steps = r['measured_gen_len'] - 1
    stream = disk / r['measured_decode_s']
    probe = r['rates']['disk_read_bw']
    bound = ((r.get('roofline') or {}).get('decode') or {}).get('bound', '—')
    lines.append(f'| {r["case"]} | {r["num_prompts"]} | {r["policy"]} | {disk / steps / 1e9:.2f} | '
                 f'{r["measured_decode_s"] / steps:.2f} | {stream / 1e9:.2f} | {probe / 1e9:.2f} | '
                 f'{stream / probe:.2f} | {bound.replace("_", " ")} |')
  return '\n'.join(lines)


def render_all(records: Sequence[dict[str, Any]]) -> str:
  parts = [('Flexjax vs peers (Table 2)', render_peers),
           ('Flexjax vs Accelerate at equal measured peak RSS', rss_match.render_matched),
           ('Roofline: measured time against this machine\'s measured peaks', render_roofline),
           ('Weight stream during decode against the disk', render_stream),
           ('Ablation (Table 4)', render_ablation),
           ('Breakdown without overlap (Table 8)', render_breakdown),
           ('Latency and throughput (Fig. 1)', render_frontier)]
  text = []
  for title, fn in parts:
    table = fn(records)
    if table.count('\n') > 1:  # more than the header
      text.append(f'### {title}\n\n{table}\n')
  text.append('`*`: decode time projected from a shorter generation (the same way for every '
              'system); OOM: no policy fits the budgets.')
  return '\n'.join(text)


def plot_frontier(records: Sequence[dict[str, Any]], output: str, *, title: str = '') -> None:
  """Saves throughput against latency (log-log) per system, frontier joined, as a PNG."""
  try:
    import matplotlib
  except ImportError:
    raise FlexjaxError("--plot needs matplotlib; install it with pip install -e '.[peers]'"
                       ) from None
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt
  front = frontier(records)
  if not front:
    raise FlexjaxError('no successful runs in the frontier table to plot; run a suite with '
                       'cases whose "tables" include "frontier"')
  fig, ax = plt.subplots(figsize=(5.5, 3.6), dpi=110)
  for system in SYSTEMS:
    runs = [r for r in frontier_runs(records) if r['system'] == system]
    if not runs:
      continue
    line = ax.plot(*zip(*front[system]), marker='o', label=system)[0]
    ax.scatter([r['latency_s'] for r in runs], [r['total_tok_s'] for r in runs],
               color=line.get_color(), alpha=0.35, s=14)
    for r in runs:
      ax.annotate(str(r['num_prompts']), (r['latency_s'], r['total_tok_s']), fontsize=7,
                  xytext=(3, 3), textcoords='offset points')
  ax.set_xscale('log')
  ax.set_yscale('log')
  ax.set_xlabel('latency of a block (s)')
  ax.set_ylabel('generation throughput (token/s)')
  ax.set_title(title, fontsize=9)
  ax.grid(True, which='both', alpha=0.3)
  ax.legend(fontsize=8)
  fig.tight_layout()
  target = Path(output)
  target.parent.mkdir(parents=True, exist_ok=True)
  tmp = target.with_name(f'.{target.name}.tmp.png')
  fig.savefig(tmp)
  plt.close(fig)
  os.replace(tmp, target)


# ---- command line --------------------------------------------------------------------------------
def define_flags(fv: flags.FlagValues) -> None:
  f = dict(flag_values=fv)
  flags.DEFINE_string('suite', None, 'Suite JSON file to run (see the module doc).', **f)
  flags.DEFINE_list('only', [], 'Run only these cases (by name), in the suite\'s order.', **f)
  flags.DEFINE_string('output', None, 'JSONL file to append one line per case to.', **f)
  flags.DEFINE_bool('isolate', True, 'Run each case in a fresh process.', **f)
  flags.DEFINE_bool('roofline', True, 'Measure this machine\'s rates first and give every row '
                    'its roofline time and fraction (see the module doc).', **f)
  flags.DEFINE_string('roofline_dir', None, 'Folder of the disk probe (default: the first case\'s '
                      'offload folder, else the system temp folder).', **f)
  flags.DEFINE_float('roofline_file_gib', 1.0, 'Size of the disk probe file in GiB.', **f)
  flags.DEFINE_bool('dry_run', False, 'Print each case\'s policy (flexjax: searched for "auto") '
                    'and predicted throughput; run nothing.', **f)
  flags.DEFINE_string('render', None, 'Print the markdown tables of this results JSONL.', **f)
  flags.DEFINE_string('plot', None, 'Plot the frontier of this results JSONL ...', **f)
  flags.DEFINE_string('plot_output', 'docs/frontier.png', '... into this PNG.', **f)
  flags.DEFINE_string('plot_title', '', 'Title of the plot.', **f)
  flags.DEFINE_string('case_json', None, 'Internal: run this one resolved case.', **f)
  flags.DEFINE_string('context_json', '{}', 'Internal: the suite run\'s shared fields.', **f)
  flags.DEFINE_string('record_output', None, 'Internal: where the one case\'s record goes.', **f)


def run_cli(fv: flags.FlagValues) -> int:
  try:
    if fv.case_json:
      record = run_case(json.loads(fv.case_json), json.loads(fv.context_json))
      Path(fv.record_output).write_text(json.dumps(record))
      return 0
    if fv.render:
      print(render_all(read_records(fv.render)))
      return 0
    if fv.plot:
      plot_frontier(read_records(fv.plot, 'plot'), fv.plot_output, title=fv.plot_title)
      print(f'wrote {fv.plot_output}')
      return 0
    if not fv.suite or not (fv.output or fv.dry_run):
      raise FlexjaxError('give --suite=FILE and --output=FILE.jsonl to run, --render=FILE to print '
                         'tables, or --plot=FILE to draw the frontier')
    name, cases = load_suite(fv.suite)
    if fv.only:
      unknown = sorted(set(fv.only) - {c['name'] for c in cases})
      if unknown:
        raise FlexjaxError(f'--only names cases {unknown} that {fv.suite!r} does not have')
      cases = [c for c in cases if c['name'] in fv.only]
    if fv.dry_run:
      for case in cases:
        print(f'{case["name"]}: {describe_case(case)}')
      return 0
    log = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    previous = read_records(fv.output, 'output') if Path(fv.output).is_file() else []
    rates = (measure_rates(cases, folder=fv.roofline_dir, file_gib=fv.roofline_file_gib, log=log)
             if fv.roofline else None)
    with jsonl_appender(fv.output) as emit:
      run_suite(name, cases, emit, isolate=fv.isolate, log=log, previous=previous, rates=rates)
  except FlexjaxError as e:
    return report_error('suite', e)
  return 0


if __name__ == '__main__':
  run_tool(define_flags, run_cli)
