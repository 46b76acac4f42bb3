"""Cost model (paper section 4.3, appendix A.3): time of a block and peak memory per tier as
linear functions of the placement fractions, for a fixed batch geometry.

Each term is a `Linear` over the nine fractions (wg, wc, wd, cg, cc, cd, hg, hc, hd), so the same
expressions serve the LP (as constraints) and the prediction for a given policy (evaluated).
Under overlap a layer takes the largest of its I/O and compute terms; without, their sum.
"""

from __future__ import annotations

import dataclasses
import math

from flexjax import plan as plan_lib
from flexjax.plan import Linear, term
from flexjax.config import ModelConfig
from flexjax.hardware import HardwareProfile
from flexjax.model import linear
from flexjax.model import params as params_lib
from flexjax.policy import Policy

FRACTIONS = ('wg', 'wc', 'wd', 'cg', 'cc', 'cd', 'hg', 'hc', 'hd')


def fractions(policy: Policy, cfg: ModelConfig | None = None) -> dict[str, float]:
  """A policy's placement as fractions: cache and hidden states by their realised rows, weights
  by the bytes each tier really gets when `cfg` is given (whole tensors), else by percent."""
  out = {'wg': policy.w_gpu_percent / 100, 'wc': policy.w_cpu_percent / 100,
         'wd': policy.w_disk_percent / 100}
  if cfg is not None:
    placed = plan_lib.weight_totals(cfg, policy, plan_lib.Itemsizes(1, 1, 1)).stored
    total = sum(placed.values())
    out.update(wg=placed['device'] / total, wc=placed['host'] / total, wd=placed['disk'] / total)
  for kind, letter in (('cache', 'c'), ('act', 'h')):
    rows = policy.rows(kind)
    b = policy.gpu_batch_size
    out.update({f'{letter}g': rows['device'] / b, f'{letter}c': rows['host'] / b,
                f'{letter}d': rows['disk'] / b})
  return out


@dataclasses.dataclass(frozen=True)
class Model:
  """The block's time terms and memory forms for one model, workload and batch geometry."""

  prefill: dict[str, Linear]  # per decoder layer
  decode: dict[str, Linear]  # per decoder layer, averaged over the generated tokens
  ends_prefill: dict[str, Linear]  # embedding + head stages, once per token
  ends_decode: dict[str, Linear]
  memory: dict[str, list[Linear]]  # tier -> forms that must each fit its budget
  num_layers: int
  gen_len: int
  block_size: int
  overlap: bool

  def layer_time(self, terms: dict[str, Linear], x: dict[str, float]) -> float:
    values = [t.value(x) for t in terms.values()]
    return max(values) if self.overlap else sum(values)

  def predict(self, x: dict[str, float]) -> 'Prediction':
    pre = self.num_layers * self.layer_time(self.prefill, x) + self.layer_time(self.ends_prefill, x)
    gen = self.num_layers * self.layer_time(self.decode, x) + self.layer_time(self.ends_decode, x)
    decode_s = gen * (self.gen_len - 1)
    peaks = {tier: max(form.value(x) for form in forms) for tier, forms in self.memory.items()}
    return Prediction(prefill_s=pre, decode_s=decode_s,
                      throughput=self.block_size * self.gen_len / (pre + decode_s),
                      peak_bytes={k: int(v) for k, v in peaks.items()})


@dataclasses.dataclass(frozen=True)
class Prediction:
  prefill_s: float  # one block
  decode_s: float
  throughput: float  # generated tokens per second
  peak_bytes: dict[str, int]


