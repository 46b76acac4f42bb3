"""Batch jobs: a JSONL file of rows in, a JSONL file of generations out, durably and resumably.

A row is a JSON object: `id` (default: its line number), `prompt` (text) or `tokens` (ids), and
optionally `max_new_tokens`, `stop` (a string or a list), `temperature`, `top_p`, `seed`,
`logprobs` (true: the output line gives each new token's log-probability) and `top_logprobs` (k:
also each step's k most likely tokens with theirs). Rows
are bucketed by length into blocks of the policy's block size, so that a block pads its prompts
to a few distinct lengths only (`--nobucket`: every block pads to the longest prompt and the
longest output, as FlexGen does).

Durability: the output is written one block at a time (lines, flush, fsync), then a progress
file beside it (`<output>.progress`) records the blocks done and the output's length, atomically.
A job killed at any moment and started again with the same command cuts the output back to the
recorded length and runs the blocks not recorded: no row is lost or written twice, and the blocks
are the same as in an uninterrupted run, so greedy outputs are identical. The progress file also
keeps the policies the job ran with, one per pipeline stage for each number of stages it ran on
(one process: one stage): a run on a layout the job has used takes its recorded policies again
(a searched policy is not searched again); a run on another layout keeps the block shape and the
approximations (what the blocks and the outputs depend on) and chooses only its placement. When
the job is complete the progress file is removed. While a run writes the output it holds an
exclusive lock on the file (the kernel drops it when the process dies, however it dies): a second
run of the same job started meanwhile (another terminal, a scheduler's retry) is refused in one
line instead of writing the same file at once.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Protocol, Sequence, TextIO

import jax
import numpy as np

from flexjax import memwatch
from flexjax import progress as progress_lib
from flexjax import scratch
from flexjax.config import ModelConfig
from flexjax.engine import Engine, GenerationConfig
from flexjax.errors import FlexjaxError
from flexjax.policy import Policy
from flexjax.tokenizer import Tokenizer

FORMAT = 'flexjax-job-v1'
PROGRESS_SUFFIX = '.progress'  # the progress file: the output's path and this
FIELDS = ('id', 'prompt', 'tokens', 'max_new_tokens', 'stop', 'temperature', 'top_p', 'seed',
          'logprobs', 'top_logprobs')


@dataclasses.dataclass(frozen=True)
class Row:
  """A valid input row, tokenized."""

  line: int  # 1-based line of the input file
  id: Any
  tokens: tuple[int, ...]
  max_new_tokens: int
  stop: tuple[str, ...]
  temperature: float
  top_p: float
  seed: int
  logprobs: bool = False  # its output gives each new token's log-probability
  top_logprobs: int = 0  # and each step's this many most likely tokens with theirs


@dataclasses.dataclass(frozen=True)
class BadRow:
  line: int
  id: Any
  error: str


@dataclasses.dataclass(frozen=True)
class Block:
  """Rows generated together: prompts padded to pad_to, gen_len decode steps at most."""

  number: int
  rows: tuple[Row, ...]
  pad_to: int
  gen_len: int

  @property
  def sampling(self) -> tuple[float, float]:
    return self.rows[0].temperature, self.rows[0].top_p

  @property
  def logprobs(self) -> tuple[bool, int]:
    """(whether a row of the block asks for its tokens' log-probabilities, the most top
    tokens' a row asks for)."""
    return (any(row.logprobs for row in self.rows),
            max(row.top_logprobs for row in self.rows))


# ---- reading -------------------------------------------------------------------------------------
def progress_path(output: str | os.PathLike) -> Path:
  """The progress file of the job writing `output`."""
  output = Path(output)
  return output.with_name(output.name + PROGRESS_SUFFIX)


def read_text(path: str, flag: str, kind: str = 'a JSONL file (one JSON object per line)') -> str:
  """A UTF-8 text file's contents; one-line errors for a folder, a missing or binary file.
  kind: what the flag takes, as its errors name it."""
  p = Path(path)
  if p.is_dir():
    raise FlexjaxError(f'--{flag}={path!r} is a folder; give {kind}')
  if not p.is_file():
    raise FlexjaxError(f'--{flag}={path!r} does not exist; give {kind}')
  data = p.read_bytes()
  try:
    return data.decode('utf-8')
  except UnicodeDecodeError as e:
    line = data[:e.start].count(b'\n') + 1
    raise FlexjaxError(f'--{flag}={path!r} is not UTF-8 text (byte {e.start}, line {line}); '
                       'give a text file saved as UTF-8') from None


def parse_rows(text: str, cfg: ModelConfig, tokenizer: Tokenizer | None,
               defaults: GenerationConfig) -> tuple[list[Row], list[BadRow]]:
  """Valid rows and bad ones (each with its error); blank lines are skipped."""
  rows, bad, seen = [], [], {}
  for line, raw in enumerate(text.splitlines(), 1):
    if not raw.strip():
      continue
    try:
      record = json.loads(raw)
    except json.JSONDecodeError as e:
      bad.append(BadRow(line, line, f'not JSON ({e.msg}, column {e.colno})'))
      continue
    row_id = record.get('id', line) if isinstance(record, dict) else line
    if not isinstance(row_id, (str, int)) or isinstance(row_id, bool):
      bad.append(BadRow(line, line, f'id {row_id!r} must be a string or an integer'))
      continue
    if row_id in seen:
      bad.append(BadRow(line, row_id, f'id {row_id!r} repeats line {seen[row_id]}; ids must be '
                                      'unique'))
      continue
    seen[row_id] = line
    try:
      rows.append(_row(record, line, row_id, cfg, tokenizer, defaults))
    except FlexjaxError as e:
      bad.append(BadRow(line, row_id, str(e)))
  return rows, bad


def _row(record, line: int, row_id, cfg: ModelConfig, tokenizer: Tokenizer | None,
         defaults: GenerationConfig) -> Row:
  if not isinstance(record, dict):
    raise FlexjaxError('a row must be a JSON object with "prompt" or "tokens"')
  unknown = sorted(set(record) - set(FIELDS))
  if unknown:
    raise FlexjaxError(f'unknown field {unknown[0]!r}; the fields are {", ".join(FIELDS)}')
  if ('prompt' in record) == ('tokens' in record):
    raise FlexjaxError('a row needs exactly one of "prompt" (text) and "tokens" (ids)')
  stop = record.get('stop', [])
  stop = [stop] if isinstance(stop, str) else stop
  if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
    raise FlexjaxError('"stop" must be a non-empty string or a list of them')
  if (stop or 'prompt' in record) and tokenizer is None:
    raise FlexjaxError('text ("prompt" or "stop") needs a tokenizer, and these weights have none; '
                       'give "tokens" ids, or a checkpoint converted with its tokenizer files')
  if 'prompt' in record:
    if not isinstance(record['prompt'], str) or not record['prompt'].strip():
      raise FlexjaxError('"prompt" must be a non-empty string')
    tokens = tokenizer.encode(record['prompt'])
  else:
    tokens = record['tokens']
    if (not isinstance(tokens, list) or not tokens or not all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < cfg.vocab_size
        for t in tokens)):
      raise FlexjaxError(f'"tokens" must be a non-empty list of ids in [0, {cfg.vocab_size})')
  new = _number(record, 'max_new_tokens', defaults.gen_len, int)
  if new < 1:
    raise FlexjaxError(f'"max_new_tokens" is {new}; it must be >= 1')
  if len(tokens) + new - 1 > cfg.max_positions:
    raise FlexjaxError(f'the prompt ({len(tokens)} tokens) plus {new} new tokens needs '
                       f'{len(tokens) + new - 1} positions but {cfg.name} has '
                       f'{cfg.max_positions}; shorten the prompt or "max_new_tokens"')
  temperature = _number(record, 'temperature', defaults.temperature, float)
  top_p = _number(record, 'top_p', defaults.top_p, float)
  seed = record.get('seed')
  if seed is None:
    seed = derived_seed(defaults.seed, row_id)
  elif not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**32:
    raise FlexjaxError(f'"seed" is {seed!r}; it must be an integer in [0, 2**32)')
  logprobs = record.get('logprobs', defaults.logprobs)
  if not isinstance(logprobs, bool):
    raise FlexjaxError(f'"logprobs" is {logprobs!r}; it must be true or false')
  top = _number(record, 'top_logprobs', defaults.top_logprobs, int)
  try:
    GenerationConfig(gen_len=new, temperature=temperature, top_p=top_p, top_logprobs=top)
  except FlexjaxError as e:
    raise FlexjaxError(str(e).replace('temperature=', '"temperature" ').replace(
        'top_p=', '"top_p" ').replace('top_logprobs=', '"top_logprobs" ')) from None
  if top > cfg.vocab_size:
    raise FlexjaxError(f'"top_logprobs" is {top}; {cfg.name} has {cfg.vocab_size} tokens')
  return Row(line, row_id, tuple(tokens), new, tuple(stop), temperature, top_p, seed,
             logprobs or top > 0, top)


