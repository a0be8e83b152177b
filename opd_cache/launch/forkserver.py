"""Stage processes forked from one interpreter that has imported torch, transformers and pyarrow (`opd run`).

Each stage used to start as a fresh `python -m opd_cache.cli <stage> …`: on bench_trl's workload three
interpreters spent ~4.4 CPU-s each importing the same modules, at once, on the two cores the stages then share
(docs/benchmarks.md, "Where opd's CPU goes"). With `run.fork_stages` (the default) the supervisor starts one
server process (`python -m opd_cache.launch.forkserver`) that imports them once; every stage start, restarts
included, is a fork of it. A forked stage is the same command as before, seen from outside as before:

- its own session and process group (signals to the group reach its children), its log on stdout and stderr,
  stdin from /dev/null, the environment and working folder the supervisor gives it;
- `python -m <module> <args>` as `runpy` runs it (the module as `__main__`, `sys.argv` as a fresh interpreter
  has it), then the interpreter's exit functions, then `os._exit` with the command's status (an uncaught
  KeyboardInterrupt ends it by SIGINT, as CPython does);
- the random states it inherited are drawn again (Python's and numpy's global ones; torch's default generator
  starts from the same constant in every fresh interpreter anyway).

The server talks JSON lines: a request `{"module", "args", "env", "log", "cwd"}` on its stdin is answered by
`{"started": pid}`; when a child ends it writes `{"exited": pid, "status": code}` (negative: the signal that
killed it, as `Popen.returncode`). It stays single-threaded (a fork copies only the calling thread, and only
this loop runs there). When its stdin closes it waits for its remaining children and exits, so the CPU of the
stages reaches whoever waits for the supervisor (`getrusage(RUSAGE_CHILDREN)`, the benchmarks' clock).

`StageForkServer` is the supervisor's side: `start(module, args, env, log)` returns a `ForkedStage`, the part
of `subprocess.Popen` the supervisor uses (`pid`, `poll`, `wait`, `returncode`). Seen in `ps`, a forked stage
shows the server's command line (a fork does not exec); its log and `opd run`'s dashboard name it.
"""

from __future__ import annotations

import gc
import json
import os
import queue
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from opd_cache.launch.heap import keep_freed_memory

# what every stage imports; the server imports them once (the stages' remaining imports are small)
PRELOAD = (
    "torch",
    "transformers",
    "pyarrow",
    "pyarrow.compute",
    "opd_cache.cli",
    "opd_cache.rollout.worker",
    "opd_cache.annotate.worker",
    "opd_cache.train.trainer",
    "opd_cache.evaluate",
)
START_TIMEOUT_S = 300.0  # the first start waits for the server's imports


# ---------------------------------------------------------------------- the server (its own process)
def serve() -> None:
    keep_freed_memory()  # before the imports; the forked stages inherit it (launch/heap.py)
    for module in PRELOAD:
        try:
            __import__(module)
        except ImportError:
            pass  # a stage that needs it imports it itself, and says what is missing
    # The imported modules live as long as the stages: out of the collector's sight, each stage's first full
    # collection skips them (0.3 CPU-s each on bench_trl's workload) and leaves their pages shared with the server
    gc.collect()
    gc.freeze()
    # one request at a time (the supervisor waits for each reply), so select() on the buffered stdin is safe
    requests, replies = sys.stdin.buffer, sys.stdout
    children: set[int] = set()
    accepting = True

    def say(message: dict) -> None:
        replies.write(json.dumps(message) + "\n")
        replies.flush()  # before any fork: a child must not inherit (and repeat) buffered replies

    while accepting or children:
        readable = select.select([requests], [], [], 0.2)[0] if accepting else []
        if readable:
            line = requests.readline()
            if not line:
                accepting = False  # the supervisor is done: wait for the remaining children, then exit
            else:
                ready_r, ready_w = os.pipe()
                pid = os.fork()
                if pid == 0:
                    os.close(ready_r)
                    os._exit(_run_stage(json.loads(line), ready_w))
                os.close(ready_w)
                os.read(ready_r, 1)  # the child leads its own session now: signals to its group reach it
                os.close(ready_r)
                children.add(pid)
                say({"started": pid})
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG if accepting else 0)
            except ChildProcessError:
                break
            if pid == 0:
                break
            children.discard(pid)
            say({"exited": pid, "status": os.waitstatus_to_exitcode(status)})


