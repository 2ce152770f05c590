"""`download` keeps what a pooling model needs: sentence-transformers' modules.json, pooling config, max length
and prompts, but not its other modules' weights or the ONNX / OpenVINO copies."""
from __future__ import annotations

from tgi_hpc.models.download import plan_files


def test_sentence_transformers_files_are_planned():
    listing = ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "vocab.txt",
               "modules.json", "sentence_bert_config.json", "config_sentence_transformers.json",
               "1_Pooling/config.json", "2_Normalize/.gitkeep", "onnx/model.onnx", "openvino/openvino_model.bin",
               "pytorch_model.bin", "README.md", "data_config.json", "train_script.py", "x/1_Pooling/config.json"]
    assert plan_files(listing) == sorted([
        "config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "vocab.txt", "modules.json",
        "sentence_bert_config.json", "config_sentence_transformers.json", "1_Pooling/config.json"])
