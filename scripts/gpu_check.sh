#!/usr/bin/env bash
# The GPU proof, in two device calls, on a CUDA machine without internet. A session's device time (15 minutes
# in 2026-11, machine start and idle time included) holds both calls with --budget 300 each; a first look fits
# in one call: --call all --skip kernels,attention,quant,moe --budget 250 (the tests, then the 8B benchmark).
#
#   scripts/gpu_check.sh --prepare [DIR]      here: collect what the GPU machine lacks into DIR (default
#                                             .gpu-bundle, ignored by git, < 40 MiB): wheels + SmolLM2 tokenizer
#   scripts/gpu_check.sh --call kernels|bench|all [--out DIR] [--bundle DIR] [--budget S] [--only/--skip STAGE,...]
#                        [-k EXPR]                  (pytest -k for the kernels and gpu-tests stages)
#                        [--runs N]                 (bench-8b*: runs per batch size, median; default 1)
#   scripts/gpu_check.sh --dry-run --out DIR  both calls on this CPU, Triton interpreted, small shapes
#
# On the device (the bundle travels as a carried path):
#   run(command="scripts/gpu_check.sh --call kernels --out $OUT", carry=[".gpu-bundle"], timeout_s=600)
#   run(command="scripts/gpu_check.sh --call bench --out $OUT", carry=[".gpu-bundle"], timeout_s=600)
#
# Call `kernels`:
#   env         GPU, driver, torch/Triton/flash-attn versions
#   imports     every engine module and every test module the check runs imports (scripts/gpu_imports.py);
#               --dry-run: the same with only the GPU machine's packages + the bundle (--as-machine)
#   selfcheck   python -m engine.attention_check: the backend picked here, and Triton forced
#   kernels     every Triton kernel test file, compiled (not interpreted)   (--dry-run: collected only)
#   gpu-tests   the `gpu`-marked test modules                              (--dry-run: they skip: no CUDA)
# Call `bench`:
#   attention   scripts/bench_attention.py: our Triton kernels vs SDPA (and flash-attn when importable)
#   bench-8b    scripts/bench_engine.py, Llama-3.1-8B shape, random weights: batch-1 decode ms/token against
#               weight bytes / copy bandwidth, batch sizes up to 256, 256 requests against HF `generate`
#   bench-8b-aten  the same engine with torch's element-wise ops (--gpu-elementwise aten): the fused kernels' A/B
#   bench-8b-sync  the same engine with --async-scheduling off: what launching step N+1 before reading N gains
#   profile     scripts/profile_step.py: the 8B shape's decode step at batch 1, 64 and 256 under torch.profiler,
#               kernels per step by kind and by name (where the time above the bandwidth floor goes)
#   serve-8b    scripts/bench_http.py: the same 8B shape served over HTTP (python -m engine), 256 streaming
#               clients x 128 tokens, 512 requests: TTFT, TPOT, ITL and output tok/s through the server, the
#               clients in one process, then in 4 (--client-processes)
#   serve-host  scripts/host_overhead_http.py: the server's CPU per streamed token with no model (stand-in runner),
#               by thread (step loop, HTTP), on this machine's CPU
#   quant       scripts/bench_quant.py: W4A16/W8A16 Triton GEMM and FP8 against bf16 on 8B shapes
#   moe         scripts/bench_moe.py: the Triton grouped expert GEMM against transformers' MoE forward
# Every stage gets what is left of --budget (default 540 s) at most, so a call ends inside the device's
# 10 minutes. Results go straight into --out after every stage: gpu_check.json, gpu_check.md, logs.tar.gz,
# and running.log (the stage under way): a call killed midway still brings back what it finished.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=gpu-check-results
BUNDLE=.gpu-bundle
PY=${PYTHON:-python3}
CALL=all
DRY=0
BUDGET=540
ONLY=""
SKIP=""
PREPARE=""
KEXPR=()
RUNS=1
while [ $# -gt 0 ]; do
  case "$1" in
    --prepare) PREPARE=${2:-.gpu-bundle}; [ $# -gt 1 ] && shift; shift ;;
    --call) CALL=$2; shift 2 ;;
    --dry-run) DRY=1; shift ;;
    --out) OUT_DIR=$2; shift 2 ;;
    --bundle) BUNDLE=$2; shift 2 ;;
    --budget) BUDGET=$2; shift 2 ;;
    --python) PY=$2; shift 2 ;;
    --only) ONLY=",$2,"; shift 2 ;;
    --skip) SKIP=",$2,"; shift 2 ;;
    -k) KEXPR=(-k "$2"); shift 2 ;;
    --runs) RUNS=$2; shift 2 ;;
    -h|--help) sed -n '2,29p' "$0"; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
