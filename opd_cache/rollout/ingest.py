"""`opd ingest`: JSONL rollouts from another producer (an agent framework, verl, TRL, a chat log) into shards.

    opd ingest runs/agent rows.jsonl --student data/models/student --policy-version 0

Row shapes and how each becomes tokens: opd_cache/rollout/ingest_formats.py. The run, top to bottom:

1. **Check every row first.** Each line is parsed, converted to tokens (text is rendered with the student's
   chat template and tokenized by the student's tokenizer) and checked as the writer will check it: malformed
   JSON, an unknown role, a tool call to an undeclared tool, a conversation over `max_tokens`, ids outside the
   vocabulary, a mask or log-probs of the wrong length... Each problem is one line naming the file and line.
   Without `skip_bad` the first one stops the ingest before anything is written; with it, bad rows are
   skipped and counted.
2. **Behavior log-probs.** Rows that carry them (token-id rows from the sampling engine) keep them. Rows that do
   not (every text row) get them from a forward pass of the student *at the row's policy version* (the
   published `policy/vN`, or the student for version 0), of the raw distribution at `temperature`. They
   equal the sampling distribution's only if the producer sampled from that policy at that temperature without
   top-k/top-p; otherwise the rows are off-policy data whose log-probs are the student's own, which is what a
   loss with importance weights then sees (ratio 1). We compute rather than mark rows "off-policy, replay
   only": nothing downstream would read such a mark, and a computed log-prob is honest about what it is.
3. **Write**, version by version in increasing order (a shard holds one version; a writer's versions never go
   back), through `RolloutWriter`: the same shards, ids, checksums and metadata as `opd rollout`, with the
   producer's policy version, so the trainer's staleness rule applies to them.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from opd_cache.rollout.ingest_formats import IngestContext, IngestError, PendingRow, parse_line
from opd_cache.rollout.policy import PolicyFiles
from opd_cache.rollout.writer import RolloutRow, RolloutWriter, RowError
from opd_cache.storage.manifest import student_id
from opd_cache.storage.store import Store
from opd_cache.tokenizer import load_tokenizer

MAX_REPORTED = 20  # bad rows reported one by one; the rest only counted
CHUNK_ROWS = 1024  # rows converted, scored and appended at a time (the files are streamed, not held)


@dataclass
class IngestOptions:
    policy_version: int | None = None  # for rows without their own `policy_version`
    skip_bad: bool = False
    worker_id: str = "ingest"
    chat_template: str | None = None  # a template file; default: the student tokenizer's own
    tools: list[str] | None = None  # tool names known for rows without a `tools` list
    max_tokens: int | None = None  # per row; default: the tokenizer's model_max_length
    temperature: float = 1.0  # of the computed behavior log-probs
    flush_rows: int = 256
    device: str = "cpu"
    dtype: str = "float32"
    batch_tokens: int = 8192  # forward-pass batch size for computed log-probs, in tokens


@dataclass
class IngestResult:
    rows: int = 0  # rows written
    skipped: int = 0  # bad rows skipped (skip_bad)
    computed: int = 0  # rows whose behavior log-probs were computed
    shards: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # the first MAX_REPORTED bad rows' messages


def read_jsonl(path: str) -> Iterator[tuple[int, object | IngestError]]:
    """(line number, parsed object or the error) for each non-blank line of `path`."""
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                yield number, json.loads(line.rstrip("\r\n"))
            except json.JSONDecodeError as e:
                yield number, IngestError(f"{path}:{number}: not valid JSON ({e.msg} at column {e.colno})")


def ingest(
    paths: list[str],
    store: Store,
    options: IngestOptions,
    *,
    student: str | None = None,
    say: Callable[[str], None] = lambda message: print(message, file=sys.stderr),
) -> IngestResult:
    """Ingest JSONL files into `store` (module docstring); raises IngestError on the first bad row unless
    `options.skip_bad`. `student`: the student model (default: run.json's)."""
    for path in paths:
        if not os.path.isfile(path):
            raise IngestError(f"{path}: no such file")
    run = store.manifest.read()
    student = student or (run.student if run else None)
    if student is None:
        raise ValueError("--student is required: this store has no run.json naming the student")
    student = student_id(student)
    tokenizer = load_tokenizer(student)
    template = None
    if options.chat_template is not None:
        with open(options.chat_template, encoding="utf-8") as f:
            template = f.read()
    max_tokens = options.max_tokens
    if max_tokens is None and 0 < getattr(tokenizer, "model_max_length", 0) < 10**7:
        max_tokens = tokenizer.model_max_length
    context = IngestContext(
        tokenizer, template, set(options.tools) if options.tools is not None else None, options.policy_version
    )
    result = IngestResult()

    # 1. Check every row; remember the good lines by version.
    lines_by_version: dict[int, list[tuple[str, int]]] = {}
    for path, number, pending in _rows(paths, context, max_tokens, len(tokenizer), result, options.skip_bad, say):
        lines_by_version.setdefault(pending.policy_version, []).append((path, number))
    if result.skipped:
        say(f"skipped {result.skipped} bad rows (--skip-bad)")
    if not lines_by_version:
        say("no rows to write")
        return result

    # 2-3. Per version, in increasing order: compute missing log-probs, write.
    writer = RolloutWriter(
        store,
        tokenizer,
        worker_id=options.worker_id,
        policy_version=min(lines_by_version),
        student=student,
        flush_rows=options.flush_rows,
        max_tokens=max_tokens,
        producer="opd ingest",
    )
    policies = PolicyFiles(store, student)
    try:
        for version in sorted(lines_by_version):
            writer.set_policy_version(version)
            wanted = set(lines_by_version[version])
            good = _rows(paths, context, max_tokens, len(tokenizer), None, True, say)
            chunk: list[tuple[str, PendingRow]] = []
            scorer = None
            for path, number, pending in good:
                if (path, number) in wanted:
                    chunk.append((f"{path}:{number}", pending))
                if len(chunk) == CHUNK_ROWS:
                    scorer = _write_chunk(chunk, writer, scorer, policies, version, len(tokenizer), options, result)
                    chunk = []
            _write_chunk(chunk, writer, scorer, policies, version, len(tokenizer), options, result)
            say(f"policy version {version}: {len(wanted)} rows")
        writer.close()
    finally:
        policies.close()
    result.shards = writer.shards
    return result


def _write_chunk(chunk, writer, scorer, policies, version, vocab_limit, options, result) -> BehaviorScorer | None:
    """Compute the chunk's missing behavior log-probs (loading the version's policy once), then append it."""
    missing = [pending for _, pending in chunk if pending.behavior_logprobs is None]
    if missing:
        scorer = scorer or BehaviorScorer(policies.path(version), vocab_limit, options)
        for pending, logprobs in zip(missing, scorer.logprobs(missing)):
            pending.behavior_logprobs = logprobs
        result.computed += len(missing)
    for where, pending in chunk:
        try:
            writer.append(
                pending.prompt_ids, pending.response_ids, pending.behavior_logprobs, **pending.writer_fields()
            )
        except RowError as e:  # checked before; only a file changed since lands here
            raise IngestError(f"{where}: {e}") from None
    result.rows += len(chunk)
    return scorer


def _rows(paths, context, max_tokens, vocab_size, result: IngestResult | None, skip_bad: bool, say):
    """(path, line, PendingRow) of every good row, checked as the writer will check it; bad rows raise, or are
    counted and reported in `result` (at most MAX_REPORTED messages) when `skip_bad`."""
    for path in paths:
        for number, obj in read_jsonl(path):
            where = f"{path}:{number}"
            try:
                if isinstance(obj, IngestError):
                    raise obj
                pending = parse_line(obj, where, context)
                try:
                    check_row(pending, vocab_size, max_tokens)
                except RowError as e:
                    raise IngestError(f"{where}: {e}") from None
            except IngestError as e:
                if not skip_bad:
                    raise
                if result is not None:
                    result.skipped += 1
                    if len(result.problems) < MAX_REPORTED:
                        result.problems.append(str(e))
                        say(f"skipped {e}")
                continue
            yield path, number, pending


def check_row(pending: PendingRow, vocab_size: int, max_tokens: int | None) -> None:
    """The writer's checks (RowError), with placeholder log-probs where they will be computed."""
    logprobs = pending.behavior_logprobs
    if logprobs is None:
        logprobs = np.zeros(len(pending.response_ids), dtype=np.float32)
    fields = pending.writer_fields()
    fields["prompt_index"] = fields["prompt_index"] or 0
    RolloutRow.checked(
        vocab_size,
        0,
        max_tokens,
        prompt_ids=pending.prompt_ids,
        response_ids=pending.response_ids,
        behavior_logprobs=logprobs,
        **fields,
    )


class BehaviorScorer:
    """Log-probs of the response tokens under one policy version (teacher-forced, raw distribution at the
    options' temperature, ids beyond the tokenizer masked as the rollout sampler masks them)."""

    def __init__(self, model_path: str, vocab_limit: int, options: IngestOptions):
        from opd_cache.engine import resolve_device, torch_dtype
        from opd_cache.models import load_causal_lm

        self.device = resolve_device(options.device)
        self.model = load_causal_lm(model_path, dtype=torch_dtype(options.dtype)).to(self.device)
        self.vocab_limit = vocab_limit
        self.temperature = options.temperature
        self.batch_tokens = options.batch_tokens

    @torch.inference_mode()
    def logprobs(self, rows: list[PendingRow]) -> Iterator[np.ndarray]:
        """One float32 array per row, in order (0.0 where the row's loss mask is 0)."""
        from opd_cache.rollout.hf_generate import sampling_logprobs

        weight = self.model.get_output_embeddings().weight
        for batch in _batches(rows, self.batch_tokens):
            width = max(len(r.prompt_ids) + len(r.response_ids) for r in batch)
            ids = torch.zeros(len(batch), width, dtype=torch.long)
            mask = torch.zeros(len(batch), width, dtype=torch.long)
            for i, r in enumerate(batch):  # right-padded: positions are 0.. for every row
                sequence = np.concatenate([r.prompt_ids, r.response_ids])
                ids[i, : len(sequence)] = torch.from_numpy(sequence.astype(np.int64))
                mask[i, : len(sequence)] = 1
            hidden = self.model.base_model(
                input_ids=ids.to(self.device), attention_mask=mask.to(self.device)
            ).last_hidden_state
            for i, r in enumerate(batch):
                p, n = len(r.prompt_ids), len(r.response_ids)
                logits = hidden[i, p - 1 : p - 1 + n].float() @ weight.float().t()  # predicts response[t]
                distribution = sampling_logprobs(logits, self.temperature, vocab_limit=self.vocab_limit)
                target = torch.from_numpy(r.response_ids.astype(np.int64)).to(self.device)
                out = distribution.gather(1, target[:, None]).squeeze(1).cpu().numpy().astype(np.float32)
                if r.loss_mask is not None:
                    out = np.where(np.asarray(r.loss_mask) == 1, out, np.float32(0.0))
                yield out


def _batches(rows: list[PendingRow], batch_tokens: int) -> Iterator[list[PendingRow]]:
    batch, widest = [], 0
    for row in rows:
        length = len(row.prompt_ids) + len(row.response_ids)
        if batch and max(widest, length) * (len(batch) + 1) > batch_tokens:
            yield batch
            batch, widest = [], 0
        batch.append(row)
        widest = max(widest, length)
    if batch:
        yield batch
