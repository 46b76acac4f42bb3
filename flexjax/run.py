"""One generation job: weights, prompts, engine, report and output file."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import socket
import sys
from pathlib import Path
from typing import Any

import numpy as np

from flexjax import config as config_lib
from flexjax import cost_model, diskio, hardware, scratch, search, stream
from flexjax import progress as progress_lib
from flexjax import plan as plan_lib
from flexjax.memwatch import MemoryWatch, meminfo_bytes
from flexjax.checkpoint import Checkpoint
from flexjax.engine import Engine, GenerationConfig, GenerationResult
from flexjax.errors import FlexjaxError
from flexjax.hardware import HardwareProfile
from flexjax.policy import Policy
from flexjax.tokenizer import Tokenizer
from flexjax.weights import DummyWeights, WeightSource

COMPILE_CACHE_BYTES = 2 << 30  # the compile cache's bound: jax drops the least recently used
COMPILE_CACHE_MIN_SECONDS = 0.25  # faster compiles are not kept: reading them back saves little


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """Everything a generation job needs; built from flags or by hand."""

  model: str | None = 'opt-125m'  # preset; None: the checkpoint's own config
  weights: str = 'dummy'  # 'dummy' | 'checkpoint'
  checkpoint: str | None = None
  dummy_seed: int = 0
  dtype: str | None = None  # stored weight dtype; None: checkpoint's, float16 for dummy weights
  compute_dtype: str | None = None  # None: hardware.default_compute_dtype of the device
  cache_dtype: str | None = None
  prompt_file: str | None = None
  chat: bool = False  # text prompts go through the tokenizer's chat template as user messages
  prompt_len: int = 128
  num_prompts: int | None = None  # synthetic prompts; None: one block of the policy
  generation: GenerationConfig = GenerationConfig()
  policy: Policy = Policy()  # hand-given, or the template of the search (approximations, overlap)
  policy_mode: str = 'manual'  # 'manual' | 'auto'
  hw_profile: str | None = None  # 'paper-t4', a JSON path, or None: this machine's (cached)
  max_block_seconds: float | None = None  # latency limit for the search
  max_block_size: int = 1024  # largest block the search may choose
  dry_run: bool = False
  budgets: dict[str, int | None] | None = None  # bytes per tier; None: unlimited
  offload_dir: str | None = None
  drop_page_cache: bool = False
  weights_cache: str | None = None  # streaming layouts of dummy / read-only weights
  io_threads: int = diskio.IO_THREADS  # threads reading weights from disk
  host_memory: str = 'auto'  # host-tier weights: 'auto' | 'pinned' | 'pageable'
  output: str | None = None
  input: str | None = None  # a batch job's JSONL rows (flexjax.job); output is then required
  bucket: bool = True  # a job's blocks padded to length buckets (else to its longest row)
  progress: bool = True  # progress bars on a terminal


def load_weights(rc: RunConfig) -> tuple[WeightSource, Tokenizer | None]:
  if rc.weights == 'dummy':
    return DummyWeights(config_lib.preset(rc.model), rc.dtype or 'float16', rc.dummy_seed), None
  ckpt = Checkpoint(rc.checkpoint)
  if rc.dtype is not None and rc.dtype != ckpt.dtype:
    raise FlexjaxError(f'--dtype={rc.dtype} differs from the checkpoint\'s stored {ckpt.dtype}; '
                       'drop --dtype, or convert with tools/convert_hf.py --dtype=' + rc.dtype)
  if rc.model is not None:
    want = config_lib.preset(rc.model)
    if dataclasses.replace(want, name=ckpt.config.name) != ckpt.config:
      raise FlexjaxError(f'--model={rc.model} does not match checkpoint {rc.checkpoint!r} '
                         f'(layers/hidden/heads {ckpt.config.num_layers}/'
                         f'{ckpt.config.hidden_size}/{ckpt.config.num_heads} vs '
                         f'{want.num_layers}/{want.hidden_size}/{want.num_heads}); drop --model '
                         'or use the matching checkpoint')
  cfg = ckpt.config
  tokenizer = Tokenizer.for_model(ckpt.tokenizer_path, cfg) if ckpt.tokenizer_path else None
  return ckpt, tokenizer


def synthetic_prompts(cfg: config_lib.ModelConfig, num: int, length: int, seed: int):
  """Deterministic random prompts of `length` tokens, BOS first."""
  rng = np.random.default_rng(seed)
  high = min(cfg.vocab_size, 50265)  # ids beyond the OPT tokenizer's vocabulary are never seen
  body = rng.integers(4, high, size=(num, length - 1))
  return [[cfg.bos_token_id] + row.tolist() for row in body]


def load_prompts(path: str, cfg: config_lib.ModelConfig, tokenizer: Tokenizer | None, *,
                 chat: bool = False):
  """Reads prompts from .txt (one per line) or .jsonl ({"prompt": ...} or {"tokens": [...]});
  with chat, each text prompt is the user's message through the chat template."""
  from flexjax.job import read_text
  p = Path(path)
  text = read_text(path, 'prompt_file', 'a text file of prompts, one per line')
  lines = [line for line in text.splitlines() if line.strip()]
  if not lines:
    raise FlexjaxError(f'--prompt_file={path!r} holds no prompts')
  texts, prompts = [], []
  for number, line in enumerate(lines, 1):
    if p.suffix == '.jsonl':
      try:
        record = json.loads(line)
      except json.JSONDecodeError as e:
        raise FlexjaxError(f'--prompt_file={path!r} line {number} is not JSON ({e.msg})') from None
      if not isinstance(record, dict) or not ({'prompt', 'tokens'} & set(record)):
        raise FlexjaxError(f'--prompt_file={path!r} line {number} needs a "prompt" or "tokens" key')
      if 'tokens' in record:
        ids = record['tokens']
        if (not isinstance(ids, list) or not ids
            or not all(isinstance(t, int) and 0 <= t < cfg.vocab_size for t in ids)):
          raise FlexjaxError(f'--prompt_file={path!r} line {number}: "tokens" must be a non-empty '
                             f'list of ids in [0, {cfg.vocab_size})')
        texts.append(record.get('prompt'))
        prompts.append(ids)
        continue
      text = record['prompt']
    else:
      text = line
    if tokenizer is None:
      raise FlexjaxError(f'--prompt_file={path!r} holds text but these weights have no tokenizer '
                         '(dummy weights, or a checkpoint converted without tokenizer files); '
                         'give token ids as .jsonl lines {"tokens": [...]}')
    texts.append(text)
    prompts.append(tokenizer.encode_chat(text) if chat else tokenizer.encode(text))
  longest = max(len(ids) for ids in prompts)
  if longest > cfg.max_positions:
    raise FlexjaxError(f'--prompt_file={path!r} has a prompt of {longest} tokens but '
                       f'{cfg.name} has {cfg.max_positions} positions; shorten it')
  return prompts, texts


