"""What must hold in a store after any number of SIGKILLs, checked from the store alone (docs/design.md §6).

`check_store` reads everything a run left behind and raises AssertionError
naming the first broken promise:

- no partial or unreadable file is visible: every rollout shard and annotated
  part validates (`read_shard`) and every part covers its rollout rows, every
  JSON / JSON-lines file parses, every published policy loads, every complete
  resume state loads in full; nothing was quarantined but the files the driver
  damaged, and each of those is quarantined or reported by `opd verify`
  (`check_damage`);
- policy versions: LATEST = N and the newest `keep_versions` up to it are there
  (retention deleted older ones, but for versions a rollout worker killed
  while holding them still pinned), each complete, no folder left half
  deleted; the newest resume state holds exactly the weights of version N;
- every trained sample_id is in exactly one rollout shard (the one its ledger
  line names) and in exactly one part of the teacher that trained it, and in
  the consumed ledger exactly once (steps 1..max_steps, full batches);
- every rollout row is trained, skipped as expired, or pending (in a shard the
  final stream cursor has not finished) — none vanished, none counted twice;
  the trainer's progress counters agree;
- each rollout worker's shards continue one another: sequence numbers without
  a gap, and the prompts they hold are exactly the worker's deterministic
  prompt stream from position 0, each prompt `n` times (a killed worker
  neither repeated nor skipped prompts).

`replay` is the determinism half: it writes the rows of each ledger step, in
ledger order, as one shard of a fresh local store and trains it with one
uninterrupted `opd train` (same configuration, staleness unbounded, no
--follow). The stream then hands out exactly the chaos run's batches, so
every policy version must equal the chaos run's (`compare_policies`).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from opd_cache.config import Config
from opd_cache.storage import layout
from opd_cache.storage.schema import ANNOTATED, ROLLOUT, ShardMeta, check_annotation_matches, read_shard, write_shard
from opd_cache.storage.store import COMPLETE_MARKER, TMP_MARKER, Store, iter_jsonl, make_shard_id
from opd_cache.train.checkpoint import complete_states, verify_ledger

REPLAY_WORKER = "replay"


# ---------------------------------------------------------------- reading the store
def _local_copy(store: Store, rel: str, scratch: Path) -> Path:
    """A local folder holding `rel` (the store's own folder when local)."""
    if store.is_local:
        return store.local_path(rel)
    return store.download_dir(rel, scratch / rel.replace("/", "_"))


def read_policy_weights(store: Store, version: int, scratch: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    folder = _local_copy(store, layout.policy_dir(version), scratch)
    weights = {}
    for path in sorted(folder.glob("*.safetensors")):
        weights.update(load_file(str(path)))
    assert weights, f"{store.path(layout.policy_dir(version))}: no safetensors weights"
    return weights


def read_state(store: Store, step: int, student: str) -> tuple[dict[str, torch.Tensor], dict]:
    """Load a complete resume state the way a resuming trainer does (`load_state`, every tensor of the model
    and of the optimizer); returns (the model's weights, trainer.json)."""
    from opd_cache.losses import LossConfig
    from opd_cache.models import load_causal_lm
    from opd_cache.train.checkpoint import load_state
    from opd_cache.train.objective import DistillationObjective

    model = load_causal_lm(student)
    objective = DistillationObjective(model, LossConfig())
    optimizer = torch.optim.AdamW(objective.parameters())
    trainer = load_state(store, step, objective, optimizer)
    assert optimizer.state, f"state {step}: no optimizer state"
    assert all(float(s["step"]) == step for s in optimizer.state.values()), f"state {step}: optimizer steps differ"
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, trainer


def ledger_lines(store: Store) -> dict[int, list[dict]]:
    """{step: the ledger lines of the rows trained at that step, in order}."""
    steps = {}
    for info in store.list_files(layout.TRAIN_CONSUMED):
        step = int(info.base_name.removeprefix("step-").removesuffix(".jsonl"))
        steps[step] = list(iter_jsonl(store.read_bytes(store.relative_path(info.path))))
    return dict(sorted(steps.items()))


# ---------------------------------------------------------------- the checks
def check_damage(store: Store, corrupted: list[dict], pristine: Path) -> dict:
    """The files the driver damaged: each is in quarantine/ with a checksum reason (a stage read it and
    recovered), or still in place and reported by `opd verify`'s check (nothing read it again); nothing else is
    quarantined or reported. Then the damaged files still in place get their pristine bytes back (a restore
    from backup), so that the other checks and the replay read what the stages trained on."""
    from opd_cache.storage.integrity import verify_store

    damaged = {c["rel"] for c in corrupted}
    quarantined = store.list_quarantine()
    for name, reason in quarantined.items():
        rel = next((r for r in damaged if r.replace("/", "__") == name), None)
        assert rel is not None, f"{name} was quarantined but never damaged: {reason}"
        assert any(
            why in reason
            for why in ("failed its checksum", "truncated or not an Arrow IPC stream", "invalid Arrow data")
        ), f"{name}: quarantined with reason {reason!r}"
    reported = {rel: reason for rel, _, reason in verify_store(store).problems}
    assert set(reported) <= damaged, f"opd verify reports files nobody damaged: {set(reported) - damaged}"
    in_place = [rel for rel in sorted(damaged) if rel in reported]
    for rel in sorted(damaged - set(reported)):
        if rel.replace("/", "__") in quarantined or not store.exists(rel):
            continue  # recovered from; or a resume state that keep_states deleted
        folder = rel.rsplit("/", 1)[0]
        if rel.startswith("train/state/") and not store.exists(f"{folder}/{COMPLETE_MARKER}"):
            continue  # a state being deleted when the damage landed: no state, never read
        raise AssertionError(f"{rel}: damaged, neither quarantined nor reported by opd verify")
    for rel in in_place:
        store.write_bytes(rel, (pristine / rel).read_bytes())
    return {"damaged": len(damaged), "quarantined": len(quarantined), "reported_by_verify": len(in_place)}


def check_store(
    store: Store, cfg: Config, scratch: Path, corrupted: list[dict] | None = None, pristine: Path | None = None
) -> dict:
    """Every promise of docs/design.md §6 about what a store holds; returns counts for the report."""
    run = store.manifest.require()
    stats: dict = {}
    stats["damage"] = check_damage(store, corrupted or [], pristine or scratch)
    quarantined = set(store.list_quarantine())

    # 1. Every visible file is complete and readable.
    all_files = store.list_files("", recursive=True)  # never lists *.tmp-* (nor anything inside a *.tmp-* folder)
    root = store.path("").rstrip("/") + "/"
    rels = [info.path[len(root) :] for info in all_files if not info.path[len(root) :].startswith("quarantine/")]
    for rel in rels:
        if rel.endswith(".json"):
            json.loads(store.read_bytes(rel))
        elif rel.endswith(".jsonl"):
            list(iter_jsonl(store.read_bytes(rel)))
    assert set(store.list_quarantine()) == quarantined, "files were quarantined besides the damaged ones"
    stats["files"] = len(rels)
    stats["tmp_left_over"] = _count_tmp(store)

    shards = store.shards.rollouts()
    tables: dict[str, pa.Table] = {}
    shard_of_sample: dict[str, list[str]] = defaultdict(list)
    for info in shards:
        table, meta = read_shard(store, info.path, kind=ROLLOUT, run=run)
        assert meta.shard_id == info.shard_id, f"{info.path}: metadata names shard {meta.shard_id}"
        tables[info.shard_id] = table
        for sid in table["sample_id"].to_pylist():
            shard_of_sample[sid].append(info.shard_id)
    repeated = {s: where for s, where in shard_of_sample.items() if len(where) > 1}
    assert not repeated, f"sample ids in more than one rollout shard: {list(repeated.items())[:3]}"

    parts = store.shards.annotated_parts()
    part_samples: dict[tuple[str, str], set[str]] = {}
    for shard_id, teachers in parts.items():
        assert shard_id in tables, f"annotated parts of {shard_id} have no rollout shard"
        for teacher in teachers:
            rel = layout.annotated_path(shard_id, teacher)
            table, meta = read_shard(store, rel, kind=ANNOTATED, run=run)
            assert meta.shard_id == shard_id and meta.teacher == teacher, f"{rel}: metadata names {meta}"
            assert not run.get("routing"), "this check assumes one teacher for every row"
            check_annotation_matches(tables[shard_id], table, store.path(rel))
            part_samples[(shard_id, teacher)] = set(table["sample_id"].to_pylist())
    stats["rollout_shards"], stats["annotated_parts"] = len(shards), len(part_samples)

    # 2. Policy versions and resume states.
    versions = store.policy_versions()
    stats["versions"] = versions
    expected_versions = cfg.train.max_steps // cfg.train.publish_every
    keep = cfg.train.keep_versions or expected_versions
    window = list(range(max(1, expected_versions - keep + 1), expected_versions + 1))
    assert versions[-len(window) :] == window, f"policy versions {versions}: the newest {keep} must be {window}"
    assert store.latest_version() == versions[-1], f"LATEST is {store.latest_version()}, newest is {versions[-1]}"
    incomplete = [d for d in store.list_dirs("policy") if not store.exists(f"policy/{d}/{COMPLETE_MARKER}")]
    assert not incomplete, f"policy folders without {COMPLETE_MARKER}: {incomplete}"
    from opd_cache.models import load_causal_lm
    from opd_cache.tokenizer import load_tokenizer, tokenizer_fingerprint

    for v in versions:
        folder = _local_copy(store, layout.policy_dir(v), scratch)
        load_causal_lm(str(folder))
        assert tokenizer_fingerprint(load_tokenizer(str(folder))) == run["tokenizer_fingerprint"]

    states = complete_states(store)  # a folder without the marker (an upload or a deletion cut short) is no state
    stats["incomplete_state_folders"] = len(store.list_dirs("train/state")) - len(states)
    assert states and states[-1] == cfg.train.max_steps, f"resume states {states}, expected {cfg.train.max_steps} last"
    trainer_json = None
    for step in states:
        weights, trainer_json = read_state(store, step, run["student"])
        assert trainer_json["step"] == step
    final_policy = read_policy_weights(store, versions[-1], scratch)
    for name, value in final_policy.items():
        assert torch.equal(weights[name], value), f"state {states[-1]} and version {versions[-1]} differ at {name}"
    stats["states"] = states

    # 3. The ledger: every step full, every trained row once, in its shard and in its teacher's part.
    ledger = ledger_lines(store)
    assert list(ledger) == list(range(1, cfg.train.max_steps + 1)), f"ledger steps {list(ledger)}"
    batch = cfg.train.global_batch_samples
    short = {step: len(lines) for step, lines in ledger.items() if len(lines) != batch}
    assert not short, f"ledger steps without {batch} rows: {short}"
    verdict = verify_ledger(store)
    assert not verdict["duplicates"], f"rows trained twice: {verdict['duplicates'][:5]}"
    assert not verdict["trained_and_skipped"], f"rows trained and skipped: {verdict['trained_and_skipped'][:5]}"
    teacher_parts = defaultdict(Counter)  # teacher -> sample id -> parts holding it
    for (shard_id, teacher), samples in part_samples.items():
        teacher_parts[teacher].update(samples)
    trained: dict[str, dict] = {}
    for lines in ledger.values():
        for line in lines:
            sid = line["sample_id"]
            where, teacher = shard_of_sample.get(sid), line["teacher"]
            assert where == [line["shard_id"]], f"{sid}: in rollout shards {where}, the ledger says {line['shard_id']}"
            assert teacher_parts[teacher][sid] == 1, f"{sid}: in {teacher_parts[teacher][sid]} parts of {teacher}"
            assert sid in part_samples[(line["shard_id"], line["teacher"])]
            trained[sid] = line
    stats["trained"] = len(trained)

    # 4. Conservation: trained + expired + pending = every rollout row, each exactly once.
    skipped = {}
    for info in store.list_files(layout.TRAIN_SKIPPED):
        for line in iter_jsonl(store.read_bytes(store.relative_path(info.path))):
            assert line["sample_id"] not in skipped, f"{line['sample_id']} skipped twice"
            skipped[line["sample_id"]] = line["reason"]
    assert set(skipped.values()) <= {"expired"}, f"unexpected skip reasons {Counter(skipped.values())}"
    cursor = trainer_json["cursor"]
    finished = set(cursor["finished"])
    all_rows = set(shard_of_sample)
    done_rows = {sid for sid in all_rows if shard_of_sample[sid][0] in finished}
    if cursor["current"]:
        current = tables[cursor["current"]]["sample_id"].to_pylist()
        done_rows |= set(current[: cursor["current_rows"]])
    accounted = set(trained) | set(skipped)
    assert accounted <= all_rows, f"ledger rows that are in no rollout shard: {sorted(accounted - all_rows)[:5]}"
    assert done_rows == accounted, (
        f"rows of finished shards neither trained nor expired: "
        f"{sorted(done_rows - accounted)[:5]}; trained or expired rows of unfinished "
        f"shards: {sorted(accounted - done_rows)[:5]}"
    )
    pending = all_rows - accounted
    progress = store.read_progress()
    assert progress["step"] == cfg.train.max_steps
    assert progress["consumed_samples"] == len(trained), (progress, len(trained))
    assert progress["expired_samples"] == len(skipped) == cursor["expired_samples"], (progress, len(skipped))
    stats.update(expired=len(skipped), pending=len(pending), rollout_rows=len(all_rows))

    # 5. Each rollout worker's prompt stream: no prompt repeated or skipped across restarts.
    stats["prompt_positions"] = _check_prompt_streams(store, shards, tables, cfg)
    return stats


def _count_tmp(store: Store) -> int:
    """`*.tmp-*` files and folders a SIGKILL left behind (invisible to every listing; local stores only)."""
    if not store.is_local:
        return 0
    return sum(1 for p in Path(store.root).rglob(f"*{TMP_MARKER}*"))


def _check_prompt_streams(store: Store, shards, tables: dict[str, pa.Table], cfg: Config) -> int:
    from opd_cache.rollout.prompt_stream import PromptStream
    from opd_cache.rollout.resume import META_CURSOR, META_NUM_PROMPTS, META_SEED
    from opd_cache.tasks.prompts import load_prompts
    from opd_cache.tokenizer import load_tokenizer

    n = cfg.rollout.n
    tokenizer = load_tokenizer(cfg.rollout.student)
    prompts = load_prompts(cfg.rollout.prompts, tokenizer, max_prompt_tokens=cfg.rollout.max_prompt_tokens)
    positions = 0
    for worker in sorted({s.worker for s in shards}):
        mine = sorted((s for s in shards if s.worker == worker), key=lambda s: s.seq)
        seqs = [s.seq for s in mine]
        assert seqs == list(range(len(mine))), f"worker {worker}: shard sequence numbers {seqs}"
        index = np.concatenate([tables[s.shard_id]["prompt_index"].to_numpy() for s in mine])
        sample_index = np.concatenate([tables[s.shard_id]["sample_index"].to_numpy() for s in mine])
        meta = {k.decode(): v.decode() for k, v in tables[mine[-1].shard_id].schema.metadata.items()}
        cursor = int(meta[META_CURSOR])
        assert int(meta[META_NUM_PROMPTS]) == len(prompts) and int(meta[META_SEED]) == cfg.rollout.seed
        assert len(index) == cursor * n, f"worker {worker}: {len(index)} rows for {cursor} prompts x {n}"
        stream = PromptStream(len(prompts), cfg.rollout.seed, worker)
        expected = np.asarray(prompts.row_index)[stream.take(0, cursor)]
        assert np.array_equal(index, np.repeat(expected, n)), f"worker {worker}: prompts repeated or skipped"
        assert np.array_equal(sample_index, np.tile(np.arange(n), cursor)), f"worker {worker}: sample indices"
        positions += cursor
    return positions


# ---------------------------------------------------------------- the replay
def build_replay_store(store: Store, replay_root: Path) -> Store:
    """A local store whose shard k holds the rows of ledger step k, in ledger order, with their annotations."""
    run = store.manifest.require()
    replay = Store(replay_root)
    manifest = {k: v for k, v in run.items() if k != "max_staleness"}  # the replay trains with unbounded staleness
    replay.write_json("run.json", manifest)
    for step, lines in ledger_lines(store).items():
        shard_id = make_shard_id(0, REPLAY_WORKER, step)
        sample_ids = pa.array([line["sample_id"] for line in lines], pa.string())
        (teacher,) = {line["teacher"] for line in lines}
        rollout_parts, annotated_parts = [], []
        for source in dict.fromkeys(line["shard_id"] for line in lines):  # source shards in ledger order
            rollout, _ = read_shard(store, layout.rollout_path(source), kind=ROLLOUT, run=run)
            part, part_meta = read_shard(store, layout.annotated_path(source, teacher), kind=ANNOTATED, run=run)
            mine = pc.filter(sample_ids, pc.is_in(sample_ids, value_set=rollout["sample_id"].combine_chunks()))
            rollout_parts.append(rollout.take(pc.index_in(mine, value_set=rollout["sample_id"].combine_chunks())))
            annotated_parts.append(part.take(pc.index_in(mine, value_set=part["sample_id"].combine_chunks())))
        rollout_table = pa.concat_tables(rollout_parts).replace_schema_metadata(None)
        annotated_table = pa.concat_tables(annotated_parts).replace_schema_metadata(None)
        assert rollout_table["sample_id"].to_pylist() == sample_ids.to_pylist()
        common = dict(
            run_id=run["run_id"],
            tokenizer_fingerprint=run["tokenizer_fingerprint"],
            shard_id=shard_id,
            policy_version=0,
        )
        write_shard(
            replay,
            layout.rollout_path(shard_id),
            rollout_table,
            ShardMeta(kind=ROLLOUT, student_topk=int(run.get("student_topk", 0)), **common),
        )
        write_shard(
            replay,
            layout.annotated_path(shard_id, teacher),
            annotated_table,
            ShardMeta(kind=ANNOTATED, top_k=part_meta.top_k, teacher=teacher, **common),
        )
    return replay


def replay(store: Store, config_path: Path, replay_root: Path, env: dict | None = None) -> Store:
    """Train the chaos run's ledger, step by step, in one uninterrupted `opd train`."""
    replay_store = build_replay_store(store, replay_root)
    cmd = [
        sys.executable,
        "-m",
        "opd_cache.cli",
        "train",
        "--config",
        str(config_path),
        "--store",
        str(replay_root),
        "--no-follow",
        "--max-staleness",
        "1000000",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, f"replay `opd train` failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return replay_store


def compare_policies(store: Store, replay_store: Store, scratch: Path, tolerance: float = 1e-5) -> float:
    """Every policy version of the chaos run equals the replay's; the two ledgers match. Returns the max difference."""
    chaos_ledger = {s: [line["sample_id"] for line in lines] for s, lines in ledger_lines(store).items()}
    replay_ledger = {s: [line["sample_id"] for line in lines] for s, lines in ledger_lines(replay_store).items()}
    assert chaos_ledger == replay_ledger, "the replay did not train the chaos run's batches"
    # the replay has no rollout workers: retention kept its newest versions only, the chaos run maybe more
    versions = replay_store.policy_versions()
    assert set(versions) <= set(store.policy_versions()), (versions, store.policy_versions())
    worst = 0.0
    for v in versions:
        ours, theirs = read_policy_weights(store, v, scratch), read_policy_weights(replay_store, v, scratch)
        assert ours.keys() == theirs.keys()
        diff = max(float((ours[k] - theirs[k]).abs().max()) for k in ours)
        assert diff <= tolerance, f"policy version {v}: differs from the uninterrupted replay by {diff:.3g}"
        worst = max(worst, diff)
    return worst


def scratch_dir() -> Path:
    return Path(tempfile.mkdtemp(prefix="opd-chaos-"))
