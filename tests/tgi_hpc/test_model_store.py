"""tgi_hpc.models.store: layout, id validation, listing, removal and resolving what to serve (no network)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tgi_hpc.errors import ModelNotFoundError, UsageError
from tgi_hpc.models.store import (PARTIAL_DIR, list_models, model_dir, remove_model, resolve_model, validate_model_id,
                                 write_manifest)


def _stored(store: Path, model_id: str, revision: str = "main", commit: str = "c" * 40) -> Path:
    """A complete model folder as download_model leaves it."""
    folder = model_dir(store, model_id, revision)
    folder.mkdir(parents=True)
    files = {"config.json": b'{"model_type": "llama"}', "model.safetensors": b"x" * 1000}
    for name, data in files.items():
        (folder / name).write_bytes(data)
    write_manifest(folder, {"model_id": model_id, "revision": revision, "commit": commit, "format": "safetensors",
                            "files": [{"path": n, "size": len(d), "sha256": "0" * 64} for n, d in files.items()]})
    return folder


def test_layout_is_documented_and_stable(tmp_path):
    llama = model_dir(tmp_path, "meta-llama/Llama-3.1-8B-Instruct")
    assert llama == tmp_path / "meta-llama--Llama-3.1-8B-Instruct" / "main"
    assert model_dir(tmp_path, "acme/x", "refs/pr/1") == tmp_path / "acme--x" / "refs--pr--1"
    assert model_dir(tmp_path, "acme/x", "0" * 40).name == "0" * 40


@pytest.mark.parametrize("good", ["a/b", "Qwen/Qwen2.5-0.5B-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct",
                                  "org_1/name.v2", "x/" + "y" * 96])
def test_valid_hub_ids(good):
    assert validate_model_id(good) == good


@pytest.mark.parametrize("bad", ["..", "../x", "a/..", "a/../b", "a/b/c", "/a/b", "a/b/", "a", "", " a/b", "a/b ",
                                 "$(rm -rf ~)/x", "a/`id`", "a/b;ls", "a/b\nc", "a/b\x00", "'a'/b", '"a"/b',
                                 "a/.b", "a/-b", "-a/b", "a./b", "a--b/c", "a/b--c", "a/" + "x" * 97, "ä/b", None])
def test_hostile_ids_are_rejected(bad, tmp_path):
    with pytest.raises(UsageError, match="invalid model id"):
        validate_model_id(bad)
    with pytest.raises(UsageError):
        model_dir(tmp_path, bad)
    with pytest.raises(UsageError):
        remove_model(tmp_path, bad)


def test_list_models_reports_complete_and_incomplete(tmp_path):
    _stored(tmp_path, "acme/b-model")
    _stored(tmp_path, "acme/a-model", "v1.0", commit="d" * 40)
    partial = model_dir(tmp_path, "other/half")
    (partial / PARTIAL_DIR).mkdir(parents=True)
    (partial / "config.json").write_text("{}")
    (partial / PARTIAL_DIR / "x.part").write_bytes(b"y" * 500)
    (tmp_path / "stray-file.txt").write_text("not a model")
    (tmp_path / ".hidden--dir").mkdir()
    models = list_models(tmp_path)
    assert [(m.model_id, m.revision, m.complete) for m in models] == [
        ("acme/a-model", "v1.0", True), ("acme/b-model", "main", True), ("other/half", "main", False)]
    a = models[0]
    assert a.commit == "d" * 40 and a.format == "safetensors" and a.size_bytes == 1023
    assert a.path == model_dir(tmp_path, "acme/a-model", "v1.0")
    assert models[2].size_bytes == 502 and models[2].commit is None
    assert list_models(tmp_path / "missing") == []


def test_a_file_missing_after_download_makes_the_model_incomplete(tmp_path):
    folder = _stored(tmp_path, "acme/x")
    (folder / "model.safetensors").write_bytes(b"short")
    assert not list_models(tmp_path)[0].complete
    with pytest.raises(ModelNotFoundError, match="incomplete: run `tgi-hpc download --model acme/x` again"):
        resolve_model("acme/x", tmp_path)


def test_remove_one_revision_then_all(tmp_path):
    main, v1 = _stored(tmp_path, "acme/x"), _stored(tmp_path, "acme/x", "v1")
    keep = _stored(tmp_path, "acme/y")
    assert remove_model(tmp_path, "acme/x", "v1") == [v1]
    assert not v1.exists() and main.exists()
    assert remove_model(tmp_path, "acme/x") == [main]
    assert not (tmp_path / "acme--x").exists() and keep.exists()
    with pytest.raises(ModelNotFoundError, match="acme/x is not in the model store"):
        remove_model(tmp_path, "acme/x")
    with pytest.raises(ModelNotFoundError, match=r"acme/y \(revision v9\) is not in the model store"):
        remove_model(tmp_path, "acme/y", "v9")


def test_remove_does_not_follow_a_symlink_out_of_the_store(tmp_path):
    outside = _stored(tmp_path / "elsewhere", "acme/x")
    link = model_dir(tmp_path / "store", "acme/x")
    link.parent.mkdir(parents=True)
    link.symlink_to(outside)
    assert remove_model(tmp_path / "store", "acme/x") == [link]
    assert not link.is_symlink() and (outside / "model.safetensors").exists()


def test_resolve_model(tmp_path, monkeypatch):
    store = tmp_path / "store"
    stored = _stored(store, "acme/x")
    v2 = _stored(store, "acme/x", "v2")
    local = tmp_path / "my model"  # a space, as users' paths have
    local.mkdir()
    (local / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert resolve_model(str(local), store) == local.resolve()
    assert resolve_model("acme/x", store) == stored
    assert resolve_model("acme/x@v2", store) == v2
    monkeypatch.chdir(tmp_path)
    assert resolve_model("my model", store) == local.resolve()


def test_resolve_model_errors(tmp_path):
    store = tmp_path / "store"
    (tmp_path / "not-a-model").mkdir()
    with pytest.raises(ModelNotFoundError, match="acme/absent is not a local folder and is not in the model store "
                                                 r".*: run `tgi-hpc download --model acme/absent` first"):
        resolve_model("acme/absent", store)
    with pytest.raises(ModelNotFoundError, match=r"run `tgi-hpc download --model acme/x --revision v3` first"):
        resolve_model("acme/x@v3", store)
    with pytest.raises(ModelNotFoundError, match="has no config.json"):
        resolve_model(str(tmp_path / "not-a-model"), store)
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        resolve_model(str(tmp_path / "missing"), store)
    with pytest.raises(UsageError, match="invalid model id"):
        resolve_model("$(id)/x", store)
    with pytest.raises(UsageError, match="invalid revision"):
        resolve_model("acme/x@../../etc", store)


def test_shell_hostile_specs_never_become_paths(hostile, tmp_path):
    for value, marker in hostile:
        with pytest.raises(UsageError):
            model_dir(tmp_path, value)
        with pytest.raises((UsageError, ModelNotFoundError)):
            resolve_model(value, tmp_path)
        assert not marker.exists()
    assert list(tmp_path.iterdir()) == []
