"""`serve --speculative-model`: the engine's flags checked before anything is rendered, the draft resolved in the
store or as a folder, checked complete before submitting, staged and passed to the engine; a folder full of
shell is data."""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from support.releases import standin_release
from test_serve_models import _bash_n, _model, _run_until_recorded
from tgi_hpc.errors import ModelNotFoundError, UsageError
from tgi_hpc.slurm.cluster import open_cluster
from tgi_hpc.slurm.jobspec import ShellPath
from tgi_hpc.slurm.render import render_job
from tgi_hpc.workflows.engine_flags import engine_args
from tgi_hpc.workflows.serve import ServeOptions, build_serve_spec, check_before_submit

SPECULATE = ["--speculate=3"]


def _medusa(folder: Path, vocab: int = 16, hidden: int = 8) -> Path:
    """Three Medusa heads of one ResBlock each, in the FasterDecoding/TGI layout (random weights)."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"medusa_num_heads": 3, "medusa_num_layers": 1}))
    rng = np.random.default_rng(0)
    tensors = {}
    for head in range(3):
        tensors[f"{head}.0.linear.weight"] = rng.standard_normal((hidden, hidden), dtype=np.float32)
        tensors[f"{head}.0.linear.bias"] = np.zeros(hidden, dtype=np.float32)
        tensors[f"{head}.1.weight"] = rng.standard_normal((vocab, hidden), dtype=np.float32)
    save_file(tensors, str(folder / "medusa_lm_head.safetensors"))
    return folder


@pytest.mark.parametrize("opts, message", [
    (dict(engine_args=[]), "add --engine-arg --speculate=N"),
    (dict(engine_args=["--speculate=0"]), "add --engine-arg --speculate=N"),
    (dict(engine_args=["--speculate=17"]), "add --engine-arg --speculate=N"),
    (dict(engine_args=[*SPECULATE, "--speculative-layers=4"]), "two drafters"),
    (dict(engine_args=[*SPECULATE, "--lora-adapters=a=/p"]), "LoRA adapters"),
    (dict(engine_args=SPECULATE, other_models=["Qwen/Qwen2.5-0.5B-Instruct"]), "several --model"),
    (dict(engine_args=SPECULATE, speculative_model="org/$(touch /tmp/pwned)"), "invalid model id"),
])
def test_flags_the_engine_would_refuse_are_refused_before_rendering(opts, message, tmp_path):
    cluster = open_cluster("local", [f"paths.jobs={tmp_path / 'jobs'}", f"paths.models={tmp_path / 'store'}"])
    opts = {"speculative_model": "acme/medusa", **opts}
    with pytest.raises(UsageError, match=message):
        build_serve_spec(cluster, ServeOptions(model="meta-llama/Llama-3.1-8B-Instruct", **opts))


def test_the_engine_flag_itself_points_at_the_serve_option():
    with pytest.raises(UsageError, match="use `tgi-hpc serve --speculative-model`"):
        engine_args(["--speculative-model=/x"])


def test_a_stored_draft_is_checked_complete_before_submitting_and_staged(tmp_path, model_path):
    store = tmp_path / "store"
    cluster = open_cluster("local", [f"paths.models={store}", f"paths.jobs={tmp_path / 'jobs'}"])
    release = ShellPath("", str(standin_release(tmp_path / "rel")))
    spec = build_serve_spec(cluster, ServeOptions(model=str(model_path("tiny-llama")), speculative_model="acme/medusa",
                                                  engine_args=SPECULATE))
    with pytest.raises(ModelNotFoundError, match="run `tgi-hpc download --model acme/medusa` first"):
        check_before_submit(cluster, spec, release, True)
    folder = _medusa(store / "acme--medusa" / "main")
    weights = (folder / "medusa_lm_head.safetensors").read_bytes()
    (folder / "medusa_lm_head.safetensors").unlink()
    with pytest.raises(ModelNotFoundError, match=r"incomplete: no weights \(\*.safetensors"):
        check_before_submit(cluster, spec, release, True)
    (folder / "medusa_lm_head.safetensors").write_bytes(weights)
    check_before_submit(cluster, spec, release, True)
    slurm = open_cluster("mila", [f"paths.models={store}", f"paths.jobs={tmp_path / 'jobs'}"])
    script = render_job(slurm.profile, build_serve_spec(slurm, ServeOptions(
        model="meta-llama/Llama-3.1-8B-Instruct", speculative_model="acme/medusa", engine_args=SPECULATE,
        gpus=1), offline=True), job_dir="/j")
    _bash_n(script)
    assert 'tgi_hpc.slurm.job stage --src "$DRAFT_DIR"' in script and '--speculative-model "$DRAFT_DIR"' in script


def test_hostile_draft_folders_run_nothing_and_reach_the_engine_whole(hostile, tmp_path):
    release = ShellPath("", str(standin_release(tmp_path / "release")))
    for i, (value, marker) in enumerate(hostile[:5]):
        name = value.replace("/", "_")
        model = _model(tmp_path / f"m{i}" / "model")
        draft = _medusa(tmp_path / f"d{i}" / name)
        cluster = open_cluster("local", [f"paths.jobs={tmp_path / f'jobs{i}'}"])
        spec = build_serve_spec(cluster, ServeOptions(model=str(model), speculative_model=str(draft),
                                                      engine_args=SPECULATE))
        script = render_job(cluster.profile, spec, job_dir=cluster.job_dir, release_dir=release)
        _bash_n(script)
        records = _run_until_recorded(script, tmp_path / f"rec{i}", 1)
        assert not marker.exists(), f"{value!r} ran as shell"
        argv = records[0]["argv"]
        assert argv[argv.index("--speculative-model") + 1] == str(draft)


# the draft in the job's sizing, its vocabulary against the model's

QWEN_14B = {"architectures": ["Qwen2ForCausalLM"], "hidden_size": 5120, "num_hidden_layers": 48,
            "num_attention_heads": 40, "num_key_value_heads": 8, "intermediate_size": 13824, "vocab_size": 152064}
QWEN_05B = {"architectures": ["Qwen2ForCausalLM"], "hidden_size": 896, "num_hidden_layers": 24,
            "num_attention_heads": 14, "num_key_value_heads": 2, "intermediate_size": 4864, "vocab_size": 151936,
            "tie_word_embeddings": True}


def _header_only(path: Path, shapes: dict[str, list[int]], dtype: str = "BF16") -> None:
    """A safetensors header declaring `shapes` (sizing reads headers only: no data needed for these figures)."""
    offset, header = 0, {}
    for name, shape in shapes.items():
        size = int(np.prod(shape)) * 2
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    path.write_bytes(len(raw).to_bytes(8, "little") + raw)


def _snapshot(folder: Path, config: dict, tokenizer: Path, shapes: dict[str, list[int]]) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "tokenizer.json").write_bytes(tokenizer.read_bytes())
    _header_only(folder / "model.safetensors", shapes)
    return folder


def test_the_job_is_sized_for_the_model_and_its_draft(tmp_path, model_path):
    tokenizer = model_path("tiny-llama") / "tokenizer.json"
    target = _snapshot(tmp_path / "qwen14b", QWEN_14B, tokenizer, {"w": [14_000_000_000]})
    # Qwen2.5-0.5B: 0.49B parameters (0.99 GB in bf16), 12 KiB of KV cache per token
    draft = _snapshot(tmp_path / "qwen05b", QWEN_05B, tokenizer, {"embed": [151936, 896], "layers": [24, 14_915_328]})
    cluster = open_cluster("mila", [f"paths.jobs={tmp_path / 'jobs'}", f"paths.models={tmp_path / 'store'}"])
    alone = build_serve_spec(cluster, ServeOptions(model=str(target)))
    both = build_serve_spec(cluster, ServeOptions(model=str(target), speculative_model=str(draft),
                                                  engine_args=SPECULATE))
    assert (alone.resources.gpus, both.resources.gpus) == (1, 2)   # 14.8B fits the 15B entry; with the draft not
    notes = " ".join(both.sizing)
    assert f"with the draft {draft} (draft): 0.49B parameters, 1.0 GB, KV cache 12 KiB per token" in notes
    assert "KV cache 204 KiB per token" in notes       # the model's 192 KiB + the draft's 12
    gb = [float(n) for n in re.findall(r"needs (\d+) GB weights \+ ([\d.]+) GB KV", " ".join(alone.sizing))[0]]
    gb_both = [float(n) for n in re.findall(r"needs (\d+) GB weights \+ ([\d.]+) GB KV", notes)[0]]
    assert gb_both[0] - gb[0] in (0, 1, 2) and gb_both[1] > gb[1]
    # float32 serving doubles the draft's floats
    f32 = build_serve_spec(cluster, ServeOptions(model=str(target), speculative_model=str(draft),
                                                 engine_args=SPECULATE, limits={"dtype": "float32"}))
    assert "0.49B parameters, 2.0 GB, KV cache 24 KiB per token" in " ".join(f32.sizing)


def test_a_draft_with_another_vocabulary_is_refused_before_submitting(tmp_path, model_path):
    cluster = open_cluster("local", [f"paths.jobs={tmp_path / 'jobs'}", f"paths.models={tmp_path / 'store'}"])
    target = model_path("tiny-llama")

    def build(draft: Path):
        return build_serve_spec(cluster, ServeOptions(model=str(target), speculative_model=str(draft),
                                                      engine_args=SPECULATE))

    same = model_path("tiny-qwen2")                     # another architecture, the same tokenizer
    assert "with the draft" in " ".join(build(same).sizing)
    with pytest.raises(UsageError, match=r"another tokenizer than the model \(49152 tokens in its vocabulary, the "
                                         r"model has \d+\)"):
        build(model_path("smollm2"))
    # the same vocabulary written out differently is accepted; one token renamed is not
    copy = tmp_path / "copy"
    copy.mkdir()
    for name in ("config.json", "model.safetensors"):
        (copy / name).write_bytes((same / name).read_bytes())
    data = json.loads((same / "tokenizer.json").read_text())
    (copy / "tokenizer.json").write_text(json.dumps(data, indent=1))
    build(copy)
    vocab = data["model"]["vocab"]
    token = next(t for t, i in vocab.items() if i == 300)
    vocab["renamed"] = vocab.pop(token)
    (copy / "tokenizer.json").write_text(json.dumps(data))
    with pytest.raises(UsageError, match="the same number of tokens with other ids"):
        build(copy)
    data["added_tokens"].append({"id": 5000, "content": "<x>", "special": True})
    vocab[token] = vocab.pop("renamed")
    (copy / "tokenizer.json").write_text(json.dumps(data))
    with pytest.raises(UsageError, match="other added or special tokens"):
        build(copy)
    # heads trained for another model: Medusa's projection, EAGLE-3's LM head without a d2t map
    with pytest.raises(UsageError, match=r"Medusa head 0 projects to \[16, 8\], the model needs \[1024, 64\]"):
        build(_medusa(tmp_path / "medusa-other"))
    assert "(medusa)" in " ".join(build(_medusa(tmp_path / "medusa", vocab=1024, hidden=64)).sizing)
    eagle = tmp_path / "eagle3"
    eagle.mkdir()
    (eagle / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": 64,
                                                   "num_hidden_layers": 1, "num_attention_heads": 4}))
    _header_only(eagle / "model.safetensors", {"fc.weight": [64, 192], "lm_head.weight": [500, 64]})
    with pytest.raises(UsageError, match="LM head has 500 tokens and no d2t map, the model has 1024"):
        build(eagle)
    _header_only(eagle / "model.safetensors", {"fc.weight": [64, 192], "lm_head.weight": [500, 64], "d2t": [500]})
    assert "(eagle3)" in " ".join(build(eagle).sizing)


@pytest.mark.parametrize("weights, message", [
    (b"x", "its header does not parse"),
    (b"\xff" * 8 + b"{}", "no header length"),
    ((20).to_bytes(8, "little") + b"not json at all!!!!!", "its header does not parse"),
    ((2).to_bytes(8, "little") + b"[]", "its header does not parse"),
    (None, "unknown dtype or negative shape"),
])
def test_hostile_draft_weights_are_refused_in_one_line(weights, message, tmp_path, model_path):
    draft = _medusa(tmp_path / "medusa", vocab=1024, hidden=64)
    if weights is None:
        _header_only(draft / "medusa_lm_head.safetensors", {"0.1.weight": [-1, 64]}, dtype="F32")
    else:
        (draft / "medusa_lm_head.safetensors").write_bytes(weights)
    cluster = open_cluster("local", [f"paths.jobs={tmp_path / 'jobs'}"])
    with pytest.raises(UsageError, match=f"medusa_lm_head.safetensors.*{message}"):
        build_serve_spec(cluster, ServeOptions(model=str(model_path("tiny-llama")), speculative_model=str(draft),
                                               engine_args=SPECULATE))


def test_a_draft_not_read_here_is_said_to_be_uncounted(tmp_path):
    """A dry run from a laptop reads nothing over SSH: the script's sizing notes say the draft is not in them."""
    cluster = open_cluster("mila", [f"paths.jobs={tmp_path / 'jobs'}", f"paths.models={tmp_path / 'store'}"])
    spec = build_serve_spec(cluster, ServeOptions(model="meta-llama/Llama-3.1-8B-Instruct", engine_args=SPECULATE,
                                                  speculative_model="acme/medusa", gpus=1))
    assert spec.sizing[-1] == "the draft acme/medusa is not counted: its files were not read here"


def test_a_draft_whose_headers_cannot_be_read_is_left_uncounted_not_refused(tmp_path, model_path):
    draft = _medusa(tmp_path / "medusa", vocab=1024, hidden=64)
    (draft / "medusa_lm_head.safetensors").chmod(0)
    cluster = open_cluster("local", [f"paths.jobs={tmp_path / 'jobs'}"])
    if os.access(draft / "medusa_lm_head.safetensors", os.R_OK):
        (draft / "medusa_lm_head.safetensors").unlink()    # root reads anything: a dangling link instead
        (draft / "medusa_lm_head.safetensors").symlink_to(tmp_path / "gone")
    spec = build_serve_spec(cluster, ServeOptions(model=str(model_path("tiny-llama")), speculative_model=str(draft),
                                                  engine_args=SPECULATE))
    assert spec.sizing[-1].endswith("is not counted: its files were not read here")
