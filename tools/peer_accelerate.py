"""Peer runner: Hugging Face transformers + Accelerate with offloading, run as its users run it.

The model is loaded with from_pretrained(..., device_map='auto', max_memory=...,
offload_folder=...) from a checkpoint holding flexjax's dummy weights (the same values flexjax
benchmarks with, stored in float16 as flexjax stores them), written once as Hugging Face
safetensors shards and kept in a cache folder. `dtype` is what Accelerate loads them as and
computes in: float32 on CPUs without native half-precision matrix units, where torch's
bfloat16/float16 matmuls are ~500x slower. Accelerate puts what fits the memory budget on the
device/CPU and reads the rest from disk for every forward pass. Prompts are flexjax's synthetic
prompts; generation is greedy and never stops early.

With page_cache='dropped' the checkpoint and offload files are dropped from the OS page cache
before the prefill and before every decode step (the time this takes is not counted), so disk
reads are real reads, as for flexjax's --drop_page_cache. Accelerate's max_memory bounds the
weights only; its KV cache and activations come on top.

Needs the optional extra `pip install -e '.[peers]'` (torch, transformers, accelerate).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from flexjax import diskio, scratch
from flexjax.config import ModelConfig
from flexjax.errors import FlexjaxError
from flexjax.hf_import import hf_key
from flexjax.model import params as params_lib
from flexjax.weights import DummyWeights

TORCH_DTYPES = ('bfloat16', 'float16', 'float32')


def check_available() -> None:
  """One-line error naming the install command when a peer package is missing."""
  import importlib.util
  missing = [name for name in ('torch', 'transformers', 'accelerate')
             if importlib.util.find_spec(name) is None]
  if missing:
    raise FlexjaxError(f'the Accelerate peer needs {", ".join(missing)}; install them with '
                       "pip install -e '.[peers]'")


def hf_config(cfg: ModelConfig, dtype: str) -> dict[str, Any]:
  """The config.json of an HF model (OPT or Llama) with flexjax's shapes."""
  common = {
      'hidden_size': cfg.hidden_size, 'num_hidden_layers': cfg.num_layers,
      'num_attention_heads': cfg.num_heads, 'vocab_size': cfg.vocab_size,
      'max_position_embeddings': cfg.max_positions, 'pad_token_id': cfg.pad_token_id,
      'bos_token_id': cfg.bos_token_id, 'eos_token_id': cfg.eos_token_id, 'dtype': dtype,
      'attention_dropout': 0.0, 'use_cache': True,
  }
  if cfg.family == 'llama':
    return {
        **common, 'model_type': 'llama', 'architectures': ['LlamaForCausalLM'],
        'hidden_act': 'silu', 'intermediate_size': cfg.ffn_dim,
        'num_key_value_heads': cfg.kv_heads, 'head_dim': cfg.head_dim,
        'rope_theta': cfg.rope_theta, 'rms_norm_eps': cfg.rms_norm_eps,
        'rope_scaling': dict(cfg.rope_scaling) if cfg.rope_scaling else None,
        'tie_word_embeddings': cfg.tie_word_embeddings, 'attention_bias': False,
        'mlp_bias': False,
    }
  return {
      **common, 'model_type': 'opt', 'architectures': ['OPTForCausalLM'],
      'activation_function': 'relu', 'ffn_dim': cfg.ffn_dim, 'word_embed_proj_dim': cfg.embed_dim,
      'do_layer_norm_before': cfg.do_layer_norm_before, 'enable_bias': cfg.enable_bias,
      '_remove_final_layer_norm': not cfg.final_layer_norm,
      'layer_norm_elementwise_affine': cfg.layer_norm_affine, 'tie_word_embeddings': True,
      'dropout': 0.0,
  }


