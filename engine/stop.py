"""Stop sequences matched on the generated text, across token boundaries."""
from __future__ import annotations


class StopMatcher:
    """Accumulates generated text; releases only text that cannot be the start of a stop string.

    `feed(piece)` returns (text safe to stream, stopped). On a match the text is cut before the
    stop string, so streamed pieces always concatenate to `text`; `cut` keeps what was cut (the
    stop string, and whatever followed it in the same token) for APIs that report it (TGI).
    """

    def __init__(self, stop: list[str] | tuple[str, ...] = ()):
        self.stop = [s for s in stop if s]
        self._matching = bool(self.stop)
        self._text = ""
        self._pieces: list[str] = []    # without stop strings: pieces not yet joined into `text`
        self.cut = ""
        self._num_released = 0          # with stop strings (without, every piece is released as it comes)

    @property
    def text(self) -> str:
        """The generated text so far (cut before the stop string once one matched)."""
        if self._pieces:
            self._text += "".join(self._pieces)
            self._pieces = []
        return self._text

    @text.setter
    def text(self, value: str) -> None:
        self._pieces = []
        self._text = value

    def feed(self, piece: str) -> tuple[str, bool]:
        if not self._matching:
            # nothing to match: the piece is released at once and kept in a list (text += piece per token
            # copies the whole text); nothing read from the piece itself (the step's loop never touches it)
            self._pieces.append(piece)
            return piece, False
        old_len = len(self.text)
        self.text += piece
        match = min((i for i in (self.text.find(s, max(0, old_len - len(s) + 1)) for s in self.stop) if i >= 0),
                    default=-1)
        if match >= 0:
            self.text, self.cut = self.text[:match], self.text[match:]
            return self._release(len(self.text)), True
        return self._release(len(self.text) - self._held_back()), False

    def _held_back(self) -> int:
        """Length of the longest text suffix that is a proper prefix of a stop string."""
        text = self.text
        for k in range(min(max(len(s) for s in self.stop) - 1, len(text)), 0, -1):
            suffix = text[-k:]
            if any(s.startswith(suffix) for s in self.stop):
                return k
        return 0

    def _release(self, end: int) -> str:
        end = max(end, self._num_released)
        out = self.text[self._num_released:end]
        self._num_released = end
        return out

    def flush(self) -> str:
        """Release the held-back tail (generation ended for another reason)."""
        return self._release(len(self.text)) if self._matching else ""
