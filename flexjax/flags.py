"""Command-line flags (the only module that imports absl.flags) and their conversion to configs."""

from __future__ import annotations

import dataclasses

from absl import flags
from absl import logging as absl_logging

from flexjax.config import DTYPES, PRESETS
from flexjax.diskio import IO_THREADS
from flexjax.engine import GenerationConfig
from flexjax.errors import FlexjaxError
from flexjax.hardware import HOST_MEMORY
from flexjax.policy import PLACEMENTS, Policy
from flexjax.run import RunConfig
from flexjax.stopping import STOP_GRACE_S

def define_flags(fv: flags.FlagValues = flags.FLAGS) -> None:
  """Defines flexjax's flags on `fv`."""
  f = dict(flag_values=fv)
  flags.DEFINE_string('model', 'opt-125m', f'Model preset: {", ".join(PRESETS)}. With '
                      '--weights=checkpoint the checkpoint\'s config is used and, if --model is '
                      'given, checked against it.', **f)
  flags.DEFINE_enum('weights', 'dummy', ['dummy', 'checkpoint'],
                    'dummy: random deterministic weights (benchmarks); checkpoint: --checkpoint.', **f)
  flags.DEFINE_string('checkpoint', None, 'Converted flexjax checkpoint (tools/convert_hf.py).', **f)
  flags.DEFINE_integer('dummy_seed', 0, 'Seed of the dummy weights.', **f)
  flags.DEFINE_enum('dtype', None, list(DTYPES), 'Dtype weights are kept in (default: the '
                    'checkpoint\'s; float16 for dummy weights).', **f)
  flags.DEFINE_enum('compute_dtype', None, list(DTYPES), 'Dtype of the layer math (default: '
                    'float16 on a GPU, float32 on the CPU backend).', **f)
  flags.DEFINE_enum('cache_dtype', None, list(DTYPES), 'KV cache dtype (default: compute).', **f)
  flags.DEFINE_string('prompt_file', None, 'Prompts: .txt (one per line, needs a tokenizer) or '
                      '.jsonl ({"prompt": text} or {"tokens": [ids]} per line). Default: '
                      'synthetic prompts of --prompt_len tokens.', **f)
  flags.DEFINE_bool('chat', False, 'Send each text prompt of --prompt_file as the user\'s message '
                    'through the checkpoint\'s chat template (instruction-tuned models).', **f)
  flags.DEFINE_integer('prompt_len', 128, 'Length of synthetic prompts (BOS included).', **f)
  flags.DEFINE_integer('num_prompts', None, 'Number of synthetic prompts (default: one block, '
                       'gpu_batch_size x num_gpu_batches).', **f)
  flags.DEFINE_integer('gen_len', 32, 'New tokens per prompt.', **f)
  flags.DEFINE_float('temperature', 0.0, 'Sampling temperature; 0 is greedy.', **f)
  flags.DEFINE_float('top_p', 1.0, 'Nucleus sampling mass.', **f)
  flags.DEFINE_integer('seed', 0, 'Sampling seed.', **f)
  flags.DEFINE_bool('stop_at_eos', True, 'Stop a sequence at EOS (pads the rest).', **f)
  flags.DEFINE_bool('logprobs', False, 'Give each new token\'s log-probability under the model '
                    '(before temperature and top-p) in --output\'s lines ("logprobs"; a job\'s '
                    'row may ask with "logprobs": true).', **f)
  flags.DEFINE_integer('top_logprobs', 0, 'Also give each step\'s this many most likely tokens '
                       'with their log-probabilities ("top_logprobs": [[id, logprob], ...] per '
                       'token; a job\'s row may ask with "top_logprobs": k).', **f)
  flags.DEFINE_string('output', None, 'Write generations here as JSON lines (with --input: '
                      'streamed block by block, resumable).', **f)
  flags.DEFINE_string('input', None, 'A batch job: JSONL rows {"id", "prompt" or "tokens", and '
                      'optionally "max_new_tokens", "stop", "temperature", "top_p", "seed", '
                      '"logprobs"}; needs --output. Run again with the same command after an '
                      'interruption to resume.', **f)
  flags.DEFINE_bool('bucket', True, 'Batch a job\'s rows by length so blocks pad little (else '
                    'every block pads to the longest prompt and output).', **f)
  flags.DEFINE_bool('progress', True, 'Progress bars on a terminal (--noprogress: none).', **f)
  flags.DEFINE_string('report_json', None, 'Also write the report as JSON to this file.', **f)
  flags.DEFINE_float('stop_grace_s', None, 'Seconds a run told to stop (SIGTERM, SIGHUP, Ctrl-C) '
                     'may take to unwind before it ends at once, without its clean-up, in one '
                     f'line (default {STOP_GRACE_S:g}); keep it below the kill timeout of '
                     'whatever stops the run.', **f)
  define_policy_flags(fv)


