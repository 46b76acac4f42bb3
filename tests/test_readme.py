"""Every command in README.md runs: as written, or on a tiny model / with --dry_run where the
real one is too big for a test (each such change is listed in RUNS below). A command the table
does not know fails the test, so a new README command comes with its check."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import without_test_compile_cache

REPO = Path(__file__).resolve().parents[1]
README = (REPO / 'README.md').read_text()
CPU_PROFILE = str(REPO / 'configs' / 'hw' / 'cpu-2core.json')
# The set-up commands: what .ci/run does on a fresh machine (checked against it below).
SET_UP = ('python3 -m venv', '. .venv/bin/activate', 'pip install', 'python -m pytest')


def code_blocks(language: str) -> list[str]:
  return re.findall(rf'```{language}\n(.*?)```', README, flags=re.S)


def commands() -> list[list[str]]:
  """The README's shell commands as argv lists (continuations joined, comments dropped, `&&`
  chains split)."""
  out = []
  for block in code_blocks('bash'):
    for line in block.replace('\\\n', ' ').splitlines():
      words = shlex.split(line, comments=True)
      while words:
        end = words.index('&&') if '&&' in words else len(words)
        out.append(words[:end])
        words = words[end + 1:]
  return out


def is_set_up(argv: list[str]) -> bool:
  return ' '.join(argv).startswith(SET_UP)


def _key(argv: list[str]) -> str:
  """Which README command this is: its module and the flag that tells it apart."""
  module = argv[2] if argv[:2] == ['python', '-m'] else argv[0]
  for flag in ('--process_id=0', '--process_id=1', '--cache_dir', '--gguf', '--compress_weight',
               '--flagfile=configs/gguf', '--hf_dir', '--model_args', '--render', '--plot', '--folder', '--flagfile',
               '--prompt_file', '--input', '--dry_run', '--model=', '--output='):
    if any(a.startswith(flag) for a in argv):
      return f'{module} {flag.rstrip("=")}'
  return module


# README command -> how the test runs it: 'as is', or what it changes and why.
RUNS = {
    'flexjax.main --flagfile': 'as is',
    'tools.convert_hf --hf_dir': 'a tiny random OPT instead of /data/opt-1.3b',
    'flexjax.main --prompt_file': 'the tiny checkpoint, 8 new tokens (it has 64 positions)',
    'flexjax.main --input': "the tiny checkpoint, the README's rows, 16 new tokens, the 2-core "
                            'profile',
    'flexjax.evalharness --model_args': 'the tiny checkpoint, a local task instead of downloads',
    'flexjax.main --model': '--dry_run (OPT-6.7B), which must fit',
    'tools.suite --dry_run': 'as is',
    'tools.suite --output': '--dry_run (a benchmark run takes many minutes)',
    'tools.suite --render': 'as is',
    'tools.suite --plot': 'the PNG written to a temporary folder',
    'tools.roofline --folder': 'as is',
    'flexjax.launch --flagfile': 'as is',
    'tools.fetch_gguf --cache_dir': 'as is (the file the GGUF tests fetched, found by checksum)',
    'tools.convert_hf --gguf': 'as is',
    'flexjax.main --flagfile=configs/gguf': 'as is',
    'flexjax.main --compress_weight': 'as is',
    'flexjax.launch --dry_run': 'as is',
    'flexjax.launch --process_id=0': 'both hosts on this one: 10.0.0.1 is 127.0.0.1, a free port',
    'flexjax.launch --process_id=1': 'both hosts on this one: 10.0.0.1 is 127.0.0.1, a free port',
}


def test_every_readme_command_is_known_and_ci_runs_the_set_up():
  keys = [_key(argv) for argv in commands() if not is_set_up(argv)]
  assert sorted(set(keys)) == sorted(RUNS), 'a README command has no check in RUNS'
  assert len(keys) == len(set(keys))
  ci = (REPO / '.ci' / 'run').read_text()
  assert 'python -m pytest' in ci and "-e '.[test]'" in ci
  set_up = [' '.join(argv) for argv in commands() if is_set_up(argv)]
  assert any(s.startswith('python -m pytest') for s in set_up)


def _run(argv: list[str], tmp_path: Path, env_extra: dict | None = None,
         own_compile_cache: bool = False):
  """Runs a command in tmp_path; own_compile_cache: without the test run's shared compilation
  cache, so that the command keeps its compiled steps where it would for a user."""
  base = without_test_compile_cache(os.environ) if own_compile_cache else os.environ
  env = dict(base, JAX_PLATFORMS='cpu', FLEXJAX_CACHE=str(tmp_path / 'cache'),
             HF_DATASETS_OFFLINE='1', HF_HUB_OFFLINE='1', **(env_extra or {}))
  argv = [sys.executable if argv[0] == 'python' else argv[0], *argv[1:]]
  proc = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True,
                        timeout=600)
  if proc.returncode != 0:  # whole lines, the fatal error's own first (pytest cuts a repr)
    lines = proc.stderr.splitlines()
    fatal = [line for line in lines if any(mark in line for mark in FATAL_MARKS)]
    pytest.fail(f'{argv} exited with {proc.returncode}:\n' + '\n'.join(fatal[:10] + lines[-60:]),
                pytrace=False)
  return proc


# How a process that aborts or crashes says why (Python, absl/XLA, glibc, C++).
FATAL_MARKS = ('Fatal Python error', 'Check failed', 'malloc', 'corrupted', 'double free',
               'terminate called', 'Segmentation fault', 'Aborted')


def _sub(argv: list[str], **subs: str) -> list[str]:
  out = []
  for word in argv:
    for old, new in subs.items():
      word = word.replace(old, new)
    out.append(word)
  return out


@pytest.fixture
def workdir(tmp_path):
  """A folder like the repository's root: its configs and docs, nothing written back."""
  for name in ('configs', 'docs', 'tools', 'flexjax'):
    (tmp_path / name).symlink_to(REPO / name)
  return tmp_path


