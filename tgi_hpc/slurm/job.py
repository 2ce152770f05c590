"""Helpers that run inside a job (`python -m tgi_hpc.slurm.job ...`): port, API key, endpoint, staging.

They live in Python, not in the template, so they are tested like the rest of the code.
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import socket
import sys
import time
from pathlib import Path

from tgi_hpc.files import write_atomic
from tgi_hpc.slurm.endpoint import Endpoint, EngineEndpoint
from tgi_hpc.slurm.ports import pick_port


def job_id(env: dict[str, str] | os._Environ = os.environ) -> str:
    value = env.get("SLURM_JOB_ID") or env.get("TGI_HPC_JOB_ID")
    if not value:
        raise SystemExit("tgi_hpc.slurm.job: neither SLURM_JOB_ID nor TGI_HPC_JOB_ID is set")
    return value


def ensure_api_key(path: Path) -> None:
    """Create a random key (mode 0600) once; a requeued job keeps the key its users already have."""
    if path.exists() and path.read_text().strip():
        return
    write_atomic(path, secrets.token_urlsafe(32) + "\n", mode=0o600)


def stage(src: Path, dst: Path) -> Path:
    """Copy a snapshot to node-local disk, skipping files whose size and mtime already match."""
    if not ((src / "config.json").is_file() or (src / "adapter_config.json").is_file()):
        raise SystemExit(f"tgi_hpc.slurm.job: no model or adapter at {src} (config.json missing)")
    for path in sorted(src.rglob("*")):
        rel = path.relative_to(src)
        if path.is_dir() or any(part.startswith(".") for part in rel.parts):
            continue
        target = dst / rel
        stat = path.stat()
        if target.exists():
            tstat = target.stat()
            if tstat.st_size == stat.st_size and int(tstat.st_mtime) == int(stat.st_mtime):
                continue
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, target)
    return dst


def await_ready(ready_file: Path, pid: int, timeout: float = 24 * 3600) -> int:
    """The port the engine bound, from the file it writes once listening; 0 if it died first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            return int(json.loads(ready_file.read_text())["port"])
        except (FileNotFoundError, ValueError, KeyError):
            pass
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return 0
        time.sleep(0.5)
    return 0


def write_endpoint(path: Path, port: int, api_key_file: str, model: str, adapters: tuple[str, ...] = (),
                   models: tuple[EngineEndpoint, ...] = ()) -> Endpoint:
    endpoint = Endpoint(
        job_id=job_id(),
        node=os.environ.get("SLURMD_NODENAME") or socket.gethostname(),
        host=socket.gethostname(),
        port=port,
        api_key_file=api_key_file,
        model=model,
        restart_count=int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0),
        started_at=time.time(),
        adapters=adapters,
        models=models,
    )
    write_atomic(path, endpoint.to_json() + "\n", mode=0o644)
    return endpoint


def await_engines(engines: list[list[str]]) -> tuple[EngineEndpoint, ...]:
    """[[model, ready file, pid, "adapter,..."], ...] -> each engine's endpoint, once all listen; () if one died."""
    found = []
    for model, ready_file, pid, adapters in engines:
        port = await_ready(Path(ready_file), int(pid))
        if not port:
            return ()
        found.append(EngineEndpoint(model, port, tuple(a for a in adapters.split(",") if a)))
    return tuple(found)


def gpu_slice(first: int, count: int, env: dict[str, str] | os._Environ = os.environ) -> str:
    """GPUs first..first+count-1 of the job's CUDA_VISIBLE_DEVICES (ids or UUIDs), for one engine of several."""
    visible = [d for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d]
    if len(visible) < first + count:
        raise SystemExit(f"tgi_hpc.slurm.job: the job sees {len(visible)} GPU(s) (CUDA_VISIBLE_DEVICES="
                         f"{env.get('CUDA_VISIBLE_DEVICES', '')!r}); engine GPUs {first}..{first + count - 1} "
                         "are not there")
    return ",".join(visible[first:first + count])


def main(argv: list[str] | None = None) -> int:
    import logging

    from tgi_hpc.errors import TgiHpcError

    # In a job, progress (e.g. a long download) must reach the job's log.
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="[tgi-hpc] %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)

    try:
        return _main(argv)
    except TgiHpcError as exc:
        print(f"[tgi-hpc] error: {exc}", file=sys.stderr)
        return exc.exit_code


