"""tgi_hpc.models.download and tgi_hpc.models.hf_token against the real huggingface_hub client and tests/support/hub_server.py."""
from __future__ import annotations

import hashlib
import inspect
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from safetensors.numpy import save_file

from tests.support.hub_server import HubServer, commit_sha, scan_repo
from tgi_hpc.errors import DownloadError, UsageError
from tgi_hpc.models.download import download_model, plan_files
from tgi_hpc.models.hf_token import find_token
from tgi_hpc.models.store import MANIFEST, PARTIAL_DIR, list_models, model_dir, read_manifest

REPO_ROOT = Path(__file__).resolve().parents[2]
TOKEN = "hf_TestTokenThatMustNeverLeak0123456789"
LFS_THRESHOLD = 32 * 1024
SERVING_FILES = {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                 "model.safetensors.index.json"}


@pytest.fixture(autouse=True)
def hf_env(tmp_path, monkeypatch):
    """HF_HOME in tmp, no token and no offline switch from the machine running the tests."""
    import huggingface_hub.constants as hf_constants

    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_TOKEN_PATH", "HF_HUB_OFFLINE", "HF_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.setattr(hf_constants, "HF_TOKEN_PATH", str(tmp_path / "hf_home" / "token"))
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", False)
    return tmp_path / "hf_home"


def _write_json(path: Path, data) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))


def _tokenizer_files(folder: Path) -> None:
    _write_json(folder / "config.json", {"model_type": "llama", "hidden_size": 64, "tie_word_embeddings": False})
    _write_json(folder / "generation_config.json", {"eos_token_id": 2})
    _write_json(folder / "tokenizer.json", {"version": "1.0", "model": {"type": "BPE", "vocab": {"a": 0}}})
    _write_json(folder / "tokenizer_config.json", {"bos_token": "<s>"})
    _write_json(folder / "special_tokens_map.json", {"bos_token": "<s>"})


def _safetensors_repo(folder: Path, seed: int = 0) -> None:
    """Two LFS-sized shards + index, plus everything serving must not download."""
    rng = np.random.default_rng(seed)
    _tokenizer_files(folder)
    shards = {"model-00001-of-00002.safetensors": {"embed.weight": rng.standard_normal((256, 64), np.float32)},
              "model-00002-of-00002.safetensors": {"lm_head.weight": rng.standard_normal((256, 64), np.float32)}}
    for name, tensors in shards.items():
        save_file(tensors, str(folder / name), metadata={"format": "pt"})
    _write_json(folder / "model.safetensors.index.json",
                {"metadata": {}, "weight_map": {k: n for n, t in shards.items() for k in t}})
    for junk in ("pytorch_model.bin", "consolidated.safetensors", "flax_model.msgpack", "model.onnx", "tf_model.h5",
                 "model.gguf", "original/consolidated.00.pth", "onnx/model.onnx", "README.md", ".gitattributes"):
        (folder / junk).parent.mkdir(parents=True, exist_ok=True)
        (folder / junk).write_bytes(os.urandom(40_000))
    _write_json(folder / "original" / "params.json", {"dim": 64})


def _gptq_repo(folder: Path) -> None:
    """An old AutoGPTQ export: GPTQ's settings only in quantize_config.json, one oddly named weights file."""
    rng = np.random.default_rng(2)
    _tokenizer_files(folder)
    _write_json(folder / "quantize_config.json", {"bits": 4, "group_size": 128, "desc_act": False, "sym": True})
    save_file({"qweight": rng.integers(0, 2**31, (8, 64), dtype=np.int32)},
              str(folder / "gptq_model-4bit-128g.safetensors"), metadata={"format": "pt"})
    for junk in ("README.md", "recipe.yaml", "gptq_model-4bit-128g.bin"):
        (folder / junk).write_bytes(os.urandom(1000))


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    root = tmp_path_factory.mktemp("hub")
    for name in ("tiny-st", "gated", "private", "corrupt"):
        _safetensors_repo(root / "acme" / name)
    _safetensors_repo(root / "acme" / "tiny-st@v2", seed=1)
    _gptq_repo(root / "acme" / "tiny-gptq")
    _tokenizer_files(root / "acme" / "gguf-only")
    (root / "acme" / "gguf-only" / "model.gguf").write_bytes(b"GGUF" + os.urandom(100))
    srv = HubServer(root, gated={"acme/gated"}, private={"acme/private"}, tokens={TOKEN},
                    lfs_threshold=LFS_THRESHOLD, tamper={"acme/corrupt/model-00002-of-00002.safetensors"})
    with srv as url:
        yield srv, url, root


