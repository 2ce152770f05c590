"""Engine flags `serve` may pass through (`--engine-arg FLAG=VALUE`), checked before rendering."""
from __future__ import annotations

from tgi_hpc.errors import UsageError

# Launcher flags (TGI's names) a user may set; value-less ones are switches.
VALUE_FLAGS = {
    "--dtype", "--revision", "--max-concurrent-requests", "--max-best-of", "--max-stop-sequences",
    "--max-top-n-tokens", "--max-input-tokens", "--max-input-length", "--max-total-tokens",
    "--max-batch-prefill-tokens", "--max-batch-total-tokens", "--max-batch-size",
    "--waiting-served-ratio", "--cuda-memory-fraction", "--cors-allow-origin", "--load-format",
    "--served-model-name", "--kv-cache-bytes", "--cuda-graphs", "--piecewise-graphs", "--cpu-gemm", "--cpu-elementwise",
    "--gpu-elementwise", "--async-scheduling",
    "--attention-backend", "--model-impl",
    "--block-size",
    "--cpu-threads", "--drain-timeout", "--max-new-tokens-default", "--prefix-caching", "--lora-adapters",
    "--rank-timeout", "--speculate", "--speculative-layers", "--max-client-batch-size", "--reasoning-parser",
    "--tool-call-parser", "--max-loras", "--max-lora-rank",
    "--max-images-per-request", "--max-image-bytes", "--image-fetch-timeout", "--image-fetch",
}
SWITCH_FLAGS = {"--json-output", "--enable-runtime-lora", "--enforce-eager"}
# Set by the job itself; --api-key in particular must never be on a command line.
RESERVED = {"--model-id", "--port", "--port-attempts", "--hostname", "--master-port", "--master-addr", "--num-shard",
            "--api-key", "--pipeline-parallel-size"}
# Serve options: checked against the snapshot and used to size the job, so never passed around them.
SERVE_OPTIONS = {"--quantize", "--speculative-model"}


def engine_args(pairs: list[str]) -> list[str]:
    """Turn ["--max-top-n-tokens=5", "--json-output"] into argv words, refusing unknown flags."""
    argv: list[str] = []
    for item in pairs:
        flag, has_value, value = item.partition("=")
        if flag in RESERVED:
            raise UsageError(f"--engine-arg {flag} is set by tgi-hpc itself; use the serve option instead")
        if flag in SERVE_OPTIONS:
            raise UsageError(f"--engine-arg {flag}: use `tgi-hpc serve {flag}`, which checks it against the "
                             "checkpoint and sizes the job by it")
        if flag in SWITCH_FLAGS and not has_value:
            argv.append(flag)
        elif flag in VALUE_FLAGS and has_value:
            argv += [flag, value]
        else:
            known = ", ".join(sorted(VALUE_FLAGS | SWITCH_FLAGS))
            raise UsageError(f"--engine-arg {item!r} is not an engine flag (FLAG=VALUE or a switch). Known: {known}")
    return argv
