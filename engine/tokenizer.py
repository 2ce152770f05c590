"""Tokenizer loading from a local snapshot: the HF tokenizer, every eos id, the chat template."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerBase


def load_tokenizer(path: str | Path, revision: str | None = None,
                   trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    try:
        return AutoTokenizer.from_pretrained(str(path), revision=revision, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot load a tokenizer from {path}: {e}; the snapshot needs "
                         "tokenizer.json or tokenizer.model with tokenizer_config.json") from e


def _ids(value: Any) -> set[int]:
    if value is None:
        return set()
    if isinstance(value, int):
        return {value}
    return {int(v) for v in value}


def _json_field(path: Path, key: str) -> Any:
    try:
        return json.loads(path.read_text()).get(key)
    except (OSError, ValueError):
        return None


def load_eos_token_ids(path: str | Path, tokenizer: PreTrainedTokenizerBase | None = None) -> set[int]:
    """Union of the eos ids in config.json, generation_config.json and the tokenizer.

    Chat models often list several (Llama 3: <|end_of_text|>, <|eot_id|>); stopping on only one
    runs generation on past the end of the turn.
    """
    path = Path(path)
    eos = _ids(_json_field(path / "config.json", "eos_token_id"))
    eos |= _ids(_json_field(path / "generation_config.json", "eos_token_id"))
    if tokenizer is not None:
        eos |= _ids(tokenizer.eos_token_id)
    return eos


def apply_chat_template(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]],
                        add_generation_prompt: bool = True, **kwargs: Any) -> str:
    """Render chat `messages` to the prompt string; the caller tokenizes it without special tokens."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template; use /generate with a plain prompt")
    return tokenizer.apply_chat_template(messages, tokenize=False,
                                         add_generation_prompt=add_generation_prompt, **kwargs)


class TokenTexts:
    """Per-token text (decode([id]), specials included) and special flag, cached per id."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase):
        self.tokenizer = tokenizer
        self.special_ids = set(tokenizer.all_special_ids)
        self._texts: dict[int, str] = {}

    def text(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def is_special(self, token_id: int) -> bool:
        return token_id in self.special_ids