def _files(folder: Path) -> set[str]:
    return {p.relative_to(folder).as_posix() for p in folder.rglob("*")
            if p.is_file() and not p.relative_to(folder).as_posix().startswith(".")}


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _assert_no_token_under(*roots: Path) -> None:
    for root in roots:
        for p in root.rglob("*"):
            if p.is_file():
                assert TOKEN.encode() not in p.read_bytes(), f"token leaked into {p}"


# plan_files (pure)

def test_plan_prefers_safetensors_and_skips_duplicates():
    listing = ["config.json", "generation_config.json", "model-00001-of-00004.safetensors",
               "model-00002-of-00004.safetensors", "model.safetensors.index.json", "original/consolidated.00.pth",
               "original/params.json", "original/tokenizer.model", "tokenizer.json", "tokenizer_config.json",
               "special_tokens_map.json", "pytorch_model.bin", "LICENSE", "README.md", ".gitattributes",
               "flax_model.msgpack", "onnx/model.onnx", "model.gguf", "chat_template.jinja",
               "additional_chat_templates/tool_use.jinja", "1_Pooling/config.json"]
    assert plan_files(listing) == sorted([  # 1_Pooling/config.json: a pooling model's mode (issue 24)
        "1_Pooling/config.json", "additional_chat_templates/tool_use.jinja", "chat_template.jinja", "config.json", "generation_config.json",
        "model-00001-of-00004.safetensors", "model-00002-of-00004.safetensors", "model.safetensors.index.json",
        "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"])


def test_plan_mistral_layout_skips_consolidated_and_single_file_wins_over_index():
    mistral = ["config.json", "consolidated.safetensors", "model-00001-of-00002.safetensors",
               "model-00002-of-00002.safetensors", "model.safetensors.index.json", "params.json",
               "tokenizer.model", "tokenizer.model.v3", "tokenizer.json"]
    assert "consolidated.safetensors" not in plan_files(mistral)
    assert "tokenizer.model" in plan_files(mistral) and "params.json" not in plan_files(mistral)
    both = ["config.json", "model.safetensors", "model-00001-of-00002.safetensors", "model.safetensors.index.json"]
    assert plan_files(both) == ["config.json", "model.safetensors"]


def test_plan_keeps_what_quantized_formats_need():
    """TheBloke-style GPTQ repo: one oddly named safetensors file and quantize_config.json beside config.json."""
    gptq = ["config.json", "generation_config.json", "gptq_model-4bit-128g.safetensors", "quantize_config.json",
            "tokenizer.json", "tokenizer_config.json", "README.md", "recipe.yaml", "awq/quantize_config.json"]
    assert plan_files(gptq) == ["config.json", "generation_config.json", "gptq_model-4bit-128g.safetensors",
                                "quantize_config.json", "tokenizer.json", "tokenizer_config.json"]


def test_plan_bin_only_takes_weights_not_training_state():
    listing = ["config.json", "pytorch_model-00001-of-00002.bin", "pytorch_model-00002-of-00002.bin",
               "pytorch_model.bin.index.json", "training_args.bin", "optimizer.pt", "vocab.json", "merges.txt"]
    assert plan_files(listing) == ["config.json", "merges.txt", "pytorch_model-00001-of-00002.bin",
                                   "pytorch_model-00002-of-00002.bin", "pytorch_model.bin.index.json", "vocab.json"]
    assert plan_files(["config.json", "model.gguf", "tokenizer.json"]) == ["config.json", "tokenizer.json"]
    assert plan_files(["additional_chat_templates/../../x.jinja", "additional_chat_templates/.x.jinja"]) == []


