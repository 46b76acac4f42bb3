"""fp16-stored weights computed in fp32: parity with transformers reading the same fp16 file."""

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from conftest import PROMPTS, TINY_SHAPES, hf_logits, left_pad, make_hf_model
from flexjax.checkpoint import Checkpoint
from flexjax.engine import Engine, GenerationConfig
from flexjax.hf_import import HFCheckpoint, convert, hf_name
from flexjax.model import params as params_lib
from flexjax.policy import Policy

GEN_LEN = 8
ATOL = 1e-4  # absolute logit bound: both sides compute in fp32 from identical fp16 weights


@dataclasses.dataclass
class Fp16Model:
  hf_dir: Path
  ckpt_dir: Path
  reference: object  # transformers' model of hf_dir, upcast to fp32 on load

  def engine(self, **kw) -> Engine:
    return Engine(Checkpoint(self.ckpt_dir), compute_dtype='float32', **kw)


@pytest.fixture(scope='module')
def fp16(tmp_path_factory) -> Fp16Model:
  """A tiny random OPT saved by transformers in fp16, converted by flexjax to an fp16 checkpoint;
  the reference is transformers loading that same fp16 folder as fp32."""
  root = tmp_path_factory.mktemp('fp16')
  make_hf_model(TINY_SHAPES['pre_ln']).to(torch.float16).save_pretrained(root / 'hf')
  convert(root / 'hf', root / 'ckpt', dtype='float16', progress=False)
  reference = transformers.OPTForCausalLM.from_pretrained(root / 'hf', dtype=torch.float32).eval()
  return Fp16Model(root / 'hf', root / 'ckpt', reference)


def test_both_sides_hold_the_same_fp16_values(fp16):
  assert HFCheckpoint(fp16.hf_dir).source_dtype() == 'float16'  # the safetensors hold fp16
  ckpt = Checkpoint(fp16.ckpt_dir)
  assert ckpt.dtype == 'float16'
  assert all(p.dtype == torch.float32 for p in fp16.reference.parameters())
  state = {k.removeprefix('model.'): v.numpy() for k, v in fp16.reference.state_dict().items()}
  compared = 0
  for stage in params_lib.stage_names(ckpt.config):
    for path, stored in params_lib.flatten(ckpt.read(stage)).items():
      theirs = state[hf_name(stage, path)]
      assert stored.dtype == np.float16, f'{stage}/{path}'
      np.testing.assert_array_equal(stored.astype(np.float32), theirs, err_msg=f'{stage}/{path}')
      compared += 1
  assert compared == len(state) - 1  # every tensor but the tied lm_head


def test_fp16_prefill_logits_match_transformers(fp16):
  """Logits of every valid prompt position within 1e-4 (absolute) of transformers'."""
  ids, mask = left_pad(PROMPTS)
  ref = hf_logits(fp16.reference, ids, mask)
  ours = fp16.engine().score(ids.numpy(), mask.numpy().astype(bool))
  valid = mask.numpy().astype(bool)
  assert ours.shape == ref.shape and ours.dtype == np.float32
  np.testing.assert_allclose(ours[valid], ref[valid], atol=ATOL, rtol=0)


@pytest.mark.parametrize('gpu_batch_size', [4, 2])
def test_fp16_greedy_generation_matches_transformers(fp16, gpu_batch_size):
  """Every decode step's logits within 1e-4 (absolute) of transformers' forward pass over the
  same tokens, and the greedy tokens equal transformers' generate(do_sample=False)."""
  result = fp16.engine(policy=Policy(gpu_batch_size=gpu_batch_size)).generate(
      PROMPTS, GenerationConfig(gen_len=GEN_LEN, stop_at_eos=False), return_logits=True)
  ids, mask = left_pad(PROMPTS)
  s = ids.shape[1]
  with torch.no_grad():
    out = fp16.reference.generate(input_ids=ids, attention_mask=mask, max_new_tokens=GEN_LEN,
                                  do_sample=False, pad_token_id=1, eos_token_id=None)
  expected = out[:, s:].numpy()
  assert expected.shape == (len(PROMPTS), GEN_LEN)  # no early stop: eos_token_id=None
  np.testing.assert_array_equal(result.tokens, expected)
  # Position s-1+t of prompt + generated tokens predicts step t.
  full_ids = torch.cat([ids, torch.tensor(result.tokens[:, :-1], dtype=ids.dtype)], dim=1)
  full_mask = torch.cat([mask, torch.ones(len(PROMPTS), GEN_LEN - 1, dtype=mask.dtype)], dim=1)
  ref = hf_logits(fp16.reference, full_ids, full_mask)[:, s - 1:]
  assert result.logits.shape == ref.shape
  np.testing.assert_allclose(result.logits, ref, atol=ATOL, rtol=0)
