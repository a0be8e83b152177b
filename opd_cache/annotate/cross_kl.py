"""The held-out KL of a student against a teacher of another tokenizer, in the teacher's tokenization.

A same-tokenizer run measures KL(teacher ‖ student) per response token over the full vocabulary
(`opd_cache.evaluate.sequence_kl`). Across tokenizers the student has no distribution over the teacher's
tokens, but it does have one over the next *byte* of text, and a teacher whose tokens each spell one byte (the
demo's character-level teacher) predicts exactly that. So at every teacher position of the student's answer
this measures

    KL( p_teacher(next token | text) ‖ q_student(next byte | text) )

over one event space: the 256 bytes, each special token the two tokenizers pair (eos with eos), and one bucket
for every other special. The student's side is exact given the student's own tokens T up to its last token
boundary at or before the position: with u the bytes from that boundary to the position,

    q(b | text) = P(the text continues with u·b | T) / P(it continues with u | T)

where P sums over every way the student can spell u·b: one token running past u, or tokens ending inside u
(one forward pass per such prefix) continued the same way. At a boundary u is empty and q(b) is the mass of
the student's tokens that start with b. With the same tokenizer on both sides every position is a boundary
and this is the full-vocabulary per-token KL of `sequence_kl`, value for value (tests/test_cross_tokenizer_kl.py).

    result = cross_tokenizer_kl(student, student_tok, teacher, teacher_tok, prompt_ids, response_ids)
    result.kl  # mean over the teacher's positions of the aligned rows
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from opd_cache.annotate.cross_tokenizer import CrossTokenizer

NUM_BYTES = 256


@dataclass
class CrossKL:
    kl: float  # mean per teacher position of KL(teacher ‖ student's next byte); nan when no row aligned
    positions: int  # teacher positions measured
    rows: int  # rows aligned and measured
    excluded_rows: int  # rows the alignment excluded (text the teacher cannot spell): not measured


class StudentBytes:
    """The student's next-byte distribution after its own tokens T and the partial text u of its next token."""

    def __init__(self, model, xt: CrossTokenizer, events: dict[int, int], device):
        self.model, self.device = model, device
        spelled = xt.student_bytes.spelled
        self.vocab = len(spelled)
        self.num_events = NUM_BYTES + len(events) + 1
        other = self.num_events - 1
        # at a boundary every token's mass goes to the event of its first byte (or its special's event)
        first = [other if w is None or not w else w[0] for w in spelled]
        for student_id, event in events.items():
            first[student_id] = event
        self.first_event = torch.tensor(first, dtype=torch.long)
        # inside a token: the tokens that run past a partial text p (by p, with their next byte), and the tokens
        # spelling p exactly (where the student could end a token and continue with another)
        self.extending: dict[bytes, tuple[list[int], list[int]]] = {}
        self.spelling: dict[bytes, list[int]] = {}
        for token, w in enumerate(spelled):
            if not w:
                continue
            self.spelling.setdefault(w, []).append(token)
            for k in range(1, len(w)):
                ids, nxt = self.extending.setdefault(w[:k], ([], []))
                ids.append(token)
                nxt.append(w[k])
        self.cache: dict[tuple[int, ...], torch.Tensor] = {}

    def fill(self, prompt: Sequence[int], response: Sequence[int]) -> None:
        """One forward pass over prompt + response caches the student's distribution after every prefix."""
        self.cache.clear()
        ids = list(prompt) + list(response)
        probs = self._forward([ids])[0]
        for i in range(len(response) + 1):
            self.cache[tuple(ids[: len(prompt) + i])] = probs[len(prompt) + i - 1]

    def _forward(self, rows: list[list[int]]) -> torch.Tensor:
        ids = torch.tensor(rows, dtype=torch.long, device=self.device)
        logits = self.model(input_ids=ids).logits[..., : self.vocab].double()
        return F.softmax(logits, dim=-1).cpu()

    def probs(self, state: tuple[int, ...]) -> torch.Tensor:
        if state not in self.cache:
            self.cache[state] = self._forward([list(state)])[0, -1]
        return self.cache[state]

    def mass(self, state: tuple[int, ...], partial: bytes) -> torch.Tensor:
        """[events] P(the text continues with `partial` then each event | the student's tokens `state`)."""
        probs = self.probs(state)
        out = torch.zeros(self.num_events, dtype=torch.float64)
        if not partial:
            return out.index_add_(0, self.first_event, probs)
        ids, nxt = self.extending.get(partial, ([], []))
        if ids:
            out.index_add_(0, torch.tensor(nxt), probs[ids])
        for k in range(1, len(partial) + 1):  # a token ending inside (or at the end of) the partial text
            for token in self.spelling.get(partial[:k], []):
                out += probs[token] * self.mass((*state, token), partial[k:])
        return out

    def next_event(self, state: tuple[int, ...], partial: bytes) -> torch.Tensor:
        mass = self.mass(state, partial)
        return mass / mass.sum()