def export_dummy_checkpoint(cfg: ModelConfig, directory: str | os.PathLike, *,
                            dtype: str = 'bfloat16', seed: int = 0,
                            shard_bytes: int = 2**30) -> Path:
  """Writes flexjax's dummy weights of `cfg` as an HF checkpoint (config.json, safetensors
  shards and their index) unless `directory` already holds one. The folder appears complete or
  not at all (written beside it, then renamed)."""
  import torch
  from safetensors.torch import save_file

  if dtype not in TORCH_DTYPES:
    raise FlexjaxError(f'dtype={dtype!r} is not one of {TORCH_DTYPES}')
  directory = Path(directory)
  if (directory / 'model.safetensors.index.json').is_file():
    return directory
  directory.parent.mkdir(parents=True, exist_ok=True)
  # written into a folder owned while it is written: a killed export's is swept by the next
  with scratch.claim(directory.parent, f'.{directory.name}.') as partial:
    tmp = partial.path
    source = DummyWeights(cfg, dtype='float32', seed=seed)
    weight_map: dict[str, str] = {}
    shard: dict[str, Any] = {}

    def flush() -> None:
      name = f'model-{len(set(weight_map.values())) + 1:05d}.safetensors'
      save_file(shard, str(tmp / name), metadata={'format': 'pt'})
      weight_map.update({key: name for key in shard})
      shard.clear()

    for stage in params_lib.stage_names(cfg):
      for path, array in params_lib.flatten(source.read(stage)).items():
        value = np.ascontiguousarray(array)
        shard[hf_key(cfg, stage, path)] = torch.from_numpy(value).to(getattr(torch, dtype))
      if sum(t.numel() * t.element_size() for t in shard.values()) >= shard_bytes:
        flush()
    if shard:
      flush()
    (tmp / 'model.safetensors.index.json').write_text(json.dumps(
        {'metadata': {}, 'weight_map': weight_map}, indent=1))
    (tmp / 'config.json').write_text(json.dumps(hf_config(cfg, dtype), indent=1))
    partial.disown()
    tmp.rename(directory)
  return directory


def drop_from_page_cache(*folders: str | os.PathLike) -> None:
  """Asks the OS to drop the cached pages of every file under the folders."""
  for folder in folders:
    for path in Path(folder).rglob('*'):
      if path.is_file():
        diskio.drop_from_page_cache(path)


def _step_clock(drop_folders: tuple[str, ...]):
  """A logits processor that notes when each generation step's forward pass ended and drops the
  offloaded files from the page cache before the next one (that time is kept apart)."""
  from transformers import LogitsProcessor

  class StepClock(LogitsProcessor):
    def __init__(self):
      self.times: list[float] = []
      self.excluded = 0.0

    def __call__(self, input_ids, scores):
      self.times.append(time.perf_counter())
      if drop_folders:
        drop_from_page_cache(*drop_folders)
        self.excluded += time.perf_counter() - self.times[-1]
      return scores

  return StepClock()


