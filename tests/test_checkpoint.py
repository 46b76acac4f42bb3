"""HF directory -> orbax checkpoint -> per-stage restore: exact, streamed, atomic, validated."""

import json
import shutil

import numpy as np
import pytest
import torch

from conftest import TINY_SHAPES, make_hf_model
from flexjax.checkpoint import Checkpoint, CheckpointWriter
from flexjax.errors import FlexjaxError
from flexjax.hf_import import HFCheckpoint, convert, hf_name
from flexjax.model import params as params_lib


def _expected(torch_model, stage, path):
  return torch_model.state_dict()['model.' + hf_name(stage, path)].numpy()


def test_round_trip_is_exact(tiny):
  ckpt = Checkpoint(tiny.ckpt_dir)
  assert ckpt.config.vocab_size == TINY_SHAPES[tiny.name]['vocab_size']
  for stage in params_lib.stage_names(ckpt.config):
    restored = params_lib.flatten(ckpt.read(stage))
    assert set(restored) == set(params_lib.flatten(params_lib.stage_shapes(ckpt.config, stage)))
    for path, value in restored.items():
      assert isinstance(value, np.ndarray) and value.dtype == np.float32
      np.testing.assert_array_equal(value, _expected(tiny.torch_model, stage, path))


def test_one_layer_restores_without_the_others(pre_ln, tmp_path):
  copy = tmp_path / 'ckpt'
  shutil.copytree(pre_ln.ckpt_dir, copy)
  ckpt = Checkpoint(copy)
  for stage in params_lib.stage_names(ckpt.config):
    if stage != 'layer_001':
      shutil.rmtree(copy / stage)
  layer = ckpt.read('layer_001')
  np.testing.assert_array_equal(layer['fc1']['weight'],
                                _expected(pre_ln.torch_model, 'layer_001', ('fc1', 'weight')))


def test_tokenizer_files_are_carried(pre_ln):
  ckpt = Checkpoint(pre_ln.ckpt_dir)
  assert (ckpt.tokenizer_path / 'vocab.json').is_file()
  from flexjax.tokenizer import Tokenizer
  tok = Tokenizer(ckpt.tokenizer_path, bos_token_id=2, special_ids=(1,))
  ids = tok.encode('Paris is the capital city of France.')
  assert ids[0] == 2 and len(ids) > 2
  assert tok.decode(ids) == 'Paris is the capital city of France.'


def test_keys_without_model_prefix_and_fp16_storage(tmp_path):
  from safetensors.numpy import save_file
  model = make_hf_model(TINY_SHAPES['pre_ln'])
  model.save_pretrained(tmp_path / 'hf')
  bare = {k.removeprefix('model.'): v.numpy() for k, v in model.state_dict().items()
          if k != 'lm_head.weight'}
  (tmp_path / 'hf' / 'model.safetensors').unlink()
  save_file(bare, str(tmp_path / 'hf' / 'model.safetensors'))
  convert(tmp_path / 'hf', tmp_path / 'ckpt', dtype='float16', progress=False)
  ckpt = Checkpoint(tmp_path / 'ckpt')
  assert ckpt.dtype == 'float16'
  q = ckpt.read('layer_000')['q']['weight']
  assert q.dtype == np.float16
  np.testing.assert_array_equal(q, _expected(model, 'layer_000', ('q', 'weight')).astype(np.float16))


def test_pytorch_bin_checkpoint(tmp_path):
  model = make_hf_model(TINY_SHAPES['post_ln_proj'])
  (tmp_path / 'hf').mkdir()
  model.config.to_json_file(tmp_path / 'hf' / 'config.json')
  torch.save(model.state_dict(), tmp_path / 'hf' / 'pytorch_model.bin')
  convert(tmp_path / 'hf', tmp_path / 'ckpt', progress=False)
  ckpt = Checkpoint(tmp_path / 'ckpt')
  np.testing.assert_array_equal(ckpt.read('head')['project_out']['weight'],
                                _expected(model, 'head', ('project_out', 'weight')))


def test_bfloat16_safetensors_are_read(tmp_path):
  model = make_hf_model(TINY_SHAPES['pre_ln']).to(torch.bfloat16)
  model.save_pretrained(tmp_path / 'hf')
  hf = HFCheckpoint(tmp_path / 'hf')
  assert hf.source_dtype() == 'bfloat16'
  got = hf.read_stage('layer_000', np.dtype(np.float32))['fc2']['weight']
  want = model.state_dict()['model.decoder.layers.0.fc2.weight'].float().numpy()
  np.testing.assert_array_equal(got, want)


def test_failed_conversion_leaves_no_checkpoint(tmp_path):
  from safetensors.numpy import save_file
  model = make_hf_model(TINY_SHAPES['pre_ln'])
  model.save_pretrained(tmp_path / 'hf')
  state = {k: v.numpy() for k, v in model.state_dict().items() if k != 'lm_head.weight'}
  state['model.decoder.layers.1.fc2.weight'] = state['model.decoder.layers.1.fc2.weight'][:, :-1]
  save_file(state, str(tmp_path / 'hf' / 'model.safetensors'))
  with pytest.raises(FlexjaxError, match=r'decoder\.layers\.1\.fc2\.weight has shape'):
    convert(tmp_path / 'hf', tmp_path / 'out' / 'ckpt', progress=False)
  assert list((tmp_path / 'out').iterdir()) == []  # no checkpoint, no leftover partial folder