def teacher_events(xt: CrossTokenizer, events: dict[int, int], num_events: int) -> torch.Tensor:
    """[teacher vocabulary] the event of each teacher id; refuses a teacher with tokens of several bytes."""
    spelled = xt.teacher_bytes.spelled
    longer = [i for i, w in enumerate(spelled) if w is not None and len(w) > 1]
    if longer:
        raise ValueError(
            f"teacher tokenizer {xt.teacher_bytes.name}: the next-byte KL needs a teacher whose tokens spell one "
            f"byte each (a character-level teacher); id {longer[0]} spells {spelled[longer[0]]!r}"
        )
    other = num_events - 1
    index = [other if not w else w[0] for w in spelled]
    for student_id, event in events.items():
        index[xt.vocab_map.special[student_id]] = event
    return torch.tensor(index, dtype=torch.long)


@torch.inference_mode()
def cross_tokenizer_kl(
    student,
    student_tok,
    teacher,
    teacher_tok,
    prompt_ids: Sequence[Sequence[int]],
    response_ids: Sequence[Sequence[int]],
    device="cpu",
) -> CrossKL:
    """Mean KL(teacher ‖ student's next byte) over the teacher's positions of the student's responses.

    `prompt_ids` and `response_ids` are the student's (its chat template, its sampled ids); the teacher scores
    its own tokenization of the same text (annotate's alignment), and rows the alignment excludes are counted,
    not measured."""
    xt = CrossTokenizer(student_tok, teacher_tok)
    events = {s: NUM_BYTES + k for k, s in enumerate(sorted(xt.vocab_map.special))}
    side = StudentBytes(student, xt, events, device)
    to_event = teacher_events(xt, events, side.num_events)
    total, positions, rows, excluded = 0.0, 0, 0, 0
    for prompt, response in zip(prompt_ids, response_ids, strict=True):
        response = [int(i) for i in response]
        row = xt.align_response(response, xt.prompt_ids(prompt))
        if row.excluded is not None:
            excluded += 1
            continue
        rows += 1
        t_ids = torch.tensor(np.concatenate([row.prompt_ids, row.response_ids])[None], device=device)
        t_logits = teacher(input_ids=t_ids).logits[0, len(row.prompt_ids) - 1 : -1, : len(to_event)].double()
        t_probs = F.softmax(t_logits, dim=-1).cpu()
        side.fill([int(i) for i in prompt], response)
        # each student token's byte span in the response text (a special token spans nothing)
        spelled = xt.student_bytes.spell(response)
        starts = np.cumsum([0] + [len(w or b"") for w in spelled])
        text = b"".join(w or b"" for w in spelled)
        offset = 0
        for j, t_id in enumerate(row.response_ids.tolist()):
            # the student token holding this offset: the first that ends after it (or a special token at it)
            i = next(i for i in range(len(response)) if starts[i + 1] > offset or starts[i] == offset)
            state = tuple(int(t) for t in prompt) + tuple(response[:i])
            q = side.next_event(state, text[starts[i] : offset])
            p = torch.zeros(side.num_events, dtype=torch.float64).index_add_(0, to_event, t_probs[j])
            support = p > 0
            total += float((p[support] * (p[support].log() - q[support].log())).sum())
            positions += 1
            offset += len(xt.teacher_bytes.spelled[t_id] or b"")
    return CrossKL(total / positions if positions else float("nan"), positions, rows, excluded)
