"""Teacher targets at the student's positions, built from the teacher's scores of its own tokens.

Given a row's alignment (cross_tokenizer.py) and the teacher's scores of its tokens (the log-prob of each
teacher token and its top-k), `row_targets` writes, for every student response position:

* `target_flags` (opd_cache/target_flags.py): GROUP_END at the last student position of each group;
  TOPK_VALID where the stored top-k is a valid target;
* the teacher's log-prob of the whole group at its GROUP_END position (the sum over the group's teacher
  tokens, exact), 0 elsewhere: the column still sums to the teacher's log-prob of the text;
* the top-k in student ids: the teacher's top-k entries that the vocabulary map covers (two teacher ids that
  spell the same bytes add their probabilities), best first; the rest of the teacher's mass falls in the
  loss's tail bucket. Where the group is the sampled token on both sides, the sampled token joins the
  entries with its exact teacher log-prob if the top-k missed it and a slot is free.

Where TOPK_VALID applies (`topk_rule`): "one_to_one" (the default) at positions whose group is one token on
both sides spelling the same bytes; "group_start" also at the first student position of longer groups, where
both tokenizations start the next token at the same text offset (docs/cross-tokenizer.md: the same
approximation, more positions).

Unused top-k slots are padded with the row's first id and a log-prob of -inf. Both halves matter: the losses
count a repeated id once (its first occurrence; `losses.targets._first_occurrence`), so the pad adds no bucket
and takes nothing from the tail; and its zero probability adds nothing to the top-k mass the packed codec
stores (a repeated id with a finite log-prob would be counted twice there). A fresh id with -inf would not be
safe: it would leave the tail bucket as a bucket of teacher mass 0 (reverse KL: infinite). Positions without
TOPK_VALID hold the sampled id with log-prob 0, then the same pads: finite for every loss, and never read.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields

import numpy as np

from opd_cache.annotate.cross_tokenizer import RowAlignment, TeacherRow
from opd_cache.engine import TeacherScores
from opd_cache.target_flags import EXCLUDED, GROUP_END, TOPK_VALID

TOPK_RULES = ("one_to_one", "group_start")


@dataclass
class AlignmentStats:
    """Counts of one batch (or shard) of aligned rows; `summary()` gives the shares annotate logs."""

    rows: int = 0
    excluded_rows: int = 0
    positions: int = 0  # student response positions of aligned rows
    excluded_positions: int = 0
    groups: int = 0
    teacher_tokens: int = 0
    one_to_one: int = 0  # positions whose group is one token on both sides
    topk_valid: int = 0
    topk_mass: float = 0.0  # sum over TOPK_VALID positions of the teacher's top-k probability mass
    mapped_mass: float = 0.0  # ... of the part of it the vocabulary map covers
    reasons: dict[str, int] = field(default_factory=dict)  # excluded rows by reason

    def add(self, other: AlignmentStats) -> AlignmentStats:
        for f in fields(self):
            if f.name == "reasons":
                for reason, count in other.reasons.items():
                    self.reasons[reason] = self.reasons.get(reason, 0) + count
            else:
                setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))
        return self

    def summary(self) -> dict:
        def share(a: float, b: float) -> float | None:
            return a / b if b else None

        return {
            "rows": self.rows,
            "excluded_rows": self.excluded_rows,
            "excluded_reasons": dict(self.reasons),
            "one_to_one_share": share(self.one_to_one, self.positions),
            "topk_valid_share": share(self.topk_valid, self.positions),
            "student_tokens_per_group": share(self.positions, self.groups),
            "teacher_tokens_per_group": share(self.teacher_tokens, self.groups),
            "mapped_mass": share(self.mapped_mass, self.topk_valid),  # mean teacher mass on mapped top-k ids
            "mapped_share_of_topk": share(self.mapped_mass, self.topk_mass),
        }


@dataclass
class RowTargets:
    topk_ids: np.ndarray  # [m, k] int32, student ids
    topk_logprobs: np.ndarray  # [m, k] float32
    token_logprob: np.ndarray  # [m] float32, the group log-prob at GROUP_END positions, 0 elsewhere
    target_flags: np.ndarray  # [m] uint8
    stats: AlignmentStats


@dataclass
class CrossTargets:
    """Targets of a batch of rows at the student's positions (flat, row after row, as `TeacherScores`)."""

    scores: TeacherScores  # topk_ids in student ids; token_logprob the group log-prob at group ends
    target_flags: np.ndarray  # [T] uint8
    stats: AlignmentStats


