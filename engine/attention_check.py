"""`python -m engine.attention_check`: which attention backend this node would run, checked for real.

`tgi-hpc release verify` runs it with a release's Python on a GPU node: it picks the backend the
engine would pick (the same priority list and reference self-check, on a Llama-8B-like head layout
with and without a sliding window) and prints one JSON line. Exit 0 when a backend passed, 1 when
none did or the forced one (--attention-backend) cannot run.
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

from engine.attention.selection import CHOICES, choose_backend
from engine.layers.attention import Attention


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.attention_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--attention-backend", default="auto", choices=CHOICES)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, choices=["float16", "bfloat16", "float32"])
    parser.add_argument("--block-size", type=int, default=None)
    parser.add_argument("--json-out", help="also write the result to this file")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    layers = [Attention(32, 8, 128, 128 ** -0.5), Attention(32, 8, 128, 128 ** -0.5, sliding_window=4096)]
    result = {"device": str(device), "dtype": str(dtype).removeprefix("torch.")}
    try:
        backend, block_size, report = choose_backend(args.attention_backend, device, dtype, layers, args.block_size)
        result.update(ok=True, attention_backend=backend.name, block_size=block_size, checked=report)
    except (ValueError, RuntimeError) as error:
        result.update(ok=False, error=str(error))
    print(json.dumps(result))
    if args.json_out:
        with open(args.json_out, "w") as out:
            json.dump(result, out)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
