"""`opd inspect SHARD`: what is in a shard, for people (`--json` for machines)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import numpy as np
import pyarrow as pa
import typer

from opd_cache.cli.common import app, console, user_errors
from opd_cache.schema import ROLLOUT, list_lengths, read_shard
from opd_cache.store import Store


def open_shard(shard: str) -> tuple[Store, str, pa.Table, object]:
    """Open a shard given by path or URI, without run checks (inspect must work on any shard)."""
    parent, _, name = shard.rstrip("/").rpartition("/")
    store = Store(parent or ".")
    table, meta = read_shard(store, name)
    return store, name, table, meta


def _find_store_root(shard: str) -> Store | None:
    """rollouts/<id>.arrow and annotated/<id>/<teacher>.arrow live one or two levels below the store root."""
    path = Path(shard)
    for root in (path.parent.parent, path.parent.parent.parent):
        if (root / "run.json").exists():
            return Store(root)
    return None


def describe_shard(shard: str) -> dict:
    _, _, table, meta = open_shard(shard)
    info = {"path": shard, "metadata": {k: v for k, v in vars(meta).items()}, "rows": table.num_rows,
            "columns": table.schema.names}
    if meta.kind == ROLLOUT:
        prompt_len, response_len = list_lengths(table["prompt_ids"]), list_lengths(table["response_ids"])
        info["prompt_tokens"] = int(prompt_len.sum())
        info["response_tokens"] = int(response_len.sum())
        info["response_tokens_mean"] = float(response_len.mean()) if len(response_len) else 0.0
        finish = table["finish_reason"].value_counts().to_pylist()
        info["finish_reasons"] = {d["values"]: d["counts"] for d in finish}
    else:
        positions = list_lengths(table["teacher_token_logprob"])
        info["response_tokens"] = int(positions.sum())
    return info


def _decode(tokenizer, ids) -> str:
    if tokenizer is None:
        return " ".join(map(str, ids))
    return tokenizer.decode(ids, skip_special_tokens=False)


@app.command("inspect")
@user_errors
def inspect_command(
    shard: str = typer.Argument(..., help="Path or URI of a rollout or annotated shard (.arrow)."),
    sample: int = typer.Option(0, "--sample", help="Which row to show."),
    tokenizer_path: Optional[str] = typer.Option(None, "--tokenizer", help="Tokenizer to decode ids (default: the run's student)."),
    teacher: Optional[str] = typer.Option(None, "--teacher", help="Teacher part to show per token (default: the first)."),
    as_json: bool = typer.Option(False, "--json", help="Print machine-readable JSON."),
) -> None:
    """Print a shard's metadata, row and token counts, and one sample."""
    info = describe_shard(shard)
    _, _, table, meta = open_shard(shard)
    if table.num_rows and not 0 <= sample < table.num_rows:
        raise ValueError(f"--sample {sample}: the shard has rows 0..{table.num_rows - 1}")
    row = table.slice(sample, 1).to_pylist()[0] if table.num_rows else None
    if as_json:
        info["sample"] = row
        print(json.dumps(info, default=str))
        return

    tokenizer = None
    store = _find_store_root(shard)
    run = store.read_run() if store else None
    tok_path = tokenizer_path or (run or {}).get("student")
    if tok_path and not tokenizer_path and not Path(tok_path).exists():
        tok_path = None  # a hub id: decoding is a convenience, never a reason to go to the network
    if tok_path:
        try:
            from opd_cache.tokenizer import load_tokenizer

            tokenizer = load_tokenizer(tok_path)
        except Exception:  # decoding is a convenience; ids are still shown
            tokenizer = None

    console.print(f"[bold]{shard}[/]")
    for key, value in info["metadata"].items():
        console.print(f"  {key:22s} {value}")
    console.print(f"  {'rows':22s} {info['rows']}")
    for key in ("prompt_tokens", "response_tokens", "response_tokens_mean", "finish_reasons"):
        if key in info:
            console.print(f"  {key:22s} {info[key]}")
    if row is None:
        return
    console.print(f"\n[bold]sample {sample}[/] ({row['sample_id']})")
    if meta.kind == ROLLOUT:
        console.print(f"  prompt:   {_decode(tokenizer, row['prompt_ids'])!r}", highlight=False)
        console.print(f"  response: {_decode(tokenizer, row['response_ids'])!r}", highlight=False)
        lp = np.array(row["behavior_logprobs"], dtype=np.float64)
        if len(lp):
            console.print(f"  behavior log-prob: sum {lp.sum():.3f}, mean {lp.mean():.3f}")
        part = _teacher_part(store, meta.shard_id, teacher) if store else None
        if part is not None:
            print_token_view(row, part, tokenizer)
    else:
        lp = np.array(row["teacher_token_logprob"], dtype=np.float64)
        console.print(f"  positions: {len(lp)}; teacher log-prob of sampled tokens: sum {lp.sum():.3f}")
        if len(lp):
            top = row["teacher_topk_ids"][0][:5]
            console.print(f"  position 0 teacher top ids: {top}")


def _teacher_part(store: Store, shard_id: str, teacher: str | None) -> tuple[str, dict] | None:
    """The annotated row of the same sample, if a teacher has annotated this shard."""
    teachers = sorted(store.list_annotated_parts().get(shard_id, ()))
    if teacher is not None and teacher not in teachers:
        raise ValueError(f"--teacher {teacher}: shard {shard_id} has parts from {teachers or 'no teacher'}")
    if not teachers:
        return None
    name = teacher or teachers[0]
    table, _ = read_shard(store, store.annotated_path(shard_id, name))
    return name, table


def print_token_view(row: dict, part: tuple[str, pa.Table], tokenizer) -> None:
    """Each response token coloured by the teacher–student log-prob gap, with the teacher's top alternatives.

    gap = log p_teacher(token) − log q_student(token): red where the teacher finds the student's token
    much less likely than the student did — where the student diverges and the loss concentrates.
    """
    from rich.table import Table

    name, table = part
    ids = table["sample_id"].to_pylist()
    if row["sample_id"] not in ids:
        console.print(f"  (teacher {name} did not annotate this sample: it is routed to another teacher)")
        return
    ann = table.slice(ids.index(row["sample_id"]), 1).to_pylist()[0]
    view = Table(title=f"per-token view, teacher {name!r} (gap = teacher − student log-prob)", show_lines=False)
    for col in ("t", "token", "student", "teacher", "gap", "teacher's top alternatives"):
        view.add_column(col, justify="left" if col in ("token", "teacher's top alternatives") else "right")
    decode = (lambda i: repr(tokenizer.decode([i]))) if tokenizer is not None else str
    for t, token in enumerate(row["response_ids"]):
        s, p = row["behavior_logprobs"][t], ann["teacher_token_logprob"][t]
        gap = p - s
        colour = "green" if gap > -0.5 else "yellow" if gap > -2.0 else "red"
        alternatives = ", ".join(f"{decode(i)} {np.exp(lp):.2f}" for i, lp in
                                 zip(ann["teacher_topk_ids"][t][:3], ann["teacher_topk_logprobs"][t][:3]))
        view.add_row(str(t), f"[{colour}]{decode(token)}[/]", f"{s:.3f}", f"{p:.3f}", f"[{colour}]{gap:+.3f}[/]",
                     alternatives)
    console.print(view)
