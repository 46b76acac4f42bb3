"""Peer benchmark: FlexGen 0.1.8 (PyTorch, CUDA) run with the same policy as a flexjax Policy.

  python -m tools.peer_flexgen --model=opt-6.7b --prompt_len=512 --gen_len=32 \
      --projected_gen_len=8 --gpu_batch_size=48 --num_gpu_batches=3 --w_gpu_percent=20 \
      --w_cpu_percent=80 --cache_gpu_percent=0 --cache_cpu_percent=100 --act_gpu_percent=0 \
      --act_cpu_percent=100 --cpu_attention --output=bench_results/flexgen.jsonl [--dry_run]

FlexGen is used from its own package, as a user would: `python -m flexgen.flex_opt` in a
subprocess, on dummy weights (`--path _DUMMY_`), reading its benchmark log afterwards. Its
throughputs follow the same paper formulas as tools/bench.py. FlexGen loads the facebook/opt-30b
tokenizer from the Hugging Face hub; GPU machines have no network, so the run gets a private,
offline HF cache holding a stand-in tokenizer (dummy weights make the token ids irrelevant).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import types
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from absl import app, flags

from flexjax import config as config_lib
from flexjax import flags as flags_lib
from flexjax import scratch
from flexjax.errors import FlexjaxError, flags_parser
from flexjax.policy import Policy

MODEL_NAMES: Mapping[str, str] = types.MappingProxyType({
    name: f'facebook/{name}' for name in (
        'opt-125m', 'opt-350m', 'opt-1.3b', 'opt-2.7b', 'opt-6.7b', 'opt-13b', 'opt-30b',
        'opt-66b', 'opt-175b')})

FLEXGEN_VERSION = '0.1.8'
_TOKENIZER_REPO = 'facebook/opt-30b'  # what flexgen.flex_opt.run_flexgen loads
_TEST_PROMPT = 'Paris is the capital city of'  # flexgen.flex_opt.get_test_inputs's prompt
_TEST_PROMPT_TOKENS = 7  # with OPT's tokenizer (and the stand-in): BOS + 6 words
_FLEXGEN_BITS, _FLEXGEN_GROUP = 4, 64  # FlexGen's CLI hard-codes its compression
_MIN_CUT_GEN_LEN = 4  # FlexGen projects decode from the mean of the steps after the first two
_PERCENT_TOLERANCE = 1e-6  # FlexGen's percents are ints; flexjax's floats must be integral


# ---- command -------------------------------------------------------------------------------------
def _integral_percents(policy: Policy) -> list[int]:
  """The six --percent values; refuses a percent that is not an integer."""
  out = []
  for kind in ('w', 'cache', 'act'):
    for tier in ('gpu', 'cpu'):
      name = f'{kind}_{tier}_percent'
      value = getattr(policy, name)
      rounded = round(value)
      if abs(rounded - value) > _PERCENT_TOLERANCE:
        raise FlexjaxError(f'{name}={value:g} is not an integer but FlexGen takes integer '
                           f'percents; use {rounded} (or another whole number)')
      out.append(max(0, rounded))
  return out


def _check_policy(policy: Policy, percents: list[int]) -> None:
  """Refuses what FlexGen cannot express or asserts against at run time."""
  if ((policy.compress_weight or policy.compress_cache)
      and (policy.compress_bits, policy.compress_group_size) != (_FLEXGEN_BITS, _FLEXGEN_GROUP)):
    raise FlexjaxError(f'compress_bits={policy.compress_bits} with compress_group_size='
                       f'{policy.compress_group_size} cannot be expressed: FlexGen compresses with '
                       f'{_FLEXGEN_BITS} bits in groups of {_FLEXGEN_GROUP}; use those')
  if policy.compress_cache and policy.attn_sparsity < 1:
    raise FlexjaxError(f'attn_sparsity={policy.attn_sparsity:g} with compress_cache=True is not '
                       'implemented in FlexGen; set attn_sparsity=1 or compress_cache=False')
  act_gpu, act_cpu = percents[4], percents[5]
  if 100 not in (act_gpu, act_cpu, 100 - act_gpu - act_cpu):
    raise FlexjaxError(f'act_gpu_percent={act_gpu}, act_cpu_percent={act_cpu} split the hidden '
                       'states across tiers, which FlexGen does not implement; put 100% on one')
  cache_gpu = percents[2]
  if policy.cpu_attention and policy.attn_sparsity < 1 and 0 < cache_gpu < 100:
    raise FlexjaxError(f'cache_gpu_percent={cache_gpu} with cpu_attention and attn_sparsity='
                       f'{policy.attn_sparsity:g} hits an unimplemented FlexGen path; use '
                       'cache_gpu_percent 0 or 100, attn_sparsity=1 or cpu_attention=False')


def _check_lengths(model: str, *, prompt_len: int, gen_len: int, cut_gen_len: int | None) -> None:
  if prompt_len < _TEST_PROMPT_TOKENS:
    raise FlexjaxError(f'prompt_len={prompt_len} is shorter than FlexGen\'s '
                       f'{_TEST_PROMPT_TOKENS}-token test prompt; use at least '
                       f'{_TEST_PROMPT_TOKENS}')
  if gen_len < 2:
    raise FlexjaxError(f'gen_len={gen_len} must be >= 2 (decode needs a second token)')
  if cut_gen_len is not None and not _MIN_CUT_GEN_LEN <= cut_gen_len < gen_len:
    raise FlexjaxError(f'cut_gen_len={cut_gen_len} must be in [{_MIN_CUT_GEN_LEN}, gen_len='
                       f'{gen_len}) (FlexGen projects from the decode steps after the first two); '
                       'drop it to measure the whole generation')
  max_positions = config_lib.preset(model).max_positions
  if prompt_len + gen_len - 1 > max_positions:
    raise FlexjaxError(f'prompt_len={prompt_len} plus gen_len={gen_len} needs '
                       f'{prompt_len + gen_len - 1} positions but {model} has {max_positions}; '
                       'shorten one')


def flexgen_command(model: str, policy: Policy, *, prompt_len: int, gen_len: int,
                    cut_gen_len: int | None, offload_dir: str, log_file: str,
                    python: str = sys.executable) -> list[str]:
  """The argv running FlexGen's benchmark of `model` (a flexjax preset) with `policy`.

  Args:
    model: a key of MODEL_NAMES, e.g. 'opt-6.7b'.
    policy: the flexjax policy; its percents must be whole numbers and its compression FlexGen's.
    cut_gen_len: generate only this many tokens and let FlexGen project decode to gen_len.
    offload_dir: FlexGen's disk tier folder; log_file: where FlexGen appends its record.
  Raises:
    FlexjaxError: for a setting FlexGen cannot run, naming it and the fix.
  """
  if model not in MODEL_NAMES:
    raise FlexjaxError(f'model={model!r} has no FlexGen counterpart; choose one of '
                       f'{", ".join(MODEL_NAMES)}')
  percents = _integral_percents(policy)
  _check_policy(policy, percents)
  _check_lengths(model, prompt_len=prompt_len, gen_len=gen_len, cut_gen_len=cut_gen_len)
  cmd = [python, '-m', 'flexgen.flex_opt', '--model', MODEL_NAMES[model], '--path', '_DUMMY_',
         '--offload-dir', str(offload_dir), '--prompt-len', str(prompt_len),
         '--gen-len', str(gen_len)]
  if cut_gen_len is not None:
    cmd += ['--cut-gen-len', str(cut_gen_len)]
  cmd += ['--gpu-batch-size', str(policy.gpu_batch_size),
          '--num-gpu-batches', str(policy.num_gpu_batches),
          '--percent', *map(str, percents),
          '--overlap', str(bool(policy.overlap)),
          '--attn-sparsity', repr(float(policy.attn_sparsity))]
  for flag, on in (('--cpu-cache-compute', policy.cpu_attention),
                   ('--compress-weight', policy.compress_weight),
                   ('--compress-cache', policy.compress_cache)):
    if on:
      cmd.append(flag)
  return cmd + ['--log-file', str(log_file), '--verbose', '1']


# ---- log -----------------------------------------------------------------------------------------
_NUMBER = r'([-+0-9.eEinfaINFA]+)'
# The lines of one record of flexgen.utils.write_benchmark_log, in order (GB = 2**30 there).
_RECORD_LINES = (
    re.compile(rf'peak gpu mem: {_NUMBER} GB\s+projected: (True|False)'),
    re.compile(rf'prefill latency: {_NUMBER} s\s+prefill throughput: {_NUMBER} token/s'),
    re.compile(rf'decode latency: {_NUMBER} s\s+decode throughput: {_NUMBER} token/s'),
    re.compile(rf'total latency: {_NUMBER} s\s+total throughput: {_NUMBER} token/s'),
)


def parse_log(text: str) -> dict[str, Any]:
  """The last complete record of a FlexGen benchmark log (FlexGen appends one per run).

  Returns prefill_s, decode_s, total_s, prefill_tok_s, decode_tok_s, total_tok_s,
  gpu_peak_bytes (int) and projected (bool).
  """
  last, partial = None, None
  for line in text.splitlines():
    line = line.strip()
    for index, pattern in enumerate(_RECORD_LINES):
      match = pattern.fullmatch(line)
      if match is None:
        continue
      if index == 0:
        partial = [match]
      elif partial is not None and len(partial) == index:
        partial.append(match)
        if len(partial) == len(_RECORD_LINES):
          last, partial = partial, None
      else:
        partial = None  # out of order: not a record
      break
  if last is None:
    raise FlexjaxError(f'the FlexGen log ({len(text.splitlines())} lines) has no complete record '
                       '(peak gpu mem, prefill, decode and total latency lines); the run likely '
                       'failed before writing it: see its output')
  peak, prefill, decode, total = last
  try:
    return {
        'prefill_s': float(prefill[1]), 'decode_s': float(decode[1]), 'total_s': float(total[1]),
        'prefill_tok_s': float(prefill[2]), 'decode_tok_s': float(decode[2]),
        'total_tok_s': float(total[2]), 'gpu_peak_bytes': round(float(peak[1]) * 2**30),
        'projected': peak[2] == 'True',
    }
  except (ValueError, OverflowError) as e:
    raise FlexjaxError(f'the FlexGen log\'s last record has a value that is not a number ({e}); '
                       'check the log file') from None


# ---- offline tokenizer ---------------------------------------------------------------------------
def write_tokenizer_cache(hf_home: Path) -> None:
  """Writes a stand-in facebook/opt-30b tokenizer into `hf_home`'s hub cache layout.

  A word-level tokenizer with OPT's special tokens (<pad> 1, </s> 2 as BOS and EOS, <unk> 3) that
  prepends BOS like OPT's; it knows the words of FlexGen's test prompt. Loads with
  AutoTokenizer.from_pretrained(...) under HF_HOME=hf_home and HF_HUB_OFFLINE=1.
  """
  from tokenizers import Tokenizer, models, pre_tokenizers, processors
  specials = ['<s>', '<pad>', '</s>', '<unk>']
  words = list(dict.fromkeys(_TEST_PROMPT.split()))
  vocab = {token: i for i, token in enumerate(specials + words)}
  tokenizer = Tokenizer(models.WordLevel(vocab, unk_token='<unk>'))
  tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
  tokenizer.post_processor = processors.TemplateProcessing(
      single='</s> $A', pair='</s> $A </s> $B', special_tokens=[('</s>', vocab['</s>'])])
  tokenizer.add_special_tokens(specials)
  files = {
      'tokenizer.json': tokenizer.to_str(),
      'tokenizer_config.json': json.dumps({
          'tokenizer_class': 'PreTrainedTokenizerFast', 'pad_token': '<pad>',
          'bos_token': '</s>', 'eos_token': '</s>', 'unk_token': '<unk>',
          'padding_side': 'left'}),
      'config.json': json.dumps({'model_type': 'opt', 'pad_token_id': 1, 'bos_token_id': 2,
                                 'eos_token_id': 2}),
  }
  commit = hashlib.sha1(json.dumps(files, sort_keys=True).encode()).hexdigest()
  repo = Path(hf_home) / 'hub' / f'models--{_TOKENIZER_REPO.replace("/", "--")}'
  snapshot = repo / 'snapshots' / commit
  snapshot.mkdir(parents=True, exist_ok=True)
  for name, content in files.items():
    (snapshot / name).write_text(content)
  (repo / 'refs').mkdir(exist_ok=True)
  (repo / 'refs' / 'main').write_text(commit)  # no newline: the hub reads it verbatim


def hf_offline_env(hf_home: Path, base: Mapping[str, str] | None = None) -> dict[str, str]:
  """`base` (default: os.environ) with the Hugging Face caches pointed at `hf_home`, offline."""
  env = dict(os.environ if base is None else base)
  for name in ('HF_HUB_CACHE', 'HUGGINGFACE_HUB_CACHE', 'TRANSFORMERS_CACHE'):
    env.pop(name, None)  # they would override HF_HOME
  env.update(HF_HOME=str(hf_home), HF_HUB_OFFLINE='1', TRANSFORMERS_OFFLINE='1')
  return env


# ---- running -------------------------------------------------------------------------------------
def check_available() -> None:
  """Raises FlexjaxError with the fix unless FlexGen is installed and a CUDA GPU is visible."""
  if importlib.util.find_spec('flexgen') is None:
    raise FlexjaxError(f'the peer system flexgen is not installed; pip install '
                       f'flexgen=={FLEXGEN_VERSION}')
  try:
    import torch
  except ImportError:
    raise FlexjaxError(f'flexgen needs torch, which is not installed; pip install '
                       f'flexgen=={FLEXGEN_VERSION} (it brings torch)') from None
  if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
    raise FlexjaxError('FlexGen needs a CUDA GPU; run this on a GPU machine')


def _run_checked(cmd: list[str], *, env: Mapping[str, str], cwd: Path,
                 timeout_s: float | None) -> subprocess.CompletedProcess:
  """Runs `cmd` capturing its output; a failure or timeout becomes a one-line FlexjaxError."""
  try:
    done = subprocess.run(cmd, env=dict(env), cwd=cwd, capture_output=True, text=True,
                          timeout=timeout_s, check=False)
  except subprocess.TimeoutExpired:
    raise FlexjaxError(f'FlexGen ran past timeout_s={timeout_s:g}; raise it or shorten the run '
                       '(e.g. a cut generation length)') from None
  if done.returncode != 0:
    lines = [line.strip() for line in (done.stderr or done.stdout or '').splitlines()
             if line.strip()]
    last = lines[-1] if lines else 'no output'
    raise FlexjaxError(f'FlexGen exited with status {done.returncode}: {last} (command: '
                       f'{shlex.join(cmd)})')
  return done


def run_flexgen(model: str, policy: Policy, *, prompt_len: int, gen_len: int,
                projected_gen_len: int | None, offload_dir: str,
                timeout_s: float | None = None) -> dict[str, Any]:
  """Runs FlexGen's benchmark of `model` with `policy` on dummy weights and returns its numbers.

  policy.block_size prompts of prompt_len tokens generate gen_len tokens each; with
  projected_gen_len=K only K are generated and FlexGen projects decode time to gen_len. FlexGen's
  disk tier is a fresh folder inside `offload_dir`, removed afterwards like the other temporary
  files. Returns parse_log's fields plus system, system_version, command, policy, gpu_name and the
  run's shape.
  """
  flexgen_command(model, policy, prompt_len=prompt_len, gen_len=gen_len,
                  cut_gen_len=projected_gen_len, offload_dir=offload_dir, log_file='-')
  check_available()
  if not Path(offload_dir).is_dir():
    raise FlexjaxError(f'offload_dir={offload_dir!r} is not a folder; create it or pass another')
  with tempfile.TemporaryDirectory(prefix='flexgen_run_') as work:
    work = Path(work)
    owned = scratch.claim(offload_dir, 'flexgen_offload_')  # a killed run's: swept by the next
    disk = str(owned.path)
    try:
      write_tokenizer_cache(work / 'hf')
      log_file = work / 'flexgen.log'
      cmd = flexgen_command(model, policy, prompt_len=prompt_len, gen_len=gen_len,
                            cut_gen_len=projected_gen_len, offload_dir=disk,
                            log_file=str(log_file))
      _run_checked(cmd, env=hf_offline_env(work / 'hf'), cwd=work, timeout_s=timeout_s)
      if not log_file.is_file():
        raise FlexjaxError(f'FlexGen exited normally but wrote no log {log_file}; check that '
                           f'flexgen=={FLEXGEN_VERSION} is the installed version')
      parsed = parse_log(log_file.read_text())
    finally:
      owned.release()
  import torch  # after the run, so this process holds no CUDA context while FlexGen measures
  return {
      **parsed, 'system': 'flexgen', 'system_version': importlib.metadata.version('flexgen'),
      'command': cmd, 'policy': policy.describe(), 'policy_fields': dataclasses.asdict(policy),
      'gpu_name': torch.cuda.get_device_name(0), 'model': model,
      'num_prompts': policy.block_size, 'prompt_len': prompt_len, 'gen_len': gen_len,
      'measured_gen_len': projected_gen_len or gen_len,
  }


# ---- command line --------------------------------------------------------------------------------
def define_flags(fv: flags.FlagValues) -> None:
  """The tool's flags (defined by the entry point only, so importing the module is free)."""
  f = {'flag_values': fv}
  flags.DEFINE_string('model', 'opt-6.7b', f'Model: {", ".join(MODEL_NAMES)}.', **f)
  flags.DEFINE_integer('prompt_len', 512, 'Tokens per prompt.', **f)
  flags.DEFINE_integer('gen_len', 32, 'New tokens per prompt (>= 2).', **f)
  flags.DEFINE_integer('projected_gen_len', None, 'Generate only this many tokens (FlexGen\'s '
                       '--cut-gen-len, 4 <= K < gen_len) and project decode time to --gen_len.',
                       **f)
  flags.DEFINE_float('timeout_s', None, 'Give up on FlexGen after this many seconds.', **f)
  flags.DEFINE_string('output', None, 'JSONL file to append the record to.', **f)
  flags_lib.define_policy_flags(fv)  # --dry_run prints FlexGen's command


