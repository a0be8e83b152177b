"""Damaged files met by the commands that read a whole store: `opd inspect STORE`, `opd export`, `opd replay`.

A damaged or unreadable shard (a failed checksum, a truncated file, a listed file gone, a part this version
cannot decode) stops such a command with one line that names the file, says that `opd verify STORE` lists every
damaged file, and offers `--skip-damaged`. With `--skip-damaged` the command leaves those files out and counts
them in its output. (The stages themselves quarantine a damaged shard and produce it again:
docs/reliability.md.)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from opd_cache.storage.columns import ShardError

# what reading a shard raises for a file that is damaged or cannot be read (ShardError names the file)
DAMAGE_ERRORS = (ShardError, FileNotFoundError)


class DamagedFileError(ShardError):
    """A damaged file stopped a whole-store command; the message names it and the two ways on."""


@dataclass
class DamagedFiles:
    """The damaged files one command met: refused (the default) or, with `skip`, recorded and left out."""

    store_uri: str
    skip: bool = False
    files: dict[str, str] = field(default_factory=dict)  # path in the store -> what is wrong with it

    def met(self, path: str, error: Exception) -> None:
        """Call in an `except DAMAGE_ERRORS` block: raises DamagedFileError unless skipping, else records it."""
        reason = " ".join(str(error).split()) or type(error).__name__
        if not self.skip:
            raise DamagedFileError(
                f"{reason}; `opd verify {self.store_uri}` lists every damaged file, and --skip-damaged goes on "
                f"without them"
            ) from None
        self.files.setdefault(path, reason)