@dataclasses.dataclass
class RunPrompts:
  """A run's prompts: a prompt file's (token ids and texts), or synthetic ones made once the
  policy's block size is known. `count` is the number of sequences where known before the
  policy (a prompt file's, --num_prompts), else None."""
  tokens: list[list[int]] | None
  texts: list[str | None] | None
  length: int
  count: int | None

  def for_policy(self, cfg: config_lib.ModelConfig, policy: Policy, seed: int):
    """(token ids, texts) to run: the file's, or `count` (else one block of) synthetic ones."""
    if self.tokens is not None:
      return self.tokens, self.texts
    tokens = synthetic_prompts(cfg, self.count or policy.block_size, self.length, seed=seed)
    return tokens, [None] * len(tokens)


def run_prompts(rc: RunConfig, cfg: config_lib.ModelConfig,
                tokenizer: Tokenizer | None) -> RunPrompts:
  """The run's prompts (`RunPrompts`), their length checked against the model's positions."""
  if rc.prompt_file:
    tokens, texts = load_prompts(rc.prompt_file, cfg, tokenizer, chat=rc.chat)
    prompts = RunPrompts(tokens, texts, max(len(p) for p in tokens), len(tokens))
  else:
    if rc.prompt_len > cfg.max_positions:
      raise FlexjaxError(f'--prompt_len={rc.prompt_len} exceeds the {cfg.max_positions} '
                         f'positions of {cfg.name}; use a shorter prompt')
    prompts = RunPrompts(None, None, rc.prompt_len, rc.num_prompts)
  total = prompts.length + rc.generation.gen_len - 1
  if total > cfg.max_positions:
    raise FlexjaxError(f'prompt ({prompts.length} tokens) plus --gen_len={rc.generation.gen_len} '
                       f'needs {total} positions but {cfg.name} has {cfg.max_positions}; '
                       'shorten one of them')
  return prompts


