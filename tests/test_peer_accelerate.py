"""Tests of tools/peer_accelerate.py: the exported dummy checkpoint is flexjax's model, exactly;
the Accelerate run (when accelerate is installed) offloads to disk and reports its timings."""

import math

import numpy as np
import pytest

from flexjax.config import ModelConfig
from flexjax.engine import Engine
from flexjax.errors import FlexjaxError
from flexjax.weights import DummyWeights
from tools import peer_accelerate

TINY = ModelConfig(name='tiny', num_layers=2, hidden_size=64, num_heads=4, ffn_dim=128,
                   vocab_size=1000, max_positions=128)


def test_exported_checkpoint_computes_flexjax_logits(tmp_path):
  torch = pytest.importorskip('torch')
  transformers = pytest.importorskip('transformers')
  folder = peer_accelerate.export_dummy_checkpoint(TINY, tmp_path / 'ckpt', dtype='float32',
                                                   shard_bytes=50_000)
  assert len(list(folder.glob('model-*.safetensors'))) > 1  # sharded, with an index
  model = transformers.OPTForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
  tokens = np.random.default_rng(0).integers(3, TINY.vocab_size, (2, 12)).astype(np.int32)
  with torch.inference_mode():
    theirs = model(torch.from_numpy(tokens).long()).logits.numpy()
  with Engine(DummyWeights(TINY, dtype='float32')) as engine:
    ours = engine.score(tokens)
  np.testing.assert_allclose(theirs, ours, atol=1e-4, rtol=1e-4)


def test_export_is_reused_and_atomic(tmp_path):
  pytest.importorskip('torch')
  folder = peer_accelerate.export_dummy_checkpoint(TINY, tmp_path / 'ckpt')
  stamp = (folder / 'model.safetensors.index.json').stat().st_mtime_ns
  assert peer_accelerate.export_dummy_checkpoint(TINY, tmp_path / 'ckpt') == folder
  assert (folder / 'model.safetensors.index.json').stat().st_mtime_ns == stamp
  assert sorted(p.name for p in tmp_path.iterdir()) == ['ckpt']  # no temporary folders left
  with pytest.raises(FlexjaxError, match="dtype='int8'"):
    peer_accelerate.export_dummy_checkpoint(TINY, tmp_path / 'other', dtype='int8')
  assert not (tmp_path / 'other').exists()


def test_accelerate_run_offloads_to_disk_and_projects(tmp_path):
  pytest.importorskip('accelerate')
  out = peer_accelerate.run_accelerate(
      TINY, batch_size=2, prompt_len=8, gen_len=6, projected_gen_len=3,
      max_memory={'cpu': 100_000}, checkpoint_dir=tmp_path / 'ckpt', offload_dir=str(tmp_path))
  assert out['system'] == 'accelerate' and out['num_prompts'] == 2
  assert out['projected'] is True and out['measured_gen_len'] == 3
  assert out['peak_bytes']['disk'] > 0 and out['peak_bytes']['host'] <= 100_000
  assert out['decode_s'] == pytest.approx(out['measured_decode_s'] * 5 / 2)
  assert math.isfinite(out['prefill_s']) and out['prefill_s'] > 0
  assert out['compute_dtype'] == 'float32' and out['weight_storage_dtype'] == 'float16'
  assert sorted(p.name for p in tmp_path.iterdir()) == ['ckpt']  # offload folder removed
