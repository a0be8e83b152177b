"""Annotating with a teacher of another tokenizer: what `opd annotate` does differently (docs/cross-tokenizer.md).

With `annotate.cross_tokenizer: true` and a teacher whose tokenizer fingerprint differs from the run's, the worker
builds one `CrossTokenizerAnnotation` (the student's tokenizer comes from run.json's student folder or a published
policy) and, per shard:

    student rows -> CrossTokenizer.teacher_rows (re-render the prompt, re-tokenize and align the response)
      -> Scorer.score on the aligned rows, in the teacher's ids -> student_targets: top-k in student ids,
      group log-probs at group ends, target_flags -> the part, with the `target_flags` column

The teacher's record keeps the student's tokenizer fingerprint and vocabulary size (the stored ids are student
ids), plus the teacher's own fingerprint, the vocabulary map's and the top-k rule: a second worker of the same
teacher that would build other targets is refused. The same-tokenizer path never comes here.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from opd_cache.annotate.cross_targets import TOPK_RULES, AlignmentStats, CrossTargets, student_targets
from opd_cache.annotate.cross_tokenizer import CrossTokenizer
from opd_cache.annotate.teacher_checks import student_tokenizer
from opd_cache.engine import Scorer, TeacherScores
from opd_cache.storage.store import RunManifest, Store
from opd_cache.tokenizer import tokenizer_fingerprint


class CrossTokenizerAnnotation:
    """Scores a student's rows with a teacher of another tokenizer and returns targets at the student's positions."""

    def __init__(self, student_tok, teacher_tok, *, topk_rule: str = "one_to_one", teacher_name: str | None = None):
        if topk_rule not in TOPK_RULES:
            raise ValueError(f"--cross-tokenizer-topk {topk_rule!r}: expected one of {', '.join(TOPK_RULES)}")
        self.topk_rule = topk_rule
        self.aligner = CrossTokenizer(student_tok, teacher_tok, teacher_name=teacher_name)
        self.student_vocab_size = len(student_tok)
        self.stats = AlignmentStats()  # over every shard this worker annotated

    def record_fields(self) -> dict:
        """The teacher record's cross-tokenizer fields (`TeacherRecord`)."""
        fields = self.aligner.vocab_map.record()
        return {
            "tokenizer_fingerprint": fields["tokenizer_fingerprint"],  # the student's: the stored ids are its ids
            "vocab_size": self.student_vocab_size,
            "teacher_tokenizer_fingerprint": fields["teacher_tokenizer_fingerprint"],
            "vocab_map_fingerprint": fields["vocab_map_fingerprint"],
            "vocab_map_size": fields["vocab_map_size"],
            "cross_tokenizer_topk": self.topk_rule,
        }

    def score(
        self, scorer: Scorer, prompts: Sequence[np.ndarray], responses: Sequence[np.ndarray], top_k: int
    ) -> CrossTargets:
        """Targets for every student response position of the rows (excluded rows: EXCLUDED everywhere)."""
        rows = self.aligner.teacher_rows(prompts, responses)
        aligned = [r for r in rows if r.alignment is not None]
        if aligned:
            teacher = scorer.score([r.prompt_ids for r in aligned], [r.response_ids for r in aligned], top_k, None)
        else:  # nothing survived the round trip: no forward pass
            teacher = TeacherScores.zeros(np.zeros(0, dtype=np.int64), top_k)
        targets = student_targets(rows, responses, teacher, self.aligner.vocab_map.teacher_to_student, self.topk_rule)
        self.stats.add(targets.stats)
        return targets


def cross_tokenizer_annotation(
    store: Store, run: RunManifest, teacher_tok, *, enabled: bool, topk_rule: str, teacher: str
) -> CrossTokenizerAnnotation | None:
    """The cross-tokenizer plan of a teacher, or None when it shares the run's tokenizer (the usual path) or
    `annotate.cross_tokenizer` is off (then the usual check refuses a differing tokenizer, naming the flag)."""
    if not enabled or tokenizer_fingerprint(teacher_tok) == run.tokenizer_fingerprint:
        return None
    student_tok = student_tokenizer(store, run)
    if student_tok is None:
        raise ValueError(
            f"--cross-tokenizer: teacher {teacher} needs the student's tokenizer to align with, and neither "
            f"run.json's student ({run.student!r}) nor a published policy of this store has one here"
        )
    if tokenizer_fingerprint(student_tok) != run.tokenizer_fingerprint:
        raise ValueError(
            f"--cross-tokenizer: the student tokenizer found for run {run.run_id} ({run.student!r}) is not the "
            f"run's (fingerprint {tokenizer_fingerprint(student_tok)}, run.json has {run.tokenizer_fingerprint})"
        )
    return CrossTokenizerAnnotation(student_tok, teacher_tok, topk_rule=topk_rule, teacher_name=teacher)
