"""Plain progress lines for output that is not a terminal: CI logs, `nohup`, `| tee`, the stage logs of `opd run`.

A rich progress bar or live table draws nothing when its output is a file, so a
long job with redirected output would look silent until it ends. Every long loop
therefore prints, when it is not on a terminal, one plain line at the start and
then at most one every `PLAIN_PROGRESS_SECONDS`.
"""

from __future__ import annotations

import time

PLAIN_PROGRESS_SECONDS = 10.0


class Every:
    """`due()` is True at its first call, then at most once every `seconds`."""

    def __init__(self, seconds: float = PLAIN_PROGRESS_SECONDS):
        self.seconds = seconds
        self.last: float | None = None

    def due(self) -> bool:
        now = time.monotonic()
        if self.last is not None and now - self.last < self.seconds:
            return False
        self.last = now
        return True


def duration(seconds: float) -> str:
    """1:05 for 65 s, 1:02:03 for 3723 s."""
    seconds = max(int(round(seconds)), 0)
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"
