"""lm-eval's "flexjax" model scores and generates what lm-eval's own hf model does on the same tiny
OPT checkpoint (fp32), offloaded or not; the command-line wrapper runs lm-eval with it."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

lm_eval = pytest.importorskip('lm_eval')

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from conftest import without_test_compile_cache  # noqa: E402
from flexjax.errors import FlexjaxError  # noqa: E402
from flexjax.evalharness import FlexjaxLM, _calls, main, options_from_args  # noqa: E402

OFFLINE = {'HF_DATASETS_OFFLINE': '1', 'HF_HUB_OFFLINE': '1'}
SENTENCES = ['Paris is the capital city of France.',
             'The quick brown fox jumps over the lazy dog.',
             'flexjax streams weights layer by layer.']
TASKS = ['fj_choice', 'fj_rolling', 'fj_generate']
POLICIES = {
    'device': dict(gpu_batch_size=16),
    'offloaded': dict(gpu_batch_size=2, num_gpu_batches=2, w_gpu_percent=0, w_cpu_percent=50,
                      cache_gpu_percent=0, cache_cpu_percent=100, act_gpu_percent=0,
                      act_cpu_percent=100, cpu_attention=True),
}


def write_tasks(folder: Path) -> None:
  """Three local tasks over JSONL files: multiple choice (one context longer than the model's 64
  positions, one continuation the model's greedy pick), rolling log-likelihood (one text longer
  than a window), and greedy generation cut at stop strings."""
  long_context = ' '.join(SENTENCES * 6) + ' The lazy'
  data = {
      'choice': [
          dict(question='Paris is the capital city of', choices=[' France.', ' dog.', ' layer.'],
               label=0),
          dict(question='The quick brown fox jumps over the',
               choices=[' lazy dog.', ' capital', ' weights by layer'], label=0),
          dict(question=long_context, choices=[' dog.', ' fox', ' France is the city'], label=1),
          dict(question='Paris is the', choices=[' the the', ' capital', ' France'], label=1),
      ],
      'rolling': [dict(text=' '.join(SENTENCES * 2 + SENTENCES[1:2])),
                  dict(text='The quick brown fox.')],
      'generate': [dict(prompt='Paris is the', answer=' capital'),
                   dict(prompt='The quick brown fox jumps over', answer=' the'),
                   dict(prompt=long_context, answer=' dog')],
  }
  for name, docs in data.items():
    (folder / f'{name}.jsonl').write_text(''.join(json.dumps(d) + '\n' for d in docs))
  head = lambda name, kind: (f'task: fj_{name}\ndataset_path: json\ndataset_kwargs:\n'
                             f'  data_files:\n    test: {folder / name}.jsonl\n'
                             f'output_type: {kind}\ntest_split: test\n')
  (folder / 'fj_choice.yaml').write_text(
      head('choice', 'multiple_choice') + 'doc_to_text: "{{question}}"\n'
      'doc_to_choice: "{{choices}}"\ndoc_to_target: label\ntarget_delimiter: ""\n'
      'metric_list:\n  - metric: acc\n  - metric: acc_norm\n')
  (folder / 'fj_rolling.yaml').write_text(
      head('rolling', 'loglikelihood_rolling') + 'doc_to_text: ""\ndoc_to_target: "{{text}}"\n'
      'metric_list:\n  - metric: word_perplexity\n  - metric: byte_perplexity\n'
      '  - metric: bits_per_byte\n')
  (folder / 'fj_generate.yaml').write_text(
      head('generate', 'generate_until') + 'doc_to_text: "{{prompt}}"\n'
      'doc_to_target: "{{answer}}"\ntarget_delimiter: ""\n'
      'generation_kwargs:\n  until: [".", "e t"]\n  max_gen_toks: 8\n  do_sample: false\n'
      'metric_list:\n  - metric: exact_match\n')


@pytest.fixture(scope='module')
def offline():
  patch = pytest.MonkeyPatch()
  for key, value in OFFLINE.items():
    patch.setenv(key, value)
  yield
  patch.undo()


@pytest.fixture(scope='module')
def tasks_dir(tmp_path_factory, offline) -> Path:
  folder = tmp_path_factory.mktemp('lm_eval_tasks')
  write_tasks(folder)
  return folder


@pytest.fixture(scope='module')
def hf_dir(pre_ln, tmp_path_factory) -> Path:
  """The tiny HF model with the tokenizer_config.json of OPT (BOS = EOS = </s>, prepended)."""
  folder = tmp_path_factory.mktemp('hf_opt') / 'hf'
  shutil.copytree(pre_ln.hf_dir, folder)
  (folder / 'tokenizer_config.json').write_text(json.dumps(dict(
      tokenizer_class='GPT2Tokenizer', bos_token='</s>', eos_token='</s>', unk_token='</s>',
      pad_token='<pad>', add_bos_token=True, errors='replace')))
  return folder


def evaluate(tasks_dir: Path, model: str, model_args: dict) -> dict:
  return lm_eval.simple_evaluate(
      model=model, model_args=model_args, tasks=TASKS, log_samples=True,
      task_manager=TaskManager(include_path=str(tasks_dir), include_defaults=False))


@pytest.fixture(scope='module')
def hf_results(hf_dir, tasks_dir) -> dict:
  return evaluate(tasks_dir, 'hf', dict(pretrained=str(hf_dir), dtype='float32', device='cpu'))


def responses(results: dict, task: str) -> list:
  """Per doc, its requests' responses in order: (log-likelihood, greedy), log-likelihood or text."""
  samples = sorted(results['samples'][task], key=lambda s: s['doc_id'])
  return [[r[0] for r in sample['resps']] for sample in samples]


