"""lm-evaluation-harness front end: the "flexjax" model of lm-eval, scoring and generating
through the offloading engine with its batching and policy (lm-eval requests -> engine calls).

lm-eval (0.4.13) finds models only in its own registry and its command line has no option to
import an outside module, so `python -m flexjax.evalharness <lm-eval arguments>` imports this
module (which registers the model) and hands over to lm-eval's own command line:

  python -m flexjax.evalharness --model flexjax \
      --model_args checkpoint=checkpoints/opt-1.3b,gpu_batch_size=16,w_gpu_percent=50 \
      --tasks lambada_openai

From Python, `import flexjax.evalharness` before `lm_eval.simple_evaluate(model='flexjax', ...)`.
"""

from __future__ import annotations

import dataclasses
import sys
import weakref
from pathlib import Path
from typing import Any, Iterator, Sequence

import lm_eval.models  # noqa: F401  lm-eval lists its own models only in an empty registry
import numpy as np
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import normalize_gen_kwargs
from tqdm import tqdm

from flexjax import diskio, scratch
from flexjax.checkpoint import Checkpoint
from flexjax.config import DTYPES
from flexjax.engine import Engine, GenerationConfig
from flexjax.errors import FlexjaxError
from flexjax.evaluate import score_continuations
from flexjax.hardware import HOST_MEMORY
from flexjax.policy import Policy
from flexjax.tokenizer import Tokenizer

__all__ = ['FlexjaxLM', 'HarnessOptions', 'main', 'options_from_args']

# Keys lm-eval adds to every model's arguments; the policy decides batching and placement.
LM_EVAL_KEYS = ('batch_size', 'max_batch_size', 'device')


@dataclasses.dataclass(frozen=True)
class HarnessOptions:
  """The model_args of the "flexjax" model: a checkpoint, a policy, dtypes and budgets."""

  checkpoint: str
  policy: Policy = Policy()
  compute_dtype: str | None = None  # None: float16 on a GPU, float32 on the CPU backend
  cache_dtype: str | None = None  # None: compute_dtype
  gpu_mem: float | None = None  # tier budgets in GiB; None: unlimited
  cpu_mem: float | None = None
  disk_mem: float | None = None
  offload_dir: str | None = None
  weights_cache: str | None = None
  io_threads: int = diskio.IO_THREADS
  host_memory: str = 'auto'  # host-tier weights: 'auto' | 'pinned' | 'pageable'
  max_length: int | None = None  # None: the model's positions
  max_gen_toks: int = 256  # generate_until's default when a task names none (lm-eval's hf: 256)
  add_bos_token: bool = True  # OPT was trained with BOS first, as lm-eval's hf model encodes it
  seed: int = 0  # sampling seed of generate_until with do_sample
  compile_cache: bool = True  # python -m flexjax.evalharness: run.use_compile_cache

  @property
  def budgets(self) -> dict[str, int | None]:
    return {tier: None if gib is None else int(gib * 2**30)
            for tier, gib in (('device', self.gpu_mem), ('host', self.cpu_mem),
                              ('disk', self.disk_mem))}


def options_from_args(args: dict[str, Any]) -> HarnessOptions:
  """Validates lm-eval's model_args (values already typed by lm-eval, or strings) into options.

  Raises FlexjaxError naming the bad key or value and the fix.
  """
  args = {k: v for k, v in args.items() if k not in LM_EVAL_KEYS}
  policy_fields = {f.name: f for f in dataclasses.fields(Policy)}
  option_fields = {f.name: f for f in dataclasses.fields(HarnessOptions) if f.name != 'policy'}
  known = sorted(option_fields) + sorted(policy_fields)
  for key in args:
    if key not in policy_fields and key not in option_fields:
      raise FlexjaxError(f'model_args {key}={args[key]!r} is not a flexjax option; use '
                         f'{", ".join(known)}')
  if args.get('checkpoint') in (None, ''):
    raise FlexjaxError('model_args needs checkpoint=PATH (a flexjax checkpoint converted with '
                       'python -m tools.convert_hf --hf_dir=... --output=PATH)')
  for key in ('compute_dtype', 'cache_dtype'):
    if args.get(key) is not None and args[key] not in DTYPES:
      raise FlexjaxError(f'model_args {key}={args[key]!r} is not a dtype; use one of '
                         f'{", ".join(DTYPES)}')
  policy = Policy(**{k: _typed(k, v, _kind(policy_fields[k])) for k, v in args.items()
                     if k in policy_fields})
  options = HarnessOptions(policy=policy, **{k: _typed(k, v, _kind(option_fields[k]))
                                             for k, v in args.items() if k in option_fields})
  for key in ('io_threads', 'max_gen_toks', 'max_length', 'gpu_mem', 'cpu_mem', 'disk_mem'):
    value = getattr(options, key)
    if value is not None and value <= 0:
      raise FlexjaxError(f'model_args {key}={value} must be positive (omit it for the default)')
  if options.host_memory not in HOST_MEMORY:
    raise FlexjaxError(f'model_args host_memory={options.host_memory!r} is not one of '
                       f'{", ".join(HOST_MEMORY)}')
  for key in ('offload_dir', 'weights_cache'):
    folder = getattr(options, key)
    if folder:
      scratch.check_writable(Path(folder), f'model_args {key}={folder!r}')
  return options