def by_key(key: str) -> list[str]:
  return next(argv for argv in commands() if not is_set_up(argv) and _key(argv) == key)


def test_the_default_job_and_the_tools_run_as_written(workdir):
  proc = _run(by_key('flexjax.main --flagfile'), workdir)
  assert 'total_tok_s' in proc.stdout and 'opt-125m' in proc.stdout
  assert '| ' in _run(by_key('tools.suite --render'), workdir).stdout
  assert 'disk read' in _run(by_key('tools.roofline --folder'), workdir).stdout
  for key in ('tools.suite --dry_run', 'tools.suite --output'):
    argv = by_key(key) + ([] if '--dry_run' in by_key(key) else ['--dry_run'])
    assert 'frontier-flexjax-4' in _run(argv, workdir).stdout
  (workdir / 'plots').mkdir()
  _run(_sub(by_key('tools.suite --plot'), **{'--plot_output=': '--plot_output=plots/'}), workdir)
  assert (workdir / 'plots' / 'frontier.png').stat().st_size > 0


def test_the_offload_example_fits_its_own_budgets(workdir):
  proc = _run(by_key('flexjax.main --model') + ['--dry_run'], workdir)
  assert re.search(r'^\s*fits: True$', proc.stdout, flags=re.M), proc.stdout