def device_memory_bytes(device) -> int | None:
  """Free memory of a device: the accelerator's limit, or the host's available RAM on CPU."""
  stats = device.memory_stats() if hasattr(device, 'memory_stats') else None
  if stats and 'bytes_limit' in stats:
    return int(stats['bytes_limit']) - int(stats.get('bytes_in_use', 0))
  return meminfo_bytes('MemAvailable')


def resolve_profile(spec: str | None, device, *, measure_if_missing: bool,
                    scratch_dir: str | None, progress: bool = True) -> HardwareProfile | None:
  """'paper-t4', a JSON path, or None: this device's cached profile (measured and cached on
  first need when measure_if_missing)."""
  if spec == 'paper-t4':
    return hardware.t4_profile()
  if spec:
    return hardware.HardwareProfile.load(spec)
  cache = profile_cache(device, scratch_dir)
  if cache.is_file():
    return hardware.HardwareProfile.load(cache)
  if not measure_if_missing:
    return None
  return measure_profile(device, scratch_dir=scratch_dir, progress=progress)


def profile_cache(device, scratch_dir: str | None) -> Path:
  """Where this device's profile, measured with its disk rates read in scratch_dir, is cached:
  one file per hardware.machine_key, so a profile measured on another CPU, core count, jax build
  or disk is never taken for this one's (a home folder shared between machines, a resized VM,
  an offload folder moved to another disk)."""
  key = json.dumps(hardware.machine_key(device, scratch_dir), sort_keys=True)
  digest = hashlib.sha256(key.encode()).hexdigest()[:16]
  return (Path(os.environ.get('XDG_CACHE_HOME', Path.home() / '.cache')) / 'flexjax'
          / f'hw-{device.platform}-{device.device_kind}-{digest}.json'.replace(' ', '_'))


def measure_profile(device, *, scratch_dir: str | None, progress: bool) -> HardwareProfile:
  """Measures this device for the cost model and caches the profile (profile_cache). One
  process of this machine measures at a time (processes measuring at once would slow each
  other, and the slowed rates would be cached): one that waited for another takes the profile
  that one cached where it is this device's."""
  cache = profile_cache(device, scratch_dir)
  with scratch.alone_in(cache.parent, 'waiting for another process measuring this machine'):
    if cache.is_file():
      return hardware.HardwareProfile.load(cache)
    print(f'measuring this machine for the cost model, once (transfers, disk, matmul and '
          f'attention rates: under a minute on a 2-core CPU); the profile is cached in {cache}',
          file=sys.stderr, flush=True)
    profile = hardware.measure(device, scratch_dir=scratch_dir,
                               progress=progress_lib.enabled(progress))
    profile.save(cache)
  return profile


def detected_budgets(rc: RunConfig, device) -> dict[str, int | None]:
  """Given budgets, else what the machine has: device memory, available RAM, free disk.

  On a CPU backend the device and host tiers are the same RAM: --cpu_mem (else the available
  RAM) bounds the two together as 'ram', and --gpu_mem, when given, still bounds the device
  tier alone (simulating an accelerator of that size).
  """
  budgets = dict(rc.budgets or {})
  if device.platform == 'cpu':
    budgets['ram'] = budgets.pop('host', None) or meminfo_bytes('MemAvailable')
    budgets['host'] = None
  elif budgets.get('device') is None:  # never plan past what the device has
    budgets['device'] = device_memory_bytes(device)
  if rc.policy_mode == 'auto':
    if budgets.get('host') is None and device.platform != 'cpu':
      budgets['host'] = meminfo_bytes('MemAvailable')
    if budgets.get('disk') is None:
      budgets['disk'] = shutil.disk_usage(scratch.offload_parent(rc.offload_dir)).free
  return budgets


def choose_policy(rc: RunConfig, cfg, planner: plan_lib.Planner, budgets, profile,
                  prompt_len: int, gen_len: int | None = None,
                  num_sequences: int | None = None, kept: Policy | None = None,
                  generation: GenerationConfig | None = None):
  """The policy to run and its prediction: searched (--policy=auto; for `num_sequences`
  sequences where the run knows how many, see search.search) or hand-given. kept: a resumed
  job's block shape and approximations (job.resumed_policy), the template then (a search keeps
  its block shape). generation: whose head step the search's plans count (default the
  run's)."""
  gen_len = gen_len or rc.generation.gen_len
  template = kept or rc.policy
  if rc.policy_mode == 'auto':
    found = search.search(cfg, profile, budgets, prompt_len=prompt_len, gen_len=gen_len,
                          sizes=planner.sizes, planner=planner, template=template,
                          max_block_seconds=rc.max_block_seconds, num_sequences=num_sequences,
                          head=(generation or rc.generation).head_args(),
                          **search.shape_choices(kept, rc.max_block_size))
    return found.policy, found.prediction
  if profile is None:
    return template, None
  return template, cost_model.predict(cfg, template, profile, planner.sizes,
                                      prompt_len=prompt_len, gen_len=gen_len, planner=planner)


