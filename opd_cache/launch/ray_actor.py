"""The body of every `opd run --launcher ray` actor: one stage command run as its child process.

Ray imports this module in each actor's worker process (the class is pickled by reference), so it imports the
standard library only: `opd_cache.config` pulls in torch (2 s of CPU each), and an actor needs none of it, its
stage command imports what the stage needs. ray_launcher.py creates the actors and supervises them.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path


def prepare_stage_process() -> None:
    """In the child, before exec: SIGKILL it when the actor's process dies (no orphaned stage processes), and
    unblock every signal: Ray runs actor methods with SIGINT blocked, a child inherits its thread's signal
    mask across exec, and the stage would never see `interrupt`'s Ctrl-C (it stays pending for ever). SIGINT's
    handler goes back to the default too: a Ray started from a background shell job (`cmd &`) inherits SIGINT
    ignored, and a Python started with SIGINT ignored never installs its KeyboardInterrupt handler."""
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])


class StageWorker:
    """Runs one stage command to its end; a failure kills the actor (Ray restarts it).

    Two threads (`max_concurrency=2`): `run` waits for the command, `interrupt` may come meanwhile.
    """

    def __init__(self, name: str, argv: list[str], log_path: str, config_path: str, config_text: str, env: dict):
        self.name, self.argv, self.log_path = name, argv, Path(log_path)
        self.config_path, self.config_text, self.env = Path(config_path), config_text, env
        self.proc: subprocess.Popen | None = None
        self.interrupted = False

    def node_ip(self) -> str:
        import ray

        return ray.util.get_node_ip_address()

    def free_port(self) -> int:
        with socket.socket() as s:
            s.bind((self.node_ip(), 0))
            return s.getsockname()[1]

    def run(self, extra_env: dict | None = None) -> int:
        if not self.config_path.exists():  # another node: the resolved config is written where the command expects it
            self.config_path.parent.mkdir(parents=True, exist_ok=True)
            self.config_path.write_text(self.config_text)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        if self.interrupted:  # scaled away before its command started
            return 0
        argv = [sys.executable, *self.argv[1:]]  # this node's python
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **self.env, **(extra_env or {})},
                preexec_fn=prepare_stage_process,
            )
        import ray

        node = ray.get_runtime_context().get_node_id()
        with open(self.log_path.with_suffix(".pids"), "a") as f:  # one line per start: restarts and places visible
            f.write(f"{os.getpid()} {self.proc.pid} {node}\n")
        code = self.proc.wait()
        if code != 0 and not self.interrupted:
            print(f"{self.name}: exited with status {code}", file=sys.stderr, flush=True)
            os._exit(1)  # an actor death: Ray restarts the actor and re-runs this method (max_restarts)
        return code

    def interrupt(self) -> bool:
        """Ask the command to stop as on Ctrl-C (scale-down): rollout flushes its rows, annotate releases its
        lease (the `with lease:` block exits), so nothing waits for an expiry. `run` then returns instead of
        failing. False when the command has not started (the launcher kills the actor at once)."""
        self.interrupted = True
        if self.proc is None or self.proc.poll() is not None:
            return False
        self.proc.send_signal(signal.SIGINT)
        return True