def run_accelerate(cfg: ModelConfig, *, batch_size: int, prompt_len: int, gen_len: int,
                   projected_gen_len: int | None, max_memory: dict[str | int, int],
                   checkpoint_dir: str | os.PathLike, offload_dir: str | None = None,
                   dtype: str = 'float32', checkpoint_dtype: str = 'float16',
                   page_cache: str = 'dropped') -> dict[str, Any]:
  """Loads the dummy checkpoint with Accelerate's offloading and times greedy generation of
  gen_len tokens (or projected_gen_len, decode time extrapolated) for batch_size prompts.

  Args:
    max_memory: bytes per device as Accelerate takes them ('cpu', or a GPU index); what does not
      fit goes to disk.
    checkpoint_dir: where the dummy HF checkpoint is (written there in checkpoint_dtype first
      if absent).
    dtype: what the model is loaded as and computes in.
  Returns the measured fields: prefill_s, decode_s (extrapolated when projected), measured
  decode, the device map's bytes per tier, peak RSS, versions.
  """
  check_available()
  import importlib.metadata

  import torch
  from transformers import AutoModelForCausalLM

  from flexjax.run import synthetic_prompts
  from tools.benchlib import host_peak_rss, reset_peak_rss

  if page_cache not in ('warm', 'dropped'):
    raise FlexjaxError(f'page_cache={page_cache!r} is unknown; use warm or dropped')
  measured_gen_len = projected_gen_len or gen_len
  if measured_gen_len < 2:
    raise FlexjaxError(f'gen_len={measured_gen_len} must be >= 2 (decode needs a second token)')
  torch.set_num_threads(os.cpu_count() or 1)
  if dtype not in TORCH_DTYPES:
    raise FlexjaxError(f'dtype={dtype!r} is not one of {TORCH_DTYPES}')
  checkpoint = export_dummy_checkpoint(cfg, checkpoint_dir, dtype=checkpoint_dtype)
  owned = scratch.claim(scratch.offload_parent(offload_dir), 'accelerate-offload-')
  offload = owned.path
  try:
    model = AutoModelForCausalLM.from_pretrained(
        checkpoint, device_map='auto', max_memory=dict(max_memory), offload_folder=str(offload),
        dtype=getattr(torch, dtype))
    model.eval()
    placement = _placement_bytes(model)
    gpus = sorted(d for d in (getattr(model, 'hf_device_map', None) or {}).values()
                  if isinstance(d, int))
    first = torch.device(f'cuda:{gpus[0]}' if gpus else 'cpu')  # where inputs go
    prompts = np.array(synthetic_prompts(cfg, num=batch_size, length=prompt_len, seed=0))
    input_ids = torch.from_numpy(prompts).long()
    mask = torch.ones_like(input_ids)
    drop = (str(checkpoint), str(offload)) if page_cache == 'dropped' else ()

    def generate(ids, attention, new_tokens, clock):
      with torch.inference_mode():
        return model.generate(ids.to(first), attention_mask=attention.to(first),
                              max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                              do_sample=False, logits_processor=[clock],
                              pad_token_id=cfg.pad_token_id)

    generate(input_ids[:, :8], mask[:, :8], 2, _step_clock(()))  # warm-up, untimed
    reset_peak_rss()
    clock = _step_clock(drop)
    if drop:
      drop_from_page_cache(*drop)
    start = time.perf_counter()
    out = generate(input_ids, mask, measured_gen_len, clock)
    end = time.perf_counter()
    rss = host_peak_rss()
  finally:
    owned.release()
  if out.shape[1] != prompt_len + measured_gen_len or len(clock.times) != measured_gen_len:
    raise FlexjaxError(f'Accelerate generated {out.shape[1] - prompt_len} tokens in '
                       f'{len(clock.times)} steps; expected {measured_gen_len}')
  drops_before_decode = clock.excluded  # every drop happens after a step's logits
  prefill_s = clock.times[0] - start
  measured_decode_s = end - clock.times[0] - drops_before_decode
  decode_s = measured_decode_s * (gen_len - 1) / (measured_gen_len - 1)
  return {
      'system': 'accelerate', 'system_version': importlib.metadata.version('accelerate'),
      'num_prompts': batch_size, 'measured_gen_len': measured_gen_len,
      'projected': measured_gen_len < gen_len, 'prefill_s': prefill_s, 'decode_s': decode_s,
      'measured_decode_s': measured_decode_s, 'peak_bytes': placement,
      'host_peak_rss_bytes': rss, 'policy': f'row-by-row batch {batch_size}, cache on '
      f'{first.type}, {dtype}', 'compute_dtype': dtype, 'weight_storage_dtype': checkpoint_dtype,
      'device': str(first), 'max_memory': {str(k): v for k, v in max_memory.items()},
  }


def _placement_bytes(model) -> dict[str, int]:
  """Weight bytes Accelerate put on the device(s), the CPU and disk (its hf_device_map)."""
  tiers = {'device': 0, 'host': 0, 'disk': 0}
  device_map = getattr(model, 'hf_device_map', {}) or {}
  for name, param in model.named_parameters():
    where = _mapped(device_map, name)
    tier = ('disk' if where == 'disk' else 'host' if where == 'cpu' else 'device')
    tiers[tier] += param.numel() * param.element_size()
  return tiers


def _mapped(device_map: dict[str, Any], name: str) -> Any:
  parts = name.split('.')
  for end in range(len(parts), -1, -1):
    key = '.'.join(parts[:end])
    if key in device_map:
      return device_map[key]
  return 'cpu'
