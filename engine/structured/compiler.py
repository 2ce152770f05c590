"""GrammarCompiler: grammars bound to the model's tokenizer, compiled once per spec and cached; each request gets
its own matcher, a cheap copy of the cached one."""
from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from engine.structured.spec import GrammarError, GrammarSpec
from engine.structured.token_table import TokenTableError, grammar_tokenizer

if TYPE_CHECKING:  # imported where used: a server that never sees a grammar does not need llguidance
    import llguidance

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
        self._table_error: TokenTableError | None = None
        self._cache: OrderedDict[GrammarSpec, llguidance.LLMatcher] = OrderedDict()

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        """The token table, checked against the tokenizer's own decoding (engine.structured.token_table);
        GrammarError naming the cause when no table matches it."""
        with self._lock:
            if self._tokenizer is None and self._table_error is None:
                try:
                    self._tokenizer, how = grammar_tokenizer(self._hf_tokenizer, self.vocab_size, self._eos)
                    log = logger.info if how == "automatic" else logger.warning
                    log("grammar tokenizer ready (%d tokens, eos %s), token table %s", self.vocab_size, self._eos,
                        how)
                except TokenTableError as exc:
                    self._table_error = exc
                    logger.error("structured output (grammars, JSON schemas, tools) is refused: %s", exc)
            if self.unavailable is not None:
                raise GrammarError(self.unavailable)
            assert self._tokenizer is not None
            return self._tokenizer

    @property
    def unavailable(self) -> str | None:
        """Why grammar requests are refused (the token table cannot be built), once that is known; else None."""
        error = self._table_error
        return f"structured output is not available for this model: {error}" if error is not None else None

    def prepare_in_background(self) -> threading.Thread:
        """Build and check the token table now (at start-up), so its outcome is logged before any request."""
        def prepare() -> None:
            try:
                self.tokenizer
            except GrammarError:
                pass        # logged; grammar requests get it as their 422
        thread = threading.Thread(target=prepare, name="grammar-token-table", daemon=True)
        thread.start()
        return thread

    def matcher(self, spec: GrammarSpec) -> llguidance.LLMatcher:
        """A fresh matcher for one request; GrammarError if the grammar does not fit this tokenizer."""
        tokenizer = self.tokenizer
        with self._lock:
            template = self._cache.get(spec)
            if template is not None:
                self._cache.move_to_end(spec)
                return template.deep_copy()
        import llguidance

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