def define_policy_flags(fv: flags.FlagValues = flags.FLAGS) -> None:
  """Flags of the offloading policy (the fields of flexjax.policy.Policy, same names), tier
  budgets and the offload folder; shared by the CLI and the benchmark tools."""
  f = dict(flag_values=fv)
  flags.DEFINE_enum('policy', 'manual', ['manual', 'auto'], 'manual: the policy flags below; '
                    'auto: search the policy with the cost model (the flags below then only fix '
                    'overlap and the approximations).', **f)
  flags.DEFINE_string('hw_profile', None, 'Hardware profile for the cost model: "paper-t4", a '
                      'JSON file from tools/profile_hw.py, or unset: this machine\'s (measured '
                      'once, cached).', **f)
  flags.DEFINE_float('max_block_seconds', None, 'Latency limit of a block for --policy=auto.',
                     **f)
  flags.DEFINE_integer('max_block_size', 1024, 'Largest block (sequences) --policy=auto may '
                       'choose.', **f)
  flags.DEFINE_bool('dry_run', False, 'Print the policy and its prediction; do not run.', **f)
  flags.DEFINE_integer('gpu_batch_size', 8, 'Sequences per GPU batch.', **f)
  flags.DEFINE_integer('num_gpu_batches', 1, 'GPU batches per block (1: row-by-row order).', **f)
  for kind, what in (('w', 'weights'), ('cache', 'KV cache'), ('act', 'hidden states')):
    flags.DEFINE_float(f'{kind}_gpu_percent', 100, f'Percent of the {what} on the device.', **f)
    flags.DEFINE_float(f'{kind}_cpu_percent', 0, f'Percent of the {what} in host RAM (the rest '
                       'of 100 goes to disk).', **f)
  flags.DEFINE_bool('overlap', True, 'Overlap loads and stores with compute (--nooverlap: '
                    'the report gives each phase\'s seconds per part, breakdown_s).', **f)
  flags.DEFINE_bool('cpu_attention', False, 'Decode attention of host/disk cache rows runs on the '
                    'CPU, next to the cache.', **f)
  flags.DEFINE_string('offload_dir', None, 'Parent folder of the run\'s disk tier (removed at '
                      'exit); default: the system temp folder.', **f)
  for tier in ('gpu', 'cpu', 'disk'):
    flags.DEFINE_float(f'{tier}_mem', None, f'Byte budget of the {tier} tier in GiB (default: '
                       'unlimited).', **f)
  flags.DEFINE_bool('drop_page_cache', False, 'Drop offloaded files from the OS page cache after '
                    'each access, so disk reads are real (benchmarks).', **f)
  flags.DEFINE_string('weights_cache', None, 'Folder for the streaming weight layouts of dummy '
                      'weights and read-only checkpoints, and for the compile cache (default: '
                      '$FLEXJAX_CACHE, else ~/.cache/flexjax).', **f)
  flags.DEFINE_bool('compile_cache', True, 'Keep XLA\'s compiled steps across runs (jax\'s '
                    'persistent compilation cache, in xla-HOST under --weights_cache\'s folder, '
                    'at most 2 GiB; JAX_COMPILATION_CACHE_DIR overrides it): a later run of the '
                    'same model searches its policy and warms up without compiling again.', **f)
  flags.DEFINE_integer('io_threads', IO_THREADS, 'Threads reading weights from disk.',
                       lower_bound=1, upper_bound=16, **f)
  flags.DEFINE_enum('host_memory', 'auto', list(HOST_MEMORY), 'Where host-tier weights live: '
                    'pinned host memory, which the device copies by DMA (auto: on an accelerator '
                    'that offers it), or pageable numpy buffers (auto on the CPU backend, where '
                    'host and device share RAM and no copy is made).', **f)
  flags.DEFINE_bool('compress_weight', False, 'Store weight matrices quantized (group-wise).',
                    **f)
  flags.DEFINE_bool('compress_cache', False, 'Store the KV cache quantized (group-wise).', **f)
  flags.DEFINE_integer('compress_bits', 4, 'Bits per quantized value (2, 4 or 8).', **f)
  flags.DEFINE_integer('compress_group_size', 64, 'Values per quantization group.', **f)
  flags.DEFINE_float('attn_sparsity', 1.0, 'Fraction of cached positions decode attention keeps '
                     '(top scores); 1 is dense.', **f)
  flags.DEFINE_enum('placement', 'exact', list(PLACEMENTS), 'How weight percents become tiers: '
                    'exact (each share met to a row; a straddling tensor is split by rows) or '
                    'flexgen (FlexGen\'s rule: whole tensors by their midpoints, per attention '
                    'and MLP, disk first).', **f)


def policy_from_flags(fv: flags.FlagValues = flags.FLAGS) -> Policy:
  return Policy(**{field.name: fv[field.name].value for field in dataclasses.fields(Policy)})


