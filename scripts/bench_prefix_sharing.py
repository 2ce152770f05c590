"""n choices sharing their prompt through the prefix cache: one /v1/completions request with n=8 on a long prompt,
against the same server started with --prefix-caching false, in one invocation.

Prints, per setting, the prompt tokens the engine prefilled for the request (tgi_prompt_tokens_total before and
after), usage.prompt_tokens_details.cached_tokens and the request time of each repetition.

    PYTHONPATH=$PWD python scripts/bench_prefix_sharing.py [--model smollm2] [--n 8] [--repeats 3]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "scripts"), str(ROOT / "tests" / "engine")]

from make_models import ensure_model  # noqa: E402
from test_clients import start_server, stop_server  # noqa: E402

PROMPT = ("The history of the printing press begins in the fifteenth century, when movable type changed how books "
          "were made, sold and read across Europe. ") * 12


def counter(url: str, name: str) -> float:
    return next(float(line.split()[1]) for line in httpx.get(f"{url}/metrics").text.splitlines()
                if line.startswith(name + " "))


def run(model: Path, prefix_caching: str, n: int, repeats: int) -> None:
    proc, url, _ = start_server(model, Path(tempfile.mkdtemp()), "--prefix-caching", prefix_caching,
                                "--max-total-tokens", "1024")
    try:
        for i in range(repeats):  # a new prompt each time: nothing cached from the previous request
            before = counter(url, "tgi_prompt_tokens_total")
            start = time.monotonic()
            body = httpx.post(f"{url}/v1/completions", json={"prompt": f"{i} {PROMPT}", "n": n, "max_tokens": 4,
                                                             "seed": 1}, timeout=900).json()
            elapsed = time.monotonic() - start
            prefilled = counter(url, "tgi_prompt_tokens_total") - before
            usage = body["usage"]
            print(f"prefix_caching={prefix_caching} n={n} prompt_tokens={usage['prompt_tokens']} "
                  f"cached_tokens={usage['prompt_tokens_details']['cached_tokens']} prefilled={prefilled:.0f} "
                  f"time_s={elapsed:.2f}", flush=True)
    finally:
        stop_server(proc)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", help="a test model name (scripts/make_models.py)")
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    model = ensure_model(args.model)
    for setting in ("true", "false"):
        run(model, setting, args.n, args.repeats)


if __name__ == "__main__":
    main()
