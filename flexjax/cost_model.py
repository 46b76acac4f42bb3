"""Cost model (paper section 4.3, appendix A.3): time of a block and peak memory per tier as
linear functions of the placement fractions, for a fixed batch geometry.

Each term is a `Linear` over the nine fractions (wg, wc, wd, cg, cc, cd, hg, hc, hd), so the same
expressions serve the LP (as constraints) and the prediction for a given policy (evaluated).
Under overlap a layer takes the largest of its I/O and compute terms; without, their sum.
"""

from __future__ import annotations

import dataclasses

from flexjax import memory
from flexjax.config import ModelConfig
from flexjax.hardware import HardwareProfile
from flexjax.policy import Policy

FRACTIONS = ('wg', 'wc', 'wd', 'cg', 'cc', 'cd', 'hg', 'hc', 'hd')


@dataclasses.dataclass
class Linear:
  """const + sum(coef[v] * v) over placement fractions."""

  const: float = 0.0
  coef: dict[str, float] = dataclasses.field(default_factory=dict)

  def __add__(self, other: 'Linear') -> 'Linear':
    coef = dict(self.coef)
    for k, v in other.coef.items():
      coef[k] = coef.get(k, 0.0) + v
    return Linear(self.const + other.const, coef)

  def __mul__(self, factor: float) -> 'Linear':
    return Linear(self.const * factor, {k: v * factor for k, v in self.coef.items()})

  def value(self, x: dict[str, float]) -> float:
    return self.const + sum(c * x[k] for k, c in self.coef.items())


def term(const: float = 0.0, **coef: float) -> Linear:
  return Linear(const, coef)


def fractions(policy: Policy, cfg: ModelConfig | None = None) -> dict[str, float]:
  """A policy's placement as fractions: cache and hidden states by their realised rows, weights
  by the bytes each tier really gets when `cfg` is given (whole tensors), else by percent."""
  out = {'wg': policy.w_gpu_percent / 100, 'wc': policy.w_cpu_percent / 100,
         'wd': policy.w_disk_percent / 100}
  if cfg is not None:
    placed = {'device': 0, 'host': 0, 'disk': 0}
    unit = memory.Itemsizes(1, 1, 1)
    for stage, count in memory.distinct_stages(cfg).items():
      shapes = memory.stage_shapes(cfg, stage)
      for path, tier in memory.place_stage(cfg, stage, policy).items():
        placed[tier] += count * memory.tensor_bytes(policy, unit, shapes[path])[0]
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


