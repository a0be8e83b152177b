"""`opd inspect SHARD`: what is in a shard, for people (`--json` for machines); `opd inspect STORE`: the whole cache."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import typer
from rich.markup import escape

from opd_cache.cli.common import app, console, user_errors
from opd_cache.storage import layout
from opd_cache.storage.damage import DAMAGE_ERRORS, DamagedFiles
from opd_cache.storage.schema import (
    META_ENGINE,
    META_ENGINE_VERSION,
    META_MODEL_DTYPE,
    ROLLOUT,
    TARGET_FLAGS,
    flat_values,
    list_lengths,
    read_shard,
)
from opd_cache.storage.store import Store, parse_shard_id
from opd_cache.target_flags import EXCLUDED, GROUP_END, TOPK_VALID, describe_flags, excluded_rows


def open_shard(shard: str) -> tuple[Store, str, pa.Table, object]:
    """Open a shard given by path or URI, without run checks (inspect must work on any shard)."""
    parent, _, name = shard.rstrip("/").rpartition("/")
    store = Store(parent or ".")
    kind = store.fs.get_file_info(store.path(name)).type
    if kind == pafs.FileType.Directory:
        inside = sorted(i.base_name for i in store.list_files(name) if i.base_name.endswith(".arrow"))
        hint = f"; it holds {', '.join(inside)}: inspect one of them" if inside else ""
        raise ValueError(
            f"{shard} is a folder but not a store (no run.json): opd inspect takes a store (a folder with "
            f"run.json) or a shard (an .arrow file){hint}"
        )
    if kind == pafs.FileType.NotFound:
        raise FileNotFoundError(f"{shard} does not exist: opd inspect takes a store or a shard (an .arrow file)")
    table, meta = read_shard(store, name)
    return store, name, table, meta


def _find_store_root(shard: str) -> Store | None:
    """rollouts/v<version>/<id>.arrow and annotated/v<version>/<id>/<teacher>.arrow (or the flat layout before
    version partitions) live two to four levels below the store root."""
    path = Path(shard)
    for root in (path.parent.parent, path.parent.parent.parent, path.parent.parent.parent.parent):
        if Store(root).manifest.exists():
            return Store(root)
    return None


def describe_shard(shard: str) -> dict:
    _, _, table, meta = open_shard(shard)
    info = {
        "path": shard,
        "metadata": {k: v for k, v in vars(meta).items()},
        # every key as stored, whichever stage added it (engine, dtype, checksum, the rollout cursor, ...)
        "schema_metadata": schema_metadata(table),
        "rows": table.num_rows,
        "columns": table.schema.names,
    }
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
        if TARGET_FLAGS in table.schema.names:  # a teacher of another tokenizer (docs/cross-tokenizer.md)
            info["cross_tokenizer"] = flag_summary(flat_values(table[TARGET_FLAGS]), positions)
    return info


def flag_summary(flags: np.ndarray, lengths: np.ndarray) -> dict:
    """What a cross-tokenizer part's target_flags say: shares of positions with each term, groups, excluded rows."""
    kept = (flags & EXCLUDED) == 0
    n = max(int(kept.sum()), 1)
    return {
        "topk_valid_share": round(float(((flags & TOPK_VALID) != 0).sum()) / n, 4),
        "groups": int(((flags & GROUP_END) != 0).sum()),
        "student_tokens_per_group": round(n / max(int(((flags & GROUP_END) != 0).sum()), 1), 3),
        "excluded_rows": excluded_rows(flags, lengths),
    }


def schema_metadata(table: pa.Table) -> dict[str, str]:
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, v in (table.schema.metadata or {}).items()}


def load_decoder(path: str):
    """A tokenizer that decodes ids for display. A folder with tokenizer.json is read by the `tokenizers` library
    itself (milliseconds; the same text as transformers' fast tokenizer), not through transformers, whose import
    (torch with it) took most of inspect's 5-9 s; any other folder goes through load_tokenizer."""
    file = Path(path, "tokenizer.json")
    if file.is_file():
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(file))
    from opd_cache.tokenizer import load_tokenizer

    return load_tokenizer(path)


def _decode(tokenizer, ids) -> str:
    if tokenizer is None:
        return " ".join(map(str, ids))
    return tokenizer.decode(ids, skip_special_tokens=False)


def store_root(path: str) -> Store | None:
    """The store whose root `path` is (a folder or prefix holding run.json), else None."""
    store = Store(path)
    if store.fs.get_file_info(store.root).type == pafs.FileType.File:
        return None
    return store if store.manifest.exists() else None