@pytest.mark.parametrize('policy', list(POLICIES))
def test_requests_and_metrics_equal_lm_eval_hf(pre_ln, tasks_dir, hf_results, policy):
  ours = evaluate(tasks_dir, 'flexjax', dict(checkpoint=str(pre_ln.ckpt_dir),
                                             compute_dtype='float32', **POLICIES[policy]))
  want_choice, got_choice = responses(hf_results, 'fj_choice'), responses(ours, 'fj_choice')
  assert [len(doc) for doc in got_choice] == [3, 3, 3, 3]
  greedy = [bool(r[1]) for doc in want_choice for r in doc]
  assert any(greedy) and not all(greedy)  # the flags are compared on both values
  for want_doc, got_doc in zip(want_choice, got_choice, strict=True):
    for (want_ll, want_greedy), (got_ll, got_greedy) in zip(want_doc, got_doc, strict=True):
      assert got_ll == pytest.approx(want_ll, abs=1e-4)
      assert bool(got_greedy) == bool(want_greedy)
  want_rolling, got_rolling = responses(hf_results, 'fj_rolling'), responses(ours, 'fj_rolling')
  for want_doc, got_doc in zip(want_rolling, got_rolling, strict=True):
    assert got_doc == pytest.approx(want_doc, abs=1e-4)
  want_text, got_text = responses(hf_results, 'fj_generate'), responses(ours, 'fj_generate')
  assert got_text == want_text
  assert any(doc[0] for doc in want_text)  # something was generated and kept
  for task in TASKS:
    want, got = hf_results['results'][task], ours['results'][task]
    assert got.keys() == want.keys()
    for key, value in want.items():
      if isinstance(value, (int, float)):
        assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-9), (task, key)
      else:
        assert got[key] == value, (task, key)


@pytest.mark.slow  # tests/test_readme.py runs README's evalharness command, checked the same way
def test_cli_wrapper_runs_lm_eval(pre_ln, tasks_dir, tmp_path):
  command = [sys.executable, '-m', 'flexjax.evalharness', '--model', 'flexjax',
             '--model_args', f'checkpoint={pre_ln.ckpt_dir},gpu_batch_size=4,w_gpu_percent=50,'
             'w_cpu_percent=50', '--tasks', 'fj_choice', '--include_path', str(tasks_dir),
             '--limit', '2']
  proc = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path,
                        env={**without_test_compile_cache(os.environ), **OFFLINE,
                             'FLEXJAX_CACHE': str(tmp_path / 'cache')})
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert 'fj_choice' in proc.stdout and 'acc_norm' in proc.stdout, proc.stdout
  assert list((tmp_path / 'cache').glob('xla-*/*-cache'))  # compiled steps kept for the next


