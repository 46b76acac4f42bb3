"""The command line: every shipped flagfile parses; bad input gets one line naming the value."""

import json
import re
import os
import shutil
import subprocess
import sys
import tempfile
import types
from pathlib import Path

import pytest
from absl import flags

from conftest import without_test_compile_cache
from flexjax import flags as flags_lib
from flexjax.config import PRESETS, preset
from flexjax.errors import FlexjaxError

REPO = Path(__file__).resolve().parents[1]
FLAGFILES = sorted((REPO / 'configs').glob('*.flags'))


def parse(*args):
  fv = flags.FlagValues()
  flags_lib.define_flags(fv)
  fv(['flexjax', *args])
  return fv


def test_there_is_a_flagfile_for_every_preset_and_opt30b():
  models = {parse(f'--flagfile={f}').model for f in FLAGFILES}
  assert models >= {'opt-125m', 'opt-350m', 'opt-1.3b', 'opt-2.7b', 'opt-6.7b', 'opt-13b',
                    'opt-30b', 'opt-66b', 'opt-175b', 'llama-2-7b', 'llama-2-13b', 'llama-2-70b',
                    'llama-3-8b', 'llama-3-70b', 'mistral-7b'}
  assert models <= set(PRESETS)
  assert (REPO / 'configs' / 'opt30b.flags') in FLAGFILES


@pytest.mark.parametrize('flagfile', FLAGFILES, ids=lambda p: p.name)
def test_flagfile_parses_into_a_run_config(flagfile):
  rc = flags_lib.run_config_from_flags(parse(f'--flagfile={flagfile}'))
  assert preset(rc.model).name == rc.model
  assert rc.generation.gen_len > 0 and rc.prompt_len > 0


# Dry-run in every test run: the small default; the others, and opt30b.flags' search
# (test_auto_policy_dry_run_prints_the_choice_and_prediction), with -m slow.
DRY_RUN_ALWAYS = ('opt125m.flags',)


@pytest.mark.parametrize('flagfile', [
    pytest.param(f, marks=() if f.name in DRY_RUN_ALWAYS else pytest.mark.slow)
    for f in FLAGFILES], ids=lambda p: p.name)
def test_every_flagfile_fits_this_machine_as_shipped(flagfile):
  """--dry_run of each flagfile plans within the detected RAM and disk (the 2-core profile
  stands in for measuring this machine). A flagfile may be refused only for want of disk (the
  4-bit OPT-175B needs more than a small machine has; a machine whose disk is filled by other
  files may refuse more), and the refusal must say so in one line with the right amount."""
  from flexjax.run import run
  fv = parse(f'--flagfile={flagfile}', '--dry_run', '--noprogress',
             f'--hw_profile={REPO / "configs/hw/cpu-2core.json"}')
  try:
    report = run(flags_lib.run_config_from_flags(fv))
  except FlexjaxError as e:
    assert 'on the disk' in str(e), str(e)
    need = float(re.search(r'needs ([\d.]+) GiB on the disk', str(e)).group(1))
    assert need * 2**30 > shutil.disk_usage(tempfile.gettempdir()).free and '\n' not in str(e)
    return
  assert report['fits'] is True, report.get('does_not_fit')
  assert report['planned_ram_peak_bytes'] <= report['ram_budget_bytes']


@pytest.mark.parametrize('args,message', [
    (['--gen_len=0'], '--gen_len=0'),
    (['--prompt_len=-3'], '--prompt_len=-3'),
    (['--gpu_batch_size=0'], '--gpu_batch_size=0'),
    (['--num_prompts=0'], '--num_prompts=0'),
    (['--compress_bits=3'], 'compress_bits=3'),
    (['--attn_sparsity=0'], 'attn_sparsity=0.0'),
    (['--w_gpu_percent=70', '--w_cpu_percent=40'], 'w_gpu_percent=70.0 + w_cpu_percent=40.0'),
    (['--num_gpu_batches=0'], '--num_gpu_batches=0'),
    (['--cpu_mem=0'], '--cpu_mem=0.0'),
    (['--weights=checkpoint'], '--checkpoint=PATH'),
    (['--top_p=0'], 'top_p=0.0'),
])
def test_bad_flags_are_refused_in_process(args, message):
  with pytest.raises(FlexjaxError, match=re.escape(message)):
    flags_lib.run_config_from_flags(parse(*args))