@dataclasses.dataclass
class Setup:
  """What every job starts from: weights, device, budgets, cost-model profile and planner."""

  source: WeightSource
  tokenizer: Tokenizer | None
  device: Any
  compute_dtype: str
  watch: MemoryWatch
  budgets: dict[str, int | None]
  profile: HardwareProfile | None
  planner: plan_lib.Planner

  @property
  def cfg(self) -> config_lib.ModelConfig:
    return self.source.config


def check_paths(rc: RunConfig, report_json: str | None = None) -> None:
  """Every path the user gave has the right kind, and no file the run writes (--output, its
  progress file, --report_json) is another path given or lies in the checkpoint, before any
  work."""
  from flexjax import job as job_lib
  written = {'--output': rc.output, '--report_json': report_json}
  for flag, value in written.items():
    if value:
      job_lib.check_output(value, flag.removeprefix('--'))
  for flag, value in (('offload_dir', rc.offload_dir), ('weights_cache', rc.weights_cache)):
    if value:
      scratch.check_writable(Path(value), f'--{flag}={value!r}')
  if rc.checkpoint and Path(rc.checkpoint).is_file():
    raise FlexjaxError(f'--checkpoint={rc.checkpoint!r} is a file; give the checkpoint folder '
                       '(tools/convert_hf.py writes one)')
  profile = rc.hw_profile if rc.hw_profile and Path(rc.hw_profile).exists() else None
  given = {'--prompt_file': rc.prompt_file, '--input': rc.input, '--hw_profile': profile,
           '--offload_dir': rc.offload_dir, '--weights_cache': rc.weights_cache, **written}
  if rc.input and rc.output:
    given["the output's progress file"] = str(job_lib.progress_path(rc.output))
  where = {name: Path(value).resolve() for name, value in given.items() if value}
  checkpoint = Path(rc.checkpoint).resolve() if rc.checkpoint else None
  for flag, value in written.items():
    if not value:
      continue
    other = next((name for name, path in where.items() if name != flag and path == where[flag]),
                 None)
    if other is not None:
      raise FlexjaxError(f'{flag}={value!r} is also {other}; the run would write over it: give '
                         'another path')
    if checkpoint is not None and checkpoint in where[flag].parents:
      raise FlexjaxError(f'{flag}={value!r} lies in --checkpoint={rc.checkpoint!r}; write '
                         'outside the checkpoint folder')


def use_compile_cache(enabled: bool, cache_dir: str | None = None) -> Path | None:
  """Keeps XLA's executables across runs (jax's persistent compilation cache), bounded to
  COMPILE_CACHE_BYTES, in a folder of this host's under the flexjax cache (`cache_dir`:
  --weights_cache, else stream.default_cache_dir): the policy search and the warm-up of a later
  run of the same model load them instead of compiling. A process setting (the command line's,
  `--compile_cache`): it must come before the process's first compile (jax decides then). Off
  where not `enabled`, or where the folder cannot be written (a run without it compiles as
  before); where the user set jax's own (JAX_COMPILATION_CACHE_DIR), that one is used as set.
  Executables XLA cannot serialize (with oneDNN fusions: float32 prompt steps of
  linear.LIBRARY_ROWS rows or more) are compiled in each run, and jax's warning about each is
  not shown. Returns the folder flexjax chose (None where off or the user's)."""
  import warnings

  import jax
  if not enabled:
    return None
  warnings.filterwarnings('ignore', 'Error writing persistent compilation cache entry',
                          UserWarning)
  if jax.config.jax_compilation_cache_dir:
    return None
  folder = Path(cache_dir or stream.default_cache_dir()) / f'xla-{socket.gethostname()}'
  try:
    scratch.check_writable(folder, str(folder))
  except FlexjaxError:
    return None
  jax.config.update('jax_compilation_cache_dir', str(folder))
  jax.config.update('jax_compilation_cache_max_size', COMPILE_CACHE_BYTES)
  jax.config.update('jax_persistent_cache_min_compile_time_secs', COMPILE_CACHE_MIN_SECONDS)
  return folder


