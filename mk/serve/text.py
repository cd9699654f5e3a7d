"""A request's text as its tokens arrive: whole characters only, cut at the first stop string,
and never a piece of a stop string sent before it is known not to be one."""

from __future__ import annotations

from mk.generate import TextStreamer


class StopText:
    """Feeds tokens to a :class:`~mk.generate.TextStreamer` and checks ``stops`` (strings).

    :meth:`put` returns the text that is now safe to send and whether a stop string was
    found (the text ends before it; nothing after it is ever sent); :meth:`end` returns
    what was held back. Text that may be the beginning of a stop string is held until the
    next token settles it."""

    def __init__(self, tokenizer, prompt_ids, stops: list[str]):
        self.streamer = TextStreamer(tokenizer, prompt_ids)
        self.stops = stops
        self.text = ""   # all of the completion's text so far (up to a stop string)
        self.sent = 0    # characters of it returned
        self.stopped = False

    def put(self, token: int) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        self.text += self.streamer.put(token)
        cut = min((i for i in (self.text.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.text, self.stopped = self.text[:cut], True
            return self._send(len(self.text)), True
        return self._send(len(self.text) - self._held()), False

    def end(self) -> str:
        """The rest of the text (an incomplete last character as U+FFFD), up to a stop string."""
        if not self.stopped:
            self.text += self.streamer.end()
            cut = min((i for i in (self.text.find(s) for s in self.stops) if i >= 0), default=-1)
            if cut >= 0:
                self.text, self.stopped = self.text[:cut], True
        return self._send(len(self.text))

    def _held(self) -> int:
        """Characters at the end of the text that begin some stop string."""
        return max((k for s in self.stops for k in range(min(len(s) - 1, len(self.text)), 0, -1)
                    if self.text.endswith(s[:k])), default=0)

    def _send(self, upto: int) -> str:
        piece = self.text[self.sent:max(upto, self.sent)]
        self.sent = max(upto, self.sent)
        return piece
