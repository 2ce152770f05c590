"""GrammarCompiler: grammars bound to the model's tokenizer, compiled once per spec and cached; each request gets
its own matcher, a cheap copy of the cached one."""
from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from typing import Any

import llguidance
import llguidance.hf

from engine.structured.spec import GrammarError, GrammarSpec

logger = logging.getLogger(__name__)


class GrammarCompiler:
    """Thread-safe. The llguidance tokenizer (about 1 s for a 49k vocabulary) is built on the first grammar
    request, so servers that never see one do not pay for it.

    A cached matcher has consumed nothing; `matcher()` hands out `deep_copy()`s of it, which share the
    compiled lexer and parser (the expensive part) and each keep their own parse state.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: set[int], max_cached: int = 512):
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        # any of the model's end tokens may close a finished grammar (Llama 3 has several)
        self._eos = sorted(eos_token_ids) or [tokenizer.eos_token_id]
        self.max_cached = max_cached
        self._lock = threading.Lock()
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[GrammarSpec, llguidance.LLMatcher] = OrderedDict()

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = llguidance.hf.from_tokenizer(self._hf_tokenizer, n_vocab=self.vocab_size,
                                                              eos_token=self._eos)
                logger.info("grammar tokenizer ready (%d tokens, eos %s)", self.vocab_size, self._eos)
            return self._tokenizer

    def matcher(self, spec: GrammarSpec) -> llguidance.LLMatcher:
        """A fresh matcher for one request; GrammarError if the grammar does not fit this tokenizer."""
        tokenizer = self.tokenizer
        with self._lock:
            template = self._cache.get(spec)
            if template is not None:
                self._cache.move_to_end(spec)
                return template.deep_copy()
        template = llguidance.LLMatcher(tokenizer, spec.grammar, log_level=0)   # drops the GIL while it builds
        if template.is_error():   # the first line: a panic's backtrace follows it
            error = (template.get_error().strip().splitlines() or ["unknown error"])[0]
            raise GrammarError(f"the {spec.kind} grammar cannot be used with this model: {error}")
        with self._lock:
            self._cache[spec] = template
            while len(self._cache) > self.max_cached:
                self._cache.popitem(last=False)
        return template.deep_copy()

    def is_cached(self, spec: GrammarSpec) -> bool:
        with self._lock:
            return spec in self._cache

    @property
    def num_cached(self) -> int:
        with self._lock:
            return len(self._cache)
