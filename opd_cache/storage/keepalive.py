"""A record in the store kept alive by a thread while its owner works (a lease, a claim).

Annotate's shard leases (annotate/leases.py) and rollout's claims (rollout/pacing.py) both say "this worker
is still here" by rewriting a small file every third of its expiry, from a thread: the work itself (a teacher
forward, a generate() call) blocks the worker for minutes. A worker that dies stops rewriting, and the others
stop honouring its record once the expiry has passed without a rewrite.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from opd_cache.storage.layout import StoreError


class KeepAlive:
    """Call `renew` every `every_s` seconds on a daemon thread, from `start()` until `stop()` (or the end of a
    `with` block), or until `renew` returns False (the record is no longer ours).

    A store error is skipped: the next renewal (two more before the expiry) may succeed. `renewals` counts the
    successful ones; `wait_renewals(n)` waits for the n-th (tests wait on it instead of sleeping)."""

    def __init__(self, renew: Callable[[], bool], every_s: float, name: str):
        self.renew, self.every_s, self.name = renew, every_s, name
        self.renewals = 0
        self._renewed = threading.Condition()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                if not self.renew():
                    return
            except (OSError, StoreError):
                continue
            with self._renewed:
                self.renewals += 1
                self._renewed.notify_all()

    def wait_renewals(self, count: int, timeout: float) -> bool:
        """Whether `count` renewals have been made within `timeout` seconds (a hang guard, not a pace)."""
        with self._renewed:
            return self._renewed.wait_for(lambda: self.renewals >= count, timeout)

    @property
    def running(self) -> bool:
        return self._thread is not None

    def start(self) -> KeepAlive:
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """No renewal after this returns (the thread has ended)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def __enter__(self) -> KeepAlive:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
