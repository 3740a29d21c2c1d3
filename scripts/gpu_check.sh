#!/usr/bin/env bash
# The GPU checks in one prepared run for a lent machine that has no network: it installs nothing (the
# checkout runs from PYTHONPATH), skips in a second what is absent (flash-attn, smollm2, matplotlib, ...)
# with a one-line note, and gives every part a timeout inside one budget, the most valuable parts first:
#   env         torch, CUDA, GPU, triton, flash-attn, the optional modules and the built assets
#   assets      tiny-qwen3 and qwen3-0.6b-shape, built offline from the Qwen3 tokenizer (carried, see below)
#   bench       `nanoengine bench` on the nano-vllm workload (Qwen3-0.6B's shape, 256 requests, in/out
#               100..1024): tok/s and the fraction of the roofline limit
#   graphs      greedy tokens of CUDA graphs and compiled ops == eager; a decode step, eager vs graphs
#               (scripts/graphs_check.py)
#   attention   greedy tokens of triton (and flash_attn) == torch; decode attention per backend against the
#               copy bandwidth (scripts/gpu_attention_check.py)
#   pytest      the Triton kernels compiled == the float64 oracle, CUDA == CPU, triton == torch, graphs
#   host-only   `nanoengine bench --host-only` (host ms per decode step, model stubbed), where bench has it
#   ops         compiled vs eager per op (scripts/graphs_check.py --only ops)
# Timeouts (s): env 15, assets 25 + 60, bench 180, graphs 65, attention 45, pytest 60, host-only 25, ops 15:
# 490 in all, and the budget (450) cuts the last parts short when the first run long.
# $OUT gets at most six files: summary.md (read this first), log.txt (every part's output), checks.json
# (graphs, attention and ops results), the benchmark's JSON and plot, host_only.json. summary.md is
# rewritten after every part, so a run cut short still leaves one.
#
# Usage:
#   bash scripts/gpu_check.sh --prepare   here, once: the Qwen3 tokenizer (18 MB) into build/gpu_carry
#   device tool: command `bash scripts/gpu_check.sh`, carry ["build/gpu_carry"], timeout_s 540
#   bash scripts/gpu_check.sh --smoke     this script itself on CPU (tiny models, the scripts' --smoke
#                                         modes, Triton's interpreter, a tiny benchmark), e.g. under unshare -n
# Environment: PYTHON (default python3), OUT (default gpu_out), NANOENGINE_HOME (default build/gpu_home),
# BUDGET (seconds for all parts; default 450, smoke 360), PARTS (comma-separated subset, e.g. bench,graphs).
set -uo pipefail

MODE=full
case "${1:-}" in
  "") ;;
  --smoke) MODE=smoke ;;
  --prepare) MODE=prepare ;;
  -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
  *) echo "gpu_check.sh: unknown option '$1' (use --smoke, --prepare or none; --help says more)" >&2; exit 2 ;;
esac
if [ $# -gt 1 ]; then echo "gpu_check.sh: one option at most, got: $*" >&2; exit 2; fi
cd "$(dirname "$0")/.." || exit 2
PY=${PYTHON:-python3}  # the lent machine's python3 is the one with torch
command -v "$PY" >/dev/null 2>&1 || { echo "gpu_check.sh: no '$PY' here (set PYTHON=...)" >&2; exit 2; }
# Installing nothing: the checkout itself, and any pip call that something makes fails at once instead of
# waiting on a network that is not there; the Hugging Face libraries stay offline.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PIP_NO_INDEX=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
  HF_HUB_DISABLE_TELEMETRY=1 PYTHONUNBUFFERED=1 MPLBACKEND=Agg TOKENIZERS_PARALLELISM=false
export NANOENGINE_HOME=${NANOENGINE_HOME:-$PWD/build/gpu_home}
CARRY=$PWD/build/gpu_carry

if [ "$MODE" = prepare ]; then  # on a machine with the assets (or the packages that build them)
  SRC=$($PY -c "from nanoengine import assets; print(assets.ensure('qwen3-tokenizer'))") \
    || { echo "gpu_check.sh --prepare: could not build the Qwen3 tokenizer here (see above)" >&2; exit 1; }
  rm -rf "$CARRY/qwen3-tokenizer" && mkdir -p "$CARRY" && cp -r "$SRC" "$CARRY/qwen3-tokenizer" || exit 1
  echo "ready: $(du -sh "$CARRY" | cut -f1) in build/gpu_carry; on the device: bash scripts/gpu_check.sh" \
       "with carry [\"build/gpu_carry\"]"
  exit 0
fi

OUT=${OUT:-gpu_out}
mkdir -p "$OUT" || exit 2
OUT=$(cd "$OUT" && pwd)
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX") || exit 2
LOG=$OUT/log.txt
: > "$LOG"
: > "$WORK/parts.tsv"
if [ "$MODE" = smoke ]; then
  export TRITON_INTERPRET=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}  # Triton on CPU runs interpreted
  BUDGET=${BUDGET:-360}
