"""Tokenizer layouts whose decoders llguidance must read right, built offline with `tokenizers`.

- sentencepiece-style BPE with `<0xXX>` byte fallback, as transformers converts them:
  Llama 2 (normalizer Prepend + Replace, decoder Replace/ByteFallback/Fuse/Strip), Mistral 7B v0.2 as newer
  transformers writes it (Metaspace pre-tokenizer, no normalizer), Gemma (no prefix space, no Strip);
- a Metaspace decoder, which llguidance refuses to read (the table is built here);
- byte-level BPE: SmolLM2's real tokenizer.json;
- SmolLM2 as an older transformers' GGUF loader converted it: its decoder a Sequence of ByteFallback, Fuse,
  Replace `▁` and ByteLevel over the byte-level vocabulary (the reported bug);
- the same with a Regex `Replace`: a decoder whose bytes this server cannot derive (the refusal path).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SPACE = "\u2581"
_WORDS = ["name", "kind", "legs", "tags", "pet", "cat", "dog", "raccoon", "true", "false", "null", "the", "an",
          "animal", "zoo", "caf\u00e9", "\u00fcber"]
_PIECES = ['{"', '":', '": ', '", "', '"}', '{"name', '": "', ', "', '}, "', "]}", "[]", "\\u", "\\n"]


def sentencepiece_json(layout: str) -> dict[str, Any]:
    """A small sentencepiece-style BPE vocabulary (specials, 256 byte tokens, characters, words with and without
    `▁`, JSON pieces) in the `layout` ("llama2", "mistral", "gemma") of transformers' conversion."""
    vocab: dict[str, int] = {}
    merges: list[tuple[str, str]] = []

    def add(piece: str) -> None:
        if piece in vocab:
            return
        if len(piece) > 1:
            add(piece[:-1])
            merges.append((piece[:-1], piece[-1]))
        vocab[piece] = len(vocab)

    specials = ["<unk>", "<s>", "</s>"] if layout != "gemma" else ["<pad>", "<eos>", "<bos>", "<unk>"]
    for special in specials:
        vocab[special] = len(vocab)
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for c in [SPACE] + [chr(c) for c in range(33, 127)] + list("\u00e9\u00fc"):
        add(c)
    for word in _WORDS:
        add(word)
        add(SPACE + word)
    for piece in (p.replace(" ", SPACE) for p in _PIECES):
        add(piece)
        add(SPACE + piece)
    unk = "<unk>"
    model = {"type": "BPE", "dropout": None, "unk_token": unk, "continuing_subword_prefix": None,
             "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True, "ignore_merges": False,
             "vocab": vocab, "merges": [list(m) for m in merges]}
    added = [{"id": vocab[s], "content": s, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True} for s in specials]
    replace_space = {"type": "Replace", "pattern": {"String": " "}, "content": SPACE}
    to_space = {"type": "Replace", "pattern": {"String": SPACE}, "content": " "}
    llama_decoder = {"type": "Sequence", "decoders": [to_space, {"type": "ByteFallback"}, {"type": "Fuse"},
                                                      {"type": "Strip", "content": " ", "start": 1, "stop": 0}]}
    if layout == "llama2":
        normalizer: Any = {"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": SPACE}, replace_space]}
        pre_tokenizer = None
        decoder = llama_decoder
    elif layout == "mistral":
        normalizer = None
        pre_tokenizer = {"type": "Metaspace", "replacement": SPACE, "prepend_scheme": "first", "split": False}
        decoder = llama_decoder
    elif layout == "metaspace":     # a Metaspace decoder (no byte fallback), which llguidance cannot read
        normalizer = None
        pre_tokenizer = {"type": "Metaspace", "replacement": SPACE, "prepend_scheme": "first", "split": False}
        decoder = {"type": "Metaspace", "replacement": SPACE, "prepend_scheme": "first", "split": False}
    elif layout == "gemma":
        normalizer = replace_space
        pre_tokenizer = None
        decoder = {"type": "Sequence", "decoders": [to_space, {"type": "ByteFallback"}, {"type": "Fuse"}]}
    else:
        raise ValueError(layout)
    return {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": normalizer,
            "pre_tokenizer": pre_tokenizer, "post_processor": None, "decoder": decoder, "model": model}


GGUF_DECODER = {"type": "Sequence", "decoders": [
    {"type": "ByteFallback"}, {"type": "Fuse"}, {"type": "Replace", "pattern": {"String": SPACE}, "content": " "},
    {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}]}
UNREADABLE_DECODER = {"type": "Sequence", "decoders": [
    {"type": "ByteFallback"}, {"type": "Fuse"}, {"type": "Replace", "pattern": {"Regex": SPACE}, "content": " "},
    {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}]}


def with_decoder(tokenizer_json: Path, decoder: dict[str, Any]) -> dict[str, Any]:
    data = json.loads(tokenizer_json.read_text())
    data["decoder"] = decoder
    return data


def load(data: dict[str, Any], eos: str) -> Any:
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(data)), eos_token=eos,
                                   bos_token=None)