def build(cfg: ModelConfig, policy: Policy, hw: HardwareProfile, sizes: plan_lib.Itemsizes, *,
          prompt_len: int, gen_len: int, planner: plan_lib.Planner | None = None) -> Model:
  """The cost model for `policy`'s batch geometry, overlap, CPU attention and approximations
  (its placement percentages are the free variables). Memory comes from the execution plan's
  buffers (planner.forms); without a planner, one for this backend is made."""
  L, h = cfg.num_layers, cfg.hidden_size
  gbs, bls = policy.gpu_batch_size, policy.block_size
  s, n = prompt_len, gen_len
  avg = s + n / 2  # average attended positions while decoding
  cpu_att = policy.cpu_attention

  stored = {stage: sum(slot.stored for slot in plan_lib.stage_layout(cfg, policy, sizes, stage))
            for stage in ('embed', 'layer_000', 'head')}  # every decoder layer is alike
  w_layer = stored['layer_000']
  w_ends = stored['embed'] + stored['head']
  k_tok = plan_lib.cache_row_bytes(cfg, policy, sizes)  # K (or V) of one token, one layer
  read_v = policy.attn_sparsity if policy.attn_sparsity < 1 else 1.0
  kv_read_tok = k_tok * (1 + read_v)  # bytes read per attended position (K and kept V)
  hid = h * sizes.compute
  flops_layer = 2 * layer_matmul_params(cfg)  # per token
  q_dim = cfg.q_dim  # attention's width: scores and weighted sums over every query head
  # a long prompt step's products: oneDNN's or XLA's own, as the family's steps compile them
  mm_p = hw.matmul_flops(gbs * s, library=linear.family_in_library(cfg.family))
  mm_g = hw.matmul_flops(gbs)
  bmm_p, bmm_g = hw.prompt_attention_flops(gbs), hw.attention_flops(gbs)
  # The engine's own time per stage step beside its products, once per GPU batch.
  step = (hw.step_overhead_s or 0.0) * policy.num_gpu_batches

  # A CPU 'device' takes the host's aligned weight buffers without a copy (mover); elsewhere
  # every loaded weight byte crosses host -> device.
  w_put_bw = math.inf if hw.copies_share_compute else hw.ctog_bw
  w_put = w_layer / w_put_bw
  prefill = {
      'ctog': term(wc=w_put, wd=w_put,
                   hc=bls * s * hid / hw.ctog_bw, hd=bls * s * hid / hw.ctog_bw),
      'gtoc': term(cc=bls * s * 2 * k_tok / hw.gtoc_bw, cd=bls * s * 2 * k_tok / hw.gtoc_bw,
                   hc=bls * s * hid / hw.gtoc_bw, hd=bls * s * hid / hw.gtoc_bw),
      'dtoc': term(wd=w_layer / hw.dtoc_bw, hd=bls * s * hid / hw.dtoc_bw),
      'ctod': term(cd=bls * s * 2 * k_tok / hw.ctod_bw, hd=bls * s * hid / hw.ctod_bw),
      'compute': term(bls * s * flops_layer / mm_p + bls * 4 * s * s * q_dim / bmm_p + step),
  }
  # offloaded cache rows brought to the device's attention; none where the CPU backend attends
  # over them in host RAM (plan.cache_read_in_place; with rows on disk too the host rows are
  # copied beside the disk reads, which the dtoc term charges: left out of this linear model)
  read_in_place = plan_lib.cache_read_in_place(policy, hw.copies_share_compute, disk_rows=0)
  cache_in = 0.0 if read_in_place else bls * avg * kv_read_tok / hw.ctog_bw
  attention_device = bls * 4 * avg * q_dim / bmm_g
  # On a CPU backend the device is the CPU: its attention and CPU attention run on the same
  # cores at one rate (two measurements of it differ only by noise).
  attention_cpu = bls * 4 * avg * q_dim / (bmm_g if hw.copies_share_compute else hw.cpu_flops)
  offloaded_attention = attention_cpu if cpu_att else attention_device
  decode = {
      'ctog': term(wc=w_put, wd=w_put, cc=cache_in, cd=cache_in,
                   hc=bls * hid / hw.ctog_bw, hd=bls * hid / hw.ctog_bw),
      'gtoc': term(cc=bls * 2 * k_tok / hw.gtoc_bw, cd=bls * 2 * k_tok / hw.gtoc_bw,
                   hc=bls * hid / hw.gtoc_bw, hd=bls * hid / hw.gtoc_bw),
      'dtoc': term(wd=w_layer / hw.dtoc_bw, cd=bls * avg * kv_read_tok / hw.dtoc_bw,
                   hd=bls * hid / hw.dtoc_bw),
      'ctod': term(cd=bls * 2 * k_tok / hw.ctod_bw, hd=bls * hid / hw.ctod_bw),
      'compute': term(bls * flops_layer / mm_g + step, cg=attention_device, cc=offloaded_attention,
                      cd=offloaded_attention),
  }
  head_flops = 2 * cfg.embed_dim * cfg.vocab_size
  ends = lambda rows, mm: {
      'ctog': term(wc=w_ends / w_put_bw, wd=w_ends / w_put_bw),
      'dtoc': term(wd=w_ends / hw.dtoc_bw),
      'compute': term(rows * head_flops / mm + 2 * step),  # embedding and head stages
  }
  if planner is None:
    planner = plan_lib.Planner.for_sizes(cfg, sizes, device_is_host=hw.copies_share_compute)
  mem = planner.forms(policy, prompt_len=prompt_len, gen_len=gen_len)
  terms = [prefill, decode, ends(bls, hw.matmul_flops(gbs)), ends(bls, mm_g)]
  if hw.copies_share_compute:
    hidden = hw.disk_overlap if policy.overlap else 1.0  # without overlap the terms add anyway
    terms = [_share_compute(t, hidden) for t in terms]
  return Model(prefill=terms[0], decode=terms[1], ends_prefill=terms[2], ends_decode=terms[3],
               memory=mem, num_layers=L, gen_len=n, block_size=bls, overlap=policy.overlap)