@pytest.mark.parametrize('value', ['0', '-1', 'inf'])
def test_a_stop_grace_time_that_is_no_time_is_refused(value):
  with pytest.raises(FlexjaxError, match=re.escape(f'--stop_grace_s={float(value):g} must be')):
    flags_lib.stop_grace_from_flags(parse(f'--stop_grace_s={value}'))


def test_the_stop_grace_time_is_the_flags_or_the_default():
  from flexjax.stopping import STOP_GRACE_S
  assert flags_lib.stop_grace_from_flags(parse()) == STOP_GRACE_S
  assert flags_lib.stop_grace_from_flags(parse('--stop_grace_s=2.5')) == 2.5


def test_a_stop_watch_takes_the_flags_grace_time_or_keeps_its_own():
  stop = types.SimpleNamespace(grace_s=7.0)  # a StopWatch's grace time (a real one installs
  # signal handlers in this process)
  flags_lib.use_stop_grace(stop, parse())
  assert stop.grace_s == 7.0
  flags_lib.use_stop_grace(stop, parse('--stop_grace_s=2.5'))
  assert stop.grace_s == 2.5
  with pytest.raises(FlexjaxError, match=re.escape('--stop_grace_s=0 must be')):
    flags_lib.use_stop_grace(None, parse('--stop_grace_s=0'))


def run_cli(*args, cwd=None):
  env = dict(os.environ, JAX_PLATFORMS='cpu')
  return subprocess.run([sys.executable, '-m', 'flexjax.main', *args], capture_output=True,
                        text=True, env=env, cwd=cwd or REPO, timeout=300)


def run_report(tmp_path, *args):
  """main's exit, its printed table and its --report_json."""
  path = tmp_path / 'reports' / 'report.json'  # its folder is made
  path.unlink(missing_ok=True)
  proc = run_cli(*args, f'--report_json={path}')
  assert proc.returncode == 0, proc.stderr
  return proc, json.loads(path.read_text())


def test_main_runs_the_default_flagfile_and_writes_outputs(tmp_path):
  out = tmp_path / 'gen.jsonl'
  proc, report = run_report(tmp_path, f'--flagfile={REPO / "configs/opt125m.flags"}',
                            '--prompt_len=8', '--gen_len=3', '--gpu_batch_size=2',
                            '--num_prompts=3', f'--output={out}')
  # the report is printed once, as a table
  assert proc.stdout.count('generated_tokens') == 1 and '{' not in proc.stdout
  assert report['model'] == 'opt-125m' and report['generated_tokens'] == 9
  assert 0 < report['measured_ram_peak_bytes'] <= report['planned_ram_peak_bytes']
  assert report['total_tok_s'] > 0
  lines = [json.loads(line) for line in out.read_text().splitlines()]
  assert len(lines) == 3 and all(len(r['output_tokens']) == 3 for r in lines)
  assert sorted(p.name for p in tmp_path.iterdir()) == ['gen.jsonl', 'reports']


def test_a_run_without_overlap_reports_its_seconds_per_part(tmp_path):
  """--nooverlap: the report breaks each phase down by part (weights all on disk, so their
  reads take time), the parts adding up to no more than the phase; with overlap, no breakdown."""
  flagfile = f'--flagfile={REPO / "configs/opt125m.flags"}'
  small = ('--prompt_len=8', '--gen_len=3', '--gpu_batch_size=2', '--num_prompts=2',
           '--w_gpu_percent=0', '--w_cpu_percent=0', f'--offload_dir={tmp_path}')
  _, report = run_report(tmp_path, flagfile, *small, '--nooverlap')
  for phase, total in (('prefill', report['prefill_s']), ('decode', report['decode_s'])):
    parts = report['breakdown_s'][phase]
    assert parts['total'] == total
    assert sum(v for k, v in parts.items() if k != 'total') <= total + 1e-3
    assert parts['compute'] > 0 and parts['weight_read'] > 0
    assert parts['cache_read'] == 0  # the cache is on the device
  _, overlapped = run_report(tmp_path, flagfile, *small)
  assert 'breakdown_s' not in overlapped


