"""`tgi-hpc list [MODEL]` against every shipped profile: the catalog as the YAML gives it, what is ready to
serve (shared read-only weights, the store), and what `serve` would ask for one model and why."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from tgi_hpc.data import data_dir
from tgi_hpc.models.store import model_dir, write_manifest
from tgi_hpc.profiles.loader import list_profiles, load_profile


def _names() -> list[str]:
    """Every shipped profile and every current cluster inside one (narval, tamia...): each has its catalog."""
    names = []
    for profile in (p for p in list_profiles() if p != "local"):
        clusters = yaml.safe_load((data_dir("profiles") / f"{profile}.yaml").read_text()).get("clusters") or {}
        names += [profile, *(c for c, body in clusters.items() if not (body or {}).get("retired"))]
    return names


PROFILES = _names()


def _snapshot(folder: Path, *, complete: bool = True) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    if complete:
        (folder / "tokenizer.json").write_text("{}")
        (folder / "model.safetensors").write_bytes(b"\0" * 8)
    return folder


@pytest.fixture
def where(tmp_path):
    """A cluster's folders in tmp: shared weights (one complete, one not), a store with one complete model."""
    shared = tmp_path / "network; weights"
    _snapshot(shared / "llama.var" / "Llama-3.1-8B-Instruct")
    _snapshot(shared / "qwen" / "Qwen3-8B", complete=False)
    store = tmp_path / "store"
    stored = model_dir(store, "HuggingFaceTB/SmolLM2-135M")
    _snapshot(stored)
    write_manifest(stored, {"model_id": "HuggingFaceTB/SmolLM2-135M", "revision": "main", "files": []})
    return ["--no-remote", "--set", f"paths.models={store}", "--set", f"paths.jobs={tmp_path / 'jobs'}",
            "--set", f"paths.shared_weights={json.dumps([str(shared)])}", "--set", "slurm.account=def-pi"], shared


@pytest.mark.parametrize("profile", PROFILES)
def test_list_shows_the_profiles_catalog_and_what_is_ready(run, where, profile):
    opts, shared = where
    code, out, err = run("list", "--cluster", profile, *opts, "--json")
    assert code == 0, err
    listing = json.loads(out)
    entries = sorted(load_profile(profile, overrides=["slurm.account=def-pi"]).catalog, key=lambda e: e.max_params_b)
    assert [r["label"] for r in listing["catalog"]] == [e.label for e in entries]
    for row, entry in zip(listing["catalog"], entries):
        for key in entry.resources.model_fields_set & {"gpus", "partition", "mem", "gpu_type", "cpus_per_task", "time"}:
            assert row[key] == getattr(entry.resources, key), (profile, entry.label, key)
    ready = {(m["where"], m["name"]): m["complete"] for m in listing["ready"]}
    assert ready == {("shared", "Llama-3.1-8B-Instruct"): True, ("shared", "Qwen3-8B"): False,
                     ("store", "HuggingFaceTB/SmolLM2-135M"): True}

    code, out, _ = run("list", "--cluster", profile, *opts)
    assert code == 0 and out.startswith("profile ") and f"{profile}" in out.splitlines()[0]
    assert ("SIZE" in out and "PARTITION" in out) if entries else "(no catalog: serve uses slurm.defaults.serve)" in out
    assert re.search(rf"^shared +Llama-3.1-8B-Instruct +{re.escape(str(shared))}/llama.var/Llama-3.1-8B-Instruct$",
                     out, re.M)
    assert "incomplete (download again): Qwen3-8B" in out


@pytest.mark.parametrize("profile", PROFILES)
def test_list_model_says_what_serve_asks_for_and_why(run, where, profile):
    opts, shared = where
    code, out, err = run("list", "meta-llama/Llama-3.1-8B-Instruct", "--cluster", profile, *opts, "--json")
    assert code == 0, err
    plan = json.loads(out)
    assert plan["where"] == "shared" and plan["ready"] and plan["path"].startswith(str(shared))
    entries = sorted(load_profile(profile, overrides=["slurm.account=def-pi"]).catalog, key=lambda e: e.max_params_b)
    entry = next((e for e in entries if e.max_params_b >= 8.0), None)
    assert plan["size_b"] == pytest.approx(8.0, abs=0.1)
    assert plan["catalog_entry"] == (entry.label if entry else None) and plan["nodes"] == 1
    if entry is not None:
        assert plan["why"][0].startswith(f"catalog entry {entry.label}")
        assert plan["resources"]["gpus"] == plan["tensor_parallel"] == entry.resources.gpus
    assert any("GB of GPU memory" in w for w in plan["why"])

    code, out, _ = run("list", "Qwen/Qwen3-8B", "--cluster", profile, *opts, "--json")   # shared but incomplete
    other = json.loads(out)
    assert code == 0 and other["where"] == "store" and not other["ready"]
    assert other["next_step"].startswith("tgi-hpc download --model Qwen/Qwen3-8B --wait" if not other["refused"]
                                         else "serve with the options")
    assert other["refused"] or "accept its licence" in other["next_step"]     # gated models: say so before a job fails
    code, out, err = run("serve", "--cluster", profile, *opts, "--model", "meta-llama/Llama-3.1-8B-Instruct",
                         "--dry-run", "--json")
    if plan["refused"]:                # serve refuses it for the same rule, citing the same page
        assert code == 2 and plan["refused"] in err and plan["next_step"].startswith("serve with the options")
        return
    assert code == 0, err
    assert plan["next_step"] == "tgi-hpc serve --model meta-llama/Llama-3.1-8B-Instruct --wait"
    dry = json.loads(out)["script"]
    for key in ("partition", "mem"):   # the same job serve would submit
        if key in plan["resources"]:
            assert f"#SBATCH --{key}={plan['resources'][key]}" in dry


def test_list_on_the_local_profile_and_a_hostile_model(run, tmp_path):
    opts = ["--cluster", "local", "--set", f"paths.models={tmp_path}", "--set", f"paths.jobs={tmp_path / 'j'}"]
    code, out, _ = run("list", *opts)
    assert code == 0 and "nothing ready to serve yet" in out
    code, out, err = run("list", "x/$(touch /tmp/pwned)", *opts)
    assert code == 2 and out == "" and "invalid model id" in err
