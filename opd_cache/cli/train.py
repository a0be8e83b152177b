"""`opd train`: train the student on annotated shards (single process, or under torchrun).

opd train runs/demo --max-steps 200 --lr 2e-3
torchrun --nproc_per_node 2 -m opd_cache.cli train runs/demo ...
"""

from __future__ import annotations

from opd_cache.cli.common import app, console, open_store, user_errors
from opd_cache.cli.config_flags import ConfigArgs, config_flags


@app.command("train")
@user_errors
@config_flags("train", sections=("store", "train"), own_section="train", top_level=("max_staleness",))
def train_command(args: ConfigArgs) -> None:
    """Train the student on annotated shards; publish policy versions; resume from the last state."""
    cfg = args.resolve()
    from opd_cache.train import run_train

    run_train(cfg, open_store(cfg), console=console)