def main(argv) -> int:
  from tools.benchlib import git_commit, jsonl_appender, timestamp, versions
  del argv
  fv = flags.FLAGS
  try:
    if fv.policy != 'manual':
      raise FlexjaxError(f'--policy={fv.policy} is not supported here; give the policy flags')
    policy = flags_lib.policy_from_flags(fv)
    if fv.dry_run:
      print(shlex.join(flexgen_command(
          fv.model, policy, prompt_len=fv.prompt_len, gen_len=fv.gen_len,
          cut_gen_len=fv.projected_gen_len, offload_dir=str(scratch.offload_parent(fv.offload_dir)),
          log_file='flexgen.log')))
      return 0
    if not fv.output:
      raise FlexjaxError('--output is required to run; e.g. --output=bench_results/flexgen.jsonl')
    record = run_flexgen(fv.model, policy, prompt_len=fv.prompt_len, gen_len=fv.gen_len,
                         projected_gen_len=fv.projected_gen_len,
                         offload_dir=str(scratch.offload_parent(fv.offload_dir)),
                         timeout_s=fv.timeout_s)
    with jsonl_appender(fv.output) as emit:
      emit({'tool': 'peer_flexgen', **record, 'commit': git_commit(), 'versions': versions(),
            'timestamp': timestamp()})
  except FlexjaxError as e:
    print(f'peer_flexgen: error: {e}', file=sys.stderr)
    return 2
  return 0


if __name__ == '__main__':
  define_flags(flags.FLAGS)
  app.run(main, flags_parser=flags_parser())
