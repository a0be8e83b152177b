"""The bits of `target_flags`: which loss terms apply at a trained position of a cross-tokenizer part.

A teacher whose tokenizer differs from the student's is aligned to the student's tokens in groups (spans of
text whose ends are token boundaries in both tokenizations; docs/cross-tokenizer.md). Its annotated parts
carry one `target_flags` byte per trained position:

    TOPK_VALID  the stored top-k (student ids) is a valid target here: the teacher's distribution over the
                same next-token events, restricted to the ids the vocabulary map covers
    GROUP_END   the last student position of its group; `teacher_token_logprob` holds the teacher's log-prob of
                the whole group there (0 at the group's other positions)
    EXCLUDED    the row's text did not survive the teacher's round trip; no term applies to any of its
                positions (set at every position of such a row)

A group is the positions after the previous GROUP_END (or EXCLUDED) position, up to and including its
GROUP_END. Same-tokenizer parts have no `target_flags` column: every position is then TOPK_VALID | GROUP_END.

This module is torch-free and imports nothing from the project, so the storage layer, annotate, the losses
and the tools can all read the same constants.
"""

from __future__ import annotations

import numpy as np

TOPK_VALID = 1
GROUP_END = 2
EXCLUDED = 4
ALL_FLAGS = TOPK_VALID | GROUP_END | EXCLUDED

# Same-tokenizer targets, written out: the value a part without the column stands for.
SAME_TOKENIZER = TOPK_VALID | GROUP_END

_NAMES = ((TOPK_VALID, "topk"), (GROUP_END, "group_end"), (EXCLUDED, "excluded"))


def describe_flags(value: int) -> str:
    """'topk|group_end' for 3, '-' for 0 (for `opd inspect` and error messages)."""
    if not 0 <= int(value) <= ALL_FLAGS:
        raise ValueError(f"target_flags value {value} has bits outside {ALL_FLAGS:#x}")
    names = [name for bit, name in _NAMES if int(value) & bit]
    return "|".join(names) or "-"


def excluded_rows(flags: np.ndarray, lengths: np.ndarray) -> int:
    """Rows of a part (flat `flags`, per-row `lengths`) whose positions are EXCLUDED (set at every position of
    such a row, so its first position tells)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    nonempty = lengths > 0
    return int(((np.asarray(flags)[starts[nonempty]] & EXCLUDED) != 0).sum())
