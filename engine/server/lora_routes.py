"""Runtime LoRA routes, vLLM's shape: POST /v1/load_lora_adapter {"lora_name", "lora_path"} and
POST /v1/unload_lora_adapter {"lora_name"} (engine/lora/runtime.py does the work, in the step thread).

Off unless the server runs with --enable-runtime-lora (404 saying so). A refused load (files, shapes, name,
rank, no free slot) is a 422 with the reason; an unload waits for the requests already on the adapter to finish,
and new ones naming it are refused from the moment it starts. /v1/models follows.
"""
from __future__ import annotations

import asyncio

from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response

from engine.lora.runtime import RuntimeAdapters
from engine.server.errors import ServerError, ValidationError
from engine.server.protocol import LoadLoraAdapterRequest, UnloadLoraAdapterRequest
from engine.server.state import ServerState
from engine.server.validation import parse_body

UNLOAD_POLL_S = 0.05


class RuntimeLoraDisabledError(ServerError):
    status_code = 404
    error_type = "not_found"

    def __init__(self) -> None:
        super().__init__("loading LoRA adapters at run time is off on this server; start it with "
                         "--enable-runtime-lora (and --max-loras N, --max-lora-rank R)")


def runtime_adapters(request: Request) -> RuntimeAdapters:
    adapters = getattr(request.app.state, "runtime_lora", None)
    if adapters is None:
        raise RuntimeLoraDisabledError()
    return adapters


async def load_lora_adapter(request: Request) -> Response:
    state: ServerState = request.app.state.server
    req = parse_body(LoadLoraAdapterRequest, await request.body())
    adapters = runtime_adapters(request)
    try:
        await state.engine.call(lambda: adapters.load(req.lora_name, req.lora_path))
    except ValueError as exc:       # LoraError and the name's rules
        raise ValidationError(str(exc)) from None
    state.validator.adapters = tuple(adapters.names())
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")


async def unload_lora_adapter(request: Request) -> Response:
    state: ServerState = request.app.state.server
    req = parse_body(UnloadLoraAdapterRequest, await request.body())
    adapters = runtime_adapters(request)
    try:
        await state.engine.call(lambda: adapters.begin_unload(req.lora_name))
    except ValueError as exc:
        raise ValidationError(str(exc)) from None
    state.validator.adapters = tuple(adapters.names())
    while not await state.engine.call(lambda: adapters.try_finish_unload(req.lora_name)):
        await asyncio.sleep(UNLOAD_POLL_S)     # its requests in flight finish first
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")