def layer_matrices(cfg: ModelConfig) -> list[tuple[int, int]]:
  """[out, in] of each matrix of one decoder layer (OPT: q, k, v, out, fc1, fc2; llama: q, k, v,
  o with grouped KV heads, then gate, up, down)."""
  return [tuple(s) for s in params_lib.flatten(cfg.layer_shapes()).values() if len(s) == 2]


def layer_matmul_params(cfg: ModelConfig) -> int:
  """Weights of one decoder layer's matrices (OPT: 4·h² + 2·h·ffn; llama: q, k, v, o with
  grouped KV heads, then gate, up, down): a token's multiply-adds in its products."""
  return sum(math.prod(shape) for shape in layer_matrices(cfg))


def _share_compute(terms: dict[str, Linear], hidden: float = 1.0) -> dict[str, Linear]:
  """On a CPU 'device' the host<->device copies run on the cores that compute: they add up, and
  only the disk terms overlap with them, `hidden` of the shorter of the two running behind the
  longer (the rest adds): each pair's time is max(a, b) + (1 - hidden) min(a, b), the larger of
  a + (1 - hidden) b and b + (1 - hidden) a."""
  shared = terms['compute'] + terms.get('ctog', Linear()) + terms.get('gtoc', Linear())
  disk = {k: v for k, v in terms.items() if k in ('dtoc', 'ctod')}
  out = {'compute': shared}
  for name, form in disk.items():
    out[name] = form + (1.0 - hidden) * shared
    if hidden < 1.0:
      out[f'compute+{name}'] = shared + (1.0 - hidden) * form
  return out


def predict(cfg: ModelConfig, policy: Policy, hw: HardwareProfile, sizes: plan_lib.Itemsizes, *,
            prompt_len: int, gen_len: int,
            planner: plan_lib.Planner | None = None) -> Prediction:
  """Predicted block time, throughput and peak bytes of a hand-given or searched policy."""
  model = build(cfg, policy, hw, sizes, prompt_len=prompt_len, gen_len=gen_len, planner=planner)
  return model.predict(fractions(policy, cfg))