def setup(rc: RunConfig, wrap=None) -> Setup:
  """wrap: a function of the weight source giving the source to run (a pipeline stage's)."""
  import jax

  hardware.include_cpu_platform()  # before jax's first backend use (when run is the first)
  source, tokenizer = load_weights(rc)
  if wrap is not None:
    source = wrap(source)
  device = jax.local_devices()[0]  # this process's own (a distributed run lists all of them)
  hardware.host_memory_kind(device, rc.host_memory)  # refused here, before any work
  compute_dtype = rc.compute_dtype or hardware.default_compute_dtype(device.platform)
  watch = MemoryWatch.start(device)  # the idle process, before anything is planned
  # what killed runs left in the offload folder goes before the free disk is measured
  scratch.sweep(scratch.offload_parent(rc.offload_dir))
  budgets = detected_budgets(rc, device)
  profile = resolve_profile(rc.hw_profile, device, measure_if_missing=False,
                            scratch_dir=rc.offload_dir)
  probe = None
  if profile is None and rc.policy_mode == 'auto':  # measured here, in this run's memory
    probe = hardware.probe_bytes(device.platform)
    plan_lib.check_probe(hardware.runtime_overhead(device.platform, probe=probe),
                         device.platform == 'cpu', budgets)
    profile = measure_profile(device, scratch_dir=rc.offload_dir, progress=rc.progress)
  planner = plan_lib.Planner.for_device(
      source.config, device, storage_dtype=source.dtype, compute_dtype=compute_dtype,
      cache_dtype=rc.cache_dtype,
      overhead=hardware.runtime_overhead(device.platform,
                                         profile if profile and profile.name.startswith(
                                             device.platform) else None, probe=probe))
  return Setup(source, tokenizer, device, compute_dtype, watch, budgets, profile, planner)


def plan_report(rc: RunConfig, st: Setup, policy: Policy, prediction, *, prompt_len: int,
                gen_len: int, generation: GenerationConfig | None = None
                ) -> tuple[dict[str, Any], FlexjaxError | None]:
  """The report's head for a policy's execution plan at the run's largest shapes (with
  --dry_run, whether it fits) and why that plan does not fit its budgets (None if it does). A
  caller that runs refuses on the latter before any weight is read. generation: whose head
  step the plan counts (default the run's; a job's heaviest, job.heaviest_head)."""
  plan = st.planner.run_plan(policy, st.budgets, prompt_len=prompt_len, gen_len=gen_len,
                             **(generation or rc.generation).head_args())
  head = {'model': st.cfg.name, 'policy_mode': rc.policy_mode, 'policy': policy.describe(),
          'hw_profile': st.profile.name if st.profile else None,
          **_prediction_fields(prediction),
          **{f'{tier}_budget_bytes': value for tier, value in st.budgets.items()},
          **{f'planned_{tier}_peak_bytes': value for tier, value in plan.peaks().items()}}
  problem = None
  try:
    plan.check(st.budgets)
  except FlexjaxError as e:
    problem = e
  if rc.dry_run:
    head['fits'] = problem is None
    if problem is not None:
      head['does_not_fit'] = str(problem)
  return head, problem


def engine_for(rc: RunConfig, st: Setup, policy: Policy) -> Engine:
  return Engine(st.source, policy=policy, compute_dtype=st.compute_dtype,
                cache_dtype=rc.cache_dtype, device=st.device, budgets=st.budgets,
                planner=st.planner, offload_dir=rc.offload_dir,
                drop_page_cache=rc.drop_page_cache, weights_cache=rc.weights_cache,
                io_threads=rc.io_threads, host_memory=rc.host_memory,
                progress=progress_lib.enabled(rc.progress))


def run(rc: RunConfig) -> dict[str, Any]:
  """Runs the job; returns the report (also what main prints)."""
  check_paths(rc)
  if rc.input:
    from flexjax import job as job_lib
    return job_lib.run_job(rc)
  st = setup(rc)
  cfg, tokenizer = st.cfg, st.tokenizer
  given = run_prompts(rc, cfg, tokenizer)
  policy, prediction = choose_policy(rc, cfg, st.planner, st.budgets, st.profile, given.length,
                                     num_sequences=given.count)
  head, problem = plan_report(rc, st, policy, prediction, prompt_len=given.length,
                              gen_len=rc.generation.gen_len)
  if rc.dry_run:
    return head
  if problem is not None:
    raise problem
  prompts, texts = given.for_policy(cfg, policy, seed=rc.generation.seed)
  with engine_for(rc, st, policy) as engine:
    result = engine.generate(prompts, rc.generation)
  measured = st.watch.peaks()
  if rc.output:
    write_outputs(rc.output, prompts, texts, result, tokenizer)
  elif rc.prompt_file and tokenizer is not None:
    show_outputs(texts, result, tokenizer)
  return {**head, **report(rc, engine, result, measured)}


