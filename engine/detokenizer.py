"""Incremental detokenization: stable text pieces per new token that add up to the full decode."""
from __future__ import annotations

from transformers import PreTrainedTokenizerBase

try:  # tokenizers >= 0.21
    from tokenizers.decoders import DecodeStream
except ImportError:  # pragma: no cover - older tokenizers: the Python path below does the same
    DecodeStream = None

# tokens of context decoded before the new ones, so that SentencePiece/byte-level spaces and
# merges at the boundary come out as they do in a full decode
CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """TGI's decode_token (prefix/read offsets): the new text is decode(ids[prefix:]) minus
    decode(ids[prefix:read]), held back while it ends in U+FFFD (an incomplete UTF-8 character
    split across byte tokens). The pieces concatenate exactly to what the caller streams.

    With a Rust tokenizer that needs no clean-up of spaces, the tokenizers library's `DecodeStream` runs
    that same algorithm in Rust (one decode per token while text comes out, not two plus the list
    slices); the offsets are mirrored here for `flush`. Should it ever refuse a step (its prefix check),
    this sequence goes on with the Python path from the same offsets.
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

    def _decode(self, token_ids: list[int]) -> str:
        return self._decoder.decode(token_ids, skip_special_tokens=self.skip_special_tokens)

    def decode_next(self, token_ids: list[int]) -> str:
        """Text that the tokens after the read offset add, or "" while it is not yet stable."""
        if self._use_stream:
            return self._stream_next(token_ids)
        prefix_text = self._decode(token_ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(token_ids[self.prefix_offset:])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(token_ids)
            return new_text[len(prefix_text):]
        return ""

    def _stream_next(self, token_ids: list[int]) -> str:
        if self._stream is None:
            self._stream = DecodeStream(token_ids[self.prefix_offset:self.read_offset], self.skip_special_tokens)
        num_tokens = len(token_ids)
        if num_tokens <= self._num_fed:
            return ""
        # one new token (every decode step) goes in as an int: no list slice
        new = token_ids[-1] if num_tokens == self._num_fed + 1 else token_ids[self._num_fed:]
        try:
            piece = self._stream.step(self._decoder, new)
        except Exception:  # noqa: BLE001 - DecodeStream's prefix check: the Python path has no such check
            self._use_stream = False
            return self.decode_next(token_ids)
        self._num_fed = num_tokens
        if piece is None:
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, num_tokens
        return piece

    def flush(self, token_ids: list[int]) -> str:
        """Whatever is still held back (a dangling partial character comes out as U+FFFD)."""
        if self.read_offset >= len(token_ids):
            return ""
        prefix_text = self._decode(token_ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(token_ids[self.prefix_offset:])
        self.prefix_offset, self.read_offset = self.read_offset, len(token_ids)
        self._use_stream = False      # the stream's state is behind the offsets now
        return new_text[len(prefix_text):]