# downloads

def test_safetensors_repo_downloads_only_what_serving_needs(hub, tmp_path):
    srv, url, root = hub
    srv.requests.clear()
    model = download_model("acme/tiny-st", tmp_path / "store", endpoint=url, progress=False)
    source = root / "acme" / "tiny-st"
    assert model.complete and model.format == "safetensors"
    assert model.path == model_dir(tmp_path / "store", "acme/tiny-st")
    assert _files(model.path) == SERVING_FILES
    assert all(_sha256(model.path / f) == _sha256(source / f) for f in SERVING_FILES)
    fetched = {r.path.split("/resolve/")[1].split("/", 1)[1] for r in srv.requests if "/resolve/" in r.path}
    assert fetched == SERVING_FILES  # nothing else was even asked for
    manifest = read_manifest(model.path)
    assert manifest["commit"] == model.commit == commit_sha(scan_repo(source, LFS_THRESHOLD))
    assert {f["path"]: f["sha256"] for f in manifest["files"]} == {f: _sha256(source / f) for f in SERVING_FILES}
    assert model.size_bytes == sum((source / f).stat().st_size for f in SERVING_FILES)
    assert not (model.path / PARTIAL_DIR).exists()
    assert [m.model_id for m in list_models(tmp_path / "store")] == ["acme/tiny-st"]


