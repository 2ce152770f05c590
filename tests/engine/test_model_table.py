"""docs/models.md's table of families against the code: native rows are exactly the registry, transformers rows
are architectures without a native class that the backend accepts and the backend test serves, refused rows
are refused for the reason the table gives."""
import re
import sys
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")

from engine.models import MODEL_REGISTRY  # noqa: E402
from engine.models.transformers_backend import unsupported_reason  # noqa: E402
from test_transformers_backend import BACKEND_MODELS  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
from make_models import _COMMON, _SIZES, SEQ2SEQ_MODELS, TINY_MODELS, VLM_MODELS  # noqa: E402
from test_multimodal_models import BIDIRECTIONAL_VLMS, VLMS  # noqa: E402


def table_rows():
    rows = []
    for line in (ROOT / "docs" / "models.md").read_text().splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 4 and re.fullmatch(r"\w+", cells[1]) and cells[1] != "architecture":
            rows.append(cells)
    return rows


def hf_config(checkpoint):
    class_name, overrides, _ = TINY_MODELS[checkpoint]
    overrides = dict(overrides)
    sizes = {None: {}, True: _SIZES, False: _COMMON}[overrides.pop("_sizes", False)]  # as make_models builds it
    return getattr(transformers, class_name)(**sizes, **overrides)


def test_native_rows_are_the_registry():
    native = {row[1] for row in table_rows() if row[2] == "native"}
    assert native == set(MODEL_REGISTRY)


def test_transformers_rows_are_served_by_the_backend_and_tested():
    rows = [row for row in table_rows() if row[2] == "transformers"]
    assert len(rows) >= 10
    assert sorted(row[3] for row in rows) == sorted(BACKEND_MODELS)
    for _, architecture, _, checkpoint in rows:
        assert architecture not in MODEL_REGISTRY
        config = hf_config(checkpoint)
        assert unsupported_reason(config) is None, architecture
        model_class = transformers.AutoModelForCausalLM._model_mapping[type(config)]
        assert model_class.__name__ == architecture


def test_refused_rows_give_the_backends_reason():
    rows = [row for row in table_rows() if row[2].startswith("refused")]
    assert {row[1] for row in rows} >= {"GPTNeoForCausalLM", "MptForCausalLM"}
    for _, architecture, runs_on, checkpoint in rows:
        reason = unsupported_reason(hf_config(checkpoint))
        assert reason is not None and runs_on.removeprefix("refused: ").removeprefix("its ") in reason, architecture


def test_every_row_names_a_known_checkpoint():
    for _, architecture, _, checkpoint in table_rows():
        assert checkpoint == "-" or checkpoint in TINY_MODELS or checkpoint in VLM_MODELS or \
            checkpoint in SEQ2SEQ_MODELS, architecture


def test_image_rows_are_the_tested_vision_language_models():
    rows = [row for row in table_rows() if row[2] == "transformers, images"]
    assert sorted(row[3] for row in rows) == sorted(VLMS)
    for _, architecture, _, checkpoint in rows:
        assert architecture not in MODEL_REGISTRY and VLM_MODELS[checkpoint][0] == architecture


def test_image_rows_behind_the_model_impl_flag_are_native_text_models_tested_with_images():
    rows = [row for row in table_rows() if row[2] == "--model-impl transformers, images"]
    assert sorted(row[3] for row in rows) == sorted(BIDIRECTIONAL_VLMS)
    for _, architecture, _, checkpoint in rows:
        assert architecture in MODEL_REGISTRY and VLM_MODELS[checkpoint][0] == architecture  # auto: text, natively


def test_encoder_decoder_rows_are_tested_seq2seq_checkpoints():
    rows = [row for row in table_rows() if row[2] == "encoder-decoder engine"]
    assert rows
    for _, architecture, _, checkpoint in rows:
        config_class, overrides = SEQ2SEQ_MODELS[checkpoint]
        config = getattr(transformers, config_class)(**overrides)
        assert config.is_encoder_decoder
        assert transformers.AutoModelForSeq2SeqLM._model_mapping[type(config)].__name__ == architecture
