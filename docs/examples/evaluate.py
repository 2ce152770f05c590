"""An evaluation job chained after a serve job: wait until the server answers, ask it questions, score them.

    JOB=$(python -c 'from tgi_hpc import api; print(api.serve("HuggingFaceTB/SmolLM2-1.7B-Instruct").job_id)')
    sbatch --dependency=after:$JOB --time=0:30:00 --wrap "python docs/examples/evaluate.py $JOB --stop-server"

`after:` starts this job once the server job has started (not when its model is loaded), so the script waits
for READY itself. It runs on the cluster: the endpoint is the server's node:port, with its API key; the cluster
and overrides come from TGI_HPC_CLUSTER / TGI_HPC_SET, which sbatch passes on from the submitting shell.
"""
from __future__ import annotations

import argparse
import json

import httpx

from tgi_hpc import api

QUESTIONS = [  # (question, what a right answer contains)
    ("What is the capital of France? Answer with one word.", "paris"),
    ("How many legs does a spider have? Answer with a number.", "8"),
    ("What color is the sky on a clear day? Answer with one word.", "blue"),
]


def ask(endpoint: api.Access, question: str) -> str:
    response = httpx.post(f"{endpoint.url}/v1/chat/completions", headers=endpoint.headers, timeout=300,
                          json={"model": endpoint.model or "tgi", "temperature": 0, "max_tokens": 16,
                                "messages": [{"role": "user", "content": question}]})
    response.raise_for_status()
    return response.json()["choices"][0]["message"]["content"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("job", help="the serve job's id")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds to wait for the server to be READY")
    parser.add_argument("--stop-server", action="store_true", help="stop the serve job when done")
    args = parser.parse_args()

    server = api.attach(args.job)
    server.wait_until_ready(timeout=args.timeout)
    try:
        with server.endpoint() as endpoint:
            answers = [{"question": q, "answer": ask(endpoint, q), "expected": want} for q, want in QUESTIONS]
        for row in answers:
            row["right"] = row["expected"] in row["answer"].lower()
        result = {"job_id": server.job_id, "model": endpoint.model, "answers": answers,
                  "score": sum(row["right"] for row in answers) / len(answers),
                  "server_counters": server.metrics(interval=0.5)["counters"]}
        print(json.dumps(result, indent=2))
    finally:
        if args.stop_server:
            server.stop()


if __name__ == "__main__":
    main()