def _run_stage(request: dict, ready_fd: int) -> int:
    """In the forked child: become the stage command and run it; returns its exit status."""
    os.setsid()
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    devnull = os.open(os.devnull, os.O_RDONLY)
    for fd, target in ((devnull, 0), (log, 1), (log, 2)):
        os.dup2(fd, target)
    os.close(log)
    os.close(devnull)
    # the server replies "started" only now: a signal to the group reaches us, and the log exists
    os.write(ready_fd, b"1")
    os.close(ready_fd)
    import io

    # unbuffered like the PYTHONUNBUFFERED=1 the stages' environment asks for (read only at a fresh start)
    sys.stdout, sys.stderr = (
        io.TextIOWrapper(open(fd, "wb", buffering=0, closefd=False), encoding="utf-8", write_through=True)
        for fd in (1, 2)
    )
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for sig in (signal.SIGTERM, signal.SIGCHLD, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_DFL)
    _redraw_random_states()
    threads = request["env"].get("OMP_NUM_THREADS")
    if threads and threads.isdigit():
        import torch

        torch.set_num_threads(int(threads))  # the server read OMP_NUM_THREADS once, at its own start
    sys.argv = [request["module"], *request["args"]]  # runpy puts the module's file first, as `python -m` does
    code = 0
    try:
        import runpy

        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, int | None):
            print(e.code, file=sys.stderr)
    except KeyboardInterrupt:
        code = -signal.SIGINT
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    import atexit

    atexit._run_exitfuncs()  # what a fresh interpreter runs at exit (e.g. the benchmarks' CPU report)
    if code == -signal.SIGINT:  # as CPython ends on an uncaught KeyboardInterrupt: by the signal
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    return code


def _redraw_random_states() -> None:
    import random

    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()


# ---------------------------------------------------------------------- the supervisor's side
class ForkedStage:
    """A stage forked by the server: what the supervisor uses of `subprocess.Popen`."""

    def __init__(self, server: StageForkServer, pid: int):
        self.server, self.pid = server, pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.server.status_of(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"stage {self.pid}", timeout)
            time.sleep(0.02)
        return self.returncode


class StageForkServer:
    """Starts the server process with `env` (its imports read it: OMP_NUM_THREADS, PYTHONPATH hooks) and forks
    stages from it. `close()` ends it after its children (call it once the stages are stopped)."""

    def __init__(self, env: dict, cwd: str | os.PathLike | None = None):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "opd_cache.launch.forkserver"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            cwd=cwd,
            start_new_session=True,  # a Ctrl-C of the terminal reaches the supervisor, which stops the stages
        )
        self._started: queue.Queue[int | None] = queue.Queue()
        self._statuses: dict[int, int] = {}
        self._lock = threading.Lock()
        self.alive = True
        self._reader = threading.Thread(target=self._read_replies, name="opd-forkserver-replies", daemon=True)
        self._reader.start()

    def _read_replies(self) -> None:
        for line in self.proc.stdout:
            message = json.loads(line)
            if "started" in message:
                self._started.put(message["started"])
            elif "exited" in message:
                self._statuses[message["exited"]] = message["status"]
        self.alive = False
        self._started.put(None)  # a start waiting for its reply: the server is gone

    def start(
        self, module: str, args: list[str], env: dict, log_path: Path, cwd: str | os.PathLike | None = None
    ) -> ForkedStage:
        """Fork `python -m <module> <args>` with this environment, its output appended to `log_path`."""
        request = {"module": module, "args": args, "env": env, "log": str(log_path), "cwd": str(cwd or os.getcwd())}
        with self._lock:  # one request, one reply, in order
            if not self.alive:
                raise RuntimeError("the stage fork server has exited")
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
            self.proc.stdin.flush()
            try:
                pid = self._started.get(timeout=START_TIMEOUT_S)
            except queue.Empty:
                raise RuntimeError(f"the stage fork server did not fork within {START_TIMEOUT_S:.0f} s") from None
        if pid is None:
            raise RuntimeError(f"the stage fork server exited (status {self.proc.wait()})")
        return ForkedStage(self, pid)

    def status_of(self, pid: int) -> int | None:
        """The exit status of a forked stage, None while it runs (or while its end is not reported yet)."""
        if pid in self._statuses:
            return self._statuses[pid]
        if not self.alive:  # the server died: its children, orphaned, are no longer reported
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return self._statuses.setdefault(pid, -signal.SIGKILL)  # ended, status unknown
        return None

    def close(self, timeout: float = 30.0) -> None:
        """Let the server exit once its children have (they were stopped by the supervisor)."""
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._reader.join(5)


if __name__ == "__main__":
    serve()
