"""The grammar's token table, checked against the tokenizer: every token's bytes as llguidance reads them must be
what the tokenizer itself decodes, or a grammar would allow tokens that spell something else.

`llguidance.hf.from_tokenizer` guesses how to read tokens from the decoder's layout. It misreads some: a
tokenizer.json converted from a GGUF by an older transformers has a `Sequence` decoder (ByteFallback, Fuse,
Replace `▁`, ByteLevel) over a byte-level BPE vocabulary, and llguidance takes `Ġ` for the two bytes of U+0120
instead of a space, so under a JSON schema the model wrote `{"customer"::`. Here each token is decoded by the
tokenizer after a context token (so that prefix-space rules, `Strip` and `Metaspace`, count), and compared.

When the automatic table disagrees, the table is rebuilt from the tokenizer's own decoding: the decoded text for
complete characters, and for tokens that are part of a character (decoded as U+FFFD) the bytes that the
decoder's own steps (`<0xXX>` byte fallback, the byte-level alphabet, `Replace`) give, checked to decode to the
same text. A token neither way explains makes the table impossible: `TokenTableError`, and grammar requests are
refused with its message rather than constrained by a wrong table.
"""
from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported where used (see compiler.py)
    import llguidance

_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
_SPECIAL = b"\xff"          # llguidance's mark for a special token


class TokenTableError(ValueError):
    """No token table for this tokenizer that matches what it decodes; the message names the cause."""


@dataclass(slots=True)
class TableCheck:
    """Tokens whose bytes differ from the tokenizer's decoding (ids, and a few examples for the log)."""

    mismatched: list[int]
    examples: list[str]

    @property
    def ok(self) -> bool:
        return not self.mismatched


def grammar_tokenizer(hf_tokenizer: Any, n_vocab: int, eos: list[int]) -> tuple[llguidance.LLTokenizer, str]:
    """The llguidance tokenizer for `hf_tokenizer` and how it was built ("automatic" or "rebuilt: ...");
    TokenTableError when neither table matches the tokenizer's own decoding."""
    if getattr(hf_tokenizer, "backend_tokenizer", None) is None:
        raise TokenTableError("the grammar token table needs a fast tokenizer (a tokenizer.json); this model's "
                              f"tokenizer is a {type(hf_tokenizer).__name__}")
    try:
        import llguidance
        import llguidance.hf
    except ImportError as exc:
        raise TokenTableError(f"structured output needs {exc.name}, which is not installed") from None
    texts = decoded_in_context(hf_tokenizer)
    special = special_ids(hf_tokenizer)
    try:
        automatic = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=n_vocab, eos_token=eos)
        first = check_table(automatic, texts, special)
    except ValueError as exc:     # e.g. "can't determine decoder type: Some(Metaspace(...))"
        first = TableCheck(list(range(len(texts))), [f"llguidance cannot read it: {exc}"])
    if first.ok:
        return automatic, "automatic"
    table, unexplained = own_table(hf_tokenizer, texts, special, n_vocab)
    if unexplained:
        raise TokenTableError(
            f"the grammar token table cannot be built for this tokenizer: llguidance misreads "
            f"{len(first.mismatched)} tokens (e.g. {', '.join(first.examples)}) and the tokenizer's decoder does "
            f"not give the bytes of {len(unexplained)} of them (e.g. {', '.join(unexplained[:3])})")
    rebuilt = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Vocabulary(hf_tokenizer, table, eos, special)),
                                     n_vocab=n_vocab, eos_token=eos)
    second = check_table(rebuilt, texts, special)
    if not second.ok:
        raise TokenTableError(f"the grammar token table rebuilt from the tokenizer's decoding still disagrees "
                              f"with it on {len(second.mismatched)} tokens (e.g. {', '.join(second.examples)})")
    return rebuilt, (f"rebuilt from the tokenizer's decoding: llguidance misread {len(first.mismatched)} tokens "
                     f"(e.g. {', '.join(first.examples)})")


def decoded_in_context(hf_tokenizer: Any) -> list[str]:
    """What the tokenizer decodes for each token id when it follows a plain context token."""
    backend = hf_tokenizer.backend_tokenizer
    context = hf_tokenizer.encode("a", add_special_tokens=False)[-1:]
    base = backend.decode(context, skip_special_tokens=False)
    size = backend.get_vocab_size(with_added_tokens=True)
    pairs = backend.decode_batch([context + [i] for i in range(size)], skip_special_tokens=False)
    # a text that does not start with the context's decoding is a decoder we cannot read: "" never matches a token
    return [text[len(base):] if text.startswith(base) else "\x00<undecodable>" for text in pairs]