def show_outputs(texts, result: GenerationResult, tokenizer: Tokenizer) -> None:
  """Prints each text prompt and what was generated for it (a run without --output)."""
  for text, seq in zip(texts, result.sequences):
    print(f'>>> {text}\n{tokenizer.decode(seq).strip()}\n', flush=True)


def _prediction_fields(prediction: cost_model.Prediction | None) -> dict[str, Any]:
  if prediction is None:
    return {}
  return {'predicted_total_tok_s': round(prediction.throughput, 3),
          'predicted_block_s': round(prediction.prefill_s + prediction.decode_s, 3),
          **{f'predicted_{tier}_peak_bytes': v for tier, v in prediction.peak_bytes.items()}}


def measured_fields(device, measured: dict[str, int]) -> dict[str, Any]:
  """Peaks from the system: the process's RSS on a CPU backend (device and host are one RAM),
  memory_stats()'s peak and the RSS on an accelerator."""
  if device.platform == 'cpu':
    return {'measured_ram_peak_bytes': measured['rss']}
  return {'measured_device_peak_bytes': measured.get('device'),
          'measured_host_peak_bytes': measured['rss']}


def report(rc: RunConfig, engine: Engine, result: GenerationResult,
           measured: dict[str, int]) -> dict[str, Any]:
  """The run's report. Planned peaks are the execution plan's; measured ones come from the
  system: on a CPU backend the process's peak RSS above the idle process ('ram': device and
  host tiers together), on an accelerator memory_stats()'s peak ('device') and the RSS
  ('host')."""
  return {
      'model': engine.config.name,
      'weights': rc.weights,
      'device': f'{engine.device.platform}:{engine.device.device_kind}',
      'weight_dtype': engine.weight_dtype,
      'host_memory': 'pinned' if engine.host_memory else 'pageable',
      'compute_dtype': engine.compute_dtype,
      'cache_dtype': engine.cache_dtype,
      'policy': engine.policy.describe(),
      'num_prompts': result.num_prompts,
      'prompt_len': result.prompt_len,
      'gen_len': result.gen_len,
      'generated_tokens': result.generated_tokens,
      'prefill_s': round(result.prefill_s, 4),
      'decode_s': round(result.decode_s, 4),
      'prefill_tok_s': round(result.prefill_throughput, 3),
      'decode_tok_s': round(result.decode_throughput, 3),
      'total_tok_s': round(result.total_throughput, 3),
      **{f'planned_{tier}_peak_bytes': value
         for tier, value in result.planned_peak_bytes.items()},
      **measured_fields(engine.device, measured),
      'runtime_counted_peak_bytes': result.peak_bytes,
      'disk_weight_bytes': result.disk_weight_bytes,
      'decode_weight_stream_gbps': round(result.decode_weight_stream / 1e9, 3),
      **({'breakdown_s': {phase: {part: round(sec, 4) for part, sec in parts.items()}
                          for phase, parts in result.breakdown.items()}}
         if result.breakdown else {}),
      'weight_layout': (None if engine.layout is None else
                        {'folder': str(engine.layout.folder),
                         'reads': 'O_DIRECT' if engine.layout.direct else 'buffered'}),
  }


def write_outputs(path: str, prompts, texts, result: GenerationResult,
                  tokenizer: Tokenizer | None) -> None:
  """Writes one JSON line per prompt, atomically (the file is whole or untouched)."""
  from flexjax.job import write_atomically
  lines = []
  for i, (ids, text, seq) in enumerate(zip(prompts, texts, result.sequences)):
    record = {'prompt': text, 'prompt_tokens': list(map(int, ids)),
              'output_tokens': seq.tolist()}
    if tokenizer is not None:
      record['output'] = tokenizer.decode(seq)
    record.update(result.logprob_fields(i, len(seq)))
    lines.append(json.dumps(record) + '\n')
  write_atomically(path, ''.join(lines))
