"""Aligning a student's response with a teacher of another tokenizer: the teacher's inputs and the groups.

A teacher whose tokenizer differs from the student's cannot score the student's token ids. Annotate
(docs/cross-tokenizer.md) therefore works on text:

1. the student's response ids are spelled out as bytes (`TokenBytes`: what each sampled id stands for, which
   need not be how the student's tokenizer would encode the text) and split at special tokens;
2. each piece of text is re-tokenized by the teacher, and must survive the round trip: the teacher's tokens
   spell exactly that text (up to the prefix space SentencePiece adds), its own decode agrees, and its offset
   mapping agrees with the byte spans of its tokens; a row that fails is excluded with its reason, never
   aligned approximately;
3. both tokenizations are cut into groups at the byte offsets where *both* have a token boundary: each group
   is 1..m student tokens and 1..n teacher tokens spelling the same bytes (`align_offsets`). The spans come
   from the bytes each token spells: exact to the byte, where the tokenizers' offset mappings are per
   character (a character split over byte tokens) and give SentencePiece's prefix space its word's offsets.
   Special tokens (eos) pair up by role and form one-token groups;
4. the prompt is re-rendered with the teacher's own chat template (`CrossTokenizer.prompt_ids`).

cross_targets.py then turns the teacher's scores of its tokens into targets at the student's positions.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerBase

from opd_cache.annotate.vocab_map import (
    TokenBytes,
    VocabularyMap,
    build_vocabulary_map,
    require_fast,
    token_bytes,
    tokenizer_name,
)


class AlignmentError(ValueError):
    """Two tokenizations of a text cannot be cut into common groups (their spans do not tile the text)."""


@dataclass
class RowAlignment:
    """How one row's student response tokens and the teacher's tokens of the same text fall into groups.

    Groups are numbered 0..num_groups-1 in text order; each holds at least one token of each side, and its
    end is a token boundary in both. `teacher_exact[j]` says teacher token j spells exactly the bytes it
    covers (False for a token carrying SentencePiece's prefix space, or part of a character).
    """

    student_group: np.ndarray  # [m] int32, non-decreasing
    teacher_group: np.ndarray  # [n] int32, non-decreasing
    teacher_exact: np.ndarray  # [n] bool
    num_groups: int


@dataclass
class TeacherRow:
    """The teacher's inputs for one rollout row, and how its response aligns with the student's."""

    prompt_ids: np.ndarray  # [p] int64, the prompt in the teacher's chat template
    response_ids: np.ndarray  # [n] int64, the teacher's tokens of the student's response text
    alignment: RowAlignment | None  # None when excluded
    excluded: str | None = None  # why the row cannot be aligned: one of EXCLUSION_REASONS (counted per shard)
    detail: str = ""  # the specifics (the text, the token), for a log line


def _cuts(spans: np.ndarray, length: int, side: str) -> tuple[np.ndarray, np.ndarray]:
    """(running end of each token, whether a boundary follows it) of spans that must tile [0, length)."""
    starts, ends = spans[:, 0], spans[:, 1]
    if (ends < starts).any() or (starts[1:] < starts[:-1]).any():
        raise AlignmentError(f"{side} offsets are not in text order")
    run_end = np.maximum.accumulate(ends)
    gaps = np.nonzero(starts[1:] > run_end[:-1])[0]
    if starts[0] != 0 or len(gaps):
        where = 0 if starts[0] != 0 else int(run_end[gaps[0]])
        raise AlignmentError(f"{side} offsets leave byte {where} of {length} uncovered")
    if run_end[-1] != length:
        raise AlignmentError(f"{side} offsets cover {int(run_end[-1])} of {length} bytes")
    # Overlapping spans (character offsets of a character split over byte tokens) have no boundary between
    # them: those tokens stay together.
    boundary_after = np.append(starts[1:] >= run_end[:-1], True)
    return run_end, boundary_after


def align_offsets(
    student_spans: np.ndarray, teacher_spans: np.ndarray, length: int
) -> tuple[np.ndarray, np.ndarray, int]:
    """Cut two tokenizations of one text into groups at their common boundaries.

    `*_spans` are `[tokens, 2]` (start, end) byte offsets into the same text of `length` bytes, covering it
    in order (tokens may be empty or overlap). Returns (student_group [m], teacher_group [n], num_groups): the
    group of each token, where group g ends at the g-th byte offset that ends a token on both sides. These are
    the finest such groups: no boundary inside a group is a boundary of both. An empty token joins the group
    of the token before it.
    """
    if length <= 0 or len(student_spans) == 0 or len(teacher_spans) == 0:
        raise AlignmentError(f"nothing to align: {length} bytes, {len(student_spans)} and {len(teacher_spans)} tokens")
    student_end, student_cut = _cuts(np.asarray(student_spans, dtype=np.int64), length, "student")
    teacher_end, teacher_cut = _cuts(np.asarray(teacher_spans, dtype=np.int64), length, "teacher")
    common = np.intersect1d(student_end[student_cut], teacher_end[teacher_cut])
    common = common[common > 0]
    student_group = np.searchsorted(common, student_end, side="left").astype(np.int32)
    teacher_group = np.searchsorted(common, teacher_end, side="left").astype(np.int32)
    return student_group, teacher_group, len(common)


def _char_to_byte_offsets(text: str, offsets: np.ndarray) -> np.ndarray:
    """Character offsets (what the tokenizers library reports) -> UTF-8 byte offsets."""
    if text.isascii():
        return offsets
    byte_at = np.zeros(len(text) + 1, dtype=np.int64)
    np.cumsum([len(c.encode("utf-8")) for c in text], out=byte_at[1:])
    return byte_at[offsets]


def _spans(spelled: list[bytes], skip: int) -> np.ndarray:
    """[tokens, 2] byte spans of consecutive tokens spelling `spelled`, less `skip` leading bytes not in the text."""
    ends = np.cumsum(np.fromiter(map(len, spelled), dtype=np.int64, count=len(spelled)))
    starts = np.concatenate([[0], ends[:-1]])
    return np.maximum(np.stack([starts, ends], axis=1) - skip, 0)


def _decodes_to(decoded: str, text: str, strip: int) -> bool:
    """`decode` gave back `text`, allowing the leading spaces its decoder strips at the start of a call."""
    if decoded == text:
        return True
    lead = len(text) - len(text.lstrip(" "))
    return any(decoded == text[k:] for k in range(1, min(strip, lead) + 1))


# Why a row is excluded: short fixed phrases, so a shard's counts have few keys.
PROMPT_NOT_RENDERED = "prompt not rendered for the teacher"
UNKNOWN_STUDENT_ID = "student id outside its tokenizer"
UNPAIRED_SPECIAL = "student special token without a teacher counterpart"
NO_TEXT = "student tokens spell no text"
INVALID_UTF8 = "student tokens spell invalid UTF-8"
STUDENT_DECODE = "student decode differs from its tokens' bytes"
TEACHER_UNKNOWN = "teacher encodes the text with an unknown or special token"
ROUND_TRIP = "text changed by the teacher's round trip"
TEACHER_DECODE = "teacher decode differs from the text"
OFFSETS = "offsets do not cover the text"
EXCLUSION_REASONS = (
    PROMPT_NOT_RENDERED, UNKNOWN_STUDENT_ID, UNPAIRED_SPECIAL, NO_TEXT, INVALID_UTF8, STUDENT_DECODE,
    TEACHER_UNKNOWN, ROUND_TRIP, TEACHER_DECODE, OFFSETS,
)  # fmt: skip

PROMPT_CACHE_SIZE = 4096  # distinct student prompts whose teacher prompt ids are kept

# Role patterns tried, in order, when recovering a conversation from a rendered prompt.
_ROLE_PATTERNS = (("user",), ("system", "user"))
_SENTINEL = "<<opd-message-{}>>"


class CrossTokenizer:
    """Everything annotate needs to score a student's rows with a teacher of another tokenizer.

    Built once per (student, teacher) pair: the byte tables of both tokenizers and their vocabulary map
    (`vocab_map`, whose fingerprint goes into the teacher's record).
    """

    def __init__(
        self,
        student: PreTrainedTokenizerBase,
        teacher: PreTrainedTokenizerBase,
        student_name: str | None = None,
        teacher_name: str | None = None,
    ):
        self.student, self.teacher = student, teacher
        self.student_name = student_name or tokenizer_name(student)
        self.teacher_name = teacher_name or tokenizer_name(teacher)
        self.student_bytes: TokenBytes = token_bytes(student, self.student_name)
        self.teacher_bytes: TokenBytes = token_bytes(teacher, self.teacher_name)
        self.vocab_map: VocabularyMap = build_vocabulary_map(student, teacher, self.student_bytes, self.teacher_bytes)
        self._student_backend = require_fast(student, self.student_name)
        # A private copy of the teacher's tokenizer that reads '<eos>' in the student's text as five characters,
        # not as the teacher's special token (the student wrote text, not a control token).
        self._teacher_encoder = Tokenizer.from_str(require_fast(teacher, self.teacher_name).to_str())
        self._teacher_encoder.encode_special_tokens = True
        self._teacher_encoder.no_truncation()
        self._teacher_encoder.no_padding()
        self._prompt_patterns: list[re.Pattern] | None = None
        # Rollout samples several responses per prompt: the teacher's prompt ids are reused, not re-rendered.
        self._prompt_cache: dict[tuple[int, ...], np.ndarray] = {}

    # ------------------------------------------------------------------ rows
    def teacher_rows(
        self,
        prompts: Sequence[Sequence[int]],
        responses: Sequence[Sequence[int]],
        messages: Sequence[list[dict]] | None = None,
    ) -> list[TeacherRow]:
        """The teacher's inputs and the alignment of each (prompt, response) row of the student.

        `messages[i]` (optional) is row i's conversation; without it the conversation is recovered from the
        student's prompt ids and the student's chat template.
        """
        rows = []
        for i, (prompt, response) in enumerate(zip(prompts, responses, strict=True)):
            try:
                prompt_ids = self.prompt_ids(prompt, None if messages is None else messages[i])
            except ValueError as e:
                rows.append(self._excluded(PROMPT_NOT_RENDERED, str(e)))
                continue
            rows.append(self.align_response(response, prompt_ids))
        return rows

    @staticmethod
    def _excluded(reason: str, detail: str = "", prompt_ids: np.ndarray | None = None) -> TeacherRow:
        empty = np.zeros(0, dtype=np.int64)
        return TeacherRow(empty if prompt_ids is None else prompt_ids, empty, None, reason, detail)

    def align_response(self, response_ids: Sequence[int], prompt_ids: np.ndarray | None = None) -> TeacherRow:
        """Re-tokenize the student's response with the teacher and align the two (or say why not)."""
        prompt_ids = np.zeros(0, dtype=np.int64) if prompt_ids is None else np.asarray(prompt_ids, dtype=np.int64)
        ids = np.asarray(response_ids, dtype=np.int64)
        spelled = self.student_bytes.spell(ids)
        special = self.student_bytes.special_ids
        teacher_ids, student_groups, teacher_groups, exact = [], [], [], []
        groups = 0
        start = 0
        while start < len(ids):
            s_id = int(ids[start])
            if spelled[start] is None:  # a special token (eos): it pairs with the teacher's by role or content
                t_id = self.vocab_map.special.get(s_id)
                if s_id not in special:
                    return self._excluded(UNKNOWN_STUDENT_ID, f"id {s_id}", prompt_ids)
                if t_id is None:
                    return self._excluded(UNPAIRED_SPECIAL, repr(self.student.convert_ids_to_tokens(s_id)), prompt_ids)
                teacher_ids.append(np.array([t_id], dtype=np.int64))
                student_groups.append(np.array([groups], dtype=np.int32))
                teacher_groups.append(np.array([groups], dtype=np.int32))
                exact.append(np.ones(1, dtype=bool))
                groups, start = groups + 1, start + 1
                continue
            stop = start
            while stop < len(ids) and spelled[stop] is not None:
                stop += 1
            piece = self._align_text(ids[start:stop], spelled[start:stop])
            if isinstance(piece[0], str):  # (reason, detail)
                return self._excluded(*piece, prompt_ids)
            piece_teacher_ids, piece_student_groups, piece_teacher_groups, piece_exact, piece_groups = piece
            teacher_ids.append(piece_teacher_ids)
            student_groups.append(piece_student_groups + groups)
            teacher_groups.append(piece_teacher_groups + groups)
            exact.append(piece_exact)
            groups, start = groups + piece_groups, stop

        def cat(parts, dtype):
            return np.concatenate(parts).astype(dtype) if parts else np.zeros(0, dtype=dtype)

        alignment = RowAlignment(cat(student_groups, np.int32), cat(teacher_groups, np.int32), cat(exact, bool), groups)
        return TeacherRow(prompt_ids, cat(teacher_ids, np.int64), alignment)

    def _align_text(self, ids: np.ndarray, spelled: list[bytes]):
        """Align one run of the student's text tokens: the pieces of the row, or (reason, detail) if it fails."""
        text_bytes = b"".join(spelled)
        if not text_bytes:
            return NO_TEXT, f"ids {ids[:8].tolist()}"
        try:
            text = text_bytes.decode("utf-8")
        except UnicodeDecodeError:  # e.g. a character cut by the end of the response
            return INVALID_UTF8, repr(text_bytes[-16:])
        # The byte table must agree with the student's own decode, or it does not follow its decoder.
        decoded = self._student_backend.decode(ids.tolist(), skip_special_tokens=False)
        if not _decodes_to(decoded, text, self.student_bytes.decode_strip):
            return STUDENT_DECODE, f"decode {decoded[:40]!r}, bytes {text[:40]!r}"

        encoding = self._teacher_encoder.encode(text, add_special_tokens=False)
        teacher_ids = np.asarray(encoding.ids, dtype=np.int64)
        teacher_spelled = self.teacher_bytes.spell(teacher_ids)
        if not len(teacher_ids) or any(p is None for p in teacher_spelled):
            return TEACHER_UNKNOWN, repr(text[:40])
        spelled_text = b"".join(teacher_spelled)
        phantom = self.teacher_bytes.phantom_prefix
        if spelled_text != text_bytes and not (phantom and spelled_text == phantom + text_bytes):
            return ROUND_TRIP, f"{text[:40]!r} became {spelled_text[:40]!r}"
        teacher_decoded = self._teacher_encoder.decode(encoding.ids, skip_special_tokens=False)
        strip = self.teacher_bytes.decode_strip
        if not (
            _decodes_to(teacher_decoded, text, strip) or teacher_decoded == phantom.decode(errors="replace") + text
        ):
            return TEACHER_DECODE, f"{teacher_decoded[:40]!r}, not {text[:40]!r}"

        # Byte spans from what each token spells (exact, finer than character offsets); the teacher's prefix
        # space, if it added one, belongs to no text byte. The teacher's own offsets must agree with them.
        student_spans = _spans(spelled, 0)
        teacher_spans = _spans(teacher_spelled, len(phantom) if spelled_text != text_bytes else 0)
        offsets = _char_to_byte_offsets(text, np.asarray(encoding.offsets, dtype=np.int64).reshape(-1, 2))
        outside = np.nonzero((teacher_spans[:, 0] < offsets[:, 0]) | (teacher_spans[:, 1] > offsets[:, 1]))[0]
        if len(outside):
            j = int(outside[0])
            return (
                OFFSETS,
                f"teacher token {j} spells bytes {teacher_spans[j].tolist()}, its offsets say {offsets[j].tolist()}",
            )
        try:
            student_group, teacher_group, groups = align_offsets(student_spans, teacher_spans, len(text_bytes))
        except AlignmentError as e:
            return OFFSETS, str(e)
        exact = np.fromiter(
            (p == text_bytes[a:b] for p, (a, b) in zip(teacher_spelled, teacher_spans.tolist())),
            dtype=bool,
            count=len(teacher_ids),
        )
        return teacher_ids, student_group, teacher_group, exact, groups

    # ------------------------------------------------------------------ the prompt
    def prompt_ids(self, student_prompt_ids: Sequence[int], messages: list[dict] | None = None) -> np.ndarray:
        """The prompt as the teacher would have been given it: its own chat template around the same messages."""
        if messages is not None:
            return np.asarray(render_prompt(self.teacher, messages), dtype=np.int64)
        key = tuple(int(i) for i in student_prompt_ids)
        if key not in self._prompt_cache:
            if len(self._prompt_cache) >= PROMPT_CACHE_SIZE:
                self._prompt_cache.clear()
            self._prompt_cache[key] = np.asarray(render_prompt(self.teacher, self.recover_messages(key)), np.int64)
        return self._prompt_cache[key]

    def recover_messages(self, student_prompt_ids: Sequence[int]) -> list[dict]:
        """The conversation behind a prompt the student's chat template rendered (one user message, or a system
        and a user message); raises ValueError when the prompt does not match the template."""
        ids = [int(i) for i in student_prompt_ids]
        if getattr(self.student, "chat_template", None) is None:
            return [{"role": "user", "content": self.student.decode(ids, skip_special_tokens=True)}]
        candidates = [self.student.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)]
        spelled = self.student_bytes.spell(ids)
        if all(p is not None or i in self.student_bytes.special_ids for p, i in zip(spelled, ids)):
            pieces = [
                p if p is not None else self.student.convert_ids_to_tokens(i).encode() for p, i in zip(spelled, ids)
            ]
            candidates.append(b"".join(pieces).decode("utf-8", errors="replace"))
        for text in candidates:
            for roles, pattern in zip(_ROLE_PATTERNS, self._patterns()):
                match = pattern.fullmatch(text) if pattern is not None else None
                if match is not None:
                    return [{"role": role, "content": content} for role, content in zip(roles, match.groups())]
        raise ValueError(
            f"the prompt {candidates[0][:60]!r} does not match student {self.student_name}'s chat template "
            "with a user message (or a system and a user message); pass the row's messages"
        )

    def _patterns(self) -> list[re.Pattern | None]:
        """One regular expression per role pattern: the student's template with each message's text as a group."""
        if self._prompt_patterns is None:
            self._prompt_patterns = []
            for roles in _ROLE_PATTERNS:
                sentinels = [_SENTINEL.format(i) for i in range(len(roles))]
                probe = [{"role": r, "content": s} for r, s in zip(roles, sentinels)]
                try:
                    rendered = self.student.apply_chat_template(probe, add_generation_prompt=True, tokenize=False)
                except Exception:  # a template that refuses this role pattern (e.g. no system role)
                    self._prompt_patterns.append(None)
                    continue
                fixed = re.split("|".join(map(re.escape, sentinels)), rendered)
                if len(fixed) != len(roles) + 1 or any(rendered.count(s) != 1 for s in sentinels):
                    self._prompt_patterns.append(None)  # the template drops or repeats a message
                    continue
                self._prompt_patterns.append(re.compile("(.*?)".join(map(re.escape, fixed)), re.DOTALL))
        return self._prompt_patterns


def render_prompt(tokenizer: PreTrainedTokenizerBase, messages: list[dict]) -> list[int]:
    """A conversation's prompt ids, by the rule `opd_cache.tasks.prompts.load_prompts` uses for rollout.

    With a chat template: the template with the generation prompt, tokenized without adding special tokens;
    without one, the first message's text with the tokenizer's own special tokens (a base model's input).
    """
    if getattr(tokenizer, "chat_template", None) is not None:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    else:
        ids = tokenizer(messages[0]["content"], add_special_tokens=True)["input_ids"]
    if not ids:
        raise ValueError(f"tokenizer {tokenizer_name(tokenizer)}: the prompt is empty after its template")
    return list(ids)
