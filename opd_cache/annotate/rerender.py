"""Multi-turn rows for a teacher with its own chat template or tokenizer: recover, re-render, score, map back.

A multi-turn rollout row (docs/agents.md) is the student's rendering of a conversation. A teacher that reads
conversations in another chat template (`annotate.chat_template`) or another tokenizer (`annotate.cross_tokenizer`)
scores the same conversation in its own rendering, and its predictions of the student's turns become the targets
at the trained positions. Per row:

1. recover the messages from the student's rendering (recover.py: the row's text, its turn index and loss mask,
   parsed against the student's template);
2. render them for the teacher (`render_conversation` with the teacher's template and tokenizer: the teacher's own
   row, its loss mask on the bodies of the trained turns);
3. put the student's turns in. Each trained body must be the same text in both renderings, up to the end-of-turn
   token (the template text around the bodies may differ; a template that writes tool calls in another format
   does not qualify). Same tokenizer: the ids the student sampled replace the teacher's encoding of the body, so
   the teacher scores exactly the tokens the student trains on. Another tokenizer: the body is re-tokenized and
   aligned by `CrossTokenizer.align_response`, the single-turn alignment, turn by turn;
4. score the teacher's sequences and keep its predictions of the body tokens. Same tokenizer, they are the targets
   at the trained positions one to one (the part is a same-tokenizer part); another tokenizer, `student_targets`
   maps them to the student's positions (groups, `target_flags`), the turns' alignments concatenated.

A row whose messages cannot be recovered, that the teacher's template cannot render, whose trained turns the
teacher's rendering writes differently, or whose text does not survive the teacher's tokenizer, is excluded:
EXCLUDED at each of its positions (a same-tokenizer part then carries `target_flags` too: TOPK_VALID | GROUP_END
elsewhere, which trains exactly as a part without the column) and its reason counted in the shard's `alignment`
metrics. Single-turn rows of the same shard (no loss mask) take the path they take without this module.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from opd_cache.annotate.cross_annotate import CrossTokenizerAnnotation
from opd_cache.annotate.cross_targets import AlignmentStats, concat_alignments, student_targets, untargeted_topk
from opd_cache.annotate.cross_tokenizer import RowAlignment, TeacherRow
from opd_cache.annotate.recover import RecoveryError, RenderedRow, recover_messages
from opd_cache.config import AnnotateConfig, Config
from opd_cache.engine import Scorer, TeacherScores
from opd_cache.rollout.agent import ENVIRONMENTS
from opd_cache.rollout.conversation import ChatRenderer, TemplateError, render_conversation
from opd_cache.rollout.messages import MessageError
from opd_cache.storage.columns import LOSS_MASK, TURN_INDEX
from opd_cache.target_flags import EXCLUDED, SAME_TOKENIZER

# Why a multi-turn row is excluded (besides the cross-tokenizer reasons of its turns' alignment)
NOT_RECOVERED = "messages not recovered from the student's rendering"
NOT_RENDERED = "conversation not rendered by the teacher's template"
TURN_DIFFERS = "assistant turn rendered differently by the teacher's template"


def has_conversations(rows: pa.Table) -> bool:
    """Whether some row of `rows` is a multi-turn row (a loss mask)."""
    return LOSS_MASK in rows.schema.names and rows[LOSS_MASK].null_count < rows.num_rows


@dataclass
class TeacherConversation:
    """One multi-turn row in the teacher's rendering, with the student's turns put in (or why not)."""

    prompt_ids: np.ndarray  # the teacher's tokens up to the first trained turn
    response_ids: np.ndarray  # every later teacher token: the student's turns and the teacher's template text
    body_positions: np.ndarray  # where in response_ids the student's trained turns lie, in order
    alignment: RowAlignment | None = None  # another tokenizer: the student's trained tokens against those
    excluded: str | None = None
    detail: str = ""


@dataclass
class RenderedTargets:
    """Targets of a shard's rows at their trained positions (row after row, as `TeacherScores`)."""

    scores: TeacherScores
    target_flags: np.ndarray | None  # None: a same-tokenizer part without exclusions (no column)
    stats: AlignmentStats


def _excluded(reason: str, detail: str = "") -> TeacherConversation:
    empty = np.zeros(0, dtype=np.int64)
    return TeacherConversation(empty, empty, empty, None, reason, detail)


