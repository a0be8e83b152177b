"""A small discrete-event kernel for `opd plan`'s pipeline model (flow/simulate.py).

A process is a Python generator that yields what it waits for:

- a number: sleep that many simulated seconds (a poll interval, a publish latency);
- a `Signal`: wake when another process fires it (the trainer's queue of prefetched batches);
- `Wait(signals, timeout)`: wake when one of the signals fires or `timeout` seconds pass, whichever comes first
  (a stage woken by the store's bells, or at its next poll);
- `Work(seconds)`: compute for that many seconds of one core; with `cores` set, the busy processes share the
  cores (processor sharing: k jobs on c < k cores each run at c / k), which is how three stages and an
  evaluator share a 2-core machine. `Work(seconds, kept_cores=c)` is a job that keeps c cores for itself while
  fewer than all are kept, the others sharing what is left (each at most one core): the trainer's step, which
  measured kept its core and a little more (its loader and publisher threads) while rollout and annotate shared
  the rest (docs/flow-control.md, "Shared cores").

`Simulation.run()` pops events in time order (ties in the order they were scheduled, so a run is deterministic)
until no process is left or `until` is reached. Nothing here knows about stages.
"""

from __future__ import annotations

import heapq
from collections.abc import Generator
from dataclasses import dataclass

Process = Generator[object, object, None]


@dataclass(frozen=True)
class Work:
    """Compute `seconds` of CPU: on one core, stretched while more processes compute than there are cores; with
    `kept_cores` > 0, at that many cores while the kept cores leave some for the others."""

    seconds: float
    kept_cores: float = 0.0


class Signal:
    """Processes wait on it (`yield signal`); `fire()` wakes every one of them at the current time."""

    def __init__(self, sim: Simulation):
        self.sim = sim
        self.waiters: list[Process] = []

    def fire(self) -> None:
        waiters, self.waiters = self.waiters, []
        for process in waiters:
            self.sim.resume_at(self.sim.now, process)


@dataclass(frozen=True)
class Wait:
    """Sleep until one of `signals` fires or `timeout` simulated seconds pass, whichever comes first."""

    signals: tuple[Signal, ...]
    timeout: float


class Processors:
    """`cores` cores shared by the processes computing (`Work`); None: every process has a core of its own."""

    def __init__(self, sim: Simulation, cores: float | None):
        self.sim, self.cores = sim, cores
        self.jobs: dict[int, list] = {}  # job id -> [remaining core-seconds, process, kept cores]
        self._next_id = 0
        self._updated = 0.0
        self._epoch = 0  # invalidates completion events scheduled before the last change
        self.busy_seconds = 0.0  # core-seconds computed

    def rates(self) -> dict[int, float]:
        """Core-seconds per second each running job gets now."""
        if self.cores is None:
            return dict.fromkeys(self.jobs, 1.0)
        kept = {job_id: k for job_id, (*_, k) in self.jobs.items() if k}
        sharing = [job_id for job_id in self.jobs if job_id not in kept]
        left = self.cores - sum(kept.values())
        if left > 0 or (left == 0 and not sharing):
            # the keepers at their cores; the others share what is left, each at most one core
            shared = min(1.0, left / len(sharing)) if sharing else 0.0
            return {**kept, **dict.fromkeys(sharing, shared)}
        # more cores kept than there are: every job shares them in proportion to the cores it wants
        wants = {job_id: kept.get(job_id, 1.0) for job_id in self.jobs}
        total = sum(wants.values())
        return {job_id: self.cores * want / total for job_id, want in wants.items()}

    def start(self, work: Work, process: Process) -> None:
        seconds = max(work.seconds, 0.0)
        if self.cores is None:
            self.busy_seconds += seconds
            self.sim.resume_at(self.sim.now + seconds, process)
            return
        self._advance()
        self.jobs[self._next_id] = [seconds, process, work.kept_cores]
        self._next_id += 1
        self._reschedule()

    def _advance(self) -> None:
        """Charge the time since the last change to every running job."""
        elapsed = self.sim.now - self._updated
        if elapsed > 0 and self.jobs:
            for job_id, rate in self.rates().items():
                self.jobs[job_id][0] -= elapsed * rate
                self.busy_seconds += elapsed * rate
        self._updated = self.sim.now

    def _reschedule(self) -> None:
        self._epoch += 1
        if not self.jobs:
            return
        rates = self.rates()
        soonest = min(max(self.jobs[job_id][0], 0.0) / rate for job_id, rate in rates.items())
        epoch = self._epoch
        self.sim.call_at(self.sim.now + soonest, lambda: self._finish(epoch))

    def _finish(self, epoch: int) -> None:
        if epoch != self._epoch:
            return  # the job set changed since this completion was scheduled
        self._advance()
        for job_id, (remaining, process, _) in list(self.jobs.items()):
            if remaining <= 1e-9:
                del self.jobs[job_id]
                self.sim.resume_at(self.sim.now, process)
        self._reschedule()


class Simulation:
    """The clock and the event queue."""

    def __init__(self, cores: float | None = None):
        self.now = 0.0
        self._queue: list[tuple[float, int, object]] = []
        self._seq = 0
        self.events = 0
        self.cpu = Processors(self, cores)

    def spawn(self, process: Process) -> None:
        self.resume_at(self.now, process)

    def resume_at(self, time: float, process: Process) -> None:
        self._push(time, process)

    def call_at(self, time: float, callback) -> None:
        self._push(time, callback)

    def _push(self, time: float, item: object) -> None:
        heapq.heappush(self._queue, (time, self._seq, item))
        self._seq += 1

    def run(self, until: float = float("inf")) -> None:
        while self._queue:
            if self._queue[0][0] > until:
                self.now = until
                return
            time, _, item = heapq.heappop(self._queue)
            self.now = time
            self.events += 1
            if callable(item) and not hasattr(item, "send"):
                item()
                continue
            self._step(item)

    def _step(self, process: Process) -> None:
        try:
            wanted = next(process)
        except StopIteration:
            return
        if isinstance(wanted, Work):
            self.cpu.start(wanted, process)
        elif isinstance(wanted, Signal):
            wanted.waiters.append(process)
        elif isinstance(wanted, Wait):
            self._wait(wanted, process)
        else:
            self.resume_at(self.now + max(float(wanted), 0.0), process)

    def _wait(self, wait: Wait, process: Process) -> None:
        """Resume `process` once: at the first signal or at the timeout (whatever comes later is ignored)."""
        resumed = False

        def resume() -> None:
            nonlocal resumed
            if not resumed:
                resumed = True
                self._step(process)

        for signal in wait.signals:
            signal.waiters.append(resume)  # Signal.fire queues it; a queued callable is called
        self.call_at(self.now + max(wait.timeout, 0.0), resume)
