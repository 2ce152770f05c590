"""`tgi-hpc chat` pieces without a server: input assembly, commands, the request, the stream and its errors.
(The real engine, through a pseudo-terminal: tests/cluster/test_metrics_chat.py.)"""
from __future__ import annotations

import json

import httpx
import pytest

from tgi_hpc.errors import UsageError
from tgi_hpc.workflows.chat import ChatClient, ChatError, Conversation, command, message_text, read_message, response_format


def _lines(*lines: str, pasted: int = 0):
    """read_line over `lines` (EOFError after), and pending() true for the first `pasted` checks."""
    queue, prompts, paste = list(lines), [], [pasted]

    def read_line(prompt: str) -> str:
        prompts.append(prompt)
        if not queue:
            raise EOFError
        return queue.pop(0)

    def pending() -> bool:
        paste[0] -= 1
        return paste[0] >= 0

    return read_line, pending, prompts


def test_one_line_is_one_message():
    read_line, pending, prompts = _lines("hello", "next")
    assert read_message(read_line, pending) == "hello" and prompts == ["> "]


def test_a_trailing_backslash_continues_and_a_block_keeps_everything_verbatim():
    read_line, pending, prompts = _lines("first \\", "second\\", "third")
    assert read_message(read_line, pending) == "first \nsecond\nthird"
    assert prompts == ["> ", "... ", "... "]
    read_line, pending, _ = _lines('"""', "a \\", "", "/reset", '"""')
    assert read_message(read_line, pending) == "a \\\n\n/reset"


def test_a_paste_is_one_message():
    read_line, pending, _ = _lines("line one", "line two", "line three", "after", pasted=2)
    assert read_message(read_line, pending) == "line one\nline two\nline three"


def test_end_of_input_inside_a_message_ends_the_chat():
    read_line, pending, _ = _lines("unfinished \\")
    with pytest.raises(EOFError):
        read_message(read_line, pending)


def test_commands():
    assert command("/system  Be terse.  ") == ("system", "Be terse.")
    assert command("/reset") == ("reset", "") and command("/exit") == ("exit", "") and command("/quit") == ("exit", "")
    assert command("hello /reset") is None and command("//reset") is None and message_text("//reset") == "/reset"
    with pytest.raises(UsageError, match="unknown command /rest"):
        command("/rest")


def test_json_schema_file_becomes_response_format(tmp_path):
    path = tmp_path / "answer.json"
    path.write_text(json.dumps({"type": "object", "properties": {"city": {"type": "string"}}}))
    fmt = response_format(str(path))
    assert fmt == {"type": "json_schema", "json_schema": {"name": "answer", "strict": True,
                   "schema": {"type": "object", "properties": {"city": {"type": "string"}}}}}
    assert response_format(None) is None
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2")
    with pytest.raises(UsageError, match="bad.json: cannot read"):
        response_format(str(bad))
    bad.write_text("[1, 2]")
    with pytest.raises(UsageError, match="is an object"):
        response_format(str(bad))


def _sse(*events: dict | str) -> str:
    return "".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n" for e in events)


def _client(handler, urls="http://test") -> ChatClient:
    client = ChatClient(urls, {"Authorization": "Bearer k"}, model="org/model")
    client._client = httpx.Client(transport=httpx.MockTransport(handler), headers={"Authorization": "Bearer k"})
    return client


