"""Wake-ups between the stages of a local store: a write rings its folder's bell, a waiting stage wakes on it.

The stages meet only in the store, so a stage that has nothing to do polls: the trainer lists annotated/ for
its next part, annotate lists rollouts/ for new shards, rollout reads train/progress.json for the trainer's
schedule. Each wait used to last a whole `poll_seconds`, and one step's rows pass through all three waits
(rollout → annotate → train → the next admission): on the demo's workload (64-sample steps of ~50 ms of
work per stage) 0.1 s polls were most of a step (docs/benchmarks.md, "Wake-ups").

On a local store every write that publishes a file (`FileStore.write_atomic`, `create_if_absent`,
`move_file`, `replace_dir`, `AtomicOutput.commit`) also sets the modification time of `bells/<topic>.bell`,
where `<topic>` is the first component of the written path (`rollouts`, `annotated`, `train`, `policy`,
`claims`, `run.json`, …; the suffix keeps an empty bell from passing for a data file: `bells/run.json` would
be read as JSON by whatever checks every `*.json` of a store). Only where `bells/` exists: the first `Bell` of
a store makes it, so a folder nobody waits on (an `opd export`, a store read by `opd inspect`) gets no bells.
A waiting stage `stat`s the bells of the topics it waits on every `TICK_S` and wakes when one changed: a few microseconds per tick instead of a listing, and a wake-up within a tick of
the write, from any process on the machine. `poll_seconds` stays the longest wait: a missed ring (another
machine writing to a shared filesystem, a filesystem with coarse timestamps) costs one poll, as before.

Object stores have no cheap change signal (a LIST costs a request): there a `Bell` waits `poll_seconds`,
and nothing rings.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterable

from opd_cache.storage.layout import BELLS

TICK_S = 0.005  # 200 stats per second per waiting stage: ~0.1% of a core, a wake-up 2.5 ms late on average


def rings(uri: str) -> bool:
    """Whether a store at `uri` has bells: a local directory (a path or file://), not an object store."""
    return "://" not in uri or uri.startswith("file://")


def bell_path(root: str, topic: str) -> str:
    return os.path.join(root, BELLS, f"{topic}.bell")


def ring(root: str, rel: str) -> None:
    """Ring the bell of `rel`'s topic in the local store at `root` (called after the write is visible).

    A ring stamps the bell with the writer's nanosecond clock (not the kernel's coarse file time, which can
    give two rings within a few milliseconds the same time); it never fails the write it follows.
    """
    topic = rel.split("/", 1)[0]
    if topic == BELLS:
        return
    path = bell_path(root, topic)
    now = time.time_ns()
    with contextlib.suppress(OSError):  # no bells/, a read-only or full store: the waiters fall back to polls
        try:
            os.utime(path, ns=(now, now))
        except FileNotFoundError:  # this topic's first ring (raises again where no waiter made bells/)
            with open(path, "a"):
                pass
            os.utime(path, ns=(now, now))


class Bell:
    """Waits for a write to one of `topics` of a store (see the module's docstring).

    Every change since the bell was made, or since the last `wait` or `changed` that saw one, wakes it:
    a ring between a stage's last look at the store and its next `wait` is not lost.
    """

    def __init__(self, store, topics: Iterable[str]):
        self.folder = os.path.join(store.root, BELLS) if store.is_local else None
        self.paths = [bell_path(store.root, topic) for topic in topics] if self.folder else []
        self._make_folder()
        self._seen = self._stamps()

    def _make_folder(self) -> None:
        """`bells/` in an existing store: from now on its writes ring (a store not created yet: at a later wait)."""
        if self.folder and not os.path.isdir(self.folder) and os.path.isdir(os.path.dirname(self.folder)):
            with contextlib.suppress(OSError):  # a read-only store: no bells, the polls remain
                os.mkdir(self.folder)

    def _stamps(self) -> tuple[int, ...]:
        stamps = []
        for path in self.paths:
            try:
                stamps.append(os.stat(path).st_mtime_ns)
            except OSError:
                stamps.append(0)
        return tuple(stamps)

    def changed(self) -> bool:
        """A ring since the last look (and the look is taken: the next call says False unless one rang again)."""
        stamps = self._stamps()
        if stamps == self._seen:
            return False
        self._seen = stamps
        return True

    def wait(self, timeout: float, stop: threading.Event | None = None) -> bool:
        """Until one of the topics rings, `stop` is set or `timeout` seconds pass; True when `stop` is set."""
        stop = stop or threading.Event()
        if not self.paths:
            return stop.wait(timeout)
        self._make_folder()
        deadline = time.monotonic() + timeout
        while not self.changed():
            left = deadline - time.monotonic()
            if left <= 0:
                break
            if stop.wait(min(TICK_S, left)):
                return True
        return stop.is_set()
