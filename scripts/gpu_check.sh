#!/usr/bin/env bash
# One prepared run for a lent GPU machine: correctness on CUDA, then the book's benchmark, results in $OUT.
# Usage (device tool): bash scripts/gpu_check.sh   (expects torch with CUDA already installed on that machine)
set -euo pipefail
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export NANOENGINE_HOME=${NANOENGINE_HOME:-$PWD/.nanoengine_home}
python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())" | tee "$OUT/env.txt"
python -m pip install -q --no-deps -e . 2>&1 | tail -1 || true
python -m nanoengine assets tiny-qwen3 smollm2-135m 2>&1 | tail -2
python -m pytest -q tests/test_gpu.py 2>&1 | tail -5 | tee "$OUT/tests.txt"
python -m nanoengine assets qwen3-0.6b-shape 2>&1 | tail -1
timeout 420 python -m nanoengine bench --model qwen3-0.6b-shape --workload nano-vllm --peer-batches 32 \
  --out-dir "$OUT" --figures-dir "$OUT" --quiet 2>&1 | tail -30 | tee "$OUT/bench.txt"