def _kind(field: dataclasses.Field) -> str:
  """The type a field holds: 'bool', 'int', 'float' or 'str' (its annotation, None left out)."""
  return str(field.type).split(' |')[0]


def _typed(key: str, value: Any, kind: str) -> Any:
  """`value` as a `kind` ('bool', 'int', 'float' or 'str'); lm-eval passes numbers and booleans
  already parsed, Python callers may pass strings."""
  if value is None:
    return None
  if kind == 'bool':
    if isinstance(value, bool):
      return value
    if str(value).lower() in ('true', 'false', '1', '0'):
      return str(value).lower() in ('true', '1')
    raise FlexjaxError(f'model_args {key}={value!r} must be true or false')
  if kind == 'int':
    try:
      if not isinstance(value, bool) and float(value) == int(float(value)):
        return int(float(value))
    except (TypeError, ValueError, OverflowError):
      pass
    raise FlexjaxError(f'model_args {key}={value!r} must be an integer')
  if kind == 'float':
    try:
      if not isinstance(value, bool):
        return float(value)
    except (TypeError, ValueError):
      pass
    raise FlexjaxError(f'model_args {key}={value!r} must be a number')
  return str(value)


@register_model('flexjax')
class FlexjaxLM(TemplateLM):
  """lm-eval's model interface over a flexjax Engine.

  Requests are sorted by length and cut into engine calls of at most one block
  (policy.gpu_batch_size x num_gpu_batches) each; log-likelihoods come from the engine's
  teacher-forced decode path, so offloading, CPU attention and compression apply exactly as in
  generation. Inputs longer than the model are truncated from the left and rolling windows are
  cut as lm-eval's hf model does, so both score the same tokens. lm-eval's batch_size and device
  are ignored: the policy sets the batch, jax's default device runs it.
  """

  def __init__(self, **model_args):
    super().__init__()
    self.options = options_from_args(model_args)
    if not Path(self.options.checkpoint).is_dir():
      raise FlexjaxError(f'model_args checkpoint={self.options.checkpoint!r} is not a folder; '
                         'convert a Hugging Face OPT model with python -m tools.convert_hf '
                         '--hf_dir=... --output=PATH')
    self._checkpoint = Checkpoint(self.options.checkpoint)
    cfg = self._checkpoint.config
    self.config = cfg
    if self._checkpoint.tokenizer_path is None:
      raise FlexjaxError(f'checkpoint {self.options.checkpoint!r} has no tokenizer files; '
                         'convert it from a Hugging Face folder with vocab.json + merges.txt or '
                         'tokenizer.json')
    self.tokenizer = Tokenizer.for_model(self._checkpoint.tokenizer_path, cfg)
    if self.options.max_length is not None and self.options.max_length > cfg.max_positions:
      raise FlexjaxError(f'model_args max_length={self.options.max_length} exceeds the '
                         f'{cfg.max_positions} positions of {cfg.name}; use at most that')
    self._engine: Engine | None = None
    self._closer: weakref.finalize | None = None

  # ---- lm-eval's model interface ---------------------------------------------------------------
  @property
  def eot_token_id(self) -> int:
    return self.config.eos_token_id

  @property
  def prefix_token_id(self) -> int:
    return self.config.bos_token_id

  @property
  def max_length(self) -> int:
    return self.options.max_length or self.config.max_positions

  @property
  def tokenizer_name(self) -> str:
    return str(self._checkpoint.tokenizer_path)

  def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
    add_bos = self.options.add_bos_token if add_special_tokens is None else add_special_tokens
    return self.tokenizer.encode(string, add_bos=add_bos)

  def tok_decode(self, tokens: Sequence[int]) -> str:
    return self.tokenizer.decode(tokens)

  def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False):
    """(log-probability, greedy) of each continuation; requests are ((context, continuation),
    context ids, continuation ids) as TemplateLM encodes them."""
    pairs = [(ctx, cont) for _, ctx, cont in requests]
    results = self._score(pairs, disable_tqdm=disable_tqdm)
    for (strings, _, _), answer in zip(requests, results):
      if strings is not None:
        self.cache_hook.add_partial('loglikelihood', strings, answer)
    return results

  def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
    """Log-likelihood of whole texts, in windows of max_length tokens (each token scored once,
    with as much context as fits), summed per text."""
    owners, pairs = [], []
    for index, (string,) in enumerate(req.args for req in requests):
      windows = lm_utils.get_rolling_token_windows(
          token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
          max_seq_len=self.max_length, context_len=1)
      for window in map(lm_utils.make_disjoint_window, windows):
        owners.append(index)
        pairs.append(window)
    totals = [0.0] * len(requests)
    for owner, (logprob, _) in zip(owners, self._score(pairs, disable_tqdm=disable_tqdm)):
      totals[owner] += logprob
    for req, total in zip(requests, totals):
      self.cache_hook.add_partial('loglikelihood_rolling', req.args, total)
    return totals

  def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
    """Generations cut at the first stop string (greedy unless do_sample); requests with the same
    generation kwargs share engine calls."""
    outputs: list[str | None] = [None] * len(requests)
    groups: dict[str, list[int]] = {}
    for index, req in enumerate(requests):
      groups.setdefault(repr(sorted(req.args[1].items())), []).append(index)
    bar = tqdm(total=len(requests), disable=disable_tqdm, desc='flexjax generate_until')
    calls = 0
    for indices in groups.values():
      until, gen = self._generation(requests[indices[0]].args[1])
      keep = self.max_length - gen.gen_len  # context tokens that leave room for the new ones
      # an empty context starts from the prefix token, as lm-eval's scoring does
      prompts = {i: self.tok_encode(requests[i].args[0])[-keep:] or [self.prefix_token_id]
                 for i in indices}
      order = sorted(indices, key=lambda i: -len(prompts[i]))
      for start in range(0, len(order), self.policy.block_size):
        rows = order[start:start + self.policy.block_size]
        result = self.engine.generate([prompts[i] for i in rows],
                                      dataclasses.replace(gen, seed=self.options.seed + calls))
        calls += 1
        for i, sequence in zip(rows, result.sequences):
          outputs[i] = _cut(self.tok_decode(sequence), until)
          self.cache_hook.add_partial('generate_until', requests[i].args, outputs[i])
        bar.update(len(rows))
    bar.close()
    return outputs

  def get_model_info(self) -> dict:
    return {'model_checkpoint': self.options.checkpoint, 'model_name': self.config.name,
            'flexjax_policy': self.policy.describe()}

  # ---- engine ----------------------------------------------------------------------------------
  @property
  def policy(self) -> Policy:
    return self.options.policy

  @property
  def engine(self) -> Engine:
    """The engine, built on first use (weights placed by the policy) and closed by close(), when
    this model is collected, or at exit."""
    if self._engine is None:
      o = self.options
      self._engine = Engine(self._checkpoint, policy=o.policy, compute_dtype=o.compute_dtype,
                            cache_dtype=o.cache_dtype, budgets=o.budgets,
                            offload_dir=o.offload_dir, weights_cache=o.weights_cache,
                            io_threads=o.io_threads, host_memory=o.host_memory)
      self._closer = weakref.finalize(self, self._engine.close)
    return self._engine

  def close(self) -> None:
    """Closes the engine (removes its offload folder); a later request builds a new one."""
    if self._closer is not None:
      self._closer()
    self._engine = self._closer = None

  def _score(self, pairs: Sequence[tuple[list[int], list[int]]], *,
             disable_tqdm: bool = False) -> list[tuple[float, bool]]:
    """(sum of log-probabilities, all tokens greedy) of each continuation after its context."""
    rows = [self._window(ctx, cont) for ctx, cont in pairs]
    results: list[tuple[float, bool] | None] = [None] * len(rows)
    bar = tqdm(total=len(rows), disable=disable_tqdm, desc='flexjax loglikelihood')
    for call in _calls(rows, block=self.policy.block_size, positions=self.max_length):
      scores = score_continuations(self.engine, [rows[i][0] for i in call],
                                   [rows[i][1] for i in call])
      for i, (logprobs, greedy) in zip(call, scores):
        results[i] = (float(logprobs.astype(np.float64).sum()), bool(greedy.all()))
      bar.update(len(call))
    bar.close()
    return results

  def _window(self, context: list[int], continuation: list[int]) -> tuple[list[int], list[int]]:
    """The prompt and continuation the model sees: the last max_length + 1 tokens of both, as
    lm-eval's hf model truncates (the last token is only scored, never fed)."""
    if not continuation:
      raise FlexjaxError(f'an empty continuation after context {self.tok_decode(context)[-40:]!r} '
                         'has nothing to score; give the task a non-empty target')
    if len(continuation) > self.max_length:
      raise FlexjaxError(f'a continuation of {len(continuation)} tokens exceeds '
                         f'max_length={self.max_length}; shorten the task\'s targets')
    whole = (context + continuation)[-(self.max_length + 1):]
    return whole[:len(whole) - len(continuation)], continuation

  def _generation(self, gen_kwargs: dict) -> tuple[list[str], GenerationConfig]:
    """Stop strings and the GenerationConfig of a task's generation kwargs (normalized as
    lm-eval does for its own models: max_new_tokens and the like, do_sample=False is greedy)."""
    kwargs = dict(normalize_gen_kwargs(gen_kwargs, self.options.max_gen_toks))
    until, gen_len = [s for s in kwargs.pop('until') if s], kwargs.pop('max_gen_toks')
    sample, temperature = kwargs.pop('do_sample'), float(kwargs.pop('temperature', 0.0))
    top_p = float(kwargs.pop('top_p', 1.0))
    if kwargs:
      key, value = next(iter(kwargs.items()))
      raise FlexjaxError(f'generation kwarg {key}={value!r} is not supported by flexjax; use '
                         'until, max_gen_toks, do_sample, temperature and top_p')
    if gen_len >= self.max_length:
      raise FlexjaxError(f'max_gen_toks={gen_len} leaves no room for a prompt in the '
                         f'{self.max_length} positions of {self.config.name}; lower it')
    return until, GenerationConfig(gen_len=gen_len, temperature=temperature if sample else 0.0,
                                   top_p=top_p, stop_at_eos=True)


