"""A chat conversation with a serve job: the history, and one streamed `/v1/chat/completions` turn at a time.

The server applies the model's chat template; only messages travel. `--json-schema` becomes OpenAI's
`response_format` (json_schema), which the engine enforces with its grammar.
"""
from __future__ import annotations

import base64
import json
import mimetypes
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from tgi_hpc.errors import TgiHpcError, UsageError

HELP = ("/system TEXT  set the system prompt (the conversation goes on)\n"
        "/image PATH   attach an image to the next message (a vision-language model)\n"
        "/reset        forget the conversation (the system prompt stays)\n"
        "/exit         leave (Ctrl-D too)\n"
        "A line ending in \\ continues on the next line; a line of \"\"\" starts and ends a block; "
        "a pasted block is one message.")


MAX_IMAGE_BYTES = 20 * 2**20  # the engine's --max-image-bytes default


class ChatError(TgiHpcError):
    """The server refused or broke off a turn (its message is shown; the conversation goes on)."""


def response_format(schema_file: str | None) -> dict | None:
    """--json-schema FILE -> OpenAI's response_format, or None."""
    if schema_file is None:
        return None
    path = Path(schema_file)
    try:
        schema = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise UsageError(f"--json-schema {schema_file}: cannot read a JSON schema ({exc})") from exc
    if not isinstance(schema, dict):
        raise UsageError(f"--json-schema {schema_file}: a JSON schema is an object, not {type(schema).__name__}")
    return {"type": "json_schema", "json_schema": {"name": path.stem or "schema", "schema": schema, "strict": True}}


@dataclass
class Conversation:
    """Messages so far (the system prompt kept apart, so /reset keeps it) and the request options."""

    system: str | None = None
    history: list[dict] = field(default_factory=list)
    max_tokens: int | None = None
    temperature: float | None = None
    response_format: dict | None = None
    images: list[str] = field(default_factory=list)     # data: URLs attached to the next message (/image)

    def attach(self, path: str) -> None:
        """/image PATH: the file as a data: URL, sent with the next message."""
        if not path:
            raise UsageError("/image needs a file: /image PATH")
        file = Path(path).expanduser()
        kind = mimetypes.guess_type(file.name)[0] or ""
        if not kind.startswith("image/"):
            raise UsageError(f"/image {path}: not an image file by its name (.png, .jpg, .webp, .gif)")
        try:
            data = file.read_bytes()
        except OSError as exc:
            raise UsageError(f"/image {path}: {exc.strerror or exc}") from None
        if len(data) > MAX_IMAGE_BYTES:
            raise UsageError(f"/image {path}: {len(data)} bytes, more than the server's default limit of "
                             f"{MAX_IMAGE_BYTES}")
        self.images.append(f"data:{kind};base64,{base64.b64encode(data).decode()}")

    def user_message(self, text: str) -> dict:
        if not self.images:
            return {"role": "user", "content": text}
        return {"role": "user", "content": [{"type": "text", "text": text}] + [
            {"type": "image_url", "image_url": {"url": url}} for url in self.images]}

    def messages(self) -> list[dict]:
        return ([{"role": "system", "content": self.system}] if self.system else []) + self.history

    def reset(self) -> None:
        self.history.clear()
        self.images.clear()

    def request(self, model: str) -> dict:
        body = {"model": model or "tgi", "messages": self.messages(), "stream": True}
        optional = {"max_tokens": self.max_tokens, "temperature": self.temperature,
                    "response_format": self.response_format}
        return body | {k: v for k, v in optional.items() if v is not None}


def command(line: str) -> tuple[str, str] | None:
    """("system", text), ("image", path), ("reset", ""), ("exit", ""), ("help", "") for a slash command, else None
    (a message).
    `//text` sends "/text"."""
    if not line.startswith("/") or line.startswith("//"):
        return None
    name, _, rest = line[1:].partition(" ")
    if name in ("system", "reset", "exit", "quit", "help", "image"):
        return ("exit" if name == "quit" else name), rest.strip()
    raise UsageError(f"unknown command /{name}; /help lists them (start with // to send a line beginning with /)")


