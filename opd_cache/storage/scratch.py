"""Local temp folders that a killed process does not leak for long.

The stages download policy versions and resume states from an object store, and build publications, in temp
folders; with a real model each one is a model copy. A SIGKILL (a preempted node, the OOM killer, the chaos
tests) skips every `finally` and `TemporaryDirectory` cleanup, and a supervisor that restarts the worker then
leaks one copy per kill until /tmp is full. So every such folder's name carries this host and process id
(`opd-rollout-policy-<host>-ns<pid namespace>-pid<N>-<random>`), and the next process that makes a folder of the
same kind removes the ones whose process is gone. Only folders of this host and pid namespace are judged: a /tmp
shared with other machines, or with containers of the same hostname in their own pid namespaces (a pod's
containers), is left alone for them.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import socket
import tempfile
from pathlib import Path


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def _pid_namespace() -> str:
    """The inode of this process's pid namespace (Linux); "0" where there is no /proc."""
    try:
        return re.sub(r"\D", "", os.readlink("/proc/self/ns/pid")) or "0"
    except OSError:
        return "0"


def owned_temp_prefix(kind: str) -> str:
    """A `prefix=` for tempfile naming this host, pid namespace and process; first removes the folders of `kind`
    left by a process of the same host and namespace that died without removing them. `kind`: like "opd-eval-"."""
    host = re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname())
    own = f"{kind}{host}-ns{_pid_namespace()}-pid"
    root = Path(tempfile.gettempdir())
    for folder in root.glob(f"{glob.escape(own)}*-*"):
        match = re.fullmatch(re.escape(own) + r"(\d+)-[^/]*", folder.name)
        if match and int(match.group(1)) != os.getpid() and not _alive(int(match.group(1))):
            shutil.rmtree(folder, ignore_errors=True)
    return f"{own}{os.getpid()}-"