def _calls(rows: Sequence[tuple[list[int], list[int]]], *, block: int,
           positions: int) -> Iterator[list[int]]:
  """Indices of `rows` (prompt, continuation) grouped into engine calls: longest first, at most
  one block each, and the longest prompt plus the longest continuation of a call within the
  model's positions (the engine left-pads prompts to the longest)."""
  order = sorted(range(len(rows)), key=lambda i: (-len(rows[i][0]) - len(rows[i][1]),
                                                   -len(rows[i][0])))
  call: list[int] = []
  prompt_len = gen_len = 0
  for i in order:
    p, g = max(prompt_len, len(rows[i][0])), max(gen_len, len(rows[i][1]))
    if call and (len(call) == block or p + g - 1 > positions):
      yield call
      call, p, g = [], len(rows[i][0]), len(rows[i][1])
    call.append(i)
    prompt_len, gen_len = p, g
  if call:
    yield call


def _cut(text: str, until: Sequence[str]) -> str:
  """`text` up to the first occurrence of each stop string, in turn."""
  for stop in until:
    text = text.split(stop)[0]
  return text


def main(argv: Sequence[str] | None = None) -> int:
  """lm-eval's command line (`lm_eval ...` arguments) with the "flexjax" model registered.

  The flexjax model_args are checked before lm-eval indexes its tasks, so a typo fails at once;
  a FlexjaxError ends the run with its one-line message and exit status 2.
  """
  from lm_eval._cli import HarnessCLI
  from lm_eval.utils import setup_logging

  from flexjax import hardware
  from flexjax import run as run_lib

  hardware.include_cpu_platform()  # JAX_PLATFORMS=cuda would leave out the CPU backend
  sys.argv = ['lm-eval', *(sys.argv[1:] if argv is None else argv)]  # lm-eval parses sys.argv
  setup_logging()
  cli = HarnessCLI()
  args = cli.parse_args()
  try:
    if getattr(args, 'model', None) == 'flexjax':
      options = options_from_args(args.model_args or {})
      # a process setting, so the command line's (lm-eval's own CLI leaves jax's as they are)
      run_lib.use_compile_cache(options.compile_cache, options.weights_cache)
    cli.execute(args)
  except FlexjaxError as e:
    print(f'flexjax: error: {e}', file=sys.stderr)
    return 2
  return 0


if __name__ == '__main__':
  sys.exit(main())