def _without_end(text: str, ends: tuple[str, ...]) -> str:
    end = next((e for e in ends if text.endswith(e)), None)
    return text[: -len(end)] if end else text


def _runs(*columns: np.ndarray) -> list[tuple[int, int]]:
    """(start, stop) of the runs over which every column is constant."""
    n = len(columns[0])
    changes = np.zeros(max(n - 1, 0), dtype=bool)
    for column in columns:
        changes |= np.diff(column) != 0
    cuts = np.nonzero(changes)[0] + 1
    return list(zip(np.r_[0, cuts].tolist(), np.r_[cuts, n].tolist()))


class ConversationRendering:
    """Scores multi-turn rows in the teacher's rendering and returns targets at the student's trained positions."""

    def __init__(
        self,
        student: ChatRenderer | None,
        teacher: ChatRenderer | None,
        cross: CrossTokenizerAnnotation | None = None,
        missing: str = "",
    ):
        self.student, self.teacher, self.cross = student, teacher, cross
        self.missing = missing  # why there is no student renderer (then multi-turn rows are refused)

    # ---------------------------------------------------------------- one row
    def teacher_conversation(self, prompt_ids, response_ids, loss_mask, turn_index) -> TeacherConversation:
        """The row in the teacher's rendering (module docstring, steps 1-3), or why it is excluded."""
        try:
            row = RenderedRow.of(self.student, prompt_ids, response_ids, loss_mask, turn_index)
            messages = recover_messages(self.student, row)
        except RecoveryError as e:
            return _excluded(NOT_RECOVERED, str(e))
        try:
            own = render_conversation(self.teacher, messages, "the teacher's rendering")
        except (TemplateError, MessageError) as e:
            return _excluded(NOT_RENDERED, str(e))
        pieces, positions, alignments, length = [], [], [], 0
        trained_turns = []
        for start, stop in _runs(own.turn_index, own.loss_mask):
            ids = own.response_ids[start:stop]
            if own.loss_mask[start]:
                turn = int(own.turn_index[start])
                trained_turns.append(turn)
                a, b = row.bodies.get(turn, (0, 0))
                ours = _without_end(row.text[a:b], self.student.end_of_turn)
                theirs = _without_end(self.teacher.decode(ids), self.teacher.end_of_turn)
                if turn not in row.bodies or ours != theirs:
                    return _excluded(TURN_DIFFERS, f"turn {turn}: {ours[:40]!r} is {theirs[:40]!r} for the teacher")
                ids = row.body_ids[turn]
                if self.cross is not None:  # the student's tokens of the turn, re-tokenized and aligned
                    aligned = self.cross.aligner.align_response(ids)
                    if aligned.alignment is None:
                        return _excluded(aligned.excluded, aligned.detail)
                    ids = aligned.response_ids
                    alignments.append(aligned.alignment)
                positions.append(np.arange(length, length + len(ids)))
            pieces.append(np.asarray(ids, dtype=np.int64))
            length += len(ids)
        if trained_turns != sorted(row.bodies):
            return _excluded(TURN_DIFFERS, f"the teacher trains turns {trained_turns}, the row {sorted(row.bodies)}")
        return TeacherConversation(
            np.asarray(own.prompt_ids, dtype=np.int64),
            np.concatenate(pieces),
            np.concatenate(positions),
            concat_alignments(alignments) if self.cross is not None else None,
        )

    # ---------------------------------------------------------------- a shard's rows
    def score(
        self, scorer: Scorer, rows: pa.Table, prompts: Sequence[np.ndarray], responses: Sequence[np.ndarray], top_k: int
    ) -> RenderedTargets:
        """Targets at the trained positions of every row of `rows` (multi-turn rows re-rendered, others as usual)."""
        if self.student is None:
            raise ValueError(
                f"multi-turn rows for this teacher need the student's chat template to read them: {self.missing} "
                "(set annotate.student_chat_template, the template the rollouts were rendered with)"
            )
        if self.cross is None and "student_topk_ids" in rows.schema.names:
            raise ValueError(
                "union support (student_topk_ids) is not scored for multi-turn rows re-rendered for the teacher "
                "(annotate.chat_template): write the rollouts without rollout.student_topk"
            )
        masks, turns = rows[LOSS_MASK].to_pylist(), rows[TURN_INDEX].to_pylist()
        multi = [i for i, m in enumerate(masks) if m is not None]
        single = [i for i, m in enumerate(masks) if m is None]
        conversations = [
            self.teacher_conversation(prompts[i], responses[i], np.asarray(masks[i]), np.asarray(turns[i]))
            for i in multi
        ]
        kept = [c for c in conversations if c.excluded is None]
        if kept:
            teacher = scorer.score([c.prompt_ids for c in kept], [c.response_ids for c in kept], top_k, None)
        else:  # every row excluded: no forward pass
            teacher = TeacherScores.zeros(np.zeros(0, dtype=np.int64), top_k)
        picked = _pick(teacher, [c.body_positions for c in kept])
        trained = [np.asarray(responses[i])[np.asarray(masks[i]) == 1] for i in multi]
        if self.cross is not None:
            teacher_rows = [
                TeacherRow(c.prompt_ids, c.response_ids[c.body_positions], c.alignment, c.excluded, c.detail)
                for c in conversations
            ]
            vocab_map = self.cross.aligner.vocab_map.teacher_to_student
            targets = student_targets(teacher_rows, trained, picked, vocab_map, self.cross.topk_rule)
            self.cross.stats.add(targets.stats)
            parts = [(multi, targets.scores, targets.target_flags)]
            stats = targets.stats
            if single:
                others = self.cross.score(scorer, [prompts[i] for i in single], [responses[i] for i in single], top_k)
                parts.append((single, others.scores, others.target_flags))
                stats = AlignmentStats().add(stats).add(others.stats)
        else:
            scores, flags, stats = _same_tokenizer_targets(conversations, trained, picked, top_k)
            parts = [(multi, scores, flags)]
            if single:
                others = scorer.score([prompts[i] for i in single], [responses[i] for i in single], top_k, None)
                parts.append((single, others, np.full(others.num_tokens, SAME_TOKENIZER, dtype=np.uint8)))
        scores, flags = _merge(parts)
        if self.cross is None and not stats.excluded_rows:
            flags = None  # nothing excluded: a plain same-tokenizer part
        return RenderedTargets(scores, flags, stats)