def budgets_from_flags(fv: flags.FlagValues = flags.FLAGS) -> dict[str, int | None]:
  """Tier budgets in bytes from --gpu_mem/--cpu_mem/--disk_mem (GiB); None is unlimited."""
  budgets = {}
  for tier, flag in (('device', 'gpu_mem'), ('host', 'cpu_mem'), ('disk', 'disk_mem')):
    value = fv[flag].value
    if value is not None and value <= 0:
      raise FlexjaxError(f'--{flag}={value} must be a positive number of GiB (omit it for no '
                         'limit)')
    budgets[tier] = None if value is None else int(value * 2**30)
  return budgets


def stop_grace_from_flags(fv: flags.FlagValues = flags.FLAGS,
                          default: float = STOP_GRACE_S) -> float:
  """--stop_grace_s, checked (`default` where not given); raises FlexjaxError naming it."""
  value = fv.stop_grace_s
  if value is None:
    return default
  if not 0 < value < float('inf'):
    raise FlexjaxError(f'--stop_grace_s={value:g} must be a positive number of seconds, e.g. '
                       f'{STOP_GRACE_S:g}')
  return value


def use_stop_grace(stop, fv: flags.FlagValues = flags.FLAGS) -> None:
  """Checks --stop_grace_s (raises FlexjaxError naming it) and gives it to `stop`, a
  flexjax.stopping.StopWatch whose own grace time is the default; with no watch, only checks."""
  grace_s = stop_grace_from_flags(fv, default=stop.grace_s if stop else STOP_GRACE_S)
  if stop is not None:
    stop.grace_s = grace_s


def run_config_from_flags(fv: flags.FlagValues = flags.FLAGS) -> RunConfig:
  """Validates parsed flags into a RunConfig; raises FlexjaxError naming the bad value."""
  for name in ('prompt_len', 'gen_len', 'gpu_batch_size', 'num_gpu_batches', 'num_prompts',
               'max_block_size'):
    value = fv[name].value
    if value is not None and value <= 0:
      raise FlexjaxError(f'--{name}={value} must be a positive integer')
  if fv.max_block_seconds is not None and fv.max_block_seconds <= 0:
    raise FlexjaxError(f'--max_block_seconds={fv.max_block_seconds} must be a positive number '
                       'of seconds (omit it for no limit)')
  if fv.dummy_seed < 0:
    raise FlexjaxError(f'--dummy_seed={fv.dummy_seed} must be >= 0')
  if fv.input and fv.prompt_file:
    raise FlexjaxError(f'--input={fv.input!r} and --prompt_file={fv.prompt_file!r} are both '
                       'given; a job reads its prompts from --input alone: drop --prompt_file')
  if fv.chat and not fv.prompt_file:
    raise FlexjaxError('--chat applies to the text prompts of --prompt_file; give one, or drop '
                       '--chat')
  if fv.weights == 'checkpoint' and not fv.checkpoint:
    raise FlexjaxError('--weights=checkpoint needs --checkpoint=PATH (a converted checkpoint)')
  if fv.weights == 'dummy' and fv.checkpoint:
    raise FlexjaxError(f'--checkpoint={fv.checkpoint!r} is given with --weights=dummy; pass '
                       '--weights=checkpoint to use it')
  budgets = budgets_from_flags(fv)
  gen = GenerationConfig(gen_len=fv.gen_len, temperature=fv.temperature, top_p=fv.top_p,
                         seed=fv.seed, stop_at_eos=fv.stop_at_eos, logprobs=fv.logprobs,
                         top_logprobs=fv.top_logprobs)
  policy = policy_from_flags(fv)
  return RunConfig(
      model=fv.model if (fv.weights == 'dummy' or fv['model'].present) else None,
      weights=fv.weights, checkpoint=fv.checkpoint, dummy_seed=fv.dummy_seed,
      dtype=fv.dtype, compute_dtype=fv.compute_dtype, cache_dtype=fv.cache_dtype,
      prompt_file=fv.prompt_file, chat=fv.chat, prompt_len=fv.prompt_len,
      num_prompts=fv.num_prompts, generation=gen, policy=policy, policy_mode=fv.policy,
      hw_profile=fv.hw_profile, max_block_seconds=fv.max_block_seconds,
      max_block_size=fv.max_block_size, dry_run=fv.dry_run,
      budgets=budgets, offload_dir=fv.offload_dir, drop_page_cache=fv.drop_page_cache,
      weights_cache=fv.weights_cache, io_threads=fv.io_threads,
      host_memory=fv.host_memory, output=fv.output,
      input=fv.input, bucket=fv.bucket, progress=fv.progress)


def quiet_library_logs(fv: flags.FlagValues = flags.FLAGS) -> None:
  """Hides libraries' INFO and WARNING logs (orbax, jax) unless the user set --verbosity: what
  goes wrong reaches the user as flexjax's own one-line error."""
  if not fv['verbosity'].present:
    absl_logging.set_verbosity(absl_logging.ERROR)