else
  unset TRITON_INTERPRET  # compiled kernels here
  BUDGET=${BUDGET:-450}
fi
START=$(date +%s)
DEADLINE=$((START + BUDGET))
PARTS=${PARTS:-}

summarize() {  # [--final]
  $PY scripts/gpu_summary.py --work "$WORK" --out "$OUT" --elapsed $(( $(date +%s) - START )) \
    --budget "$BUDGET" "$@" >> "$LOG" 2>&1 || echo "gpu_check.sh: scripts/gpu_summary.py failed (see log.txt)"
}
record() {  # record NAME STATUS SECONDS TIMEOUT NOTE
  printf '%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" "$5" >> "$WORK/parts.tsv"
  printf '[%4d s] %-22s %s%s\n' $(( $(date +%s) - START )) "$1" "$2" "${5:+: $5}"
  summarize
}
skip() { record "$1" skipped 0 - "$2"; }
part() {  # part NAME TIMEOUT CMD...: runs CMD within TIMEOUT (cut to what the budget has left), logged
  local name=$1 limit=$2 left t0 rc status note=""
  shift 2
  if [ -n "$PARTS" ] && [[ ",$PARTS," != *",${name%% *},"* ]]; then return 0; fi
  left=$((DEADLINE - $(date +%s)))
  if [ "$left" -lt 10 ]; then skip "$name" "the budget of $BUDGET s is spent"; return 1; fi
  [ "$limit" -gt "$left" ] && limit=$left
  printf '\n===== %s (timeout %s s) =====\n$ %s\n' "$name" "$limit" "$*" >> "$LOG"
  t0=$(date +%s)
  timeout -k 5 "$limit" "$@" < /dev/null >> "$LOG" 2>&1
  rc=$?
  case $rc in
    0) status=ok ;;
    124|137) status="timed out"; note="after $limit s" ;;
    *) status=failed; note="exit $rc: $(grep -v '^\s*$' "$LOG" | tail -1 | cut -c1-200)" ;;
  esac
  record "$name" "$status" $(( $(date +%s) - t0 )) "$limit" "$note"
  [ "$rc" = 0 ]
}

echo "gpu_check.sh ($MODE): budget $BUDGET s, results in $OUT, work in $WORK"
part env 15 $PY scripts/gpu_env.py probe --work "$WORK" --carry "$CARRY" $([ "$MODE" = smoke ] && echo --smoke)
if [ ! -s "$WORK/env.sh" ]; then echo "gpu_check.sh: the env probe gave nothing; see $LOG" >&2; exit 1; fi
# shellcheck disable=SC1091
. "$WORK/env.sh"
if [ "$CAN_RUN" != 1 ]; then summarize --final; cat "$OUT/summary.md"; exit 1; fi

NANO="$PY scripts/gpu_env.py cli"  # python -m nanoengine, with a stand-in plot module where matplotlib is absent
# Without built C++ CPU kernels, the CPU runs below take the torch backend rather than compile them (~30 s):
# the plan picks torch where it finds no compiler.
NOCXX=()
[ "$HAVE_CPU_KERNELS" = 1 ] || NOCXX=(env CXX=gpu-check-builds-no-cpu-kernels)
MODELS=tiny-qwen3
[ "$HAVE_SMOLLM2" = 1 ] && MODELS=tiny-qwen3,smollm2-135m
if [ "$HAVE_TOKENIZER" != 1 ]; then
  for p in assets bench graphs attention pytest host-only ops; do skip "$p" "no Qwen3 tokenizer (see env)"; done
