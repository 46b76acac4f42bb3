"""Memory XLA:CPU's library fusions allocate outside XLA's own buffers, read from a compiled
program's text.

XLA:CPU hands parts of a program to matrix libraries as custom fusions. XLA's memory analysis
counts each fusion's operands and result, not what the library allocates while it runs:

- A YNNPACK graph fusion (`__ynn_fusion`) can span several products with the element-wise work
  between them (from 4096 product rows, OPT's out-projection, residual, layer norm, fc1, ReLU,
  fc2 and residual as one fusion). The products' results and the products' inputs computed
  inside the fusion are tensors of the library's own. Measured peak RSS over XLA's bytes
  (bfloat16 prefill layer steps): opt-1.3b 32 x 128 208 MiB, opt-6.7b 8 x 512 480 MiB, 16 x
  512 959 MiB; float32 opt-6.7b 8 x 512 640 MiB; counted here as 272, 544, 1088 and 704 MiB.
  Steps of 3584 rows or fewer, and llama's steps, have no such fusion and measured nothing over.
- A oneDNN fusion (`__onednn_fusion`, linear.library_options) packs the matrix its product
  reads (the right-hand operand) for as long as the product runs. Products of a step may
  overlap: a prefill layer of 8 x 512 rows (hidden 2048, ffn 8192, float32) measured 65-129 MiB
  over XLA's bytes in six fresh processes, one or two of its 64 MiB matrices and some MiB of
  oneDNN's own buffers. Counted: every oneDNN product's matrix plus ONEDNN_WORKSPACE (192 + 16
  MiB there).

Where no library fusion is compiled (GPUs, small programs) the count is 0.
"""

from __future__ import annotations

import math
import re

ITEMSIZE = {'pred': 1, 's8': 1, 'u8': 1, 's16': 2, 'u16': 2, 'f16': 2, 'bf16': 2, 's32': 4,
            'u32': 4, 'f32': 4, 's64': 8, 'u64': 8, 'f64': 8}
ONEDNN_WORKSPACE = 16 << 20  # oneDNN's buffers beside the packed matrices (module doc)
_INSTRUCTION = re.compile(r'^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*'  # name = dtype[dims] op(rest
                          r'(\w+)\[([\d,]*)\]\S*\s+([\w\-]+)\((.*)$')
_HEADER = re.compile(r'^%([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$')
_LIBRARY = re.compile(r'calls=%([\w.\-]+).*"kind":"__(ynn|onednn)_fusion"')
_OPERAND = re.compile(r'%([\w.\-]+)')


class _Instruction:
  __slots__ = ('name', 'nbytes', 'op', 'operands', 'root')

  def __init__(self, name: str, dtype: str, dims: str, op: str, rest: str, root: bool):
    self.name, self.op, self.root = name, op, root
    shape = [int(d) for d in dims.split(',') if d]
    self.nbytes = math.prod(shape) * ITEMSIZE.get(dtype, 4)
    self.operands = _OPERAND.findall(rest.split('),', 1)[0]) if op != 'parameter' else []


def _computations(text: str) -> dict[str, dict[str, _Instruction]]:
  """Computation name -> its instructions by name (tuple-shaped ones are left out)."""
  out: dict[str, dict[str, _Instruction]] = {}
  current = None
  for line in text.splitlines():
    header = _HEADER.match(line)
    if header:
      current = out.setdefault(header.group(1), {})
      continue
    if current is None:
      continue
    if line.strip() == '}':
      current = None
      continue
    m = _INSTRUCTION.match(line)
    if m:
      name, dtype, dims, op, rest = m.groups()
      current[name] = _Instruction(name, dtype, dims, op, rest,
                                   line.lstrip().startswith('ROOT'))
  return out


def _through_bitcasts(body: dict[str, _Instruction], name: str) -> _Instruction | None:
  inst = body.get(name)
  while inst is not None and inst.op == 'bitcast' and inst.operands:
    inst = body.get(inst.operands[0])
  return inst


def _graph_tensors(body: dict[str, _Instruction]) -> int:
  """Bytes of a YNNPACK fusion's own tensors: each product's result unless it is the fusion's
  result, and each product input computed inside the fusion."""
  root = next((i for i in body.values() if i.root), None)
  result = _through_bitcasts(body, root.name) if root is not None else None
  own: dict[str, int] = {}
  for inst in body.values():
    if inst.op != 'dot':
      continue
    if inst is not result:
      own[inst.name] = inst.nbytes
    for operand in inst.operands:
      source = _through_bitcasts(body, operand)
      if source is not None and source.op not in ('parameter', 'constant'):
        own[source.name] = source.nbytes
  return sum(own.values())


def _packed_matrix(body: dict[str, _Instruction]) -> int:
  """Bytes of the matrix a oneDNN fusion's product reads (its right-hand operand)."""
  return max((body[inst.operands[1]].nbytes for inst in body.values()
              if inst.op == 'dot' and len(inst.operands) > 1 and inst.operands[1] in body),
             default=0)


def scratch_bytes(text: str) -> int:
  """Bytes XLA:CPU's library fusions of a compiled program (`compiled.as_text()`) allocate
  beyond XLA's own: every YNNPACK fusion's own tensors, every oneDNN product's packed matrix
  and, where oneDNN runs, ONEDNN_WORKSPACE (see the module doc)."""
  if '_fusion"' not in text:
    return 0
  bodies = _computations(text)
  graphs, packed, onednn = 0, 0, False
  for line in text.splitlines():
    m = _LIBRARY.search(line)
    if not m or m.group(1) not in bodies:
      continue
    if m.group(2) == 'ynn':
      graphs += _graph_tensors(bodies[m.group(1)])
    else:
      onednn = True
      packed += _packed_matrix(bodies[m.group(1)])
  return graphs + (packed + ONEDNN_WORKSPACE if onednn else 0)
