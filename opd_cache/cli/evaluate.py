"""`opd eval`: accuracy (strict and lenient parsers) and teacher–student KL of a checkpoint or a store; `opd
eval-agent`: the same for an agent run (tool-call success too; opd_cache/evaluate_agent.py)."""

from __future__ import annotations

import json
import signal
import tempfile
from dataclasses import asdict
from pathlib import Path

import typer

from opd_cache.cli.common import StoreAliasOpt, app, console, one_store, store_arg, user_errors
from opd_cache.cli.config_flags import ConfigArgs, config_flags
from opd_cache.storage.layout import RUN_JSON
from opd_cache.storage.scratch import owned_temp_prefix
from opd_cache.storage.store import Store


def _interrupt(signum, frame):
    raise KeyboardInterrupt


@app.command("eval")
@user_errors
@config_flags("eval", sections=("eval",), own_section="eval")
def eval_command(
    model: str = typer.Option(..., "--model", help="Checkpoint folder, or a store (evaluates its newest version)."),
    device: str = typer.Option("auto", "--device"),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
    follow: bool = typer.Option(
        False,
        "--follow",
        help="With a store: evaluate each published version into metrics/eval-0.jsonl until training is done.",
    ),
    every: int = typer.Option(1, "--every", help="With --follow: every N-th version (and the last)."),
    *,
    args: ConfigArgs,
) -> None:
    """Evaluate a student on held-out prompts."""
    from opd_cache.evaluate import (
        evaluate_model,
        evaluate_store,
        first_prompts,
        load_teacher,
        model_store,
        resolve_model,
    )
    from opd_cache.models import check_model_path
    from opd_cache.observe.tracking import Tracker
    from opd_cache.tasks.prompts import check_prompts_path, load_prompts
    from opd_cache.tokenizer import load_tokenizer

    n, greedy = args.flags.get("eval.n"), args.flags.get("eval.greedy")
    if n is not None and n > 1:
        if greedy:
            raise ValueError("--n > 1 needs --sample (greedy decoding gives the same answer n times)")
        args.flags["eval.greedy"] = False  # --n 3 alone: sample
    full = args.resolve()
    cfg = full.eval
    if cfg.prompts is None:
        raise ValueError("--prompts is required (or eval.prompts in --config)")
    if follow and not Path(model, "config.json").exists():
        # `opd run` starts the evaluator with the other stages: the store's run.json comes with the first rollout
        # worker (the evaluator's imports are done meanwhile, and its baseline, version 0, shows early)
        Store(model, s3_endpoint=full.store.s3_endpoint).manifest.wait(2.0, say=console.print)
    # missing local inputs: one clear line before any tokenizer, prompt file or model loads
    if "://" not in model and not Path(model, RUN_JSON).exists():
        check_model_path(model, "--model")
    check_prompts_path(cfg.prompts)
    if follow:  # each version is checked out in turn (evaluate_store): nothing to download here
        store = model_store(model, s3_endpoint=full.store.s3_endpoint)
        if store is None:
            raise ValueError("--follow needs --model to be a store (a folder with run.json, or a URI)")
        # train.report_to: the evaluator logs its results to the run's trackers too, as job "eval"
        tracker = (
            Tracker(
                full.train.report_to,
                store=store,
                run_id=store.manifest.require()["run_id"],
                job="eval",
                config=full.model_dump(mode="json"),
            )
            if full.train.report_to
            else None
        )
        previous = signal.getsignal(signal.SIGTERM)
        if tracker is not None:  # `opd run` stops its stages with SIGTERM: close the tracker (W&B flushes) first
            signal.signal(signal.SIGTERM, _interrupt)
        try:
            evaluate_store(
                store,
                cfg.prompts,
                teacher_path=cfg.teacher,
                max_prompts=cfg.max_prompts,
                max_new_tokens=cfg.max_new_tokens,
                every=every,
                device=device,
                echo=lambda line: console.print(line, highlight=False),
                tracker=tracker,
            )
        finally:
            if tracker is not None:
                tracker.close()
                signal.signal(signal.SIGTERM, previous)
        return
    # a remote store's version is downloaded for this evaluation only
    with tempfile.TemporaryDirectory(prefix=owned_temp_prefix("opd-eval-")) as downloads:
        path, version, store = resolve_model(model, full.store.s3_endpoint, download_to=Path(downloads))
        tokenizer = load_tokenizer(path)
        prompt_set = first_prompts(load_prompts(cfg.prompts, tokenizer), cfg.max_prompts)
        teacher_model = load_teacher(cfg.teacher, tokenizer, device) if cfg.teacher else None
        result = evaluate_model(
            path,
            prompt_set,
            tokenizer,
            teacher=teacher_model,
            n=cfg.n,
            greedy=cfg.greedy,
            max_new_tokens=cfg.max_new_tokens,
            device=device,
        )
        # a remote store's download is removed on return: name the store's URI, which still means something
        shown = model if "://" in model else str(path)
        out = {"model": shown, "version": version, **asdict(result)}
        if as_json:
            print(json.dumps(out))
            return
        console.print(f"[bold]{shown}[/]" + (f" (version {version})" if version is not None else ""))
        console.print(
            f"  prompts {result.num_prompts} × {result.n}   strict {result.strict:.3f}   "
            f"lenient {result.lenient:.3f}" + (f"   KL {result.kl:.4f}" if result.kl is not None else "")
        )
        console.print(f"  first answer: {result.example!r}", highlight=False)


@app.command("eval-agent")
@user_errors
def eval_agent_command(
    store: str | None = store_arg(
        "The agent run's store or a checkpoint to evaluate (default: the config's store.uri)."
    ),
    store_option: str | None = StoreAliasOpt,
    config: Path = typer.Option(..., "--config", help="The agent run's config (rollout.agent, annotate.teacher)."),
    prompts: str = typer.Option("data/arithmetic/test.parquet", "--prompts", help="Held-out prompts."),
    max_prompts: int = typer.Option(200, "--max-prompts"),
    device: str = typer.Option("auto", "--device"),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
    check: bool = typer.Option(False, "--check", help="Exit 1 when the bar is not met."),
) -> None:
    """Evaluate an agent student: tool-call success, final-answer accuracy and KL at its trained positions, for the
    teacher, the student before training and the newest policy (docs/agents.md)."""
    from opd_cache.config import load_config
    from opd_cache.evaluate_agent import evaluate_agent_run, format_table
    from opd_cache.tasks.prompts import check_prompts_path

    if not config.exists():
        raise ValueError(f"--config {config} does not exist")
    check_prompts_path(prompts)
    model = one_store("eval-agent", store, store_option) if (store or store_option) else None  # None: store.uri
    report = evaluate_agent_run(load_config(config), prompts, model=model, max_prompts=max_prompts, device=device)
    if as_json:
        print(json.dumps(report))
    else:
        print(format_table(report))
    if check and not report["bar"]["passed"]:
        raise typer.Exit(1)