def summarize_store(store: Store, on_file=None, damaged: DamagedFiles | None = None) -> dict:
    """Teachers, k, rows, tokens and bytes per token of the annotations, policy versions, codec, engines.

    Reads every shard once through the validated reader (so its cost grows with the store; `on_file(rel)`
    reports each one). Bytes per token are the stored bytes of a teacher's parts over the tokens they score.
    A damaged file stops it with a hint (storage/damage.py), or with `damaged.skip` is left out and counted.
    """
    run = store.manifest.require()
    damaged = damaged or DamagedFiles(store.uri)
    shards, parts = store.shards.dataset()
    rollout = {"shards": 0, "rows": 0, "response_tokens": 0, "bytes": 0}
    teachers: dict[str, dict] = {}
    for shard in shards:
        try:
            table, _ = read_shard(store, shard.path)
            rollout["shards"] += 1
            rollout["rows"] += table.num_rows
            rollout["response_tokens"] += int(list_lengths(table["response_ids"]).sum())
            rollout["bytes"] += max(shard.size, 0)
        except DAMAGE_ERRORS as e:
            damaged.met(shard.path, e)
        if on_file:
            on_file(shard.path)
        for teacher in sorted(parts.get(shard.shard_id, ())):
            rel = layout.annotated_path(shard.shard_id, teacher)
            try:
                part, meta = read_shard(store, rel)
            except DAMAGE_ERRORS as e:
                damaged.met(rel, e)
                continue
            t = teachers.setdefault(
                teacher,
                {
                    "parts": 0,
                    "rows": 0,
                    "tokens": 0,
                    "bytes": 0,
                    "decoded_bytes": 0,
                    "top_k": set(),
                    "topk_logprob_dtype": set(),
                    "engine": set(),
                    "codec": set(),
                    "policy_versions": set(),
                },
            )
            lp = part.schema.field("teacher_topk_logprobs").type.value_type
            t["parts"] += 1
            t["rows"] += part.num_rows
            t["tokens"] += int(list_lengths(part["teacher_token_logprob"]).sum())
            t["bytes"] += store.fs.get_file_info(store.path(rel)).size
            t["decoded_bytes"] += part.nbytes
            t["top_k"].add(meta.top_k)
            t["codec"].add(
                meta.codec if meta.codec == "none" else f"{meta.codec} v{meta.packed_version}"
            )  # annotate.codec
            t["topk_logprob_dtype"].add(np.dtype(lp.value_type.to_pandas_dtype()).name)
            t["policy_versions"].add(shard.policy_version)
            stored = {k.decode(): v.decode() for k, v in (part.schema.metadata or {}).items()}
            engine = " ".join(
                stored[key] for key in (META_ENGINE, META_ENGINE_VERSION, META_MODEL_DTYPE) if key in stored
            )
            if engine:
                t["engine"].add(engine)
            if on_file:
                on_file(rel)
    for t in teachers.values():
        # stored: the files as they are (with annotate.compression zstd/lz4, compressed; tiny parts are mostly
        # metadata); decoded: the columns in memory. Arrow IPC does not record its codec in the schema, so the
        # two side by side are what tells a compressed store from an uncompressed one.
        t["bytes_per_token"] = t["bytes"] / t["tokens"] if t["tokens"] else None
        t["decoded_bytes_per_token"] = t["decoded_bytes"] / t["tokens"] if t["tokens"] else None
        for key in ("top_k", "topk_logprob_dtype", "engine", "codec", "policy_versions"):
            t[key] = sorted(t[key])
    return {
        "store": store.path(""),
        "run_id": run.run_id,
        "student": run.student,
        "policy_versions": sorted({s.policy_version for s in shards}),
        "published_versions": store.policy_versions(),
        "published_dtype": _published_dtype(store),
        "rollouts": rollout,
        "teachers": teachers,
        "damaged": damaged.files,  # path -> reason, with --skip-damaged (else a damaged file stops the summary)
    }


def _published_dtype(store: Store) -> str | None:
    """The weights' dtype recorded in the newest version's config.json (train.publish_dtype, else the training one)."""
    latest = store.latest_version()
    if latest == 0:
        return None
    config = store.read_json(f"{layout.policy_dir(latest)}/config.json", default=None) or {}
    return config.get("dtype") or config.get("torch_dtype")


