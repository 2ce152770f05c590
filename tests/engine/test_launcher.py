"""`python -m engine`: flags, env twins, clear errors, and a real server whose API key came from the env
(enforced, never in argv or logs); the real engine frees a disconnected stream's KV blocks."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from engine.launcher import build_parser, parse_args, to_config, write_ready_file

ROOT = Path(__file__).resolve().parents[2]


def run_launcher(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "engine", *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})


def test_unknown_flag_is_a_clear_error():
    result = run_launcher("--model-id", "x", "--max-input-lenght", "5")
    assert result.returncode == 2
    assert "error: unrecognized arguments: --max-input-lenght 5" in result.stderr
    assert "Traceback" not in result.stderr


def test_quantize_and_missing_model_are_clear_errors(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(["--model-id", "m", "--quantize", "exl2"], environ={})
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--quantize exl2 is not supported; supported: GPTQ" in err and "bitsandbytes-nf4" in err
    parse_args(["--model-id", "m", "--quantize", "none"], environ={})  # the TGI default is fine
    assert to_config(parse_args(["--model-id", "m", "--quantize", "fp8"], environ={}), "m").quantize == "fp8"
    assert to_config(parse_args(["--model-id", "m"], environ={"QUANTIZE": "awq"}), "m").quantize == "awq"
    with pytest.raises(SystemExit):
        parse_args([], environ={})
    assert "--model-id is required (or set MODEL_ID)" in capsys.readouterr().err
    result = run_launcher("--model-id", str(tmp_path / "nope"), env={"HF_HUB_OFFLINE": "1"})
    assert result.returncode != 0
    assert "is neither a directory nor in the local Hugging Face cache" in result.stderr


def test_defaults_follow_tgi():
    args = parse_args(["--model-id", "m"], environ={})
    config = to_config(args, "/snap")
    assert (config.hostname, config.port, config.num_shard, config.max_concurrent_requests) == ("0.0.0.0", 3000, 1, 128)
    assert (config.max_best_of, config.max_stop_sequences, config.max_top_n_tokens) == (2, 4, 5)
    assert config.api_key is None and config.model_id == "/snap" and config.served_model_name == "m"


def test_env_twins_and_flags_override_env():
    env = {"MODEL_ID": "/m", "REVISION": "abc", "NUM_SHARD": "2", "HOSTNAME": "10.0.0.7", "PORT": "8080",
           "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29600", "DTYPE": "bfloat16", "API_KEY": "k",
           "MAX_INPUT_LENGTH": "100", "MAX_TOTAL_TOKENS": "200", "CORS_ALLOW_ORIGIN": "https://a, https://b",
           "JSON_OUTPUT": "true", "KV_CACHE_BYTES": "256MiB", "MAX_CONCURRENT_REQUESTS": "7"}
    config = to_config(parse_args([], environ=env), "/m")
    assert (config.revision, config.num_shard, config.hostname, config.port) == ("abc", 2, "10.0.0.7", 8080)
    assert (config.master_addr, config.master_port, config.dtype, config.api_key) == ("10.0.0.1", 29600, "bfloat16", "k")
    assert (config.max_input_tokens, config.max_total_tokens, config.max_concurrent_requests) == (100, 200, 7)
    assert config.cors_allow_origin == ["https://a", "https://b"] and config.json_output is True
    assert config.cpu_kv_cache_bytes == 256 * 1024**2
    config = to_config(parse_args([], environ={**env, "CUDA_GRAPHS": "1, 2,8", "CPU_GEMM": "aten"}), "/m")
    assert config.cuda_graphs == [1, 2, 8] and config.cpu_gemm == "aten"
    assert to_config(parse_args(["--cuda-graphs", "0"], environ=env), "/m").cuda_graphs == []
    assert to_config(parse_args([], environ=env), "/m").cuda_graphs is None  # the engine's default sizes
    args = parse_args(["--port", "9000", "--max-input-tokens", "50", "--cors-allow-origin", "https://c"], environ=env)
    assert (args.port, args.max_input_tokens, args.cors_allow_origin) == (9000, 50, ["https://c"])
    assert parse_args(["--max-input-length", "60"], environ=env).max_input_tokens == 60


def test_failure_and_grammar_limits_have_flags_env_twins_and_defaults():
    config = to_config(parse_args(["--model-id", "/m"], environ={}), "/m")
    assert (config.step_timeout_s, config.max_grammar_bytes, config.grammar_timeout_s) == (300.0, 512 * 1024, 10.0)
    env = {"MODEL_ID": "/m", "STEP_TIMEOUT": "30", "MAX_GRAMMAR_BYTES": "2MiB", "GRAMMAR_TIMEOUT": "2.5"}
    config = to_config(parse_args([], environ=env), "/m")
    assert (config.step_timeout_s, config.max_grammar_bytes, config.grammar_timeout_s) == (30.0, 2 * 1024**2, 2.5)
    config = to_config(parse_args(["--max-grammar-bytes", "1000", "--step-timeout", "9"], environ=env), "/m")
    assert (config.max_grammar_bytes, config.step_timeout_s) == (1000, 9.0)


def test_prefix_caching_and_max_new_tokens_default(capsys):
    env = {"MODEL_ID": "/m"}
    config = to_config(parse_args([], environ=env), "/m")
    assert config.prefix_caching is True and config.max_new_tokens_default == 1024
    config = to_config(parse_args([], environ={**env, "PREFIX_CACHING": "false", "MAX_NEW_TOKENS_DEFAULT": "0"}), "/m")
    assert config.prefix_caching is False and config.max_new_tokens_default == 0     # 0: TGI's "all the room"
    config = to_config(parse_args(["--prefix-caching", "true", "--max-new-tokens-default", "64"],
                                  environ={**env, "PREFIX_CACHING": "false"}), "/m")
    assert config.prefix_caching is True and config.max_new_tokens_default == 64
    for argv, message in [(["--prefix-caching", "maybe"], "invalid boolean 'maybe'"),
                          (["--max-new-tokens-default", "-1"], "--max-new-tokens-default must be >= 0")]:
        with pytest.raises(SystemExit):
            parse_args(argv, environ=env)
        assert message in capsys.readouterr().err


def test_bad_env_values_name_the_variable(capsys):
    with pytest.raises(SystemExit):
        parse_args([], environ={"MODEL_ID": "m", "DTYPE": "float8"})
    assert "DTYPE='float8' is not one of float16, bfloat16, float32" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args([], environ={"MODEL_ID": "m", "PORT": "http"})
    assert "--port" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args([], environ={"MODEL_ID": "m", "CPU_GEMM": "blas"})
    assert "CPU_GEMM='blas' is not one of auto, onednn, aten" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--model-id", "m", "--cuda-graphs", "1,two"], environ={})
    assert "invalid batch sizes '1,two'" in capsys.readouterr().err


def test_cpu_threads_flag_and_its_env_twin(capsys):
    assert parse_args(["--model-id", "m"], environ={}).cpu_threads is None   # every core of the allocation
    assert parse_args(["--model-id", "m"], environ={"CPU_THREADS": "2"}).cpu_threads == 2
    with pytest.raises(SystemExit):
        parse_args(["--model-id", "m", "--cpu-threads", "0"], environ={})
    assert "--cpu-threads must be >= 1, got 0" in capsys.readouterr().err


def test_api_key_stays_out_of_repr():
    config = to_config(parse_args(["--model-id", "m"], environ={"API_KEY": "hunter2"}), "/m")
    assert config.api_key == "hunter2" and "hunter2" not in repr(config)


def test_ready_file_is_written_atomically(tmp_path):
    target = tmp_path / "sub" / "ready.json"
    write_ready_file(str(target), {"port": 1234})
    assert json.loads(target.read_text()) == {"port": 1234}
    assert [p.name for p in target.parent.iterdir()] == ["ready.json"]


def test_real_server_with_env_api_key(model_path, tmp_path):
    from test_clients import start_server, stop_server

    secret = "env-secret-93d1"
    proc, url, log = start_server(model_path("smollm2"), tmp_path, "--json-output", "--max-total-tokens", "1024",
                                  "--cpu-threads", "1", env={"API_KEY": secret})
    try:
        cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes()
        assert secret.encode() not in cmdline
        auth = {"Authorization": f"Bearer {secret}"}
        # a prompt that keeps generating (no early EOS), so the request is still running after one token
        body = {"inputs": "Count to one thousand: 1, 2, 3, 4, 5,", "parameters": {"max_new_tokens": 500}}
        assert httpx.post(f"{url}/generate", json=body).status_code == 401
        assert httpx.get(f"{url}/health").status_code == 200  # probes carry no token
        info = httpx.get(f"{url}/info").json()
        assert info["attention_backend"] == "cpu_paged" and info["cuda_graphs"] == []
        # what start-up tried, and why it chose
        from engine.kernels import cpu_prefill_attention
        why = cpu_prefill_attention.width_reason()  # the prefill kernel where the CPU has AVX-512, else SDPA
        assert info["attention_checks"] == {"cpu_paged": "ok",
                                             "cpu_paged prefill": "kernel" if why is None else f"sdpa ({why})"}
        assert info["linear_backend"] in ("onednn", "aten")  # oneDNN unless this torch build lacks it
        assert info["elementwise_backend"] == "fused"  # float32 on CPU: the one-pass C++ kernels
        assert info["sampler_backend"] == "fused"  # logprobs and greedy picks: kernels/cpu_log_softmax.py
        assert info["quant_kernels"] == {}  # no quantized layers (and no CUDA) here
        with httpx.Client(base_url=url, headers=auth, timeout=60) as http:
            with http.stream("POST", "/generate_stream", json=body) as r:
                assert r.status_code == 200
                lines = r.iter_lines()
                assert next(lines).startswith("data:{")
                # the running request holds KV blocks (checked over a few tokens: the metrics are live)
                held = False
                for _, line in zip(range(20), lines):
                    free, total = blocks(url)
                    if free < total:
                        held = True
                        break
                assert held
            # the client left after one token: the engine aborts the request and frees its blocks
            deadline = time.monotonic() + 10
            while (b := blocks(url))[0] != b[1]:
                assert time.monotonic() < deadline, b
                time.sleep(0.05)
            assert "tgi_request_success 0.0" in http.get("/metrics").text
    finally:
        stop_server(proc)
    text = log.read_text()
    assert secret not in text
    assert any(json.loads(line).get("message", "").startswith("serving on") for line in text.splitlines()
               if line.startswith("{"))
    assert any(json.loads(line).get("message", "").startswith("CPU: the model uses 1 torch threads")
               for line in text.splitlines() if line.startswith("{"))


def blocks(url: str) -> tuple[float, float]:
    lines = {line.split()[0]: float(line.split()[1]) for line in httpx.get(f"{url}/metrics").text.splitlines()
             if line.startswith("tgi_kv_cache_blocks")}
    return lines["tgi_kv_cache_blocks_free"], lines["tgi_kv_cache_blocks_total"]


def test_a_dead_rank_stops_the_launcher_with_no_orphans(model_path, tmp_path):
    """--num-shard 2 on CPU (gloo): kill rank 1; the launcher exits non-zero within seconds, nothing left."""
    import os
    import signal
    import subprocess

    from test_clients import start_server

    proc, url, log = start_server(model_path("tiny-llama"), tmp_path, "--num-shard", "2")
    try:
        children = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
        workers = [int(p) for p in children if b"spawn_main" in Path(f"/proc/{p}/cmdline").read_bytes()]
        assert len(workers) == 1, children  # rank 1; rank 0 is the launcher itself
        os.kill(workers[0], signal.SIGKILL)
        code = proc.wait(timeout=20)
        assert code != 0
        time.sleep(0.5)
        leftovers = [p for p in workers if Path(f"/proc/{p}").exists()
                     and Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"]
        assert not leftovers
    finally:
        if proc.poll() is None:
            proc.kill()


def test_flags_tgi_hpc_passes_through_exist_in_the_launcher():
    from tgi_hpc.workflows.engine_flags import RESERVED, SERVE_OPTIONS, SWITCH_FLAGS, VALUE_FLAGS

    launcher_flags = {flag for action in build_parser({})._actions for flag in action.option_strings}
    assert (VALUE_FLAGS | SWITCH_FLAGS | RESERVED | SERVE_OPTIONS) - launcher_flags == set()
