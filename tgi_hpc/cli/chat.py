"""`tgi-hpc chat [JOB]`: talk to a serve job from the terminal, answers streamed as they are generated."""
from __future__ import annotations

import sys

import click

from tgi_hpc.cli._app import App, with_app


def _read_line(prompt: str) -> str:
    return input(prompt)


def _pending() -> bool:
    """More input already waiting (a pasted block): it joins the line just read."""
    import select

    if not sys.stdin.isatty():
        return False
    return bool(select.select([sys.stdin], [], [], 0.05)[0])


@click.command()
@click.argument("target", metavar="[JOB|SERVICE]", required=False)
@click.option("--model", "-m", help="A job serving several models (or adapters): the one to talk to (default: the first).")
@click.option("--system", "system", help="System prompt (change it later with /system TEXT).")
@click.option("--json-schema", "json_schema", type=click.Path(exists=True, dir_okay=False),
              help="Answers are JSON matching this JSON-schema file (OpenAI response_format json_schema).")
@click.option("--max-tokens", type=click.IntRange(min=1), help="Longest answer, in tokens (default: the server's).")
@click.option("--temperature", type=click.FloatRange(min=0), help="Sampling temperature (default: the server's).")
@click.option("--timeout", default=600.0, show_default=True, help="Seconds to wait for the job to be READY.")
@with_app
def chat(app: App, target, model, system, json_schema, max_tokens, temperature, timeout) -> None:
    """Chat with JOB's or SERVICE's model (default: my newest running serve job), answers streamed.

    Through /v1/chat/completions: the server applies the model's chat template. /system TEXT, /reset,
    /exit (or Ctrl-D), /help; a line ending in \\ goes on, a line of \"\"\" opens a block, a paste is one message."""
    from tgi_hpc.workflows import access
    from tgi_hpc.workflows.chat import ChatClient, Conversation, response_format

    conversation = Conversation(system, max_tokens=max_tokens, temperature=temperature,
                                response_format=response_format(json_schema))
    with access.connect(app.cluster(), target, model=model, timeout=timeout, progress=app.info) as found:
        client = ChatClient(found.urls, found.headers, found.model)
        what = "service" if found.service else "job"
        app.info(f"chat with {what} {found.job_id} ({found.model or 'model'}) at {found.url}; /help for commands")
        try:
            _loop(app, client, conversation)
        finally:
            client.close()


def _loop(app: App, client, conversation) -> None:
    import readline  # noqa: F401  (imported for its effect: line editing and history in input())

    from tgi_hpc.errors import UsageError
    from tgi_hpc.workflows.chat import HELP, command, message_text, read_message

    while True:
        try:
            text = read_message(_read_line, _pending)
        except (EOFError, KeyboardInterrupt):
            click.echo()
            return
        try:
            cmd = command(text) if "\n" not in text else None
        except UsageError as exc:
            app.info(str(exc))
            continue
        if cmd is None:
            if text.strip():
                _answer(app, client, conversation, message_text(text))
        elif cmd[0] == "exit":
            return
        elif cmd[0] == "reset":
            conversation.reset()
            app.info("(conversation cleared)")
        elif cmd[0] == "image":
            try:
                conversation.attach(cmd[1])
                app.info(f"(image attached to the next message: {len(conversation.images)} so far)")
            except UsageError as exc:
                app.info(str(exc))
        elif cmd[0] == "system":
            conversation.system = cmd[1] or None
            app.info(f"(system prompt {'set' if cmd[1] else 'removed'})")
        else:
            app.info(HELP)


def _answer(app: App, client, conversation, text: str) -> None:
    from tgi_hpc.workflows.chat import ChatError

    try:
        for piece in client.turn(conversation, text):
            click.echo(piece, nl=False)
            sys.stdout.flush()
        click.echo()
    except ChatError as exc:
        click.echo()
        app.info(f"error: {exc}")
    except KeyboardInterrupt:
        click.echo()
        app.info("(answer interrupted; not kept)")