def test_a_turn_streams_pieces_and_keeps_the_history():
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append((request.headers["authorization"], json.loads(request.content)))
        chunks = [{"choices": [{"delta": {"role": "assistant"}}]}, {"choices": [{"delta": {"content": "Par"}}]},
                  {"choices": [{"delta": {"content": "is"}}]}, {"choices": [{"delta": {}, "finish_reason": "stop"}]}]
        return httpx.Response(200, text=_sse(*chunks, "[DONE]"), headers={"content-type": "text/event-stream"})

    conversation = Conversation(system="Be terse.", max_tokens=8)
    client = _client(handler)
    assert list(client.turn(conversation, "Capital of France?")) == ["Par", "is"]
    assert list(client.turn(conversation, "And Italy?")) == ["Par", "is"]
    auth, body = seen[-1]
    assert auth == "Bearer k" and body["stream"] is True and body["max_tokens"] == 8 and body["model"] == "org/model"
    assert "temperature" not in body and "response_format" not in body
    assert [m["role"] for m in body["messages"]] == ["system", "user", "assistant", "user"]
    assert body["messages"][2]["content"] == "Paris"
    conversation.reset()
    assert conversation.messages() == [{"role": "system", "content": "Be terse."}]


def test_a_refused_turn_says_why_and_leaves_the_history_alone():
    def handler(request):
        return httpx.Response(422, json={"error": "Input validation error: `max_tokens` must be > 0",
                                         "error_type": "validation"})

    conversation = Conversation()
    with pytest.raises(ChatError, match="422: Input validation error.*validation"):
        list(_client(handler).turn(conversation, "hi"))
    assert conversation.history == []


def test_an_error_event_inside_the_stream_is_shown():
    def handler(request):
        return httpx.Response(200, text=_sse({"choices": [{"delta": {"content": "a"}}]},
                                             {"error": "incomplete generation", "error_type": "incomplete_generation"}))

    conversation = Conversation()
    with pytest.raises(ChatError, match="incomplete generation"):
        list(_client(handler).turn(conversation, "hi"))
    assert conversation.history == []


def test_a_dropped_connection_is_a_chat_error():
    def handler(request):
        raise httpx.ConnectError("connection refused")

    with pytest.raises(ChatError, match="connection to the server failed"):
        list(_client(handler).turn(Conversation(), "hi"))


def test_a_service_turn_skips_a_refusing_or_draining_replica_for_the_next():
    asked = []

    def handler(request):
        asked.append(request.url.host)
        if request.url.host == "gone":
            raise httpx.ConnectError("connection refused")
        if request.url.host == "draining":
            return httpx.Response(503, json={"error": "the server is draining", "error_type": "draining"})
        return httpx.Response(200, text=_sse({"choices": [{"delta": {"content": "ok"}}]}, "[DONE]"))

    urls = lambda: ["http://gone:1", "http://draining:2", "http://ready:3"]  # noqa: E731
    conversation = Conversation()
    assert list(_client(handler, urls).turn(conversation, "hi")) == ["ok"]
    assert asked == ["gone", "draining", "ready"] and len(conversation.history) == 2
    with pytest.raises(ChatError, match="draining"):
        list(_client(handler, lambda: ["http://gone:1", "http://draining:2"]).turn(conversation, "hi"))


def test_an_attached_image_goes_with_the_next_message_only(tmp_path):
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        return httpx.Response(200, text=_sse({"choices": [{"delta": {"content": "A cat"}}]}, "[DONE]"),
                              headers={"content-type": "text/event-stream"})

    assert command("/image ~/cat.png") == ("image", "~/cat.png")
    picture = tmp_path / "cat 1.png"
    picture.write_bytes(b"\x89PNG fake")
    conversation, client = Conversation(), _client(handler)
    conversation.attach(str(picture))
    assert list(client.turn(conversation, "What is it?")) == ["A cat"]
    list(client.turn(conversation, "Sure?"))
    first, second = seen
    parts = first["messages"][-1]["content"]
    assert parts[0] == {"type": "text", "text": "What is it?"}
    assert parts[1]["image_url"]["url"] == "data:image/png;base64,iVBORyBmYWtl"
    assert second["messages"][0]["content"] == parts and second["messages"][-1] == {"role": "user", "content": "Sure?"}
    for bad, message in [("", "needs a file"), (str(tmp_path / "notes.txt"), "not an image file"),
                         (str(tmp_path / "missing.png"), "No such file")]:
        with pytest.raises(UsageError, match=message):
            conversation.attach(bad)
