"""ExactRoute: a route that answers only the methods it names (Starlette adds HEAD to GET routes)."""
from __future__ import annotations

from typing import Any

from starlette.routing import Route


class ExactRoute(Route):
    """HEAD is not in /api-doc/openapi.json, so it gets 405 like every other undeclared method."""

    def __init__(self, path: str, endpoint: Any, *, methods: list[str]) -> None:
        super().__init__(path, endpoint, methods=methods)
        self.methods = {m.upper() for m in methods}