def _main(argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tgi_hpc.slurm.job")
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pick-port")
    p.add_argument("--base", type=int, default=10000)
    p.add_argument("--exclude", type=int, action="append", default=[])
    p = sub.add_parser("api-key")
    p.add_argument("--file", type=Path, required=True)
    p = sub.add_parser("write-endpoint")
    p.add_argument("--file", type=Path, required=True)
    p.add_argument("--port", type=int, help="the port (default: wait for --ready-file)")
    p.add_argument("--ready-file", type=Path)
    p.add_argument("--pid", type=int, default=0, help="the engine's pid: stop waiting if it dies")
    p.add_argument("--api-key-file", default="")
    p.add_argument("--model", default="")
    p.add_argument("--adapter", action="append", default=[], help="a LoRA adapter served beside --model")
    p.add_argument("--engine", nargs=4, action="append", default=[], metavar=("MODEL", "READY_FILE", "PID", "ADAPTERS"),
                   help="several models: one per engine (ADAPTERS: comma-separated names, or '')")
    p = sub.add_parser("gpu-slice")
    p.add_argument("--first", type=int, required=True)
    p.add_argument("--count", type=int, required=True)
    p = sub.add_parser("stage")
    p.add_argument("--src", type=Path, required=True)
    p.add_argument("--dst", type=Path, required=True)
    p = sub.add_parser("download")
    p.add_argument("--model", required=True)
    p.add_argument("--revision", default="main")
    p.add_argument("--store", type=Path, required=True)
    p = sub.add_parser("models")
    p.add_argument("--store", type=Path, required=True)
    p = sub.add_parser("models-rm")
    p.add_argument("--store", type=Path, required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--revision")
    p = sub.add_parser("compile")
    p.add_argument("--release-dir", type=Path, required=True)
    p.add_argument("--cuda-archs", default="")
    p.add_argument("--with-kernels", action="store_true")
    p.add_argument("--name")
    p.add_argument("--torch-spec")
    p.add_argument("--wheelhouse")
    p.add_argument("--venv-tool", default="venv", choices=["venv", "virtualenv"])
    p = sub.add_parser("service", help="a service's job: watch (handover), term (SIGTERM trap), exit")
    p.add_argument("service_cmd", choices=["watch", "term", "exit"])
    p.add_argument("--state", required=True, help="the service's state file")
    p.add_argument("--endpoint-file", default="")
    p.add_argument("--pid", type=int, default=0, help="the engine's pid")
    args = parser.parse_args(argv)

    if args.cmd == "pick-port":
        port = pick_port(job_id(), base=args.base, exclude=set(args.exclude))
        print(f"[tgi-hpc] port {port} (job {job_id()})", file=sys.stderr)
        print(port)
    elif args.cmd == "api-key":
        ensure_api_key(args.file)
    elif args.cmd == "write-endpoint" and args.engine:
        engines = await_engines(args.engine)
        if not engines:
            print("[tgi-hpc] an engine exited before listening: no endpoint published", file=sys.stderr)
            return 1
        endpoint = write_endpoint(args.file, engines[0].port, args.api_key_file, engines[0].model,
                                  engines[0].adapters, engines)
        print(f"[tgi-hpc] endpoint {', '.join(f'{e.model} on port {e.port}' for e in engines)} written to "
              f"{args.file}", file=sys.stderr)
    elif args.cmd == "gpu-slice":
        print(gpu_slice(args.first, args.count))
    elif args.cmd == "write-endpoint":
        port = args.port or await_ready(args.ready_file, args.pid or os.getppid())
        if not port:
            print("[tgi-hpc] the engine exited before listening: no endpoint published", file=sys.stderr)
            return 1
        endpoint = write_endpoint(args.file, port, args.api_key_file, args.model, tuple(args.adapter))
        print(f"[tgi-hpc] endpoint {endpoint.url} written to {args.file}", file=sys.stderr)
    elif args.cmd == "service":
        from tgi_hpc.slurm.handover import main as service_main

        return service_main(args)
    elif args.cmd == "stage":
        print(stage(args.src, args.dst))
    elif args.cmd == "download":
        from tgi_hpc.models.download import download_model

        stored = download_model(args.model, args.store, revision=args.revision)  # token: HF_TOKEN or stored login
        print(f"[tgi-hpc] stored {stored.model_id}@{stored.revision} in {stored.path}", file=sys.stderr)
    elif args.cmd in ("models", "models-rm"):  # for a laptop: results as JSON
        import json

        from tgi_hpc.models.store import list_models, remove_model, stored_dict

        if args.cmd == "models":
            print(json.dumps([stored_dict(m) for m in list_models(args.store)]))
        else:
            print(json.dumps([str(p) for p in remove_model(args.store, args.model, args.revision)]))
    elif args.cmd == "compile":
        from tgi_hpc.release.build import build_release
        from tgi_hpc.release.options import CompileOptions, release_spec

        opts = CompileOptions(str(args.release_dir), args.name, args.cuda_archs, args.with_kernels,
                              args.torch_spec, args.wheelhouse, args.venv_tool)
        manifest = build_release(release_spec(str(args.release_dir), opts))
        print(f"[tgi-hpc] release {args.release_dir}/{manifest.name} is current", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