def _pick(scores: TeacherScores, positions: list[np.ndarray]) -> TeacherScores:
    """The scores at `positions[r]` of each row r (positions within the row's response)."""
    starts = np.concatenate([[0], np.cumsum(scores.lengths)[:-1]]).astype(np.int64)
    flat = np.concatenate([np.zeros(0, np.int64), *(s + p for s, p in zip(starts, positions))])
    return TeacherScores(
        lengths=np.array([len(p) for p in positions], dtype=np.int64),
        topk_ids=scores.topk_ids[flat],
        topk_logprobs=scores.topk_logprobs[flat],
        token_logprob=scores.token_logprob[flat],
    )


def _same_tokenizer_targets(
    conversations: list[TeacherConversation], trained: list[np.ndarray], picked: TeacherScores, k: int
) -> tuple[TeacherScores, np.ndarray, AlignmentStats]:
    """Targets of rows scored in the student's own ids: the picked scores, placeholders for excluded rows."""
    lengths = np.array([len(t) for t in trained], dtype=np.int64)
    out = TeacherScores.zeros(lengths, k)
    flags = np.full(int(lengths.sum()), SAME_TOKENIZER, dtype=np.uint8)
    # every kept position is a group of one token on both sides, its whole top-k mapped (the same vocabulary)
    kept = len(picked.token_logprob)
    mass = float(np.exp(picked.topk_logprobs.astype(np.float64)).sum())
    stats = AlignmentStats(rows=len(conversations), positions=kept, groups=kept, teacher_tokens=kept)
    stats.one_to_one, stats.topk_valid, stats.topk_mass, stats.mapped_mass = kept, kept, mass, mass
    starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    source = 0
    for r, c in enumerate(conversations):
        at = slice(starts[r], starts[r + 1])
        if c.excluded is None:
            n = len(c.body_positions)
            out.topk_ids[at] = picked.topk_ids[source : source + n]
            out.topk_logprobs[at] = picked.topk_logprobs[source : source + n]
            out.token_logprob[at] = picked.token_logprob[source : source + n]
            source += n
        else:
            out.topk_ids[at], out.topk_logprobs[at] = untargeted_topk(trained[r], k)
            flags[at] = EXCLUDED
            stats.excluded_rows += 1
            stats.excluded_positions += int(lengths[r])  # not among `positions`: as student_targets counts them
            stats.reasons[c.excluded] = stats.reasons.get(c.excluded, 0) + 1
    return out, flags, stats


