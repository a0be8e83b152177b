"""`opd migrate STORE`: move a store's shards from the flat layout into version partitions.

Earlier opd_cache versions wrote `rollouts/<shard>.arrow` and `annotated/<shard>/<teacher>.arrow`; shards now
live under their policy version (`rollouts/v000003/<shard>.arrow`, `annotated/v000003/<shard>/<teacher>.arrow`)
so that a poll lists only the versions it can use. The stages refuse a flat store with a message naming this
command. Run it once, with no stage running; it can be interrupted and run again (a file already in place is
not copied twice, and the rollout shards move last, so the stages refuse the store until everything moved).
"""

from __future__ import annotations

import typer

from opd_cache.cli.common import StoreAliasOpt, app, console, one_store, store_arg, user_errors
from opd_cache.storage import layout
from opd_cache.storage.layout import ANNOTATED


def flat_layout_moves(store) -> list[tuple[str, str]]:
    """(old, new) store-relative paths of every shard and part still in the flat layout; parts first."""
    moves = []
    prefix = store.path(ANNOTATED) + "/"
    for info in store.list_files(ANNOTATED, recursive=True):
        names = info.path[len(prefix) :].split("/")
        if len(names) == 2 and names[1].endswith(".arrow"):
            shard_id, teacher = names[0], names[1][: -len(".arrow")]
            try:
                moves.append((layout.flat_annotated_path(shard_id, teacher), layout.annotated_path(shard_id, teacher)))
            except ValueError:
                continue  # not a shard's part: left where it is
    moves += [
        (s.path, layout.rollout_path(s.shard_id))
        for s in store.shards.rollouts()
        if s.path != layout.rollout_path(s.shard_id)
    ]
    return moves


@app.command("migrate")
@user_errors
def migrate_command(
    store: str | None = store_arg(),
    store_option: str | None = StoreAliasOpt,
    dry_run: bool = typer.Option(False, "--dry-run", help="Only say how many files would move."),
) -> None:
    """Move shards written in the flat layout of earlier versions into version partitions (once, stages stopped)."""
    from opd_cache.storage.store import Store

    s = Store(one_store("migrate", store, store_option))
    s.manifest.require()
    moves = flat_layout_moves(s)
    if dry_run or not moves:
        console.print(
            f"{s.uri}: {len(moves)} files to move into version partitions"
            + ("" if moves else " (the store is already in the partitioned layout)"),
            highlight=False,
            soft_wrap=True,
        )
        return
    for i, (old, new) in enumerate(moves, 1):
        s.move_file(old, new)  # object stores: copy, then delete (a run cut short is finished by the next)
        if i % 1000 == 0 or i == len(moves):
            console.print(f"moved {i}/{len(moves)} files", highlight=False, soft_wrap=True)
    for leftover in s.list_dirs(ANNOTATED):  # the emptied flat part folders (local stores; S3 has none)
        folder = layout.annotated_folder(leftover)
        if not s.list_files(folder, recursive=True) and "-" in leftover:
            s.delete_dir(folder)
    console.print(f"{s.uri}: moved {len(moves)} files into version partitions", highlight=False, soft_wrap=True)