def print_store_summary(summary: dict) -> None:
    console.print(
        f"[bold]{escape(summary['store'])}[/] (run {escape(str(summary['run_id']))}, "
        f"student {escape(str(summary['student']))})",
        highlight=False,
        soft_wrap=True,
    )
    r = summary["rollouts"]
    versions = summary["policy_versions"]
    console.print(
        f"  rollouts: {r['shards']} shards, {r['rows']} rows, {r['response_tokens']} response tokens, "
        f"{r['bytes']} bytes",
        highlight=False,
    )
    console.print(
        f"  policy versions in rollouts: {_ranges(versions) or 'none'}; published: "
        f"{_ranges(summary['published_versions']) or 'none'}"
        + (f" ({summary['published_dtype']})" if summary.get("published_dtype") else ""),
        highlight=False,
    )
    if summary.get("damaged"):
        n = len(summary["damaged"])
        console.print(
            f"  damaged: {n} file{'s' if n != 1 else ''} left out (--skip-damaged): "
            f"{escape(', '.join(summary['damaged']))}; `opd verify {escape(summary['store'])}` says what is wrong "
            f"with each",
            highlight=False,
            soft_wrap=True,
        )
    if not summary["teachers"]:
        console.print("  no annotations yet (run `opd annotate`)", highlight=False)
    for name, t in summary["teachers"].items():
        bpt = (
            "-"
            if t["bytes_per_token"] is None
            else f"{t['bytes_per_token']:.1f} bytes/token stored, {t['decoded_bytes_per_token']:.1f} decoded"
        )
        console.print(
            f"  teacher {escape(name)}: k={'/'.join(map(str, t['top_k']))}, {t['parts']} parts, {t['rows']} rows, "
            f"{t['tokens']} tokens, {t['bytes']} bytes ({bpt}), codec {escape('/'.join(t['codec']))}, top-k log-probs "
            f"{'/'.join(t['topk_logprob_dtype'])}, versions "
            f"{_ranges(t['policy_versions'])}" + (f", engine {escape('; '.join(t['engine']))}" if t["engine"] else ""),
            highlight=False,
            soft_wrap=True,
        )


def _ranges(values: list[int], shown: int = 8) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'; past `shown` ranges, the first and last few and a count (--json lists all).

    A long run's annotations skip versions irregularly (a shard per step, expired ones never annotated), which
    would print hundreds of ranges.
    """
    out, start = [], None
    for i, v in enumerate(values):
        if start is None:
            start = v
        if i + 1 == len(values) or values[i + 1] != v + 1:
            out.append(str(start) if start == v else f"{start}-{v}")
            start = None
    if len(out) > shown:
        half = shown // 2
        return f"{', '.join(out[:half])}, …, {', '.join(out[-half:])} ({len(values)} versions in {len(out)} ranges)"
    return ", ".join(out)


@app.command("inspect")
@user_errors
def inspect_command(
    shard: str = typer.Argument(
        ...,
        metavar="STORE|SHARD",
        help="Path or URI of a rollout or annotated shard (.arrow), or of a store "
        "(a folder with run.json) for a summary of the whole cache.",
    ),
    sample: int = typer.Option(0, "--sample", help="Which row to show."),
    tokenizer_path: str | None = typer.Option(
        None, "--tokenizer", help="Tokenizer to decode ids (default: the run's student)."
    ),
    teacher: str | None = typer.Option(None, "--teacher", help="Teacher part to show per token (default: the first)."),
    as_json: bool = typer.Option(False, "--json", help="Print machine-readable JSON."),
    skip_damaged: bool = typer.Option(
        False, "--skip-damaged", help="With a store: leave damaged files out of the summary (counted)."
    ),
) -> None:
    """Print a shard's metadata, row and token counts, and one sample; or, given a store, a summary of it."""
    store_given = store_root(shard)
    if store_given is not None:
        summary = summarize_store(store_given, damaged=DamagedFiles(shard, skip=skip_damaged))
        if as_json:
            print(json.dumps(summary))
        else:
            print_store_summary(summary)
        return
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
    run = store.manifest.read() if store else None
    tok_path = tokenizer_path or (run.student if run else None)
    if tok_path and not tokenizer_path and not Path(tok_path).exists():
        tok_path = None  # a hub id: decoding is a convenience, never a reason to go to the network
    if tok_path:
        try:
            tokenizer = load_decoder(tok_path)
        except Exception:  # decoding is a convenience; ids are still shown
            tokenizer = None

    # escape(): shard names, metadata, ids and decoded text are the user's data, never Rich markup ("[/b]" in a
    # response would otherwise vanish or raise a MarkupError)
    console.print(f"[bold]{escape(shard)}[/]")
    for key, value in info["schema_metadata"].items():
        console.print(f"  {escape(f'{key:28s}')} {escape(str(value))}", highlight=False)
    console.print(f"  {'rows':28s} {info['rows']}")
    for key in ("prompt_tokens", "response_tokens", "response_tokens_mean", "finish_reasons", "cross_tokenizer"):
        if key in info:
            console.print(f"  {key:28s} {escape(str(info[key]))}")
    if row is None:
        return
    console.print(f"\n[bold]sample {sample}[/] ({escape(str(row['sample_id']))})")
    if meta.kind == ROLLOUT:
        console.print(f"  prompt:   {escape(repr(_decode(tokenizer, row['prompt_ids'])))}", highlight=False)
        console.print(f"  response: {escape(repr(_decode(tokenizer, row['response_ids'])))}", highlight=False)
        lp = np.array(row["behavior_logprobs"], dtype=np.float64)
        if len(lp):
            console.print(f"  behavior log-prob: sum {lp.sum():.3f}, mean {lp.mean():.3f}")
        part = _teacher_part(store, meta.shard_id, teacher) if store else None
        if part is not None:
            print_token_view(row, part, tokenizer)
    else:
        lp = np.array(row["teacher_token_logprob"], dtype=np.float64)
        console.print(f"  positions: {len(lp)}; teacher log-prob of sampled tokens: sum {lp.sum():.3f}")
        rollout_row = _rollout_row(store, meta.shard_id, row["sample_id"]) if store else None
        if rollout_row is not None:  # the sampled text, and the per-token view against this part
            console.print(f"  prompt:   {escape(repr(_decode(tokenizer, rollout_row['prompt_ids'])))}", highlight=False)
            console.print(
                f"  response: {escape(repr(_decode(tokenizer, rollout_row['response_ids'])))}", highlight=False
            )
            print_token_view(rollout_row, (meta.teacher or "teacher", table), tokenizer)
        elif len(lp):  # no rollout shard beside the part: the teacher's own first choice at each position
            top1 = [ids[0] for ids in row["teacher_topk_ids"]]
            console.print(
                f"  teacher's top-1 token per position: {escape(repr(_decode(tokenizer, top1)))}", highlight=False
            )