else
  part "assets tiny-qwen3" 25 $NANO assets tiny-qwen3
  if [ "$MODE" = smoke ]; then
    part bench 60 "${NOCXX[@]}" $NANO bench --model tiny-qwen3 --workload smoke --no-peers --no-step-profile \
      --out-dir "$WORK/bench" --figures-dir "$WORK/bench" --quiet
  elif part "assets qwen3-0.6b-shape" 60 $NANO assets qwen3-0.6b-shape; then
    # no peers: vLLM and nano-vllm are not installed, and transformers' static batches take minutes;
    # the published figures stand beside the result in summary.md
    part bench 180 $NANO bench --model qwen3-0.6b-shape --workload nano-vllm --no-peers \
      --out-dir "$WORK/bench" --figures-dir "$WORK/bench" --quiet
  else
    skip bench "qwen3-0.6b-shape could not be built (see log.txt)"
  fi
  cp "$WORK"/bench/*.json "$WORK"/bench/*.png "$OUT"/ 2>/dev/null
  SMOKE=$([ "$MODE" = smoke ] && echo --smoke)
  part graphs "$([ "$MODE" = smoke ] && echo 90 || echo 65)" $PY scripts/graphs_check.py --only tokens,decode \
    --models "$MODELS" --out "$WORK/graphs" $SMOKE
  part attention "$([ "$MODE" = smoke ] && echo 60 || echo 45)" $PY scripts/gpu_attention_check.py --models "$MODELS" --out "$WORK/attention" $SMOKE
  if [ "$HAVE_PYTEST" != 1 ]; then
    skip pytest "pytest is not installed"
  else
    TESTS=(tests/test_triton_kernels.py tests/test_gpu.py tests/test_flash_attn.py tests/test_triton_moe.py::test_compiled_kernel_at_qwen3_30b_a3b_expert_shapes
           tests/test_tp_host_inputs.py::test_sending_a_cuda_step_never_waits_for_the_device)
    if [ "$MODE" = smoke ]; then
      TESTS+=(tests/test_graphs.py::test_cuda_graphs_equal_eager_on_cuda)  # skips without CUDA: a check of the call
    else
      TESTS+=(tests/test_triton_engine.py tests/test_graphs.py::test_cuda_graphs_equal_eager_on_cuda)
    fi
    DESELECT=()
    [ "$HAVE_SMOLLM2" = 1 ] || DESELECT=(--deselect tests/test_flash_attn.py::test_bf16_backends_agree_with_torch)
    $PY scripts/gpu_env.py stubs "$WORK/stubs"
    [ "$HAVE_TRITON" = 1 ] || echo "triton absent: the Triton tests skip themselves" >> "$LOG"
    PYTHONPATH="$PYTHONPATH:$WORK/stubs" part pytest 60 "${NOCXX[@]}" $PY -m pytest -v --tb=line -p no:cacheprovider \
      -o addopts= "${TESTS[@]}" "${DESELECT[@]}"
  fi
  HELP=$($NANO bench --help 2>/dev/null)
  if grep -q -- --host-only <<< "$HELP"; then
    STEPS=()
    grep -q -- --steps <<< "$HELP" && STEPS=(--steps 50)  # of 200 by default: enough for a median
    part host-only "$([ "$MODE" = smoke ] && echo 60 || echo 25)" $NANO bench --host-only \
      --model "$([ "$MODE" = smoke ] && echo tiny-qwen3 || echo qwen3-0.6b-shape)" "${STEPS[@]}" \
      --out-dir "$WORK/host" --figures-dir "$WORK/host" --quiet
    cp "$(ls "$WORK"/host/*.json 2>/dev/null | head -1)" "$OUT/host_only.json" 2>/dev/null
  else
    skip host-only "this checkout's nanoengine bench has no --host-only option yet"
  fi
  part ops "$([ "$MODE" = smoke ] && echo 60 || echo 15)" $PY scripts/graphs_check.py --only ops \
    --out "$WORK/ops" $SMOKE
fi
summarize --final
echo "gpu_check.sh: done in $(( $(date +%s) - START )) s; $OUT/summary.md:"
cat "$OUT/summary.md"