def _number(record: dict, key: str, default, kind):
  value = record.get(key, default)
  if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int):
    raise FlexjaxError(f'"{key}" is {value!r}; it must be ' +
                       ('an integer, written without a decimal point or exponent'
                        if kind is int else 'a number'))
  return kind(value)


def derived_seed(seed: int, row_id) -> int:
  """A row's sampling seed from the job's --seed and its id (the same wherever it is batched)."""
  digest = hashlib.sha256(json.dumps([seed, row_id]).encode()).digest()
  return int.from_bytes(digest[:4], 'little')


# ---- blocks --------------------------------------------------------------------------------------
def bucket_length(n: int) -> int:
  """n rounded up to one of few lengths: a multiple of 8 up to 64, then of 1/8 of the power of
  two below n (at most about 1/8 of padding, and a handful of distinct shapes per octave)."""
  step = max(8, 2 ** max(0, math.floor(math.log2(max(n, 1))) - 3))
  return -(-n // step) * step


def plan_blocks(rows: Sequence[Row], block_size: int, *, bucket: bool,
                max_positions: int) -> list[Block]:
  """Rows grouped into blocks. Rows of one block share temperature and top_p. Bucketed: sorted by
  prompt and output length, longest first, each block padded to the bucket of its longest; else
  in input order, every block padded to the job's longest prompt and output.

  Longest first: the job is planned at its largest block, which then runs on the heap as the
  engine left it, and the smaller blocks after it reuse what it freed (run shortest first, an
  opt-125m job measured 0.89-0.98 GiB of peak RSS against a 0.96 GiB plan; longest first
  0.81-0.86)."""
  groups: dict[tuple[float, float], list[Row]] = {}
  for row in rows:
    groups.setdefault((row.temperature, row.top_p), []).append(row)
  blocks = []
  for key in sorted(groups):
    group = groups[key]
    if bucket:
      group = sorted(group, key=lambda r: (-bucket_length(len(r.tokens)),
                                           -bucket_length(r.max_new_tokens), r.line))
    longest = max(len(r.tokens) for r in group)
    most = max(r.max_new_tokens for r in group)
    for start in range(0, len(group), block_size):
      chunk = tuple(group[start:start + block_size])
      if bucket:
        longest = max(len(r.tokens) for r in chunk)
        most = max(r.max_new_tokens for r in chunk)
      pad_to, gen_len = _shape(longest, most, bucket, max_positions)
      blocks.append(Block(len(blocks), chunk, pad_to, gen_len))
  return blocks


def _shape(longest: int, most: int, bucket: bool, max_positions: int) -> tuple[int, int]:
  """A block's padded prompt length and decode steps; bucketed lengths where they fit the
  model's positions (a row's own lengths always do)."""
  if not bucket:
    return longest, most
  pad_to, gen_len = bucket_length(longest), bucket_length(most)
  if pad_to + gen_len - 1 > max_positions:
    gen_len = max(most, max_positions + 1 - pad_to)
  if pad_to + gen_len - 1 > max_positions:
    pad_to = max(longest, max_positions + 1 - gen_len)
  return pad_to, gen_len


def heaviest_head(rows: Sequence[Row], generation: GenerationConfig) -> GenerationConfig:
  """`generation` with the head step of the rows' blocks that needs the most memory, which the
  job's plan counts: sampling where a row samples (with the lowest top-p of those that do),
  log-probabilities where a row asks (the most top tokens any asks for)."""
  sampled = [row for row in rows if row.temperature > 0]
  return dataclasses.replace(
      generation, temperature=sampled[0].temperature if sampled else 0.0,
      top_p=min((row.top_p for row in sampled), default=1.0),
      logprobs=any(row.logprobs for row in rows),
      top_logprobs=max((row.top_logprobs for row in rows), default=0))


def largest_shape(rows: Sequence[Row], *, bucket: bool,
                  max_positions: int) -> tuple[int, int]:
  """A prompt length and output length no block of these rows exceeds (for the plan)."""
  longest = max(len(r.tokens) for r in rows)
  most = max(r.max_new_tokens for r in rows)
  return _shape(longest, most, bucket, max_positions)


# ---- durable output ------------------------------------------------------------------------------
def check_output(path: str, flag: str = 'output') -> Path:
  """An output file given as --`flag`, checked before any work (`scratch.check_output_file`)."""
  return scratch.check_output_file(path, f'--{flag}={path!r}')


def write_atomically(path: str | os.PathLike, text: str) -> None:
  """Writes a file whole or not at all: a temporary file in the same folder, synced, renamed.
  A failed write (a full disk) is a one-line error; the file is left as it was."""
  try:
    scratch.replace_file(Path(path).absolute(), text)
  except OSError as e:
    raise FlexjaxError(f'cannot write {str(path)!r} ({e.strerror}); it was left as it was: free '
                       'space there or choose another path') from None


class JobOutput:
  """The output file and its progress file: blocks appended durably, resumable."""

  def __init__(self, path: str, job: str):
    self.path = check_output(path)
    self.marker = progress_path(self.path)
    self.job = job
    self.done: set[int] = set()
    self.policies: dict[str, list[dict]] = {}  # number of stages -> each stage's policy
    self.rows = 0
    self._bytes = 0
    self._file = None
    self._lock: int | None = None  # the claimed output's descriptor holding its lock
    self._made = False  # claim() made the file
    self._made_folders: list[Path] = []  # and these folders for it, deepest first
    self._opened = False  # open() started writing: the file is the job's from then on

  def claim(self) -> None:
    """Takes the output for this run: an exclusive lock on the file (made, empty, where it is
    missing), held until release(); refused in one line while another live process holds it.
    Writes nothing into the file; one this run made and never wrote is removed on release."""
    try:
      self._made_folders = [p for p in (self.path.parent, *self.path.parent.parents)
                            if not p.exists()]
      self.path.parent.mkdir(parents=True, exist_ok=True)
      while self._lock is None:
        try:
          fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
          made = True
        except FileExistsError:
          try:
            fd = os.open(self.path, os.O_RDWR | os.O_CLOEXEC)
          except FileNotFoundError:  # removed in between by the run releasing it: again
            continue
          made = False
        try:
          free = scratch.try_lock(fd)
        except OSError:
          os.close(fd)
          raise
        if not free:
          os.close(fd)
          raise FlexjaxError(
              f'--output={str(self.path)!r} is being written by another flexjax run that is '
              'still going; wait for it to end (or stop it), or choose another --output')
        if _same_file(fd, self.path):  # not a file the last holder removed as it let go
          self._lock, self._made = fd, made
        else:
          os.close(fd)
    except OSError as e:
      raise self._failed(e) from None

  def resume(self) -> bool:
    """Reads the progress of an interrupted run of this job; False when starting afresh.
    Refuses to touch an output that is not an interrupted run of the same job (an empty file
    without a progress file holds nothing to lose: it starts afresh)."""
    if not self.marker.exists():
      if self.path.exists() and self.path.stat().st_size:
        raise FlexjaxError(f'--output={str(self.path)!r} already exists; remove it or choose '
                           'another path (it is never overwritten)')
      return False
    try:
      state = json.loads(self.marker.read_text())
      assert state['format'] == FORMAT
      done, size, rows = set(state['done']), int(state['bytes']), int(state['rows'])
    except (OSError, ValueError, KeyError, TypeError, AssertionError):
      raise FlexjaxError(f'{str(self.marker)!r} is not a flexjax job progress file; remove it '
                         'and the output to start again') from None
    if state['job'] != self.job:
      raise FlexjaxError(f'--output={str(self.path)!r} holds an interrupted run of another job '
                         '(its input or generation flags differ); rerun that command to finish '
                         'it, or choose another --output')
    have = self.path.stat().st_size if self.path.exists() else 0
    if have < size:
      raise FlexjaxError(f'--output={str(self.path)!r} is shorter ({have} bytes) than its '
                         f'progress file records ({size}); it was changed outside the job: '
                         'remove both to start again')
    self.done, self._bytes, self.rows = done, size, rows
    self.policies = state.get('policies') or (
        {'1': [state['policy']]} if state.get('policy') else {})  # an earlier version's file
    return True

  def open(self, policies: Sequence[Policy]) -> None:
    """Starts writing: records the stages' policies (where the job has not run on as many
    stages before), cuts off what an interrupted block left after the last recorded one."""
    self._opened = True
    try:
      if str(len(policies)) not in self.policies:
        self.policies[str(len(policies))] = [dataclasses.asdict(p) for p in policies]
        self._save_marker()
      os.ftruncate(self._lock, self._bytes)  # the claimed descriptor: the file it locked
      self._file = os.fdopen(os.dup(self._lock), 'ab')  # closed, the lock stays with _lock
    except OSError as e:
      raise self._failed(e) from None

  def write_block(self, number: int, records: Iterable[dict]) -> None:
    """Appends a block's lines and syncs them, then records it in the progress file. A failed
    write (a full disk) is a one-line error; what it left after the last recorded block is cut
    off when the job is resumed."""
    data = b''.join(json.dumps(r, ensure_ascii=False).encode() + b'\n' for r in records)
    try:
      self._file.write(data)
      self._file.flush()
      os.fsync(self._file.fileno())
      self._bytes += len(data)
      self.rows += data.count(b'\n')
      self.done.add(number)
      self._save_marker()
    except OSError as e:
      raise self._failed(e) from None

  def _failed(self, error: OSError) -> FlexjaxError:
    """One line for a failed claim or write; what to do depends on why (a full disk or a file
    size limit, or anything else: permissions, a read-only or failing disk)."""
    if error.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
      fix = 'free space there'
    else:
      fix = 'make it writable there (or choose another --output)'
    return FlexjaxError(
        f'writing --output={str(self.path)!r} failed ({error.strerror}); {fix} and run the same '
        'command again: the job resumes after its last complete block')

  def finish(self) -> None:
    """The job is complete: the progress file goes (the output still claimed)."""
    self.close()
    self.marker.unlink(missing_ok=True)
    _sync_folder(self.path.parent)

  def close(self) -> None:
    """Stops writing (the output stays claimed)."""
    if self._file is not None:
      try:
        self._file.close()
      except OSError:  # a failed write's buffered tail: cut off when the job is resumed
        pass
      self._file = None

  def release(self) -> None:
    """Stops writing and lets the output go: a file claim() made and nothing wrote is
    removed first, with the folders made for it where still empty (a refused run leaves no
    empty output behind)."""
    self.close()
    if self._lock is not None:
      if self._made and not self._opened:
        self.path.unlink(missing_ok=True)
        for folder in self._made_folders:
          try:
            folder.rmdir()
          except OSError:  # holds something now (another run's files)
            break
      os.close(self._lock)
      self._lock = None

  def _save_marker(self) -> None:
    state = {'format': FORMAT, 'job': self.job, 'policies': self.policies, 'bytes': self._bytes,
             'rows': self.rows, 'done': sorted(self.done)}
    scratch.replace_file(self.marker, json.dumps(state) + '\n')
    _sync_folder(self.path.parent)


# What a job keeps when it runs on another number of stages: its blocks and its outputs depend on
# these; the rest (the placement, the schedule's overlap) is chosen again.
KEPT_FIELDS = ('gpu_batch_size', 'num_gpu_batches', 'compress_weight', 'compress_cache',
               'compress_bits', 'compress_group_size', 'attn_sparsity')


def resumed_policy(policies: dict[str, list[dict]], *, stages: int, stage: int,
                   template: Policy) -> tuple[Policy | None, bool]:
  """What a run of a job on `stages` stages starts from, for its stage `stage`:
  (policy, final). The policy this layout recorded: final. Where the job ran on another layout
  only: `template` with that run's KEPT_FIELDS, its placement still to choose for that block
  shape (not final). A fresh job: (None, False)."""
  if str(stages) in policies:
    return Policy(**policies[str(stages)][stage]), True
  if not policies:
    return None, False
  earlier = next(iter(policies.values()))[0]
  return dataclasses.replace(template, **{k: earlier[k] for k in KEPT_FIELDS}), False


def _same_file(fd: int, path: Path) -> bool:
  """Whether the open descriptor `fd` is the file at `path` now."""
  try:
    here = os.stat(path)
  except FileNotFoundError:
    return False
  mine = os.fstat(fd)
  return (mine.st_dev, mine.st_ino) == (here.st_dev, here.st_ino)


def _sync_folder(folder: Path) -> None:
  fd = os.open(folder, os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


def job_fingerprint(input_text: str, **settings) -> str:
  """What makes two runs the same job: the input and every setting that changes its outputs."""
  h = hashlib.sha256(input_text.encode())
  h.update(json.dumps(settings, sort_keys=True, default=str).encode())
  return h.hexdigest()


# ---- running -------------------------------------------------------------------------------------
@dataclasses.dataclass
class Tally:
  """Tokens of the blocks run, useful and padded (the paper's Table 25 counts), and time."""

  rows: int = 0
  useful: int = 0  # prompt tokens + new tokens kept
  padded: int = 0  # padded prompt tokens + decode steps, over every slot of a block
  generated: int = 0
  seconds: float = 0.0


def run_blocks(engine: Engine, blocks: Sequence[Block], done: set[int],
               write: Callable[[int, list[dict]], None], *, tokenizer: Tokenizer | None,
               stop_at_eos: bool, show_progress: bool, progress_stream=None) -> Tally:
  """Generates the blocks not in `done`, handing each block's records to write(block number,
  records) as it completes (JobOutput.write_block: durably); the bar on progress_stream
  (default stderr)."""
  todo = [b for b in blocks if b.number not in done]
  tally = Tally()
  eos = engine.config.eos_token_id
  slots = engine.policy.block_size
  with progress_lib.bar(sum(len(b.rows) for b in blocks), 'generating', unit='row',
                        show=show_progress, stream=progress_stream) as bar:
    bar.update(sum(len(b.rows) for b in blocks if b.number in done))
    shape = None
    for block in todo:
      if shape is not None and (block.pad_to, block.gen_len) != shape:
        # The plan counts one shape's executables: the last shape's go before the next compiles.
        jax.clear_caches()
      shape = (block.pad_to, block.gen_len)
      temperature, top_p = block.sampling
      gen = GenerationConfig(gen_len=block.gen_len, temperature=temperature, top_p=top_p,
                             stop_at_eos=stop_at_eos, logprobs=block.logprobs[0],
                             top_logprobs=block.logprobs[1])
      start = time.perf_counter()
      result = engine.generate([list(r.tokens) for r in block.rows], gen,
                               seeds=[r.seed for r in block.rows],
                               limits=[r.max_new_tokens for r in block.rows],
                               pad_to=block.pad_to)
      records = [_record(row, seq, tokenizer, eos,
                         lambda n, i=i, row=row: result.logprob_fields(
                             i, n, chosen=row.logprobs, top=row.top_logprobs))
                 for i, (row, seq) in enumerate(zip(block.rows, result.sequences))]
      write(block.number, records)
      memwatch.return_free_memory()  # the next block's buffers start from a trimmed heap
      tally.seconds += time.perf_counter() - start
      tally.rows += len(block.rows)
      tally.generated += result.generated_tokens
      tally.useful += sum(len(r.tokens) + len(rec['output_tokens'])
                          for r, rec in zip(block.rows, records))
      decode_steps = result.generated_tokens // len(block.rows)
      tally.padded += slots * (block.pad_to + decode_steps)
      bar.update(len(block.rows))
      bar.set_postfix_str(f'{tally.generated / tally.seconds:.1f} tok/s')
  return tally


def _record(row: Row, seq: np.ndarray, tokenizer: Tokenizer | None, eos: int,
            logprobs: Callable[[int], dict]) -> dict:
  """An output line: the row's id and line, its new tokens (cut at a stop string) and text,
  and logprobs(number of tokens kept): the log-probabilities the row asks for."""
  ids = [int(t) for t in seq[:row.max_new_tokens]]
  reason = 'eos' if ids and ids[-1] == eos else 'length'
  record = {'id': row.id, 'line': row.line, 'prompt_tokens': len(row.tokens)}
  if tokenizer is not None:
    text = tokenizer.decode(ids)
    hits = [(text.find(s), s) for s in row.stop if s in text]
    if hits:
      cut, stop = min(hits)
      ids, text, reason = _tokens_through(ids, tokenizer, stop), text[:cut], 'stop'
    record['output'] = text
  record.update(output_tokens=ids, finish_reason=reason, error=None)
  record.update(logprobs(len(ids)))
  return record


def _tokens_through(ids: list[int], tokenizer: Tokenizer, stop: str) -> list[int]:
  """The shortest prefix of ids whose text contains the stop string."""
  for k in range(1, len(ids) + 1):
    if stop in tokenizer.decode(ids[:k]):
      return ids[:k]
  return ids


def bad_record(row: BadRow) -> dict:
  return {'id': row.id, 'line': row.line, 'output_tokens': [], 'finish_reason': None,
          'error': row.error}


def padding_report(rows: Sequence[Row], block_size: int, max_positions: int,
                   tally: Tally) -> dict[str, Any]:
  """Useful and padded tokens (Table 25's counts) measured over the blocks this run generated,
  and the efficiency of the job's blocks bucketed and not, counting every row at its full
  max_new_tokens (the same rows both ways, whichever way this run batched them)."""
  report = {'useful_tokens': tally.useful, 'padded_tokens': tally.padded,
            'padding_efficiency': round(tally.useful / tally.padded, 4) if tally.padded else None,
            'actual_tok_s': round(tally.useful / tally.seconds, 3) if tally.seconds else None,
            'padded_tok_s': round(tally.padded / tally.seconds, 3) if tally.seconds else None}
  if rows:
    useful = sum(len(r.tokens) + r.max_new_tokens for r in rows)
    report['padding_efficiency_full_length'] = {
        way: round(useful / sum(block_size * (b.pad_to + b.gen_len) for b in plan_blocks(
            rows, block_size, bucket=way == 'bucketed', max_positions=max_positions)), 4)
        for way in ('bucketed', 'unbucketed')}
  return report


def read_input(rc) -> str:
  """The job's input text, refused with its --output missing."""
  text = read_text(rc.input, 'input')
  if not rc.output:
    raise FlexjaxError(f'--input={rc.input!r} needs --output=FILE.jsonl for the generations')
  return text


class Place(Protocol):
  """Where a job runs (run_job_at): one process alone (_Alone), or one stage of a pipeline
  (stage_run), whose stages read the same rows and run the same blocks."""

  rc: Any
  st: Any  # run.Setup
  source: Any  # the whole model's weight source
  stages: int  # the pipeline's (1: one process)
  stage: int  # this process's
  owns_output: bool  # this process writes the output and its progress file
  progress_stream: TextIO | None  # where the bar shows; None: nowhere

  def same_job(self, job: str) -> None:
    """Refuses a job that differs from the other stages'."""

  def agree(self, error: FlexjaxError | None, what: str) -> None:
    """Raises `error`, or another stage's failure (`what` it could not do)."""

  def from_owner(self, value):
    """The output owner's `value`, on every stage."""

  def plan(self, policy: Policy | None, *, final: bool, prompt_len: int, gen_len: int,
           num_sequences: int, generation: GenerationConfig) -> tuple[Policy, dict]:
    """The policy to run (final: `policy` as resumed; else chosen, keeping its block shape and
    approximations where given) and the report's head; a plan that does not fit is raised
    unless a dry run. generation: whose head step the plan counts (heaviest_head)."""

  def policies(self, policy: Policy) -> list[Policy]:
    """Every stage's policy, as the progress file records them."""

  def engine(self, policy: Policy):
    """The engine (a context manager) running this process's layers."""

  def report(self, report: dict, *, ran: bool) -> dict | None:
    """The job's report from this process (None where another process reports)."""


@dataclasses.dataclass
class _Alone:
  """A job in one process."""

  rc: Any
  st: Any
  stages = 1
  stage = 0
  owns_output = True

  @property
  def source(self):
    return self.st.source

  @property
  def progress_stream(self) -> TextIO:
    return sys.stderr

  def same_job(self, job: str) -> None:
    pass

  def agree(self, error: FlexjaxError | None, what: str) -> None:
    if error is not None:
      raise error

  def from_owner(self, value):
    return value

  def plan(self, policy, *, final, prompt_len, gen_len, num_sequences, generation):
    from flexjax import run as run_lib
    rc, st = self.rc, self.st
    prediction = None
    if not final:
      policy, prediction = run_lib.choose_policy(rc, st.cfg, st.planner, st.budgets, st.profile,
                                                 prompt_len, gen_len=gen_len,
                                                 num_sequences=num_sequences, kept=policy,
                                                 generation=generation)
    head, problem = run_lib.plan_report(rc, st, policy, prediction, prompt_len=prompt_len,
                                        gen_len=gen_len, generation=generation)
    if problem is not None and not rc.dry_run:
      raise problem
    return policy, head

  def policies(self, policy: Policy) -> list[Policy]:
    return [policy]

  def engine(self, policy: Policy) -> Engine:
    from flexjax import run as run_lib
    return run_lib.engine_for(self.rc, self.st, policy)

  def report(self, report: dict, *, ran: bool) -> dict:
    return report


def run_job(rc) -> dict[str, Any]:
  """Runs a batch job (--input rows to --output) in one process; returns its report."""
  from flexjax import run as run_lib
  text = read_input(rc)  # refused before any setup
  return run_job_at(_Alone(rc, run_lib.setup(rc)), text)


def run_job_at(place: Place, text: str) -> dict[str, Any] | None:
  """Runs a batch job of the input `text` where `place` says; returns the report (see
  Place.report).

  The output's owner resumes it and hands every stage the blocks done and the recorded
  policies; each block's records are written as it completes, and a write that fails stops
  every stage with the writer's one line; the same command resumes the job after its last
  complete block, in one process or in a pipeline alike."""
  rc, st = place.rc, place.st
  rows, bad = parse_rows(text, place.source.config, st.tokenizer, rc.generation)
  job = job_of(rc, place.source, st.compute_dtype, text)
  place.same_job(job)
  output = JobOutput(rc.output, job) if place.owns_output else None
  try:
    return _run_job(place, rows, bad, output)
  finally:
    if output:
      output.release()


def _run_job(place: Place, rows: list[Row], bad: list[BadRow],
             output: JobOutput | None) -> dict[str, Any] | None:
  """run_job_at's work; `output`: this process's to claim and write (None: another's)."""
  from flexjax import run as run_lib
  rc, st = place.rc, place.st
  cfg = place.source.config
  error, resumed = None, False
  try:
    if output and not rc.dry_run:  # a dry run writes nothing, so holds nothing
      output.claim()
    resumed = output.resume() if output else False
  except FlexjaxError as e:
    error = e
  place.agree(error, 'cannot write the output')
  state = place.from_owner({'policies': output.policies, 'done': sorted(output.done),
                            'rows': output.rows, 'resumed': resumed} if output else None)
  done = set(state['done'])
  summary = {'input': rc.input, 'output': str(output.path) if output else rc.output,
             'rows': len(rows) + len(bad), 'bad_rows': len(bad)}
  policy, final = resumed_policy(state['policies'], stages=place.stages, stage=place.stage,
                                 template=rc.policy)
  head, blocks = {'model': cfg.name}, []
  if rows:
    prompt_len, gen_len = largest_shape(rows, bucket=rc.bucket, max_positions=cfg.max_positions)
    policy, head = place.plan(policy, final=final, prompt_len=prompt_len, gen_len=gen_len,
                              num_sequences=len(rows),
                              generation=heaviest_head(rows, rc.generation))
    blocks = plan_blocks(rows, policy.block_size, bucket=rc.bucket,
                         max_positions=cfg.max_positions)
  policy = policy or rc.policy  # a job of bad rows only: nothing runs
  summary['blocks'] = len(blocks)
  if rc.dry_run:
    return place.report({**head, **summary}, ran=False)

  def write(number: int, records: list[dict]) -> None:
    error = None
    if output:
      try:
        output.write_block(number, records)
      except FlexjaxError as e:
        error = e
    place.agree(error, 'could not write the output; run the same command again to resume')

  tally, error = Tally(), None
  try:
    if output:  # every stage's policy, recorded for this number of stages
      output.open(place.policies(policy))
  except FlexjaxError as e:
    error = e
  place.agree(error, 'cannot write the output')
  if bad and -1 not in done:
    write(-1, [bad_record(b) for b in bad])
  if any(b.number not in done for b in blocks):
    stream = place.progress_stream
    with place.engine(policy) as engine:
      tally = run_blocks(engine, blocks, done, write, tokenizer=st.tokenizer,
                         stop_at_eos=rc.generation.stop_at_eos,
                         show_progress=stream is not None and progress_lib.enabled(
                             rc.progress, stream),
                         progress_stream=stream)
  if output:
    output.finish()
  return place.report(
      {**head, **summary, 'resumed': state['resumed'], 'rows_written_before': state['rows'],
       'rows_generated': tally.rows, 'generated_tokens': tally.generated,
       'generation_s': round(tally.seconds, 3),
       **padding_report(rows, policy.block_size, cfg.max_positions, tally),
       **run_lib.measured_fields(st.device, st.watch.peaks())}, ran=True)


def job_of(rc, source, compute_dtype: str, text: str) -> str:
  """The job's fingerprint: its input, its weights (the whole model's `source`) and every flag
  that changes its outputs; a pipelined run of the job has the one-process run's."""
  return job_fingerprint(text, weights=_weights_identity(rc, source), compute=compute_dtype,
                         cache=rc.cache_dtype, stop_at_eos=rc.generation.stop_at_eos,
                         gen_len=rc.generation.gen_len, temperature=rc.generation.temperature,
                         top_p=rc.generation.top_p, seed=rc.generation.seed, bucket=rc.bucket,
                         # (named only when on: jobs begun without it keep their fingerprint)
                         **({'logprobs': True} if rc.generation.logprobs else {}),
                         **({'top_logprobs': rc.generation.top_logprobs}
                            if rc.generation.top_logprobs else {}))


def _weights_identity(rc, source) -> dict[str, Any]:
  if rc.weights == 'dummy':
    return {'dummy': source.config.name, 'seed': rc.dummy_seed, 'dtype': source.dtype}
  return {'checkpoint': source.fingerprint()}