def _rollout_row(store: Store, shard_id: str, sample_id: str) -> dict | None:
    """The rollout row an annotated row scores (None when the rollout shard is not in this store)."""
    # the partitioned layout, then the flat one of stores not yet migrated (inspect reads any store)
    for rel in (layout.rollout_path(shard_id), layout.flat_rollout_path(shard_id)):
        try:
            table, _ = read_shard(store, rel)
            break
        except (FileNotFoundError, ValueError):
            continue
    else:
        return None
    ids = table["sample_id"].to_pylist()
    return table.slice(ids.index(sample_id), 1).to_pylist()[0] if sample_id in ids else None


def _teacher_part(store: Store, shard_id: str, teacher: str | None) -> tuple[str, dict] | None:
    """The annotated row of the same sample, if a teacher has annotated this shard."""
    teachers = sorted(store.shards.annotated_parts([parse_shard_id(shard_id)[0]]).get(shard_id, ()))  # its partition
    if teacher is not None and teacher not in teachers:
        raise ValueError(f"--teacher {teacher}: shard {shard_id} has parts from {teachers or 'no teacher'}")
    if not teachers:
        return None
    name = teacher or teachers[0]
    table, _ = read_shard(store, layout.annotated_path(shard_id, name))
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
        console.print(f"  (teacher {escape(name)} did not annotate this sample: it is routed to another teacher)")
        return
    ann = table.slice(ids.index(row["sample_id"]), 1).to_pylist()[0]
    flags = ann.get(TARGET_FLAGS)  # cross-tokenizer: a group's student and teacher log-probs at its last position
    view = Table(
        title=f"per-token view, teacher {escape(repr(name))} (gap = teacher − student log-prob)", show_lines=False
    )
    columns = ("t", "token", "student", "teacher", "gap", "teacher's top alternatives")
    if flags is not None:
        columns = ("t", "token", "flags", "group text", "student", "teacher", "gap", "teacher's top alternatives")
    for col in columns:
        view.add_column(
            col, justify="left" if col in ("token", "group text", "teacher's top alternatives") else "right"
        )
    decode = (lambda i: escape(repr(tokenizer.decode([i])))) if tokenizer is not None else str
    group_start = 0
    for t, token in enumerate(row["response_ids"]):
        s, p = row["behavior_logprobs"][t], ann["teacher_token_logprob"][t]
        cross = []
        if flags is not None:
            ends = bool(flags[t] & (GROUP_END | EXCLUDED))
            span = row["response_ids"][group_start : t + 1]
            s = float(np.sum(row["behavior_logprobs"][group_start : t + 1])) if ends else float("nan")
            p = float("nan") if flags[t] & EXCLUDED else p  # a row the alignment refused: no teacher target
            text = escape(repr(tokenizer.decode(span)) if tokenizer is not None else str(span)) if ends else ""
            cross = [describe_flags(flags[t]), text]
            group_start = t + 1 if ends else group_start
        gap = p - s
        colour = "green" if gap > -0.5 else "yellow" if gap > -2.0 else "red"
        alternatives = ", ".join(
            f"{decode(i)} {np.exp(lp):.2f}"
            for i, lp in zip(ann["teacher_topk_ids"][t][:3], ann["teacher_topk_logprobs"][t][:3])
        )
        view.add_row(
            str(t),
            f"[{colour}]{decode(token)}[/]",
            *cross,
            f"{s:.3f}",
            f"{p:.3f}",
            f"[{colour}]{gap:+.3f}[/]",
            alternatives,
        )
    console.print(view)