def test_a_gptq_export_keeps_quantize_config_json_and_serve_reads_it(hub, tmp_path, capsys):
    from tgi_hpc.cli import main

    _, url, root = hub
    model = download_model("acme/tiny-gptq", tmp_path / "store", endpoint=url, progress=False)
    wanted = {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json", "quantize_config.json", "gptq_model-4bit-128g.safetensors"}
    assert model.complete and _files(model.path) == wanted
    assert all(_sha256(model.path / f) == _sha256(root / "acme" / "tiny-gptq" / f) for f in wanted)
    code = main(["serve", "--cluster", "local", "--set", f"paths.models={tmp_path / 'store'}",
                 "--model", "acme/tiny-gptq", "--dry-run", "--quantize", "fp8"])
    assert code == 2 and "--quantize fp8 contradicts this gptq checkpoint" in capsys.readouterr().err


def test_rerun_is_a_no_op_and_a_new_revision_gets_its_own_folder(hub, tmp_path):
    srv, url, root = hub
    store = tmp_path / "store"
    first = download_model("acme/tiny-st", store, endpoint=url, progress=False)
    srv.requests.clear()
    again = download_model("acme/tiny-st", store, endpoint=url, progress=False)
    assert again == first and not [r for r in srv.requests if "/resolve/" in r.path]
    v2 = download_model("acme/tiny-st", store, revision="v2", endpoint=url, progress=False)
    assert v2.path == model_dir(store, "acme/tiny-st", "v2") and v2.commit != first.commit
    assert _sha256(v2.path / "model-00001-of-00002.safetensors") == _sha256(
        root / "acme" / "tiny-st@v2" / "model-00001-of-00002.safetensors")


def test_bin_only_repo_ends_as_safetensors(tmp_path):
    torch = pytest.importorskip("torch")
    repo = tmp_path / "hub" / "acme" / "tiny-bin"
    _tokenizer_files(repo)
    torch.manual_seed(0)
    embed = torch.randn(256, 64)
    shard1 = {"model.embed_tokens.weight": embed, "lm_head.weight": embed,  # tied: one storage, two names
              "model.layers.0.qkv": torch.randn(3, 64, 64)[0]}  # a view into a larger storage
    shard2 = {"model.norm.weight": torch.ones(64, dtype=torch.bfloat16)}
    torch.save(shard1, repo / "pytorch_model-00001-of-00002.bin")
    torch.save(shard2, repo / "pytorch_model-00002-of-00002.bin")
    torch.save({"lr": torch.tensor(1.0)}, repo / "training_args.bin")
    _write_json(repo / "pytorch_model.bin.index.json", {"weight_map": {
        **dict.fromkeys(shard1, "pytorch_model-00001-of-00002.bin"),
        **dict.fromkeys(shard2, "pytorch_model-00002-of-00002.bin")}})
    with HubServer(tmp_path / "hub", lfs_threshold=LFS_THRESHOLD) as url:
        kept = download_model("acme/tiny-bin", tmp_path / "store", endpoint=url, progress=False, convert_bin=False)
        assert kept.complete and kept.format == "bin" and "training_args.bin" not in _files(kept.path)
        model = download_model("acme/tiny-bin", tmp_path / "store", endpoint=url, progress=False)
    from safetensors.torch import load_file as load_torch

    assert model.complete and model.format == "safetensors"
    assert not list(model.path.glob("*.bin")) and not (model.path / "pytorch_model.bin.index.json").exists()
    index = json.loads((model.path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(shard1) | set(shard2)
    loaded = {k: v for n in set(index["weight_map"].values()) for k, v in load_torch(model.path / n).items()}
    for name, tensor in {**shard1, **shard2}.items():
        assert torch.equal(loaded[name], tensor), name
    manifest = read_manifest(model.path)
    assert {f["path"] for f in manifest["files"]} == _files(model.path)
    assert "pytorch_model-00001-of-00002.bin" in manifest["converted_from"]


def test_gated_repo_needs_a_token_that_never_leaves_the_hub_host(hub, tmp_path, caplog, monkeypatch):
    srv, url, _ = hub
    caplog.set_level(logging.DEBUG)
    with pytest.raises(DownloadError, match=r"acme/gated is gated/private: accept the licence on "
                                            rf"{url}/acme/gated and log in with `hf auth login` or set HF_TOKEN"):
        download_model("acme/gated", tmp_path / "store", endpoint=url, progress=False)
    with pytest.raises(DownloadError, match="gated/private.*a token was sent"):
        download_model("acme/gated", tmp_path / "store", endpoint=url, progress=False, token="hf_wrong")
    monkeypatch.setenv("HF_TOKEN", TOKEN)  # found by find_token(), as in the download job
    srv.requests.clear()
    model = download_model("acme/gated", tmp_path / "store", endpoint=url, progress=False)
    assert model.complete and _files(model.path) == SERVING_FILES
    hub_heads = [r for r in srv.requests if "/resolve/" in r.path]
    cdn = [r for r in srv.requests if r.path.startswith("/_cdn/")]
    assert hub_heads and all(r.has_auth for r in hub_heads)
    assert cdn and {r.host.split(":")[0] for r in cdn} == {"localhost"}  # the redirect went to a second host
    assert not any(r.has_auth for r in cdn)
    assert download_model("acme/private", tmp_path / "store", endpoint=url, progress=False).complete
    assert TOKEN not in caplog.text
    _assert_no_token_under(tmp_path)


def test_missing_private_and_corrupt_repos_fail_clearly(hub, tmp_path):
    _, url, _ = hub
    store = tmp_path / "store"
    with pytest.raises(DownloadError, match="acme/nope was not found on .*check the id"):
        download_model("acme/nope", store, endpoint=url, progress=False)
    with pytest.raises(DownloadError, match="acme/private was not found.*gated/private.*no Hugging Face token"):
        download_model("acme/private", store, endpoint=url, progress=False)
    with pytest.raises(DownloadError, match="revision 'v9' of acme/tiny-st does not exist"):
        download_model("acme/tiny-st", store, revision="v9", endpoint=url, progress=False)
    with pytest.raises(DownloadError, match="no safetensors or PyTorch .bin weights"):
        download_model("acme/gguf-only", store, endpoint=url, progress=False)
    with pytest.raises(DownloadError, match="model-00002-of-00002.safetensors of acme/corrupt is corrupt"):
        download_model("acme/corrupt", store, endpoint=url, progress=False)
    corrupt = model_dir(store, "acme/corrupt")
    assert not (corrupt / "model-00002-of-00002.safetensors").exists() and not (corrupt / MANIFEST).exists()
    assert not list((corrupt / PARTIAL_DIR).glob("*"))
    assert not [m for m in list_models(store) if m.complete]


def test_unreachable_hub_says_what_to_do(tmp_path):
    with pytest.raises(DownloadError, match="cannot reach http://127.0.0.1:9 .*login node"):
        download_model("acme/tiny-st", tmp_path / "store", endpoint="http://127.0.0.1:9", progress=False)


@pytest.mark.parametrize("bad", ["../etc", "acme/../x", "a/b/c", "$(touch pwned)/x", "a/b;ls", "a/b\nc",
                                 "'a'/b", '"a"/b', "", "gpt2", "/abs/x", "a/.hidden", "a/-rf", "a--b/c", "a/b c",
                                 "a/" + "x" * 97])
def test_hostile_ids_are_rejected_before_any_request(bad, tmp_path):
    with pytest.raises(UsageError, match="invalid model id"):
        download_model(bad, tmp_path / "store", endpoint="http://127.0.0.1:9", progress=False)
    assert not (tmp_path / "store").exists()


def test_hostile_revisions_are_rejected(tmp_path):
    for bad in ["../x", "a b", "-x", "x--y", "v1/", "$(id)", "a\nb"]:
        with pytest.raises(UsageError, match="invalid revision"):
            download_model("acme/x", tmp_path, revision=bad, endpoint="http://127.0.0.1:9")


# interrupted download, in a subprocess that gets SIGKILLed halfway

CHILD = """
import logging, sys
from pathlib import Path
logging.basicConfig(level=logging.DEBUG)
from tgi_hpc.models.download import download_model
download_model("acme/big", Path(sys.argv[1]), endpoint=sys.argv[2], progress=True)
"""


def test_killed_download_resumes_and_is_hash_checked(tmp_path, hf_env):
    repo = tmp_path / "hub" / "acme" / "big"
    _tokenizer_files(repo)
    save_file({"w": np.frombuffer(os.urandom(24 << 20), np.uint8)}, str(repo / "model.safetensors"))
    size, oid = (repo / "model.safetensors").stat().st_size, _sha256(repo / "model.safetensors")
    store = tmp_path / "store"
    part_dir = model_dir(store, "acme/big") / PARTIAL_DIR
    srv = HubServer(tmp_path / "hub", gated={"acme/big"}, tokens={TOKEN}, throttle=8 << 20)
    with srv as url:
        env = {**os.environ, "HF_TOKEN": TOKEN, "HF_HOME": str(hf_env), "PYTHONPATH": str(REPO_ROOT)}
        log = tmp_path / "child.log"  # its debug log, scanned for the token below
        with open(log, "wb") as out:
            child = subprocess.Popen([sys.executable, "-c", CHILD, str(store), url], env=env, stdout=out, stderr=out)
        try:
            deadline, partial = time.monotonic() + 30, 0
            while time.monotonic() < deadline and child.poll() is None and not partial:
                assert TOKEN.encode() not in Path(f"/proc/{child.pid}/cmdline").read_bytes()
                partial = _partial_bytes(part_dir, oid)  # the weights' part only: a tokenizer part may come first
                time.sleep(0.02)
            child.send_signal(signal.SIGKILL)
        finally:
            child.kill()
            child.wait(timeout=10)
        stderr = log.read_bytes()
        assert b"GET" in stderr or b"HEAD" in stderr  # the log did capture the HTTP traffic
        assert 0 < partial < size, stderr.decode()[-2000:]
        assert not (model_dir(store, "acme/big") / "model.safetensors").exists()
        srv.throttle = None
        srv.requests.clear()
        model = download_model("acme/big", store, endpoint=url, token=TOKEN, progress=False)
    ranged = [r for r in srv.requests if r.path.startswith("/_cdn/") and r.method == "GET"]
    assert len(ranged) == 1 and ranged[0].range and int(ranged[0].range[6:].rstrip("-")) >= partial
    assert model.complete and _sha256(model.path / "model.safetensors") == _sha256(repo / "model.safetensors")
    assert not part_dir.exists()
    assert TOKEN.encode() not in stderr
    _assert_no_token_under(tmp_path)


def _partial_bytes(part_dir: Path, oid: str) -> int:
    try:
        return sum(p.stat().st_size for p in part_dir.glob(f"*.{oid}.part"))
    except FileNotFoundError:  # the folder or a part moved between listing and stat
        return 0


# token discovery

def test_find_token_order(tmp_path):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "token").write_text("hf_from_file\n")
    assert find_token({"HF_TOKEN": " hf_env ", "HF_HOME": str(tmp_path / "hf")}) == "hf_env"
    assert find_token({"HF_HOME": str(tmp_path / "hf")}) == "hf_from_file"
    (tmp_path / "elsewhere").write_text("hf_path")
    assert find_token({"HF_TOKEN_PATH": str(tmp_path / "elsewhere"), "HF_HOME": str(tmp_path / "hf")}) == "hf_path"
    assert find_token({"XDG_CACHE_HOME": str(tmp_path / "none")}) is None
    assert find_token({"HF_TOKEN": "", "HF_HOME": str(tmp_path / "none")}) is None


def test_find_token_reads_the_real_environment(monkeypatch, hf_env):
    assert find_token() is None
    hf_env.mkdir(parents=True, exist_ok=True)
    (hf_env / "token").write_text("hf_stored")
    assert find_token() == "hf_stored"
    monkeypatch.setenv("HF_TOKEN", "hf_env")
    assert find_token() == "hf_env"


def test_library_imports_neither_torch_nor_huggingface_hub():
    code = ("import sys, tgi_hpc.models.download, tgi_hpc.models.store, tgi_hpc.models.hf_token\n"
            "print(sorted(m for m in ('torch', 'huggingface_hub', 'safetensors') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr


def test_converted_bin_model_loads_in_transformers_like_the_original(tmp_path, model_path):
    """A real (tiny) Llama checkpoint shipped as two .bin shards serves the same logits after conversion."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file as load_torch

    original = model_path("tiny-llama")
    repo = tmp_path / "hub" / "acme" / "llama-bin"
    shutil.copytree(original, repo, ignore=shutil.ignore_patterns("*.safetensors"))
    state = load_torch(original / "model.safetensors")
    names = sorted(state)
    shards = {"pytorch_model-00001-of-00002.bin": names[::2], "pytorch_model-00002-of-00002.bin": names[1::2]}
    for shard, keys in shards.items():
        torch.save({k: state[k] for k in keys}, repo / shard)
    _write_json(repo / "pytorch_model.bin.index.json", {"weight_map": {k: s for s, ks in shards.items() for k in ks}})
    with HubServer(tmp_path / "hub", lfs_threshold=LFS_THRESHOLD) as url:
        model = download_model("acme/llama-bin", tmp_path / "store", endpoint=url, progress=False)
    ids = torch.tensor([[1, 5, 9, 2, 7]])
    with torch.no_grad():
        want = transformers.AutoModelForCausalLM.from_pretrained(original)(ids).logits
        got = transformers.AutoModelForCausalLM.from_pretrained(model.path)(ids).logits
    assert torch.equal(got, want)


def test_offline_mode_is_named(tmp_path, monkeypatch):
    import huggingface_hub.constants as hf_constants

    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(DownloadError, match="HF_HUB_OFFLINE=1 is set"):
        download_model("acme/tiny-st", tmp_path / "store", endpoint="http://127.0.0.1:9", progress=False)


def test_progress_in_a_log_file_is_a_line_now_and_then(hub, tmp_path, caplog, monkeypatch):
    import tgi_hpc.models.hub

    _, url, _ = hub
    monkeypatch.setattr(tgi_hpc.models.hub, "PROGRESS_LOG_INTERVAL_S", 0.0)
    caplog.set_level(logging.INFO, logger="tgi_hpc.models.download")  # "fetched ..."
    caplog.set_level(logging.INFO, logger="tgi_hpc.models.hub")  # progress lines
    download_model("acme/tiny-st", tmp_path / "store", endpoint=url, progress=True)  # stderr is not a terminal here
    assert "fetched model-00001-of-00002.safetensors" in caplog.text
    from huggingface_hub.file_download import http_get

    if "tqdm_class" in inspect.signature(http_get).parameters:  # huggingface_hub >= 2: lines during the transfer
        assert re.search(r"model-00001-of-00002\.safetensors: [0-9.]+ MB of 0\.1 MB", caplog.text), caplog.text


def test_a_new_commit_replaces_the_old_files(tmp_path):
    repo = tmp_path / "hub" / "acme" / "moving"
    _tokenizer_files(repo)
    save_file({"w": np.zeros((64, 64), np.float32)}, str(repo / "model.safetensors"))
    store = tmp_path / "store"
    with HubServer(tmp_path / "hub", lfs_threshold=LFS_THRESHOLD) as url:
        old = download_model("acme/moving", store, endpoint=url, progress=False)
        (repo / "model.safetensors").unlink()  # the repo is re-uploaded as shards
        _safetensors_repo(repo, seed=3)
        new = download_model("acme/moving", store, endpoint=url, progress=False)
    assert new.path == old.path and new.commit != old.commit and new.complete
    assert _files(new.path) == SERVING_FILES  # the old single file is gone
    assert read_manifest(new.path)["commit"] == new.commit


def test_not_enough_disk_space_fails_before_downloading_weights(hub, tmp_path, monkeypatch):
    srv, url, _ = hub
    monkeypatch.setattr(shutil, "disk_usage", lambda path: SimpleNamespace(total=10**12, used=10**12, free=1000))
    srv.requests.clear()
    with pytest.raises(DownloadError, match="not enough disk space .* 0.0 MB are free"):
        download_model("acme/tiny-st", tmp_path / "store", endpoint=url, progress=False)
    assert not [r for r in srv.requests if r.path.startswith("/_cdn/")]


def test_an_adapter_repo_is_stored_as_an_adapter(tmp_path, model_path, capsys):
    """A PEFT repo (adapter_config.json + adapter_model.safetensors, no config.json) is stored whole and small;
    `models` shows it as an adapter, and `serve --lora` finds it complete."""
    from support.adapters import make_adapter
    from tgi_hpc.cli import main

    repo = tmp_path / "hub" / "acme" / "tiny-lora"
    make_adapter(model_path("tiny-llama"), repo, base_name="acme/tiny-llama")
    (repo / "training_args.bin").write_bytes(os.urandom(5000))   # training state: never needed to serve
    with HubServer(tmp_path / "hub", lfs_threshold=LFS_THRESHOLD) as url:
        stored = download_model("acme/tiny-lora", tmp_path / "store", endpoint=url, progress=False)
    assert stored.complete and stored.kind == "adapter" and stored.format == "safetensors"
    assert _files(stored.path) == {"adapter_config.json", "adapter_model.safetensors"}
    assert _sha256(stored.path / "adapter_model.safetensors") == _sha256(repo / "adapter_model.safetensors")
    assert read_manifest(stored.path)["base_model"] == "acme/tiny-llama"
    assert stored.size_bytes < 1_000_000
    assert main(["models", "--cluster", "local", "--set", f"paths.models={tmp_path / 'store'}"]) == 0
    assert "acme/tiny-lora@main" in (out := capsys.readouterr().out) and "(adapter)" in out


def test_an_adapter_repo_without_weights_is_refused(tmp_path):
    repo = tmp_path / "hub" / "acme" / "no-weights"
    _write_json(repo / "adapter_config.json", {"base_model_name_or_path": "acme/x", "r": 4})
    with HubServer(tmp_path / "hub", lfs_threshold=LFS_THRESHOLD) as url:
        with pytest.raises(DownloadError, match="no adapter_model.safetensors"):
            download_model("acme/no-weights", tmp_path / "store", endpoint=url, progress=False)