def test_interrupted_write_leaves_no_checkpoint_and_keeps_the_old_one(pre_ln, tmp_path):
  target = tmp_path / 'ckpt'
  shutil.copytree(pre_ln.ckpt_dir, target)
  cfg = Checkpoint(target).config
  with pytest.raises(KeyboardInterrupt):
    with CheckpointWriter(target, cfg, 'float32', overwrite=True) as writer:
      writer.write_stage('tokens', {'tokens': np.zeros(cfg.tokens_shape(), np.float32)})
      raise KeyboardInterrupt
  assert sorted(p.name for p in tmp_path.iterdir()) == ['ckpt']
  np.testing.assert_array_equal(Checkpoint(target).read('tokens')['tokens'],
                                Checkpoint(pre_ln.ckpt_dir).read('tokens')['tokens'])


def test_existing_output_needs_overwrite(pre_ln, tmp_path):
  target = tmp_path / 'ckpt'
  shutil.copytree(pre_ln.ckpt_dir, target)
  with pytest.raises(FlexjaxError, match='already exists'):
    convert(pre_ln.hf_dir, target, progress=False)
  convert(pre_ln.hf_dir, target, overwrite=True, progress=False)
  assert Checkpoint(target).config.num_layers == 2


def test_an_output_made_while_converting_is_left_as_it_is(pre_ln, tmp_path):
  """Another conversion to the same path finished first (both found it missing): without
  --overwrite this one refuses at its end, leaving that output and nothing of its own."""
  target = tmp_path / 'ckpt'
  cfg = Checkpoint(pre_ln.ckpt_dir).config
  with pytest.raises(FlexjaxError, match='appeared while this checkpoint was written'):
    with CheckpointWriter(target, cfg, 'float32') as writer:
      for stage in params_lib.stage_names(cfg):
        writer.write_stage(stage, Checkpoint(pre_ln.ckpt_dir).read(stage))
      shutil.copytree(pre_ln.ckpt_dir, target)
      (target / 'theirs').write_text('kept')
  assert sorted(p.name for p in tmp_path.iterdir()) == ['ckpt']
  assert (target / 'theirs').read_text() == 'kept'


def test_an_output_that_is_or_holds_the_source_is_refused_and_the_source_kept(pre_ln, tmp_path):
  """--overwrite replaces the output folder: one that is the HF folder being converted, or
  holds it, is refused before any stage is read, the source as it was."""
  source = tmp_path / 'models' / 'hf'
  shutil.copytree(pre_ln.hf_dir, source)
  files = {p: p.read_bytes() for p in source.rglob('*') if p.is_file()}
  (tmp_path / 'link').symlink_to(source)
  for output, says in ((source, 'is the source'), (source.parent, 'holds the source'),
                       (tmp_path / 'link', 'is the source')):
    with pytest.raises(FlexjaxError, match=says):
      convert(source, output, overwrite=True, progress=False)
  assert {p: p.read_bytes() for p in source.rglob('*') if p.is_file()} == files
  convert(source, source / 'ckpt', progress=False)  # inside it is only a new folder
  assert Checkpoint(source / 'ckpt').config.num_layers == 2


def test_an_output_folder_that_cannot_be_made_is_one_line_before_reading(pre_ln, tmp_path):
  blocker = tmp_path / 'file'
  blocker.write_text('')
  with pytest.raises(FlexjaxError, match=r"\(its folder\) is a file; give a folder"):
    convert(pre_ln.hf_dir, blocker / 'ckpt', progress=False)
  assert sorted(p.name for p in tmp_path.iterdir()) == ['file']


@pytest.mark.parametrize('damage,message', [
    ('no_meta', 'incomplete or not a flexjax checkpoint'),
    ('bad_json', 'corrupt flexjax.json'),
    ('shape', 'has shape'),
    ('stage_files', 'is unreadable'),
    ('missing', 'does not exist'),
])
def test_damaged_checkpoints_give_one_line_errors(pre_ln, tmp_path, damage, message):
  target = tmp_path / 'ckpt'
  shutil.copytree(pre_ln.ckpt_dir, target)
  meta = target / 'flexjax.json'
  if damage == 'no_meta':
    meta.unlink()
  elif damage == 'bad_json':
    meta.write_text('{"format": ')
  elif damage == 'shape':
    d = json.loads(meta.read_text())
    d['model']['ffn_dim'] += 8
    meta.write_text(json.dumps(d))
  elif damage == 'stage_files':
    for f in (target / 'layer_001').rglob('*'):
      if f.is_file():
        f.write_bytes(b'garbage')
  elif damage == 'missing':
    target = tmp_path / 'nowhere'
  with pytest.raises(FlexjaxError, match=message) as err:
    Checkpoint(target).read('layer_001')
  assert '\n' not in str(err.value)
