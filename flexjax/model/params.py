"""Parameter trees of the model's stages (input embedding, decoder layers, head) and dummy init."""

from __future__ import annotations

import concurrent.futures
import hashlib
import os
from typing import Any, Callable

import numpy as np

from flexjax.config import ModelConfig, ShapeTree

# A stage's parameters: nested dicts of host numpy arrays, mirroring ModelConfig's shape trees.
HostParams = dict[str, Any]

# Values per independently seeded chunk of a dummy tensor (4 MiB of float32: a core's cache).
DUMMY_CHUNK = 1 << 20
# Values a chunk is drawn in at a time (the same stream of values): a whole chunk's float32 draw
# (up to 4 MiB) in a short-lived worker thread stays in that thread's malloc arena as its free top,
# which malloc_trim does not return; a SmolLM2 run that wrote its dummy layout held eleven such
# 3.6 MB arenas, 50 MB more through its run than one that found the layout written.
DUMMY_PIECE = 1 << 17


def map_shapes(fn: Callable[[tuple[str, ...], tuple[int, ...]], Any], shapes: ShapeTree,
               prefix: tuple[str, ...] = ()) -> dict:
  """Applies fn(path, shape) to every leaf of a shape tree, keeping its structure."""
  return {k: map_shapes(fn, v, prefix + (k,)) if isinstance(v, dict) else fn(prefix + (k,), v)
          for k, v in shapes.items()}


def flatten(tree: dict, prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], Any]:
  """{'a': {'b': x}} -> {('a', 'b'): x}."""
  out = {}
  for k, v in tree.items():
    if isinstance(v, dict):
      out.update(flatten(v, prefix + (k,)))
    else:
      out[prefix + (k,)] = v
  return out


def unflatten(flat: dict[tuple[str, ...], Any]) -> dict:
  """{('a', 'b'): x} -> {'a': {'b': x}}."""
  tree: dict = {}
  for path, value in flat.items():
    node = tree
    for key in path[:-1]:
      node = node.setdefault(key, {})
    node[path[-1]] = value
  return tree


def stage_shapes(cfg: ModelConfig, stage: str) -> ShapeTree:
  """Shapes of a stored stage: 'tokens', 'embed', 'head' or 'layer_<i>'."""
  if stage == 'tokens':
    return {'tokens': cfg.tokens_shape()}
  if stage == 'embed':
    return cfg.embed_shapes()
  if stage == 'head':
    return cfg.head_shapes()
  if stage.startswith('layer_') and 0 <= int(stage[6:]) < cfg.num_layers:
    return cfg.layer_shapes()
  raise ValueError(f'unknown stage {stage!r}')


def stage_names(cfg: ModelConfig) -> list[str]:
  """Stored stages in model order."""
  return ['tokens', 'embed'] + [layer_name(i) for i in range(cfg.num_layers)] + ['head']


def used_in_parts(stage: str, path: tuple[str, ...], *, cast: bool) -> bool:
  """Whether a stage's function takes this tensor, when it is split across tiers, as the tuple
  of its row parts instead of joined: the embedding stage's token table (each id is gathered
  from the part holding it, exactly as from the whole), and every matrix a step multiplies by,
  a dense layer's weight or the head's LM head (the tied token table or lm_head), where the
  step casts it to the compute dtype (`cast`: it arrives in another dtype), a tile at a time,
  the whole matrix's tiles taken from its parts (model/linear.dense). Loading it then joins
  nothing. A matrix the step multiplies as it arrives (float16 compute on a GPU, a packed one
  dequantized as it loads) is one product of the whole matrix, so its parts are joined once per
  load, not in every step that uses it."""
  if (stage, path) == ('embed', ('tokens',)):
    return True
  return cast and (path[-1] == 'weight' or (stage, path) in (
      ('head', ('tokens',)), ('head', ('lm_head',))))


def gathered(stage: str, path: tuple[str, ...]) -> bool:
  """Whether a stage's function reads only the rows its ids look up of this tensor: the
  embedding stage's token table."""
  return (stage, path) == ('embed', ('tokens',))


def layer_name(index: int) -> str:
  return f'layer_{index:03d}'


def dummy_stage(cfg: ModelConfig, stage: str, dtype: np.dtype, seed: int, *,
                workers: int | None = None) -> HostParams:
  """Random but deterministic parameters of one stage, created without touching other stages.

  LayerNorm scales are 1; every other tensor is uniform with std 0.02 (the OPT initialisation
  scale), so activations stay in a realistic range through deep models. Each tensor is filled in
  chunks of DUMMY_CHUNK values, each chunk from its own generator seeded by (seed, stage, tensor,
  chunk): the values do not depend on `workers`, the threads that fill the chunks (default: one
  per core; numpy's generators and casts run outside the GIL). An opt-6.7b layer in float16 on
  the 2-core CPU: 120-190 M values/s as whole tensors from one generator, 450-500 in chunks.
  """
  half_width = np.float32(0.02 * np.sqrt(3.0))
  out = flatten(map_shapes(lambda path, shape: np.ones(shape, dtype) if path[-1] == 'scale'
                           else np.empty(shape, dtype), stage_shapes(cfg, stage)))
  jobs = [(path, chunk) for path, array in out.items() if path[-1] != 'scale'
          for chunk in range(-(-array.size // DUMMY_CHUNK))]

  def fill(job: tuple[tuple[str, ...], int]) -> None:
    path, chunk = job
    name = hashlib.sha256('/'.join((stage, *path)).encode()).digest()[:16]
    rng = np.random.default_rng([seed, int.from_bytes(name, 'little'), chunk])
    part = out[path].reshape(-1)[chunk * DUMMY_CHUNK:(chunk + 1) * DUMMY_CHUNK]
    for start in range(0, part.size, DUMMY_PIECE):
      values = rng.random(min(DUMMY_PIECE, part.size - start), dtype=np.float32)
      values *= 2 * half_width
      values -= half_width
      part[start:start + DUMMY_PIECE] = values

  with concurrent.futures.ThreadPoolExecutor(workers or os.cpu_count() or 1) as pool:
    list(pool.map(fill, jobs))
  return unflatten(out)
