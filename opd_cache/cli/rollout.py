"""`opd rollout`: sample student responses to prompts and publish them as rollout shards."""

from __future__ import annotations

import signal
import threading

from opd_cache.cli.common import app, console, err_console, open_store, user_errors
from opd_cache.cli.config_flags import ConfigArgs, config_flags


@app.command("rollout")
@user_errors
@config_flags("rollout", sections=("store", "rollout"), own_section="rollout", top_level=("max_staleness",))
def rollout_command(args: ConfigArgs) -> None:
    """Sample student responses to prompts and publish them as rollout shards."""
    from opd_cache.rollout import run_rollout
    from opd_cache.tasks.prompts import check_prompts_path

    cfg = args.resolve()
    if "store.uri" not in args.flags and cfg.store.uri == "store" and args.file is None:
        raise ValueError(
            "opd rollout needs a store: opd rollout STORE (a directory or URI for the run's shared storage; or --store)"
        )
    # missing local inputs: one clear line before the tokenizer, the prompts or the model load
    if cfg.rollout.prompts is not None:
        check_prompts_path(cfg.rollout.prompts)

    # SIGINT/SIGTERM: finish the current batch, flush what is buffered, exit. A second signal aborts.
    stop = threading.Event()

    def on_signal(signum, frame):
        if stop.is_set():
            raise KeyboardInterrupt
        console.print(f"{signal.Signals(signum).name}: flushing buffered rows, then stopping", highlight=False)
        stop.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        result = run_rollout(cfg, open_store(cfg), stop=stop, console=err_console)  # progress on stderr
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)

    skipped = (
        f"; skipped {result.skipped_prompts} prompts over {cfg.rollout.max_prompt_tokens} tokens"
        if result.skipped_prompts
        else ""
    )
    rate = result.tokens / result.generate_seconds if result.generate_seconds else 0.0
    console.print(
        f"rollout {cfg.rollout.worker_id}: wrote {len(result.shards)} shards, {result.samples} samples, "
        f"{result.tokens} tokens ({rate:.0f} tok/s sampling) at policy v{result.policy_version}; "
        f"{result.total_samples} samples in all, prompt cursor {result.cursor}{skipped}",
        highlight=False,
    )
