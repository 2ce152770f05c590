"""Incremental detokenization: stable text pieces per new token that add up to the full decode."""
from __future__ import annotations

import weakref

from tokenizers import decoders
from transformers import PreTrainedTokenizerBase

try:  # tokenizers >= 0.21
    from tokenizers.decoders import DecodeStream
except ImportError:  # pragma: no cover - older tokenizers: the Python path below does the same
    DecodeStream = None

# tokens of context decoded before the new ones, so that SentencePiece/byte-level spaces and
# merges at the boundary come out as they do in a full decode
CONTEXT_TOKENS = 5


class TokenPieces:
    """Per token id, the text it adds when everything before it has been released: for a byte-level BPE
    decoder (GPT-2, Llama 3, Qwen, SmolLM2) decode(ids) is the lossy UTF-8 decoding of the tokens' bytes put
    together, so a token whose own bytes are complete UTF-8 adds exactly decode([id]), whatever precedes it
    (an unfinished character before it ends at its first byte as it would at the end of the text). Empty
    for a token that is not such (part of a character, U+FFFD, a skipped special, an id past the vocabulary):
    those go through the incremental algorithm. Filled lazily, one decode per id ever seen."""

    def __init__(self, backend: object, skip_special_tokens: bool):
        self._backend, self._skip = backend, skip_special_tokens
        self.texts: list[str | None] = [None] * backend.get_vocab_size(with_added_tokens=True)   # None: not yet

    def get(self, token_id: int) -> str:
        texts = self.texts
        if not 0 <= token_id < len(texts):
            return ""
        text = texts[token_id]
        if text is None:
            text = self._backend.decode([token_id], skip_special_tokens=self._skip)
            text = texts[token_id] = "" if "\ufffd" in text else text
        return text


_pieces: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # tokenizer -> {skip_special_tokens: TokenPieces}


def token_pieces(tokenizer: PreTrainedTokenizerBase, skip_special_tokens: bool) -> TokenPieces | None:
    """The tokenizer's shared TokenPieces, or None unless it decodes with a plain byte-level decoder and
    no clean-up of spaces (which is not a per-token concatenation)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if (backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", True)
            or type(backend.decoder) is not decoders.ByteLevel):
        return None
    try:
        tables = _pieces.setdefault(tokenizer, {})
    except TypeError:       # not weakly referenceable: no shared table
        return None
    if skip_special_tokens not in tables:
        tables[skip_special_tokens] = TokenPieces(backend, skip_special_tokens)
    return tables[skip_special_tokens]


class IncrementalDetokenizer:
    """TGI's decode_token (prefix/read offsets): the new text is decode(ids[prefix:]) minus
    decode(ids[prefix:read]), held back while it ends in U+FFFD (an incomplete UTF-8 character
    split across byte tokens). The pieces concatenate exactly to what the caller streams.

    With a Rust tokenizer that needs no clean-up of spaces, the tokenizers library's `DecodeStream` runs
    that same algorithm in Rust (one decode per token while text comes out, not two plus the list
    slices); the offsets are mirrored here for `flush`. Should it ever refuse a step (its prefix check),
    this sequence goes on with the Python path from the same offsets.
    With a byte-level decoder, a token that arrives with nothing held back and whose bytes are whole
    characters is its own piece (`TokenPieces`, a list look-up): neither path runs, and the stream is made
    again from the offsets when a token needs it.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, num_prompt_tokens: int,
                 skip_special_tokens: bool = True):
        self.skip_special_tokens = skip_special_tokens
        self.read_offset = num_prompt_tokens
        self.prefix_offset = max(num_prompt_tokens - CONTEXT_TOKENS, 0)
        # the Rust decoder directly is ~7x faster than the Python wrapper, which only adds the
        # optional clean-up of spaces
        backend = getattr(tokenizer, "backend_tokenizer", None)
        use_backend = backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", True)
        self._decoder = backend if use_backend else tokenizer
        self._stream = None                   # created on the first token: it needs the prompt's tail
        self._use_stream = use_backend and DecodeStream is not None
        self._num_fed = num_prompt_tokens     # tokens the stream has seen
        self._pieces = token_pieces(tokenizer, skip_special_tokens) if use_backend else None
        self._piece_texts = self._pieces.texts if self._pieces is not None else None

    def _decode(self, token_ids: list[int]) -> str:
        return self._decoder.decode(token_ids, skip_special_tokens=self.skip_special_tokens)

    def decode_next(self, token_ids: list[int], num_tokens: int | None = None) -> str:
        """Text that the tokens after the read offset add, or "" while it is not yet stable. `num_tokens`: read
        only the first that many of `token_ids` (the step thread may have appended more: deferred_text.py)."""
        if num_tokens is None:
            num_tokens = len(token_ids)
        read_offset = self.read_offset
        if self._piece_texts is not None and read_offset == num_tokens - 1:
            # TokenPieces.get with its list read here (one call less per token)
            token_id, texts = token_ids[num_tokens - 1], self._piece_texts
            piece = texts[token_id] if 0 <= token_id < len(texts) else ""
            if piece is None:
                piece = self._pieces.get(token_id)
            if piece:
                self.prefix_offset = read_offset
                self.read_offset = self._num_fed = num_tokens
                if self._stream is not None:
                    self._stream = None
                return piece
        if self._use_stream:
            return self._stream_next(token_ids, num_tokens)
        prefix_text = self._decode(token_ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(token_ids[self.prefix_offset:num_tokens])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, num_tokens
            return new_text[len(prefix_text):]
        return ""

    def _stream_next(self, token_ids: list[int], num_tokens: int) -> str:
        if self._stream is None:     # (again, after pieces) from the offsets, as TGI's algorithm starts
            self._stream = DecodeStream(token_ids[self.prefix_offset:self.read_offset], self.skip_special_tokens)
            self._num_fed = self.read_offset
        if num_tokens <= self._num_fed:
            return ""
        # one new token (every decode step) goes in as an int: no list slice
        new = token_ids[num_tokens - 1] if num_tokens == self._num_fed + 1 else token_ids[self._num_fed:num_tokens]
        try:
            piece = self._stream.step(self._decoder, new)
        except Exception:  # noqa: BLE001 - DecodeStream's prefix check: the Python path has no such check
            self._use_stream = False
            return self.decode_next(token_ids, num_tokens)
        self._num_fed = num_tokens
        if piece is None:
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, num_tokens
        return piece

    def flush(self, token_ids: list[int], num_tokens: int | None = None) -> str:
        """Whatever is still held back (a dangling partial character comes out as U+FFFD)."""
        if num_tokens is None:
            num_tokens = len(token_ids)
        if self.read_offset >= num_tokens:
            return ""
        prefix_text = self._decode(token_ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(token_ids[self.prefix_offset:num_tokens])
        self.prefix_offset, self.read_offset = self.read_offset, num_tokens
        self._use_stream = False      # the stream's state is behind the offsets now
        return new_text[len(prefix_text):]