def test_cli_bad_model_arg_is_one_line(pre_ln, tasks_dir, monkeypatch, capsys):
  monkeypatch.setattr(sys, 'argv', ['python'])  # main() hands lm-eval its arguments in argv
  rc = main(['--model', 'flexjax', '--model_args', f'checkpoint={pre_ln.ckpt_dir},w_gpu_percnt=50',
             '--tasks', 'fj_choice', '--include_path', str(tasks_dir)])
  err = capsys.readouterr().err.strip().splitlines()
  assert rc == 2
  assert err[-1].startswith('flexjax: error: model_args w_gpu_percnt=50 is not a flexjax option')
  assert 'w_gpu_percent' in err[-1] and 'Traceback' not in '\n'.join(err)


@pytest.mark.parametrize('args, message', [
    (dict(gpu_batch_size=8), 'model_args needs checkpoint=PATH'),
    (dict(checkpoint='/no/such/ckpt'), "checkpoint='/no/such/ckpt' is not a folder"),
    (dict(checkpoint='CKPT', gpu_batch_size='many'), "gpu_batch_size='many' must be an integer"),
    (dict(checkpoint='CKPT', cpu_attention='maybe'), "cpu_attention='maybe' must be true or"),
    (dict(checkpoint='CKPT', compute_dtype='float8'), "compute_dtype='float8' is not a dtype"),
    (dict(checkpoint='CKPT', w_gpu_percent=80, w_cpu_percent=40), 'exceed 100'),
    (dict(checkpoint='CKPT', max_gen_toks=0), 'max_gen_toks=0 must be positive'),
    (dict(checkpoint='CKPT', attn_sparsity='dense'), "attn_sparsity='dense' must be a number"),
])
def test_bad_model_args_name_value_and_fix(pre_ln, args, message):
  args = {k: str(pre_ln.ckpt_dir) if v == 'CKPT' else v for k, v in args.items()}
  with pytest.raises(FlexjaxError, match=message) as error:
    FlexjaxLM(**args)
  assert '\n' not in str(error.value)


def test_bad_model_args_through_lm_eval(pre_ln, tasks_dir):
  with pytest.raises(FlexjaxError, match='max_length=65 exceeds the 64 positions'):
    lm_eval.simple_evaluate(model='flexjax', model_args=f'checkpoint={pre_ln.ckpt_dir},'
                            'max_length=65', tasks=['fj_choice'],
                            task_manager=TaskManager(include_path=str(tasks_dir),
                                                     include_defaults=False))


def test_unsupported_generation_kwargs_name_the_key(pre_ln):
  lm = FlexjaxLM(checkpoint=str(pre_ln.ckpt_dir))
  request = Instance('generate_until', doc={}, arguments=('Paris', dict(until=['.'], top_k=5)),
                     idx=0)
  with pytest.raises(FlexjaxError, match='generation kwarg top_k=5 is not supported'):
    lm.generate_until([request])
  request = Instance('generate_until', doc={}, arguments=('Paris', dict(max_new_tokens=64)),
                     idx=0)
  with pytest.raises(FlexjaxError, match='max_gen_toks=64 leaves no room'):
    lm.generate_until([request])


def test_model_args_as_strings_are_typed():
  options = options_from_args(dict(checkpoint='/c', gpu_batch_size='4', cpu_attention='true',
                                   w_gpu_percent='25.5', w_cpu_percent=50, gpu_mem='0.5',
                                   batch_size=1, device='cuda'))
  assert options.policy.gpu_batch_size == 4 and options.policy.cpu_attention is True
  assert options.policy.w_gpu_percent == 25.5 and options.policy.w_cpu_percent == 50
  assert options.budgets == {'device': 2**29, 'host': None, 'disk': None}


def test_folders_the_engine_cannot_write_are_refused_with_the_options(tmp_path):
  blocker = tmp_path / 'file'
  blocker.write_text('')
  for key, value, says in (('offload_dir', blocker, 'is a file'),
                           ('weights_cache', blocker / 'layouts', 'cannot be written')):
    with pytest.raises(FlexjaxError, match=f'model_args {key}=.*{says}'):
      options_from_args({'checkpoint': '/c', key: str(value)})


def test_calls_group_longest_first_within_block_and_positions():
  # (prompt, continuation) lengths: 1+9, 5+5, 2+3, 1+1 with 10 positions and blocks of 2.
  rows = [([0] * p, [0] * c) for p, c in ((1, 9), (5, 5), (2, 3), (1, 1))]
  # 5+5 and 1+9 would pad to 5 + 9 - 1 = 13 positions; 1+9 and 2+3 pad to 2 + 9 - 1 = 10.
  assert list(_calls(rows, block=2, positions=10)) == [[1], [0, 2], [3]]
