"""Published policy versions as rollout loads them: checked against their checksums, downloaded when remote."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from opd_cache.storage import layout
from opd_cache.storage.integrity import legacy_warning, verify_local_folder
from opd_cache.storage.scratch import owned_temp_prefix
from opd_cache.storage.store import Store
from opd_cache.tokenizer import load_tokenizer, tokenizer_fingerprint


class CorruptPolicyError(ValueError):
    """A published policy version whose files fail their checksums: never loaded."""


class PolicyFiles:
    """Local folders of published policy versions (remote stores: downloaded to a temporary cache).

    Every version is checked against its `_CHECKSUMS.json` before its path is handed out; the files that
    fail are quarantined and the version is refused (CorruptPolicyError), so damaged weights are never loaded.
    """

    RETRY_SECONDS = 30.0  # a refused version is checked again after this long (the trainer may re-publish it)

    def __init__(self, store: Store, student: str):
        self.store, self.student = store, student
        self.cache_dir: str | None = None
        self.refused: dict[int, float] = {}  # version -> when it failed its checksum

    def path(self, version: int) -> str:
        if version == 0:
            return self.student
        rel = layout.policy_dir(version)
        in_store = self.store.local_dir(rel)  # a local store: loaded in place
        if in_store is not None:
            path = str(in_store)
        else:
            if self.cache_dir is None:
                self.cache_dir = tempfile.mkdtemp(prefix=owned_temp_prefix("opd-rollout-policy-"))
            path = str(self.store.download_dir(rel, os.path.join(self.cache_dir, f"v{version:06d}")))
        problems = verify_local_folder(Path(path))  # the bytes about to be loaded (remote: the downloaded copy)
        if problems is None:
            legacy_warning("policy version", self.store.path(rel))
        elif problems:
            self.release(version)
            for problem in problems:
                if problem.status == "corrupt" and self.store.exists(f"{rel}/{problem.name}"):
                    self.store.quarantine(f"{rel}/{problem.name}", problem.reason)
            self.refused[version] = time.monotonic()
            raise CorruptPolicyError(
                f"policy version {version} is not loaded: {problems[0].reason}"
                + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else "")
                + ": quarantined"
            )
        self.refused.pop(version, None)
        return path

    def worth_trying(self, version: int) -> bool:
        failed_at = self.refused.get(version)
        return failed_at is None or time.monotonic() - failed_at >= self.RETRY_SECONDS

    def newest_intact(self, latest: int) -> tuple[int, str]:
        """(version, path) of the newest published version <= `latest` that passes its checksums (0: the student)."""
        for version in range(latest, 0, -1):
            if not self.store.is_published(version):
                continue
            try:
                return version, self.path(version)
            except CorruptPolicyError as e:
                print(f"warning: {e}; trying the previous version", file=sys.stderr)
        return 0, self.path(0)

    def release(self, version: int) -> None:
        """Forget a downloaded copy once its weights are loaded."""
        if self.cache_dir is not None and version > 0:
            shutil.rmtree(os.path.join(self.cache_dir, f"v{version:06d}"), ignore_errors=True)

    def close(self) -> None:
        if self.cache_dir is not None:
            shutil.rmtree(self.cache_dir, ignore_errors=True)


def check_policy_tokenizer(path: str, fingerprint: str, version: int) -> None:
    if any(os.path.isfile(os.path.join(path, name)) for name in ("tokenizer.json", "tokenizer_config.json")):
        found = tokenizer_fingerprint(load_tokenizer(path))
        if found != fingerprint:
            raise ValueError(f"policy version {version} ({path}) has tokenizer {found}, this run uses {fingerprint}")
