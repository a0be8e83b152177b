"""Kill points for the chaos test: stop a stage process at the moments worth killing it.

The chaos driver puts this folder on PYTHONPATH of the stage processes it
starts, so Python imports this file at start-up (`sitecustomize`). With
`OPD_CHAOS_DIR` set, it wraps three functions that every store write goes
through and, at each *kill point*, with probability `OPD_CHAOS_PAUSE` (per
kind of file), stops its own process with SIGSTOP after writing the point's
name to `$OPD_CHAOS_DIR/pause-<pid>`. The driver, which watches its children,
then either SIGKILLs the stopped process (a kill exactly at that point) or
resumes it with SIGCONT. Nothing else changes: the stage runs its real code,
and the kill is the same SIGKILL a preempted machine gets.

Kill points (`<kind>:<moment>`; kind from the store path, e.g. `rollout-shard`,
`annotated-part`, `policy`, `policy-latest`, `train-state`, `ledger`):

- `<kind>:open` — `Store.write_atomic` has produced the content but not
  published it (local: a `*.tmp-*` file, maybe partly flushed; S3: the content
  in memory, the upload not started);
- `<kind>:before-rename` — a complete `*.tmp-*` file or folder, not renamed;
- `<kind>:after-rename` — a folder (policy version, train state) just renamed
  into place, before the next action (LATEST, old states' deletion);
- `<kind>:published` — `write_atomic` returned (the file is visible);
- `train-state:saved-locally` — DCP wrote the state folder; rng/trainer.json
  and the marker not yet (local), nothing uploaded yet (S3);
- `<kind>:deleting` — retention (opd_cache/storage/retention.py) removed an old policy
  version's or resume state's `_COMPLETE` marker, its files not yet.

A key point whose quota of kills is not met yet is listed in `$OPD_CHAOS_DIR/owed` (the driver rewrites it
after every kill): the hook pauses there every time, so the quotas are met whatever the dice say.
"""

from __future__ import annotations

import os

_DIR = os.environ.get("OPD_CHAOS_DIR")


def _install() -> None:
    import pathlib
    import random
    import signal
    import threading

    import opd_cache.storage.store as store_module

    real_replace = os.replace
    real_write_text = pathlib.Path.write_text
    real_write_atomic = store_module.Store.write_atomic
    real_delete_dir = store_module.Store.delete_dir
    local_root = os.environ.get("OPD_CHAOS_STORE_ROOT", "")
    # per kind: probability of pausing at each of its points; "*" for kinds not listed
    probabilities = {"*": 0.0}
    for item in os.environ.get("OPD_CHAOS_PAUSE", "").split(","):
        if "=" in item:
            kind, p = item.split("=")
            probabilities[kind.strip()] = float(p)
    seed = os.environ.get("OPD_CHAOS_SEED", "0")
    rngs: dict[int, random.Random] = {}

    def chance() -> float:
        """A draw from this process's own sequence: a stage forked from `opd run`'s fork server (which imported
        this file once) draws its own, as a fresh interpreter does."""
        pid = os.getpid()
        if pid not in rngs:
            rngs[pid] = random.Random(f"{seed}-{pid}")
        return rngs[pid].random()

    up_marker_written: list[bool] = []

    def kind_of(rel: str) -> str:
        rel = rel.split(".tmp-")[0]
        for prefix, kind in (
            ("rollouts/", "rollout-shard"),
            ("annotated/", "annotated-part"),
            ("policy/LATEST", "policy-latest"),
            ("policy/", "policy"),
            ("train/state", "train-state"),
            ("train/consumed/", "ledger"),
            ("train/skipped/", "skipped-ledger"),
            ("train/progress", "progress"),
            ("train/DONE", "done-marker"),
            ("metrics/", "metrics"),
            ("run.json", "run-manifest"),
            ("quarantine/", "quarantine"),
        ):
            if rel.startswith(prefix):
                return kind
        return "other"

    def relative(path: str) -> str | None:
        path = str(path)
        if local_root and path.startswith(local_root + "/"):
            return path[len(local_root) + 1 :]
        return None

    pause_lock = threading.Lock()

    owed_file = os.path.join(_DIR, "owed")

    def owed(point: str) -> bool:
        """A key point the driver still needs a kill at (its `owed` file): paused at every time, not by chance.
        Chance alone missed `policy:before-rename` in a whole run under load (ten publications at 0.5 each)."""
        try:
            with open(owed_file) as f:
                return point in f.read().split()
        except OSError:
            return False

    def pause(kind: str, moment: str) -> None:
        if chance() >= probabilities.get(kind, probabilities["*"]) and not owed(f"{kind}:{moment}"):
            return
        marker = os.path.join(_DIR, f"pause-{os.getpid()}")
        # One pause at a time per process: the trainer's background publisher and its loop can reach kill
        # points together, and the driver handles one marker per pid (the second waits for the SIGCONT).
        with pause_lock:
            with open(marker + ".new", "w") as f:
                f.write(f"{kind}:{moment}")
            real_replace(marker + ".new", marker)
            os.kill(os.getpid(), signal.SIGSTOP)  # the driver SIGKILLs us here, or sends SIGCONT

    def write_atomic(self, rel, write_fn):
        kind = kind_of(rel)
        if not up_marker_written:
            up_marker_written.append(True)  # lets the driver tell a kill at start-up from one at work
            open(os.path.join(_DIR, f"up-{os.getpid()}"), "w").close()

        def write(out):
            write_fn(out)
            pause(kind, "open")

        real_write_atomic(self, rel, write)
        pause(kind, "published")

    def replace(src, dst, *args, **kwargs):
        rel = relative(os.fspath(dst))
        if rel is None or ".tmp-" not in os.fspath(src):
            return real_replace(src, dst, *args, **kwargs)
        kind = kind_of(rel)
        pause(kind, "before-rename")
        result = real_replace(src, dst, *args, **kwargs)
        if os.path.isdir(dst):
            pause(kind, "after-rename")
        return result

    def write_text(self, *args, **kwargs):
        name = str(self)
        if self.name.startswith("rng-") and (".tmp-save" in name or "/opd-state-" in name):
            pause("train-state", "saved-locally")
        return real_write_text(self, *args, **kwargs)

    def delete_dir(self, rel):
        kind = kind_of(rel)
        if kind in ("policy", "train-state"):
            pause(kind, "deleting")
        return real_delete_dir(self, rel)

    store_module.Store.write_atomic = write_atomic
    store_module.Store.delete_dir = delete_dir
    os.replace = replace
    pathlib.Path.write_text = write_text


if _DIR:
    _install()
