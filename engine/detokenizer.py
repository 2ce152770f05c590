"""Incremental detokenization: stable text pieces per new token that add up to the full decode."""
from __future__ import annotations

from transformers import PreTrainedTokenizerBase

# tokens of context decoded before the new ones, so that SentencePiece/byte-level spaces and
# merges at the boundary come out as they do in a full decode
CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """TGI's decode_token (prefix/read offsets): the new text is decode(ids[prefix:]) minus
    decode(ids[prefix:read]), held back while it ends in U+FFFD (an incomplete UTF-8 character
    split across byte tokens). The pieces concatenate exactly to what the caller streams.
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

    def _decode(self, token_ids: list[int]) -> str:
        return self._decoder.decode(token_ids, skip_special_tokens=self.skip_special_tokens)

    def decode_next(self, token_ids: list[int]) -> str:
        """Text that the tokens after the read offset add, or "" while it is not yet stable."""
        prefix_text = self._decode(token_ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(token_ids[self.prefix_offset:])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(token_ids)
            return new_text[len(prefix_text):]
        return ""

    def flush(self, token_ids: list[int]) -> str:
        """Whatever is still held back (a dangling partial character comes out as U+FFFD)."""
        if self.read_offset >= len(token_ids):
            return ""
        prefix_text = self._decode(token_ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(token_ids[self.prefix_offset:])
        self.prefix_offset, self.read_offset = self.read_offset, len(token_ids)
        return new_text[len(prefix_text):]