def _merge(parts: list[tuple[list[int], TeacherScores, np.ndarray]]) -> tuple[TeacherScores, np.ndarray]:
    """Scores of disjoint sets of rows (each row after row, with the rows' indices) as one, in row order."""
    rows = np.concatenate([np.asarray(r, dtype=np.int64) for r, _, _ in parts])
    lengths = np.concatenate([s.lengths for _, s, _ in parts]).astype(np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    order = np.argsort(rows, kind="stable")
    flat = np.concatenate([np.zeros(0, np.int64), *(np.arange(starts[o], starts[o] + lengths[o]) for o in order)])

    def cat(name: str) -> np.ndarray:
        return np.concatenate([getattr(s, name) for _, s, _ in parts])[flat]

    scores = TeacherScores(lengths[order], cat("topk_ids"), cat("topk_logprobs"), cat("token_logprob"))
    return scores, np.concatenate([f for _, _, f in parts])[flat]


# ---------------------------------------------------------------- from the configuration
def _read_template(path: str, key: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"{key} {path}: cannot read the chat template ({e.strerror or e})") from None


def _environment_tools(config: Config) -> list[dict] | None:
    """The tool definitions rollout gave the chat template (`rollout.agent.environment`'s): a template that
    renders them (Qwen's system prompt) renders them for the teacher too."""
    agent = config.rollout.agent
    if agent.environment is None:
        return None
    if agent.environment not in ENVIRONMENTS:
        raise ValueError(f"rollout.agent.environment {agent.environment!r}: expected one of {', '.join(ENVIRONMENTS)}")
    return ENVIRONMENTS[agent.environment](**agent.environment_options).tools


def template_record_fields(cfg: AnnotateConfig) -> dict:
    """The teacher record's field for `annotate.chat_template` (a second worker of the teacher must agree); none
    without one, so a record is what it was before this option."""
    if cfg.chat_template is None:
        return {}
    text = _read_template(cfg.chat_template, "annotate.chat_template")
    return {"chat_template_fingerprint": hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]}


def conversation_rendering(
    config: Config, teacher_tok, cross: CrossTokenizerAnnotation | None
) -> ConversationRendering | None:
    """How this teacher reads multi-turn rows: None when it reads the student's rendering as it is (the same
    tokenizer and no other chat template: today's path), else a `ConversationRendering`.

    The student's template: `annotate.student_chat_template`, else `rollout.agent.chat_template`,
    else the student tokenizer's. The teacher's: `annotate.chat_template`, else the student's (rendered with the
    teacher's tokenizer: its own end-of-turn and special tokens)."""
    cfg, agent_template = config.annotate, config.rollout.agent.chat_template
    student_path = cfg.student_chat_template or agent_template
    student_key = "annotate.student_chat_template" if cfg.student_chat_template else "rollout.agent.chat_template"
    student_template = _read_template(student_path, student_key) if student_path else None
    teacher_template = _read_template(cfg.chat_template, "annotate.chat_template") if cfg.chat_template else None
    student_tok = cross.aligner.student if cross is not None else teacher_tok
    tools = _environment_tools(config)
    try:
        student = ChatRenderer(student_tok, student_template, tools=tools)
    except TemplateError as e:
        if cross is None and teacher_template is not None:
            raise ValueError(
                f"annotate.chat_template: the student's chat template is needed to read multi-turn rows ({e}); "
                "set annotate.student_chat_template"
            ) from None
        return ConversationRendering(None, None, cross, missing=str(e)) if cross is not None else None
    if cross is None and (teacher_template is None or teacher_template == student.template):
        return None
    teacher = ChatRenderer(teacher_tok, teacher_template or student.template, tools=tools)
    return ConversationRendering(student, teacher, cross)