if [ -n "$PREPARE" ]; then
  exec "$PY" scripts/gpu_bundle.py "$PREPARE"
fi
case "$CALL" in kernels|bench|all) ;; *) echo "gpu_check.sh: --call is kernels, bench or all" >&2; exit 2 ;; esac
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
LOGS=$(mktemp -d "${TMPDIR:-/tmp}/gpu-check-logs.XXXXXX")
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-${TMPDIR:-/tmp}/tgi-hpc-triton-cache}
START=$(date +%s)
: > "$LOGS/stages.tsv"

if [ "$DRY" = 1 ]; then
  export TRITON_INTERPRET=1
  DEVICE=cpu
else
  unset TRITON_INTERPRET  # compiled kernels only
  DEVICE=cuda
  if [ -d "$BUNDLE/wheels" ]; then   # the machine's own torch and Triton stay; the bundle goes in front
    SITE=${TMPDIR:-/tmp}/gpu-check-site
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
      "$BUNDLE"/wheels/*.whl > "$LOGS/bundle-install.log" 2>&1 || { cat "$LOGS/bundle-install.log" >&2; exit 2; }
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
    [ -d "$BUNDLE/tokenizer" ] && export TGI_HPC_TOKENIZER_DIR=${TGI_HPC_TOKENIZER_DIR:-$(cd "$BUNDLE/tokenizer" && pwd)}
  fi
  if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check.sh: $PY sees no CUDA device; run this on a GPU node (or --dry-run)" >&2
    exit 2
  fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

wanted() {  # wanted STAGE: in --only (when given) and not in --skip
  { [ -z "$ONLY" ] || [[ $ONLY == *",$1,"* ]]; } && [[ $SKIP != *",$1,"* ]]
}

report() {
  "$PY" scripts/gpu_check_report.py "$LOGS" "$OUT_DIR" "$(( $(date +%s) - START ))" "$CALL" "$DRY" > /dev/null \
    || echo "gpu_check.sh: the report failed" >&2
  tar -czf "$OUT_DIR/logs.tar.gz" -C "$LOGS" . 2>/dev/null
}

stage() {  # stage NAME SECONDS COMMAND...: run within min(SECONDS, budget left), log, record, report
  local name=$1 limit=$2; shift 2
  wanted "$name" || return 0
  local left=$(( BUDGET - ($(date +%s) - CALL_START) - 15 ))
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -le 0 ]; then
    printf '%s\t%s\t%s\n' "$name" "budget" 0 >> "$LOGS/stages.tsv"; report; return 0
  fi
  local t0 rc
  t0=$(date +%s)
  echo "== $name (limit ${limit}s): $*" | tee "$OUT_DIR/running.log" >&2
  timeout --kill-after=5 "$limit" "$@" 2>&1 | tee -a "$OUT_DIR/running.log" > "$LOGS/$name.log"
  rc=${PIPESTATUS[0]}
  printf '%s\t%s\t%s\n' "$name" "$rc" "$(( $(date +%s) - t0 ))" >> "$LOGS/stages.tsv"
  echo "   $name: exit $rc after $(( $(date +%s) - t0 ))s" >&2
  rm -f "$OUT_DIR/running.log"
  report
}

# -v names each test as it starts (a stage cut off by its limit shows which test it was in); a per-test
# limit, where pytest-timeout is installed, turns a hung test into a failure with its stack, not a lost stage
PYTEST=("$PY" -m pytest -v -p no:cacheprovider -o addopts= -rs --tb=short --durations=10 ${KEXPR[@]+"${KEXPR[@]}"})
"$PY" -c "import pytest_timeout" 2>/dev/null && PYTEST+=(--timeout=75 --timeout-method=thread)
# On the device, the kernel tests in parallel processes where pytest-xdist is installed: Triton compiles on the host's
# CPU, one kernel variant after another, and the attention tests alone outlasted a 143 s stage in one process. Not the
# `gpu` tests: each starts an engine that sizes its KV cache from the GPU's free memory, and 8 at once left the
# later ones none (14 "no memory left for the KV cache" failures on the H200, 2026-11-26)
PAR=()
[ "$DRY" = 0 ] && "$PY" -c "import xdist" 2>/dev/null && PAR=(-n "${GPU_CHECK_WORKERS:-8}")
KERNEL_TESTS=$(ls tests/engine/test_*triton*.py tests/engine/test_*kernel*.py tests/engine/test_quant_gemm.py \
  2>/dev/null | sort -u | tr '\n' ' ')
GPU_TESTS=$(grep -l "pytest.mark.gpu" tests/engine/test_*.py | tr '\n' ' ')

call_kernels() {
  if [ "$DRY" = 1 ]; then
    stage env 30 "$PY" -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, "cpu")'
    if [ -d "$BUNDLE/wheels" ]; then
      stage imports 240 "$PY" scripts/gpu_imports.py --as-machine "$BUNDLE"
    else
      stage imports 240 "$PY" scripts/gpu_imports.py
    fi
    stage selfcheck 60 "$PY" -m engine.attention_check --json-out "$LOGS/selfcheck-auto.json"
    # shellcheck disable=SC2086
    stage kernels 120 "${PYTEST[@]}" --collect-only $KERNEL_TESTS
  else
    stage env 30 bash -c "nvidia-smi; $PY -c 'import torch, triton; print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, \"triton\", triton.__version__, torch.cuda.get_device_name())'; $PY -c 'from engine.attention.flash import flash_version; print(flash_version())'"
    stage imports 60 "$PY" scripts/gpu_imports.py
    stage selfcheck 60 bash -c "$PY -m engine.attention_check --json-out '$LOGS/selfcheck-auto.json'; $PY -m engine.attention_check --attention-backend triton --json-out '$LOGS/selfcheck-triton.json'"
    # shellcheck disable=SC2086
    stage kernels 170 "${PYTEST[@]}" ${PAR[@]+"${PAR[@]}"} $KERNEL_TESTS --junitxml="$LOGS/kernels.xml"
  fi
  # shellcheck disable=SC2086
  stage gpu-tests 180 "${PYTEST[@]}" -m gpu $GPU_TESTS --junitxml="$LOGS/gpu-tests.xml"
}

call_bench() {
  if [ "$DRY" = 1 ]; then
    stage attention 10 bash -c 'echo "bench_attention.py times CUDA kernels only: not run in --dry-run"'
    stage bench-8b 150 "$PY" scripts/bench_engine.py --model-id tiny-llama --device cpu --dtype float32 \
      --batch-sizes 1,4 --prompt-len 16 --new-tokens 4 --runs 1 --hf-prompts 4 --hf-serial-max 1 \
      --async-scheduling on --json-out "$LOGS/bench-8b.json"
    stage quant 150 "$PY" scripts/bench_quant.py --smoke --json "$LOGS/bench-quant.json"
    stage moe 150 "$PY" scripts/bench_moe.py --device cpu --sizes tiny --tokens 1,16 --repeats 1 --batch 2 \
      --prompt-len 8 --new-tokens 4
    stage serve-8b 120 "$PY" scripts/bench_http.py --model-id tiny-llama --device cpu --concurrency 4 \
      --new-tokens 4 --no-hf --json-out "$LOGS/serve-8b.json"
    stage profile 120 "$PY" scripts/profile_step.py --model-id tiny-llama --device cpu --dtype float32 \
      --batch-sizes 1,4 --prompt-len 16 --profile-steps 2 --top 10 --json-out "$LOGS/profile.json"
  else
    stage attention 60 "$PY" scripts/bench_attention.py --json "$LOGS/attention.json"
    stage bench-8b 240 "$PY" scripts/bench_engine.py --model-id "${TGI_HPC_TOKENIZER_DIR:-smollm2}" --config-like 8b \
      --load-format dummy --device cuda --dtype bfloat16 --batch-sizes 1,16,64,256 --prompt-len 128 --new-tokens 64 \
      --runs "$RUNS" --hf-prompts 256 --hf-serial-max 2 --json-out "$LOGS/bench-8b.json"
    stage bench-8b-aten 60 "$PY" scripts/bench_engine.py --model-id "${TGI_HPC_TOKENIZER_DIR:-smollm2}" --config-like 8b \
      --load-format dummy --device cuda --dtype bfloat16 --batch-sizes 1,64,256 --prompt-len 128 --new-tokens 64 \
      --runs "$RUNS" --hf-prompts 256 --no-hf --gpu-elementwise aten --json-out "$LOGS/bench-8b-aten.json"
    stage bench-8b-sync 90 "$PY" scripts/bench_engine.py --model-id "${TGI_HPC_TOKENIZER_DIR:-smollm2}" --config-like 8b \
      --load-format dummy --device cuda --dtype bfloat16 --batch-sizes 1,64,256 --prompt-len 128 --new-tokens 64 \
      --runs "$RUNS" --hf-prompts 256 --no-hf --async-scheduling off --json-out "$LOGS/bench-8b-sync.json"
    stage profile 90 "$PY" scripts/profile_step.py --model-id "${TGI_HPC_TOKENIZER_DIR:-smollm2}" --config-like 8b \
      --load-format dummy --device cuda --dtype bfloat16 --batch-sizes 1,64,256 --prompt-len 128 --profile-steps 8 \
      --json-out "$LOGS/profile.json"
    stage serve-host 60 "$PY" scripts/host_overhead_http.py --model-id "${TGI_HPC_TOKENIZER_DIR:-smollm2}" \
      --concurrency 256 --new-tokens 128
    # the load generator in 4 processes (one process parsing every event of 256 streams was the limit); the engine
    # with its piecewise graphs (mixed steps as requests arrive and leave), then without: their effect, same call
    stage serve-8b 180 bash -c "for pieces in default 0; do extra=; [ \$pieces = 0 ] && extra='--piecewise-graphs 0'; \
      $PY scripts/bench_http.py --model-id '${TGI_HPC_TOKENIZER_DIR:-smollm2}' --config-like 8b --load-format dummy \
      --device cuda --dtype bfloat16 --concurrency 256 --num-requests 512 --new-tokens 128 --no-hf \
      --client-processes 4 --engine-args=\"\$extra\" --json-out '$LOGS/serve-8b-pieces-'\$pieces.json; done"
    stage quant 90 "$PY" scripts/bench_quant.py --json "$LOGS/bench-quant.json"
    stage moe 90 "$PY" scripts/bench_moe.py --device "$DEVICE" --dtype bfloat16 --sizes mid
  fi
}

CALL_START=$START
case "$CALL" in
  kernels) call_kernels ;;
  bench) call_bench ;;
  all) call_kernels; CALL_START=$(date +%s); call_bench ;;   # each call its own budget, as on the device
esac
report
rm -rf "$LOGS"
echo "results: $OUT_DIR/gpu_check.json, $OUT_DIR/gpu_check.md, $OUT_DIR/logs.tar.gz" >&2
