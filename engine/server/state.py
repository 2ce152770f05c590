"""ServerState: what every route needs, built once per app and kept on app.state.server."""
from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.server.errors import ServerError
from engine.server.infer import Infer
from engine.server.metrics import ServerMetrics
from engine.server.protocol import Info
from engine.server.validation import Validator


@dataclass(slots=True)
class ServerState:
    engine: AsyncEngine
    config: EngineConfig
    tokenizer: Any
    validator: Validator
    infer: Infer
    metrics: ServerMetrics
    info: Info

    @property
    def model_name(self) -> str:
        return self.info.model_id

    @property
    def system_fingerprint(self) -> str:
        return f"{self.info.version}-native"

    @contextlib.contextmanager
    def request(self) -> Iterator[float]:
        """Count the request, count its failure by error type, and give its arrival time."""
        self.metrics.request()
        try:
            yield time.monotonic()
        except ServerError as err:
            self.metrics.failure(err.error_type)
            raise
