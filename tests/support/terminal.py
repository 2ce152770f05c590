"""A command on a pseudo-terminal, for tests of interactive commands (`tgi-hpc chat`): stdlib `pty` only."""
from __future__ import annotations

import fcntl
import os
import re
import select
import signal
import subprocess
import termios
import time


class Terminal:
    """A command on a pseudo-terminal: what it writes is collected (with the time of each read)."""

    def __init__(self, argv: list[str], env: dict[str, str], term: str = "dumb"):
        import pty

        master, slave = pty.openpty()
        self.proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, env={**env, "TERM": term},
                                     preexec_fn=_controlling_terminal, close_fds=True)
        os.close(slave)
        self.master, self.reads, self.seen = master, [], ""

    def _pump(self, timeout: float) -> None:
        ready, _, _ = select.select([self.master], [], [], timeout)
        if ready:
            try:
                data = os.read(self.master, 65536).decode(errors="replace")
            except OSError:       # the other end closed
                data = ""
            if data:
                self.reads.append((time.monotonic(), data))
                self.seen += data

    def expect(self, pattern: str, timeout: float = 120, start: int = 0) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = re.search(pattern, self.seen[start:], re.S)
            if found:
                return found
            if self.proc.poll() is not None:
                self._pump(0.2)
                if not re.search(pattern, self.seen[start:], re.S):
                    break
            self._pump(0.2)
        raise AssertionError(f"{pattern!r} not seen in:\n{self.seen[start:]}")

    def send(self, text: str) -> int:
        """Type `text`; returns where the output after it starts."""
        mark = len(self.seen)
        os.write(self.master, text.encode())
        return mark

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)
        os.close(self.master)


def _controlling_terminal() -> None:
    """In the child: a session of its own whose controlling terminal is the pty, so Ctrl-C there is SIGINT."""
    os.setsid()
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)