def test_the_checkpoint_examples_run_on_a_tiny_model(pre_ln, workdir):
  subs = {'/data/opt-1.3b': str(pre_ln.hf_dir)}
  _run(_sub(by_key('tools.convert_hf --hf_dir'), **subs), workdir)
  assert (workdir / 'checkpoints' / 'opt-1.3b' / 'flexjax.json').is_file()
  (workdir / 'prompts.txt').write_text('Paris is the capital\nThe quick brown fox\n')
  _run(_sub(by_key('flexjax.main --prompt_file'), **{'--gen_len=64': '--gen_len=8'}), workdir)
  assert len((workdir / 'generations.jsonl').read_text().splitlines()) == 2
  (workdir / 'rows.jsonl').write_text(code_blocks('jsonl')[0])
  proc = _run(_sub(by_key('flexjax.main --input'), **{'--gen_len=32': '--gen_len=16'})
              + [f'--hw_profile={CPU_PROFILE}'], workdir)
  lines = (workdir / 'out.jsonl').read_text().splitlines()
  assert len(lines) == 3 and all('"error": null' in line for line in lines)
  asked = {row['id']: row for row in map(json.loads, lines)}
  assert len(asked['q2']['logprobs']) == len(asked['q2']['output_tokens']) > 0
  assert 'logprobs' not in asked['q1']
  shape = re.search(r'policy: (\d+)x(\d+) ', proc.stdout)
  assert int(shape[1]) * int(shape[2]) <= 4, proc.stdout  # the searched block fits three rows
  python = code_blocks('python')[0].replace('print(', 'print("GENERATED", ')
  proc = _run(['python', '-c', python], workdir)
  assert 'GENERATED' in proc.stdout
  pytest.importorskip('lm_eval')
  from test_evalharness import write_tasks
  tasks = workdir / 'tasks'
  tasks.mkdir()
  write_tasks(tasks)
  argv = _sub(by_key('flexjax.evalharness --model_args'),
              **{'lambada_openai,hellaswag': 'fj_choice'})
  proc = _run(argv + ['--include_path', str(tasks), '--limit', '2'], workdir,
              own_compile_cache=True)
  assert 'fj_choice' in proc.stdout and 'acc_norm' in proc.stdout
  assert list((workdir / 'cache').glob('xla-*/*-cache'))  # compiled steps kept for the next


def test_the_pipeline_launches_run_as_written_and_across_hosts_on_localhost(workdir):
  proc = _run(by_key('flexjax.launch --flagfile'), workdir)
  assert 'pipeline_stages' in proc.stdout and 'stage1' in proc.stdout, proc.stdout
  proc = _run(by_key('flexjax.launch --dry_run'), workdir)
  assert re.search(r'^\s*fits: True$', proc.stdout, flags=re.M), proc.stdout
  import socket
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    port = s.getsockname()[1]
  env = dict(os.environ, JAX_PLATFORMS='cpu', FLEXJAX_CACHE=str(workdir / 'cache'))
  procs = [subprocess.Popen(
      [sys.executable, *_sub(by_key(f'flexjax.launch --process_id={i}'),
                             **{'10.0.0.1:4000': f'127.0.0.1:{port}'})[1:]],
      cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
      for i in (0, 1)]
  outs = [p.communicate(timeout=600) for p in procs]
  assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outs]
  assert 'pipeline_stages' in outs[0][0] and 'total_tok_s' in outs[0][0]
  assert 'pipeline_stages' not in outs[1][0]  # stage 0 reports


def test_the_real_model_example_runs_as_written(workdir):
  from tools import fetch_gguf
  cached = fetch_gguf.fetch_smollm2()  # downloaded once per machine (tests/test_gguf.py too)
  (workdir / 'models').mkdir()
  (workdir / 'models' / cached.name).symlink_to(cached)
  for key in ('tools.fetch_gguf --cache_dir', 'tools.convert_hf --gguf'):
    _run(by_key(key), workdir)
  out = _run(by_key('flexjax.main --flagfile=configs/gguf'), workdir).stdout
  answers = re.findall(r'^>>> (.*)\n(.*)$', out, flags=re.M)
  assert len(answers) == 4, out
  assert answers[0][0] == 'What is the capital of France?' and 'Paris' in answers[0][1], out
  out = _run(by_key('flexjax.main --compress_weight'), workdir).stdout
  assert 'compress_weight=4b/g32' in out, out
  answers = re.findall(r'^>>> (.*)\n(.*)$', out, flags=re.M)
  assert len(answers) == 4 and all(answer.strip() for _, answer in answers), out
