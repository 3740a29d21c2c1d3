#!/usr/bin/env bash
# One prepared run for a lent GPU machine; everything it finds goes into $OUT:
#   env.txt         torch, CUDA, GPU, triton and flash-attn versions, and what could not be installed
#   tests.txt       the GPU tests: CUDA == CPU, the Triton kernels compiled == the float64 oracle, triton and
#                   flash_attn == torch on the engine
#   attention_check.md / .json   greedy tokens of triton and flash_attn vs torch (tiny-qwen3, smollm2; fp32,
#                   bf16), and decode attention per backend at batch 1/32/256, context 512/4096, as a fraction
#                   of the measured copy bandwidth (scripts/gpu_attention_check.py)
#   graphs_check.md / .json   CUDA graphs and torch.compile (chapter 06): greedy tokens of graphs == eager and
#                   compiled == eager (tiny-qwen3, smollm2; fp32, bf16), a decode step eager vs graphs at batch
#                   1/8/32/128 on qwen3-0.6b-shape, compiled vs eager per op (scripts/graphs_check.py); the
#                   gpu-marked graph tests go into tests.txt
#   bench.txt + JSON/plot   the book's benchmark on Qwen3-0.6B's shape, with graphs (the CUDA default): tok/s
#                   and the fraction of the roofline bound (skip with BENCH=0)
# Usage (device tool): bash scripts/gpu_check.sh   (about 6-8 minutes; expects torch with CUDA installed)
# Installs what it needs without replacing that torch: pip gets a constraints file that pins the torch and
# triton already there (the repo's constraints.txt pins the CPU build). flash-attn is tried and, when it
# cannot be had (no wheel, no network, a build that fails), the run goes on without it and says so.
set -uo pipefail
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export NANOENGINE_HOME=${NANOENGINE_HOME:-$PWD/.nanoengine_home}
unset TRITON_INTERPRET  # compiled kernels here
PY=${PYTHON:-python}
note() { echo "$*" | tee -a "$OUT/env.txt"; }

$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())" \
  | tee "$OUT/env.txt" || { note "no CUDA torch here: nothing to check"; exit 1; }
PINS=$(mktemp)
$PY - > "$PINS" <<'EOF'
import importlib.metadata as m
for name in ("torch", "triton"):
    try:
        print(f"{name}=={m.version(name)}")
    except m.PackageNotFoundError:
        pass
EOF
note "pins for pip: $(tr '\n' ' ' < "$PINS")"
$PY -m pip install -q --no-deps -e . 2>&1 | tail -1
if ! $PY -c "import transformers, safetensors, tokenizers, xxhash, jinja2, tqdm, pytest" 2>/dev/null; then
  timeout 180 $PY -m pip install -q -c "$PINS" -e ".[dev]" 2>&1 | tail -2 \
    || note "could not install nanoengine's dependencies (no network?)"
fi
$PY -c "import triton; print('triton', triton.__version__)" 2>&1 | tee -a "$OUT/env.txt" \
  || { timeout 120 $PY -m pip install -q -c "$PINS" triton 2>&1 | tail -1; }
if ! $PY -c "import flash_attn" 2>/dev/null; then
  timeout 240 $PY -m pip install -q -c "$PINS" --no-build-isolation flash-attn 2>&1 | tail -2 \
    || true
fi
$PY -c "import flash_attn; print('flash_attn', flash_attn.__version__)" 2>&1 | tail -1 | tee -a "$OUT/env.txt" \
  || note "flash_attn: not available; the run goes on without it"

$PY -m nanoengine assets tiny-qwen3 smollm2-135m 2>&1 | tail -2
{ timeout 300 $PY -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/test_flash_attn.py \
    tests/test_triton_kernels.py tests/test_triton_engine.py 2>&1 | tail -15
  timeout 120 $PY -m pytest -q -p no:cacheprovider tests/test_attention.py -k triton 2>&1 | tail -3
} | tee "$OUT/tests.txt"
timeout 240 $PY scripts/gpu_attention_check.py --out "$OUT" 2>&1 | tail -40
timeout 120 $PY -m pytest -q -p no:cacheprovider -m gpu tests/test_graphs.py 2>&1 | tail -3 | tee -a "$OUT/tests.txt"
timeout 240 $PY scripts/graphs_check.py --out "$OUT" 2>&1 | tail -40
if [ "${BENCH:-1}" != 0 ]; then
  $PY -m nanoengine assets qwen3-0.6b-shape 2>&1 | tail -1
  timeout 300 $PY -m nanoengine bench --model qwen3-0.6b-shape --workload nano-vllm --peer-batches 32 \
    --out-dir "$OUT" --figures-dir "$OUT" --quiet 2>&1 | tail -30 | tee "$OUT/bench.txt"
fi
