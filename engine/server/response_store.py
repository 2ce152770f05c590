"""ResponseStore: the conversations behind stored responses, for `previous_response_id`, bounded (the oldest
are forgotten first) and in memory: a restarted server knows none."""
from __future__ import annotations

from collections import OrderedDict
from typing import Any

MAX_STORED_RESPONSES = 1024


class ResponseStore:
    def __init__(self, max_entries: int = MAX_STORED_RESPONSES) -> None:
        self.max_entries = max_entries
        self._conversations: OrderedDict[str, list[dict[str, Any]]] = OrderedDict()

    def put(self, response_id: str, messages: list[dict[str, Any]]) -> None:
        """`messages`: the chat messages up to and including the response's own turn."""
        self._conversations[response_id] = messages
        while len(self._conversations) > self.max_entries:
            self._conversations.popitem(last=False)

    def get(self, response_id: str) -> list[dict[str, Any]] | None:
        messages = self._conversations.get(response_id)
        if messages is not None:
            self._conversations.move_to_end(response_id)
        return list(messages) if messages is not None else None

    def __len__(self) -> int:
        return len(self._conversations)