def check_table(tokenizer: llguidance.LLTokenizer, texts: list[str], special: set[int]) -> TableCheck:
    mismatched, examples = [], []
    for i, text in enumerate(texts):
        if i in special:
            if not tokenizer.is_special_token(i):
                mismatched.append(i)
                if len(examples) < 3:
                    examples.append(f"special token {i} {text!r} reads as text")
            continue
        if text == "\ufffd" and tokenizer.is_special_token(i):
            continue    # the byte 0xFF, never valid UTF-8: llguidance takes it for its special-token mark
        got = tokenizer.decode_bytes([i]).decode("utf-8", errors="replace")
        if got != text:
            mismatched.append(i)
            if len(examples) < 3:
                examples.append(f"token {i} reads {got!r}, decodes {text!r}")
    return TableCheck(mismatched, examples)


def own_table(hf_tokenizer: Any, texts: list[str], special: set[int],
              n_vocab: int) -> tuple[list[bytes], list[str]]:
    """Each token's bytes from the tokenizer's decoding, and descriptions of the tokens it cannot explain."""
    backend = hf_tokenizer.backend_tokenizer
    steps = _decoder_steps(json.loads(backend.to_str()).get("decoder"))
    table, unexplained = [], []
    for i, text in enumerate(texts):
        piece = backend.id_to_token(i) or ""
        if i in special:
            table.append(_SPECIAL + piece.encode())
            continue
        raw = _decode_piece(piece, steps)
        if raw is not None and raw.decode("utf-8", errors="replace") == text:
            table.append(raw)
        elif "\ufffd" not in text and not text.startswith("\x00"):
            table.append(text.encode())
        else:
            table.append(b"")
            unexplained.append(f"token {i} {piece!r} decodes {text!r}")
    table += [b""] * (n_vocab - len(table))
    return table, unexplained


def _decoder_steps(decoder: dict[str, Any] | None) -> list[dict[str, Any]]:
    if decoder is None:
        return []
    if decoder.get("type") == "Sequence":
        return [s for d in decoder.get("decoders", []) for s in _decoder_steps(d)]
    return [decoder]


def _decode_piece(piece: str, steps: list[dict[str, Any]]) -> bytes | None:
    """One token's bytes through the decoder's steps, as a token that is not the first of the text; None for a
    step this does not know."""
    value: str | bytes = piece
    for step in steps:
        kind = step.get("type")
        if kind in ("Fuse", "Strip"):
            continue        # Strip only trims the start of the whole text
        if isinstance(value, bytes):
            return value if kind in ("ByteLevel", "Replace") else None
        if kind == "ByteFallback":
            match = _BYTE_TOKEN.match(value)
            if match:
                value = bytes([int(match.group(1), 16)])
        elif kind == "Replace":
            pattern = step.get("pattern", {})
            if "String" not in pattern:
                return None
            value = value.replace(pattern["String"], step.get("content", ""))
        elif kind == "Metaspace":
            value = value.replace(step.get("replacement", "\u2581"), " ")
        elif kind == "ByteLevel":
            table = _unicode_to_byte()
            value = bytes(table[c] for c in value) if all(c in table for c in value) else value.encode()
        else:
            return None
    return value if isinstance(value, bytes) else value.encode()


@functools.cache
def _unicode_to_byte() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed (tokenizers' ByteLevel `bytes_char`)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def special_ids(hf_tokenizer: Any) -> set[int]:
    decoder = hf_tokenizer.backend_tokenizer.get_added_tokens_decoder()
    return {i for i, token in decoder.items() if token.special}


class _Vocabulary:
    """What llguidance.TokenizerWrapper reads: the byte table, eos/bos, specials, and a tokenize callable."""

    def __init__(self, hf_tokenizer: Any, table: list[bytes], eos: list[int], special: set[int]):
        self._hf = hf_tokenizer
        self.tokens = table
        self.eos_token_id = eos[0]
        self.bos_token_id = hf_tokenizer.bos_token_id
        self.special_token_ids = sorted(special)
        self._by_bytes: dict[bytes, int] = {}
        self._longest = 0

    def __call__(self, text: str | bytes) -> list[int]:
        """The tokenizer's own ids when they spell exactly `text` (a sentencepiece tokenizer adds a prefix space),
        else the longest table entries from left to right."""
        data = text if isinstance(text, bytes) else text.encode()
        ids = list(self._hf.encode(data.decode("utf-8", errors="replace"), add_special_tokens=False))
        if b"".join(self.tokens[i] for i in ids) == data:
            return ids
        return self._greedy(data)

    def _greedy(self, data: bytes) -> list[int]:
        if not self._by_bytes:
            self._by_bytes = {b: i for i, b in reversed(list(enumerate(self.tokens)))
                              if b and not b.startswith(_SPECIAL)}
            self._longest = max(map(len, self._by_bytes))
        ids, at = [], 0
        while at < len(data):
            for end in range(min(len(data), at + self._longest), at, -1):
                if data[at:end] in self._by_bytes:
                    ids.append(self._by_bytes[data[at:end]])
                    at = end
                    break
            else:
                at += 1     # a byte no token spells: nothing can force it
        return ids