def build(cfg: ModelConfig, policy: Policy, hw: HardwareProfile, sizes: memory.Itemsizes, *,
          prompt_len: int, gen_len: int) -> Model:
  """The cost model for `policy`'s batch geometry, overlap, CPU attention and approximations
  (its placement percentages are the free variables)."""
  L, h = cfg.num_layers, cfg.hidden_size
  gbs, bls = policy.gpu_batch_size, policy.block_size
  s, n = prompt_len, gen_len
  t = s + n - 1  # cache positions
  avg = s + n / 2  # average attended positions while decoding
  buffers = 2 if policy.overlap else 1
  inflight = 3 if policy.overlap else 1  # as memory.peak_bytes
  cpu_att = policy.cpu_attention

  stored, on_device, resident = {}, {}, {}
  for stage in ('embed', 'layer_000', 'head'):  # every decoder layer has the same shapes
    shapes = memory.stage_shapes(cfg, stage).values()
    pairs = [memory.tensor_bytes(policy, sizes, shape) for shape in shapes]
    stored[stage] = sum(p[0] for p in pairs)
    on_device[stage] = sum(p[1] for p in pairs)  # once loaded
    resident[stage] = sum(p[0] if memory.compressed(policy, shape) else p[1]
                          for p, shape in zip(pairs, shapes))
  w_layer = stored['layer_000']
  w_ends = stored['embed'] + stored['head']
  k_tok = memory.cache_row_bytes(cfg, policy, sizes)  # K (or V) of one token, one layer
  read_v = policy.attn_sparsity if policy.attn_sparsity < 1 else 1.0
  kv_read_tok = k_tok * (1 + read_v)  # bytes read per attended position (K and kept V)
  hid = h * sizes.compute
  flops_layer = 2 * (4 * h * h + 2 * h * cfg.ffn_dim)  # per token
  mm_p, mm_g = hw.matmul_flops(gbs * s), hw.matmul_flops(gbs)
  bmm_p, bmm_g = hw.attention_flops(gbs), hw.attention_flops(gbs)

  prefill = {
      'ctog': term(wc=w_layer / hw.ctog_bw, wd=w_layer / hw.ctog_bw,
                   hc=bls * s * hid / hw.ctog_bw, hd=bls * s * hid / hw.ctog_bw),
      'gtoc': term(cc=bls * s * 2 * k_tok / hw.gtoc_bw, cd=bls * s * 2 * k_tok / hw.gtoc_bw,
                   hc=bls * s * hid / hw.gtoc_bw, hd=bls * s * hid / hw.gtoc_bw),
      'dtoc': term(wd=w_layer / hw.dtoc_bw, hd=bls * s * hid / hw.dtoc_bw),
      'ctod': term(cd=bls * s * 2 * k_tok / hw.ctod_bw, hd=bls * s * hid / hw.ctod_bw),
      'compute': term(bls * s * flops_layer / mm_p + bls * 4 * s * s * h / bmm_p),
  }
  cache_in = 0.0 if cpu_att else bls * avg * kv_read_tok / hw.ctog_bw
  attention_device = bls * 4 * avg * h / bmm_g
  attention_cpu = bls * 4 * avg * h / hw.cpu_flops
  offloaded_attention = attention_cpu if cpu_att else attention_device
  decode = {
      'ctog': term(wc=w_layer / hw.ctog_bw, wd=w_layer / hw.ctog_bw, cc=cache_in, cd=cache_in,
                   hc=bls * hid / hw.ctog_bw, hd=bls * hid / hw.ctog_bw),
      'gtoc': term(cc=bls * 2 * k_tok / hw.gtoc_bw, cd=bls * 2 * k_tok / hw.gtoc_bw,
                   hc=bls * hid / hw.gtoc_bw, hd=bls * hid / hw.gtoc_bw),
      'dtoc': term(wd=w_layer / hw.dtoc_bw, cd=bls * avg * kv_read_tok / hw.dtoc_bw,
                   hd=bls * hid / hw.dtoc_bw),
      'ctod': term(cd=bls * 2 * k_tok / hw.ctod_bw, hd=bls * hid / hw.ctod_bw),
      'compute': term(bls * flops_layer / mm_g, cg=attention_device, cc=offloaded_attention,
                      cd=offloaded_attention),
  }
  head_flops = 2 * cfg.embed_dim * cfg.vocab_size
  ends = lambda rows, mm: {
      'ctog': term(wc=w_ends / hw.ctog_bw, wd=w_ends / hw.ctog_bw),
      'dtoc': term(wd=w_ends / hw.dtoc_bw),
      'compute': term(rows * head_flops / mm),
  }
  # Memory, mirroring memory.peak_bytes with fractions in place of rows and tensors.
  w_all_store = w_ends + L * w_layer
  w_all_dev = resident['embed'] + resident['head'] + L * resident['layer_000']
  w_max_dev = max(on_device.values())
  largest_tensor = max(memory.tensor_bytes(policy, sizes, shape)[0]
                       for stage in ('embed', 'layer_000', 'head')
                       for shape in memory.stage_shapes(cfg, stage).values())
  kv_seq = 2 * t * k_tok  # K and V of one sequence, one layer
  kv_read_seq = t * kv_read_tok
  act_seq = s * hid
  base = term(buffers * w_max_dev, wg=w_all_dev - buffers * w_max_dev,
              cg=L * bls * kv_seq, hg=bls * act_seq - inflight * gbs * act_seq)
  base = base + term(inflight * gbs * act_seq)
  prefill_working = term(buffers * gbs * 2 * s * h * sizes.cache)
  decode_working = (term() if cpu_att
                    else term(cc=inflight * gbs * kv_read_seq, cd=inflight * gbs * kv_read_seq))
  mem = {
      'device': [base + prefill_working, base + decode_working],
      'host': [term(wc=w_all_store, cc=L * bls * kv_seq, hc=bls * act_seq,
                    wd=largest_tensor, cd=inflight * gbs * kv_read_seq,
                    hd=inflight * gbs * act_seq)],
      'disk': [term(wd=w_all_store, cd=L * bls * kv_seq, hd=bls * act_seq)],
  }
  terms = [prefill, decode, ends(bls, hw.matmul_flops(gbs)), ends(bls, mm_g)]
  if hw.copies_share_compute:
    terms = [_share_compute(t) for t in terms]
  return Model(prefill=terms[0], decode=terms[1], ends_prefill=terms[2], ends_decode=terms[3],
               memory=mem, num_layers=L, gen_len=n, block_size=bls, overlap=policy.overlap)


def _share_compute(terms: dict[str, Linear]) -> dict[str, Linear]:
  """On a CPU 'device' the host<->device copies run on the cores that compute: they add up, and
  only the disk terms overlap with them."""
  shared = terms['compute'] + terms.get('ctog', Linear()) + terms.get('gtoc', Linear())
  return {k: v for k, v in terms.items() if k in ('dtoc', 'ctod')} | {'compute': shared}


def predict(cfg: ModelConfig, policy: Policy, hw: HardwareProfile, sizes: memory.Itemsizes, *,
            prompt_len: int, gen_len: int) -> Prediction:
  """Predicted block time, throughput and peak bytes of a hand-given or searched policy."""
  model = build(cfg, policy, hw, sizes, prompt_len=prompt_len, gen_len=gen_len)
  return model.predict(fractions(policy, cfg))