def test_a_second_run_loads_its_compiled_steps_from_the_compile_cache(tmp_path):
  """--compile_cache (the default) keeps XLA's executables in the flexjax cache folder: a
  second run of the same model compiles its steps no more (jax's log of cache hits, asked for
  with JAX_LOG_COMPILES) and generates the same tokens; --nocompile_cache keeps nothing."""
  def generate(cache, *extra):
    out = tmp_path / f'{cache}-{len(list(tmp_path.glob("*.jsonl")))}.jsonl'
    env = dict(without_test_compile_cache(os.environ), JAX_PLATFORMS='cpu',
               JAX_LOG_COMPILES='1', FLEXJAX_CACHE=str(tmp_path / cache))
    proc = subprocess.run([sys.executable, '-m', 'flexjax.main', '--model=opt-125m',
                           '--weights=dummy', '--prompt_len=8', '--gen_len=3', '--num_prompts=2',
                           '--gpu_batch_size=2', '--noprogress', '--verbosity=0',
                           f'--output={out}', *extra],
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    hits = re.findall(r"Persistent compilation cache hit for '(\w+)'", proc.stderr)
    return hits, [json.loads(line)['output_tokens'] for line in out.read_text().splitlines()]

  first_hits, first = generate('on')
  kept = list((tmp_path / 'on').glob('xla-*/*-cache'))
  assert not first_hits and kept
  second_hits, second = generate('on')
  assert {'jit_prefill_layer', 'jit_decode_layer'} <= set(second_hits), second_hits
  assert second == first
  off_hits, off = generate('off', '--nocompile_cache')
  assert not off_hits and off == first and not list((tmp_path / 'off').glob('xla-*'))


def test_main_with_a_checkpoint_and_text_prompts(pre_ln, tmp_path):
  prompts = tmp_path / 'prompts.txt'
  prompts.write_text('Paris is the capital\nThe quick brown fox jumps\n')
  out = tmp_path / 'gen.jsonl'
  proc = run_cli('--weights=checkpoint', f'--checkpoint={pre_ln.ckpt_dir}',
                 f'--prompt_file={prompts}', '--gen_len=4', '--gpu_batch_size=2',
                 f'--output={out}')
  assert proc.returncode == 0, proc.stderr
  lines = [json.loads(line) for line in out.read_text().splitlines()]
  assert [r['prompt'] for r in lines] == ['Paris is the capital', 'The quick brown fox jumps']
  assert all(isinstance(r['output'], str) and r['prompt_tokens'][0] == 2 for r in lines)


def _one_line_error(proc, *needles):
  assert proc.returncode == 2, proc.stdout + proc.stderr
  lines = [line for line in proc.stderr.splitlines() if line.strip()]
  assert len(lines) == 1, proc.stderr
  assert 'Traceback' not in proc.stderr
  for needle in needles:
    assert needle in lines[0], lines[0]


def test_cli_errors_are_one_line(pre_ln, tmp_path):
  _one_line_error(run_cli('--model=opt-7b'), "'opt-7b'", 'opt-125m')
  _one_line_error(run_cli('--weights=checkpoint', f'--checkpoint={tmp_path / "none"}'),
                  str(tmp_path / 'none'), 'does not exist')
  corrupt = tmp_path / 'corrupt'
  corrupt.mkdir()
  (corrupt / 'flexjax.json').write_text('not json')
  _one_line_error(run_cli('--weights=checkpoint', f'--checkpoint={corrupt}'), 'corrupt')
  _one_line_error(run_cli('--weights=checkpoint', f'--checkpoint={pre_ln.ckpt_dir}',
                          '--model=opt-125m'), '--model=opt-125m', 'does not match')
  _one_line_error(run_cli('--prompt_len=5000'), '--prompt_len=5000', '2048')
  _one_line_error(run_cli('--weights=checkpoint', f'--checkpoint={pre_ln.ckpt_dir}',
                          '--prompt_len=60', '--gen_len=10'), '64')
  _one_line_error(run_cli('--gen_len=0'), '--gen_len=0')
  _one_line_error(run_cli('--gpu_batch_size=-1'), '--gpu_batch_size=-1')
  _one_line_error(run_cli('--compress_group_size=7'), 'compress_group_size=7')
  _one_line_error(run_cli('--gpu_mem=0.001'), 'on the device', 'short by')
  # refused by absl as the flags are parsed (bounds, choices, types), and before any search
  _one_line_error(run_cli('--io_threads=0'), 'flexjax: error:', '--io_threads=0', '[1, 16]')
  _one_line_error(run_cli('--dtype=int8'), '--dtype=int8', 'float32')
  _one_line_error(run_cli('--max_block_size=0', '--policy=auto'), '--max_block_size=0')
  _one_line_error(run_cli('--max_block_seconds=-1', '--policy=auto'), '--max_block_seconds=-1')
  _one_line_error(run_cli('--dummy_seed=-5'), '--dummy_seed=-5')
  _one_line_error(run_cli(f'--flagfile={tmp_path / "none.flags"}'),
                  f"--flagfile='{tmp_path / 'none.flags'}' cannot be read", 'configs/opt125m.flags')
  tool = subprocess.run([sys.executable, '-m', 'tools.memcheck', '--random=two'],
                        capture_output=True, text=True, cwd=REPO, timeout=120)
  _one_line_error(tool, 'memcheck: error:', '--random', "'two'")
  for args, needles in ((['tools.memcheck', '--only=all_device,nope'], ["'nope'", 'choose from']),
                        (['tools.roofline', '--file_gib=0'], ['--file_gib=0']),
                        (['tools.roofline', '--dtypes=float64'], ["'float64'", 'bfloat16']),
                        (['tools.pipeline_scaling', '--stages=1,x'], ['--stages', "'x'", '1,2,4'])):
    tool = subprocess.run([sys.executable, '-m', *args], capture_output=True, text=True, cwd=REPO,
                          timeout=120)
    _one_line_error(tool, *needles)
  # refused before its output file is made
  for bad, needle in (('--models=opt-9b', "'opt-9b'"), ('--batch_sizes=x', "'x'"),
                      ('--prompt_len=5000', '--prompt_len=5000')):
    output = tmp_path / 'bench' / 'out.jsonl'
    tool = subprocess.run([sys.executable, '-m', 'tools.bench', bad, f'--output={output}'],
                          capture_output=True, text=True, cwd=REPO, timeout=120)
    _one_line_error(tool, 'bench: error:', needle)
    assert not output.exists()


def test_inputs_of_the_wrong_kind_are_one_line_errors(pre_ln, tmp_path):
  binary = tmp_path / 'prompts.txt'
  binary.write_bytes(b'Paris is\n\xff\xfe nonsense\n')
  ckpt = (f'--checkpoint={pre_ln.ckpt_dir}', '--weights=checkpoint')
  _one_line_error(run_cli(*ckpt, f'--prompt_file={binary}'), str(binary), 'not UTF-8',
                  'line 2')
  _one_line_error(run_cli(*ckpt, f'--prompt_file={tmp_path}'), str(tmp_path), 'is a folder')
  _one_line_error(run_cli(*ckpt, f'--output={tmp_path}'), 'is a folder')
  _one_line_error(run_cli(*ckpt, f'--output={binary / "out.jsonl"}'), 'its folder',
                  'is a file; give a folder')
  _one_line_error(run_cli(*ckpt, f'--report_json={tmp_path}'), '--report_json', 'is a folder')
  _one_line_error(run_cli('--weights=checkpoint', f'--checkpoint={binary}'), 'is a file')
  _one_line_error(run_cli(f'--hw_profile={tmp_path}', '--dry_run'), 'is a folder')
  _one_line_error(run_cli(f'--offload_dir={binary}'), '--offload_dir', 'is a file')
  readonly = tmp_path / 'readonly'
  readonly.mkdir(mode=0o500)
  if not os.access(readonly, os.W_OK):  # root writes anywhere: then there is nothing to refuse
    _one_line_error(run_cli(*ckpt, f'--output={readonly / "out.jsonl"}'), 'cannot be written')


def test_a_file_the_run_writes_over_another_given_path_is_refused_and_nothing_written(
    pre_ln, tmp_path):
  """--output and --report_json may not name an input (through a link too), each other, the
  job's progress file, the offload folder or a file in the checkpoint: one line, the user's
  files as they were, nothing made."""
  prompts = tmp_path / 'prompts.jsonl'
  prompts.write_text('{"tokens": [2, 5, 6]}\n')
  (tmp_path / 'link.jsonl').symlink_to(prompts)
  ckpt = (f'--checkpoint={pre_ln.ckpt_dir}', '--weights=checkpoint', '--gen_len=2')
  before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
  checkpoint_files = sorted(pre_ln.ckpt_dir.rglob('*'))
  out = tmp_path / 'out.jsonl'
  _one_line_error(run_cli(*ckpt, f'--prompt_file={prompts}', f'--output={tmp_path / "link.jsonl"}'),
                  'is also --prompt_file', 'give another path')
  _one_line_error(run_cli(*ckpt, f'--input={prompts}', f'--output={out}', f'--report_json={out}'),
                  f'--output={str(out)!r} is also --report_json')
  _one_line_error(run_cli(*ckpt, f'--input={prompts}', f'--output={out}',
                          f'--report_json={out}.progress'), "is also the output's progress file")
  _one_line_error(run_cli(*ckpt, f'--input={prompts}', f'--output={out}', f'--offload_dir={out}'),
                  'is also --offload_dir')
  _one_line_error(run_cli(*ckpt, f'--prompt_file={prompts}',
                          f'--report_json={pre_ln.ckpt_dir / "flexjax.json"}'),
                  'lies in --checkpoint')
  assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
  assert sorted(pre_ln.ckpt_dir.rglob('*')) == checkpoint_files


def test_a_folder_the_run_cannot_create_is_refused_before_any_work(tmp_path):
  from flexjax import run as run_lib
  blocker = tmp_path / 'file'
  blocker.write_text('')
  for flag in ('offload_dir', 'weights_cache'):
    rc = run_lib.RunConfig(**{flag: str(blocker / 'sub' / 'folder')})
    with pytest.raises(FlexjaxError, match=f"--{flag}=.*cannot be written") as e:
      run_lib.check_paths(rc)
    assert '\n' not in str(e.value)
  later = tmp_path / 'new' / 'offload'
  run_lib.check_paths(run_lib.RunConfig(offload_dir=str(later)))
  assert sorted(p.name for p in tmp_path.iterdir()) == ['file']  # made by the run, if it needs it


def test_a_damaged_checkpoint_is_one_line_with_nothing_after_it(pre_ln, tmp_path):
  """Damaged weight data, read while the streaming layout is written (every read of the stage
  is waited for, so nothing prints at exit)."""
  import shutil
  damaged = tmp_path / 'damaged'
  shutil.copytree(pre_ln.ckpt_dir, damaged)
  for f in (damaged / 'layer_001').rglob('*'):
    if f.is_file() and f.parent.name == 'd' and f.parent.parent.name.startswith('ocdbt'):
      f.write_bytes(f.read_bytes()[:20])
  for _ in range(3):  # stray reads finished at random times; a few runs catch them
    _one_line_error(run_cli('--weights=checkpoint', f'--checkpoint={damaged}',
                            '--w_gpu_percent=0', '--w_cpu_percent=0', '--prompt_len=4',
                            '--gen_len=2', f'--weights_cache={tmp_path / "cache"}'),
                    'layer_001', 'unreadable', 'convert the checkpoint again')


# slow (45 s in CI): the searches of README's launch --dry_run (opt-1.3b per stage) and suite
# --dry_run, and test_auto_policy_without_room_names_the_short_tier (opt-30b on the T4's profile)
# run in every test run
@pytest.mark.slow
def test_auto_policy_dry_run_prints_the_choice_and_prediction(tmp_path):
  _, report = run_report(tmp_path, f'--flagfile={REPO / "configs/opt30b.flags"}',
                         '--hw_profile=paper-t4', '--gpu_mem=15', '--cpu_mem=200',
                         '--disk_mem=1500', '--dry_run')
  assert report['policy_mode'] == 'auto' and report['predicted_total_tok_s'] > 0
  assert report['predicted_device_peak_bytes'] <= 15 * 2**30


# slow: README's batch job and tests/test_memcheck.py run searched policies; tests/test_search.py
# searches within a small device budget
@pytest.mark.slow
def test_auto_policy_runs_within_a_device_budget(tmp_path):
  profile = REPO / 'configs' / 'hw' / 'paper-t4.json'
  _, report = run_report(tmp_path, '--model=opt-125m', '--policy=auto',
                         f'--hw_profile={profile}', '--gpu_mem=0.5', '--cpu_mem=2',
                         '--disk_mem=4', f'--offload_dir={tmp_path}', '--prompt_len=8',
                         '--gen_len=3')
  assert report['planned_device_peak_bytes'] <= 0.5 * 2**30 and report['generated_tokens'] > 0


def test_hand_policies_get_a_prediction(tmp_path):
  _, manual = run_report(tmp_path, '--model=opt-125m', '--hw_profile=paper-t4',
                         '--prompt_len=8', '--gen_len=3', '--gpu_batch_size=2', '--dry_run')
  assert manual['predicted_total_tok_s'] > 0


def test_auto_policy_without_room_names_the_short_tier():
  _one_line_error(run_cli('--model=opt-30b', '--policy=auto', '--hw_profile=paper-t4',
                          '--gpu_mem=16', '--cpu_mem=8', '--disk_mem=10', '--prompt_len=512',
                          '--dry_run'), 'on the disk', 'GiB more than its budget')