def _lookup(table: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """table[ids], -1 for ids outside the table."""
    out = np.full(ids.shape, -1, dtype=np.int64)
    inside = (ids >= 0) & (ids < len(table))
    out[inside] = table[ids[inside]]
    return out


def _merge_repeats(ids: np.ndarray, lp: np.ndarray) -> None:
    """In place: rows where several teacher ids map to one student id get one entry with the summed probability."""
    ordered = np.sort(ids, axis=1)
    repeated = ((ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)).any(1)
    for r in np.nonzero(repeated)[0]:  # rare: a byte-fallback token and a regular one in the same top-k
        merged: dict[int, float] = {}
        for token, value in zip(ids[r].tolist(), lp[r].tolist()):
            if token >= 0:
                merged[token] = np.logaddexp(merged[token], value) if token in merged else value
        ids[r] = -1
        lp[r] = -np.inf
        ids[r, : len(merged)] = list(merged)
        lp[r, : len(merged)] = list(merged.values())


def map_topk(
    topk_ids: np.ndarray,
    topk_logprobs: np.ndarray,
    teacher_to_student: np.ndarray,
    sampled_ids: np.ndarray | None = None,
    sampled_logprobs: np.ndarray | None = None,
):
    """The teacher's top-k rows `[c, k]` in student ids, best first, padded (see the module docstring).

    `sampled_ids[r]` (>= 0 to use it) joins row r with `sampled_logprobs[r]` when absent and a slot is free.
    Returns (ids int32, log-probs float32, mapped mass [c], top-k mass [c]); a row with no entry at all has
    -inf in its first column.
    """
    lp = np.asarray(topk_logprobs, dtype=np.float64)
    ids = _lookup(teacher_to_student, np.asarray(topk_ids, dtype=np.int64))
    valid = (ids >= 0) & np.isfinite(lp)
    topk_mass = np.exp(np.where(np.isfinite(lp), lp, -np.inf)).sum(1)
    ids = np.where(valid, ids, -1)
    lp = np.where(valid, lp, -np.inf)
    _merge_repeats(ids, lp)
    mapped_mass = np.exp(lp).sum(1)
    if sampled_ids is not None:
        sampled_ids = np.asarray(sampled_ids, dtype=np.int64)
        free = ids < 0
        put = (sampled_ids >= 0) & ~(ids == sampled_ids[:, None]).any(1) & free.any(1)
        rows, slots = np.nonzero(put)[0], free.argmax(1)[put]
        ids[rows, slots] = sampled_ids[put]
        lp[rows, slots] = np.asarray(sampled_logprobs, dtype=np.float64)[put]
    order = np.argsort(-lp, axis=1, kind="stable")  # best first; -inf (empty) slots last
    ids, lp = np.take_along_axis(ids, order, 1), np.take_along_axis(lp, order, 1)
    ids = np.where(np.isneginf(lp), ids[:, :1], ids)
    return ids.astype(np.int32), lp.astype(np.float32), mapped_mass, topk_mass


def untargeted_topk(student_ids: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Top-k placeholders of positions without TOPK_VALID: the sampled id at log-prob 0, then pads."""
    ids = np.repeat(np.asarray(student_ids, dtype=np.int32)[:, None], k, axis=1)
    lp = np.full((len(ids), k), -np.inf, dtype=np.float32)
    if k:
        lp[:, 0] = 0.0
    return ids, lp


def row_targets(
    alignment: RowAlignment,
    student_ids: np.ndarray,
    teacher_ids: np.ndarray,
    teacher_token_logprob: np.ndarray,
    teacher_topk_ids: np.ndarray,
    teacher_topk_logprobs: np.ndarray,
    teacher_to_student: np.ndarray,
    topk_rule: str = "one_to_one",
) -> RowTargets:
    """The targets of one aligned row at its m student positions (see the module docstring).

    `teacher_token_logprob[j]` is the teacher's log-prob of its token j, `teacher_topk_*[j]` its top-k at
    the position that predicts token j (as `Scorer.score` returns them for the teacher's response ids).
    Several rows at once: concatenate them, with `concat_alignments` numbering their groups apart.
    """
    if topk_rule not in TOPK_RULES:
        raise ValueError(f"topk_rule {topk_rule!r}: expected one of {list(TOPK_RULES)}")
    student_ids = np.asarray(student_ids, dtype=np.int64)
    teacher_ids = np.asarray(teacher_ids, dtype=np.int64)
    m, n, k = len(student_ids), len(teacher_ids), teacher_topk_ids.shape[1]
    sg, tg, num_groups = alignment.student_group, alignment.teacher_group, alignment.num_groups
    if len(sg) != m or len(tg) != n or len(teacher_token_logprob) != n or len(teacher_topk_ids) != n:
        raise ValueError(
            f"row_targets: {m} student and {n} teacher tokens, but groups for {len(sg)} and {len(tg)}, "
            f"{len(teacher_token_logprob)} teacher log-probs and {len(teacher_topk_ids)} top-k rows"
        )
    topk_ids, topk_logprobs = untargeted_topk(student_ids, k)
    flags = np.zeros(m, dtype=np.uint8)
    token_logprob = np.zeros(m, dtype=np.float32)
    stats = AlignmentStats(positions=m, groups=num_groups, teacher_tokens=n)
    if m == 0:
        return RowTargets(topk_ids, topk_logprobs, token_logprob, flags, stats)

    # The group log-prob (exact: a sum of the teacher's own token log-probs), at each group's last position.
    group_logprob = np.zeros(num_groups, dtype=np.float64)
    np.add.at(group_logprob, tg, np.asarray(teacher_token_logprob, dtype=np.float64))
    is_end = np.append(sg[1:] != sg[:-1], True)
    is_start = np.insert(sg[1:] != sg[:-1], 0, True)
    flags[is_end] |= GROUP_END
    token_logprob[is_end] = group_logprob[sg[is_end]]

    # The teacher position that starts each student position's group: its top-k predicts the same next text.
    first_teacher = np.searchsorted(tg, np.arange(num_groups))
    j = first_teacher[sg]
    one_to_one = ((np.bincount(sg, minlength=num_groups) == 1) & (np.bincount(tg, minlength=num_groups) == 1))[sg]
    exact = alignment.teacher_exact[j]
    same_token = one_to_one & exact & (_lookup(teacher_to_student, teacher_ids[j]) == student_ids)
    candidates = same_token if topk_rule == "one_to_one" else is_start & exact
    pos = np.nonzero(candidates)[0]
    tj = j[pos]
    ids, lp, mapped_mass, topk_mass = map_topk(
        teacher_topk_ids[tj],
        teacher_topk_logprobs[tj],
        teacher_to_student,
        np.where(same_token[pos], student_ids[pos], -1),
        np.asarray(teacher_token_logprob)[tj],
    )
    has_entry = np.isfinite(lp[:, 0]) if k else np.zeros(len(pos), dtype=bool)
    pos = pos[has_entry]
    topk_ids[pos], topk_logprobs[pos] = ids[has_entry], lp[has_entry]
    flags[pos] |= TOPK_VALID

    stats.one_to_one = int(one_to_one.sum())
    stats.topk_valid = len(pos)
    stats.topk_mass = float(topk_mass[has_entry].sum())
    stats.mapped_mass = float(mapped_mass[has_entry].sum())
    return RowTargets(topk_ids, topk_logprobs, token_logprob, flags, stats)


def concat_alignments(alignments: Sequence[RowAlignment]) -> RowAlignment:
    """Several rows' alignments as one, their groups numbered apart (no group spans two rows)."""
    if not alignments:
        return RowAlignment(np.zeros(0, np.int32), np.zeros(0, np.int32), np.zeros(0, bool), 0)
    first_group = np.concatenate([[0], np.cumsum([a.num_groups for a in alignments])])
    return RowAlignment(
        np.concatenate([a.student_group + g for a, g in zip(alignments, first_group)]).astype(np.int32),
        np.concatenate([a.teacher_group + g for a, g in zip(alignments, first_group)]).astype(np.int32),
        np.concatenate([a.teacher_exact for a in alignments]),
        int(first_group[-1]),
    )


def student_targets(
    rows: Sequence[TeacherRow],
    responses: Sequence[Sequence[int]],
    teacher_scores: TeacherScores,
    teacher_to_student: np.ndarray,
    topk_rule: str = "one_to_one",
) -> CrossTargets:
    """Targets at every student response position of `rows`, from the teacher's scores of their aligned rows.

    `teacher_scores` holds the scores of the rows that have an alignment, in order (`Scorer.score` on their
    `prompt_ids` and `response_ids`). Excluded rows get EXCLUDED at every position and placeholder targets.
    All aligned rows are computed in one vectorized pass.
    """
    aligned = [i for i, r in enumerate(rows) if r.alignment is not None]
    expected = [len(rows[i].response_ids) for i in aligned]
    if len(rows) != len(responses) or list(teacher_scores.lengths) != expected:
        raise ValueError(
            f"student_targets: {len(rows)} rows and {len(responses)} responses; teacher scores for rows of "
            f"{list(teacher_scores.lengths)[:8]} tokens, expected the {len(aligned)} aligned rows' {expected[:8]}"
        )
    lengths = np.array([len(r) for r in responses], dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)])
    all_ids = np.concatenate([np.zeros(0, np.int64), *(np.asarray(r, dtype=np.int64) for r in responses)])
    k = teacher_scores.topk_ids.shape[1]
    out = TeacherScores.zeros(lengths, k)
    out.topk_ids[:], out.topk_logprobs[:] = untargeted_topk(all_ids, k)
    flags = np.full(int(lengths.sum()), EXCLUDED, dtype=np.uint8)

    where = np.concatenate([np.zeros(0, np.int64), *(np.arange(starts[i], starts[i + 1]) for i in aligned)])
    targets = row_targets(
        concat_alignments([rows[i].alignment for i in aligned]),
        all_ids[where],
        np.concatenate([np.zeros(0, np.int64), *(rows[i].response_ids for i in aligned)]),
        teacher_scores.token_logprob,
        teacher_scores.topk_ids,
        teacher_scores.topk_logprobs,
        teacher_to_student,
        topk_rule,
    )
    out.topk_ids[where], out.topk_logprobs[where] = targets.topk_ids, targets.topk_logprobs
    out.token_logprob[where], flags[where] = targets.token_logprob, targets.target_flags

    stats = targets.stats
    stats.rows = len(rows)
    for row, m in zip(rows, lengths.tolist()):
        if row.alignment is None:
            stats.excluded_rows += 1
            stats.excluded_positions += m
            stats.reasons[row.excluded] = stats.reasons.get(row.excluded, 0) + 1
    return CrossTargets(out, flags, stats)