def message_text(line: str) -> str:
    return line[1:] if line.startswith("//") else line


def read_message(read_line: Callable[[str], str], pending: Callable[[], bool] = lambda: False,
                 prompt: str = "> ", more: str = "... ") -> str:
    """One message from the terminal: a line; lines ending in \\ go on; a \"\"\" line opens a block up to the
    next \"\"\" line; lines already waiting when one is read (a paste: `pending()`) join it. EOFError at the end."""
    lines: list[str] = []
    block = False
    while True:
        line = read_line(prompt)
        if line.strip() == '"""' and (block or not lines):
            if block:
                return "\n".join(lines)
            block, prompt = True, more
        elif block:
            lines.append(line)
        elif line.endswith("\\"):
            lines.append(line[:-1])
            prompt = more
        else:
            lines.append(line)
            if not pending():
                return "\n".join(lines)
            prompt = ""


class ChatClient:
    """Streams turns from a server's /v1/chat/completions. `urls` (a URL, or a function listing the current ones:
    a service's READY replicas) is asked each turn; a replica that refuses the connection or is draining is
    skipped for the next one, as nothing was started there."""

    def __init__(self, urls: str | Callable[[], list[str]], headers: dict[str, str] | None = None, model: str = "",
                 timeout: float = 300.0):
        self._urls = urls if callable(urls) else (lambda: [urls])
        self._client = httpx.Client(headers=headers or {}, trust_env=False, timeout=httpx.Timeout(timeout, connect=30.0))
        self.model = model

    def turn(self, conversation: Conversation, text: str) -> Iterator[str]:
        """Send `text`, yield the answer's pieces as they arrive; the full answer joins the history at the end
        (a turn that fails or is interrupted leaves the history as it was)."""
        body = conversation.request(self.model)
        message = conversation.user_message(text)
        body["messages"] = body["messages"] + [message]
        pieces: list[str] = []
        for piece in self._stream(body):
            pieces.append(piece)
            yield piece
        conversation.history += [message, {"role": "assistant", "content": "".join(pieces)}]
        conversation.images = []    # sent: they stay in the history, not attached again

    def _stream(self, body: dict) -> Iterator[str]:
        skipped = []
        for url in self._urls():
            try:
                with self._client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
                    if response.status_code == 503 and _error(response)[1] == "draining":
                        skipped.append(f"{url} is draining")
                        continue
                    if response.status_code != 200:
                        message, kind = _error(response)
                        raise ChatError(f"the server answered {response.status_code}: {message} ({kind})")
                    yield from _pieces(response)
                    return
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                skipped.append(f"{url}: {exc}")
            except httpx.HTTPError as exc:
                raise ChatError(f"the connection to the server failed: {exc}") from exc
        raise ChatError(f"the connection to the server failed: {'; '.join(skipped) or 'no server is READY'}")

    def close(self) -> None:
        self._client.close()


def _pieces(response: httpx.Response) -> Iterator[str]:
    for event in _sse_data(response.iter_lines()):
        if "error" in event:
            raise ChatError(f"the server stopped: {event['error']}")
        for choice in event.get("choices", []):
            piece = (choice.get("delta") or {}).get("content") or ""
            if piece:
                yield piece


def _sse_data(lines: Iterator[str]) -> Iterator[dict]:
    """The JSON of each `data:` line of a server-sent event stream, until `data: [DONE]`."""
    for line in lines:
        if not line.startswith("data:"):
            continue
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            return
        yield json.loads(data)


def _error(response: httpx.Response) -> tuple[str, str]:
    """TGI's error body: (message, error_type)."""
    response.read()
    try:
        body = response.json()
        return str(body["error"]), str(body.get("error_type", "?"))
    except (ValueError, KeyError, TypeError):
        return response.text[:300], "?"
