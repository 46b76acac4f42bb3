#!/usr/bin/env bash
# The GPU checks in one command, sized for a lent GPU machine (one H100 or H200, no network, its
# image holding CUDA jax, torch, flax, orbax, absl, transformers and accelerate): run from the
# repository root, nothing installed but FlexGen's wheel, every result under OUT_DIR.
#
#   bash tools/device_check.sh OUT_DIR [SECONDS [STEPS]]
#
# SECONDS (default 560) bounds the whole check; each step gets at most its share and the suite
# what is left. STEPS, a comma-separated list of the step names below (default: all of them),
# runs only those, in the order below: a short lease spends its time on what is still
# unmeasured. FlexGen 0.1.8 comes from .device/wheels (fetch it beforehand where the package
# registry is reachable: pip download flexgen==0.1.8 --no-deps -d .device/wheels) and is
# installed into .device/site; without it the FlexGen rows fail and the rest still runs.
#
# Steps, each one's output in OUT_DIR/log.txt, its exit status and seconds in OUT_DIR/steps.txt
# (with memcheck.jsonl, suite.jsonl and suite.md: five files, which a lent machine hands back):
#   env        python, jax, the device and its memory kinds, torch's CUDA, FlexGen
#   transfers  host -> device GB/s of 1 GiB from pageable numpy and from pinned host memory
#   writeback  tools.transfer_probe: a prompt step's offloaded rows (256 MiB) device -> host and
#              back by each method the engine could use (pageable, through pinned memory)
#   fp16       opt-1.3b with weights 30/70 on device/host pinned: the default compute dtype on
#              a GPU (float16), host memory kind, memory_stats peak against the plan
#   overhead   tools.step_overhead: the engine's own time per decode step (a narrow model all
#              on the device), what bounds a small batch's decode on a GPU
#   memcheck   tools.memcheck's GPU-relevant cases: memory_stats peak <= plan per case
#   phases     tools.phase_memory: device bytes in use and peak after placing, compiling and
#              generating, with jax's default allocator and with growth
#   suite      configs/bench/gpu-lent.json: flexjax against FlexGen 0.1.8, same policies (all the
#              time left but the tests' 120 s)
#   tests      the dispatch-count and pinned-host tests on the GPU backend, one process
# memcheck's cases (one process at a time) run with jax's default allocator, which takes most of
# the GPU up front, as a user's run does; where processes share the GPU (the suite's parent and
# its runs, pytest and the runs its tests start) each allocates as it grows
# (XLA_PYTHON_CLIENT_PREALLOCATE=false), which rounds allocations up (BUILD_NOTES: up to ~2%).
set -u
out=${1:?usage: bash tools/device_check.sh OUT_DIR [SECONDS [STEPS]]}
total=${2:-560}
steps=${3:-env,transfers,writeback,fp16,overhead,memcheck,phases,suite,tests}
known=,env,transfers,writeback,fp16,overhead,memcheck,phases,suite,tests,
for name in ${steps//,/ }; do
  [[ $known == *",$name,"* ]] || { echo "unknown step '$name': use some of ${known:1:-1}"; exit 2; }
done
py=${PYTHON:-python3}
tests_s=120
[[ ,$steps, == *,tests,* ]] || tests_s=0
start=$(date +%s)
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
grow=(env XLA_PYTHON_CLIENT_PREALLOCATE=false)
if compgen -G '.device/wheels/*.whl' > /dev/null; then
  "$py" -m pip install -q --no-deps --no-index --target .device/site .device/wheels/*.whl \
    >> "$out/log.txt" 2>&1 && export PYTHONPATH="$PYTHONPATH:$PWD/.device/site"
fi

# step NAME SECONDS COMMAND...: runs COMMAND for at most SECONDS (never past the total).
step() {
  local name=$1 limit=$2 began rc left
  shift 2
  [[ ,$steps, == *",$name,"* ]] || return 0
  left=$(( start + total - $(date +%s) ))
  (( limit > left )) && limit=$left
  if (( limit < 10 )); then
    echo "$name skipped: no time left" | tee -a "$out/steps.txt"
    return
  fi
  began=$(date +%s)
  echo "==== $name" >> "$out/log.txt"
  timeout "$limit" "$@" > "$out/step.log" 2>&1
  rc=$?
  echo "$name rc=$rc $(( $(date +%s) - began )) s (limit $limit s)" | tee -a "$out/steps.txt"
  tail -n 25 "$out/step.log"
  cat "$out/step.log" >> "$out/log.txt"
  rm -f "$out/step.log"
}

step env 30 "$py" -c '
import importlib.util, sys, jax, torch
d = jax.devices()[0]
print("python", sys.version.split()[0], "jax", jax.__version__, "device", d.platform, d.device_kind)
print("memory kinds", [m.kind for m in d.addressable_memories()])
print("torch", torch.__version__, "cuda", torch.cuda.is_available())
print("flexgen", importlib.util.find_spec("flexgen") is not None)'

step transfers 60 "$py" -c '
import numpy as np, jax
from flexjax.hardware import host_memory_kind, transfer_rate
d = jax.devices()[0]
host = np.random.default_rng(0).random(2**28, dtype=np.float32)
kinds = [None] + [k for k in [host_memory_kind(d)] if k]
for kind in kinds:
  name = kind or "pageable numpy"
  print(f"{name} -> device: {transfer_rate(host, d, kind) / 1e9:.1f} GB/s")
if len(kinds) == 1:
  print("no pinned host memory offered")'

step writeback 45 "$py" -m tools.transfer_probe --mib=256

step fp16 90 "$py" -m flexjax.main --model=opt-1.3b --weights=dummy --prompt_len=512 --gen_len=8 \
  --num_prompts=16 --gpu_batch_size=8 --num_gpu_batches=2 --w_gpu_percent=30 --w_cpu_percent=70 \
  --host_memory=pinned
# what that run says of the checks (its table is longer than a step's tail)
said=' (device|weight_dtype|compute_dtype|cache_dtype|host_memory|total_tok_s): '
awk '/^==== /{on = ($2 == "fp16")} on' "$out/log.txt" 2> /dev/null |
  grep -E "$said|(planned|measured)_[a-z]+_peak_bytes"

step overhead 40 "$py" -m tools.step_overhead

step memcheck 150 "$py" -m tools.memcheck \
  --only=all_device,weights_host_pinned,weights_disk,cache_host,cpu_attention,int4_weights_cache \
  --output="$out/memcheck.jsonl"

step phases 60 bash -c '"$0" -m tools.phase_memory; XLA_PYTHON_CLIENT_PREALLOCATE=false \
  "$0" -m tools.phase_memory' "$py"

step suite $(( start + total - tests_s - $(date +%s) )) "${grow[@]}" "$py" -m tools.suite \
  --suite=configs/bench/gpu-lent.json --output="$out/suite.jsonl"
if [[ -s "$out/suite.jsonl" ]]; then
  "$py" -m tools.suite --render="$out/suite.jsonl" > "$out/suite.md" 2>&1
  cat "$out/suite.md"
fi
step tests "$tests_s" "${grow[@]}" "$py" -m pytest -q -p no:cacheprovider -n 0 \
  tests/test_host_memory.py tests/test_dispatch.py
echo "device check: $(( $(date +%s) - start )) s" | tee -a "$out/steps.txt"
