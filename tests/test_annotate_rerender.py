"""Multi-turn rows for a teacher with its own chat template or tokenizer (issue #28 item 1, with #27): the messages
read back from the student's rendering, the teacher's rendering of them, an annotated part against a hand
computation on the teacher's own rendering, and a cross-tokenizer teacher's parts trained (annotate/recover.py,
annotate/rerender.py; docs/agents.md, "Annotate and train")."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from opd_cache.annotate import Annotator
from opd_cache.annotate.recover import RecoveryError, RenderedRow, recover_messages
from opd_cache.annotate.rerender import NOT_RECOVERED, ConversationRendering
from opd_cache.config import load_config
from opd_cache.models import load_causal_lm
from opd_cache.rollout.conversation import ChatRenderer, ConversationBuilder, ConversationRow, render_conversation
from opd_cache.rollout.messages import Message, ToolCall
from opd_cache.storage import layout
from opd_cache.storage.manifest import StoreError
from opd_cache.storage.schema import ANNOTATED, TARGET_FLAGS, flat_values, list_lengths, read_shard, trained_lengths
from opd_cache.target_flags import EXCLUDED, GROUP_END, SAME_TOKENIZER, TOPK_VALID
from opd_cache.tokenizer import load_tokenizer
from tests.conftest import REPO
from tests.test_conversation import CASES, llama, qwen  # noqa: F401 (llama, qwen: renderer fixtures)

TOOLS_TEMPLATE = REPO / "data/chat_templates/arithmetic_tools.jinja"
ROLES_TEMPLATE = REPO / "tests/data/arithmetic_tools_roles.jinja"  # the same bodies, other role markers
STUDENT, TEACHER = REPO / "data/models/agent_student", REPO / "data/models/agent_teacher"
STUDENT_BPE = REPO / "data/models/student_bpe"
K = 4


def tool_conversation(a: int, b: int) -> list[Message]:
    return [
        Message("user", f"What is {a} + {b}?"),
        Message("assistant", "", [ToolCall("calc", f"{a}+{b}")]),
        Message("tool", str(a + b)),
        Message("assistant", f" #### {a + b}"),
    ]


CONVERSATIONS = [
    tool_conversation(37, 48),
    [  # an untrained answer, the environment's reply, then the call and the answer
        Message("system", "Use calc."),
        Message("user", "What is 12 + 30?"),
        Message("assistant", " ans= 42", trained=False),
        Message("user", "Check it with calc."),
        Message("assistant", "", [ToolCall("calc", "12+30")]),
        Message("tool", "42"),
        Message("assistant", " #### 42"),
    ],
    [  # two trained turns around a tool result that is not a number, and a retry
        Message("user", "What is 9 * 9?"),
        Message("assistant", " ans= 80"),
        Message("user", "Check it with calc."),
        Message("assistant", "", [ToolCall("calc", "9**9")]),
        Message("tool", "error: bad expression"),
        Message("assistant", "", [ToolCall("calc", "9*9")]),
        Message("tool", "81"),
        Message("assistant", " #### 81"),
    ],
]


def as_read(messages: list[Message], template=TOOLS_TEMPLATE) -> list[Message]:
    """The conversation as the student's rendering can tell it: the tools template renders a system message as a
    user message, so the preferred role (user) is what is read back."""
    if template != TOOLS_TEMPLATE:
        return messages
    return [Message("user", m.content) if m.role == "system" else m for m in messages]


def renderer(tokenizer, template) -> ChatRenderer:
    return ChatRenderer.from_file(tokenizer, template)


def read_back(student: ChatRenderer, row: ConversationRow) -> list[Message]:
    return recover_messages(
        student, RenderedRow.of(student, row.prompt_ids, row.response_ids, row.loss_mask, row.turn_index)
    )


# ---------------------------------------------------------------- the messages, read back
@pytest.mark.parametrize("template", [TOOLS_TEMPLATE, ROLES_TEMPLATE], ids=["tools", "roles"])
@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
def test_recovered_messages_equal_the_originals(tokenizer, template, conversation):
    student = renderer(tokenizer, template)
    messages = CONVERSATIONS[conversation]
    row = render_conversation(student, messages)
    assert read_back(student, row) == as_read(messages, template)


@pytest.mark.parametrize("name", ["qwen", "llama"])
def test_qwen_and_llama_style_conversations_read_back(name, request):
    """tests/test_conversation.py's templates: tools in the system prompt, consecutive tool results closed once
    (Qwen2.5), JSON calls as the whole turn (Llama 3.1). Call ids are not rendered, so they are not read back."""
    student = request.getfixturevalue(name)
    messages, _ = CASES[name]
    row = render_conversation(student, messages)
    without_ids = [
        replace(m, tool_call_id=None, tool_calls=[replace(c, id=None) for c in m.tool_calls]) for m in messages
    ]
    assert read_back(student, row) == without_ids


def test_a_live_conversation_cut_by_its_budget_reads_back_as_sampled(tokenizer):
    """ConversationBuilder's row (the sampled ids kept, the last turn cut without its end-of-turn token)."""
    student = renderer(tokenizer, TOOLS_TEMPLATE)
    builder = ConversationBuilder(student, [Message("user", "What is 5 + 6?")])
    first = student.encode("[calc(5+6)]") + [tokenizer.eos_token_id]
    builder.add_assistant(first, np.full(len(first), -0.1))
    builder.add_messages([Message("tool", "11")])
    cut = student.encode(" ###")
    builder.add_assistant(cut, np.full(len(cut), -0.1), finish_reason="length")
    row = builder.row()
    assert row.finish_reason == "length"
    assert read_back(student, row) == [
        Message("user", "What is 5 + 6?"),
        Message("assistant", "", [ToolCall("calc", "5+6")]),
        Message("tool", "11"),
        Message("assistant", " ###"),
    ]


def unreadable_row(student: ChatRenderer) -> ConversationRow:
    """A masked row whose turn 2 is "= 3" without the tool line's newline: no role of the template renders it."""
    eos = student.tokenizer.eos_token_id
    pieces = [student.encode("[calc(1+2)]") + [eos], student.encode("= 3"), student.encode(" 3") + [eos]]
    response = np.concatenate([np.asarray(p, dtype=np.int32) for p in pieces])
    mask = np.repeat(np.array([1, 0, 1], dtype=np.uint8), [len(p) for p in pieces])
    turns = np.repeat(np.array([1, 2, 3], dtype=np.int16), [len(p) for p in pieces])
    return ConversationRow(np.array(student.encode("What is 1 + 2?\n"), np.int32), response, mask, turns, None, [])


def test_a_row_that_is_no_conversation_of_the_template_is_not_read_back(tokenizer):
    student = renderer(tokenizer, TOOLS_TEMPLATE)
    row = unreadable_row(student)
    with pytest.raises(RecoveryError, match="does not read as a conversation"):
        read_back(student, row)


# ---------------------------------------------------------------- the teacher's rendering
def test_the_teachers_rendering_holds_each_trained_token_where_the_student_has_it(tokenizer):
    student, teacher = renderer(tokenizer, TOOLS_TEMPLATE), renderer(tokenizer, ROLES_TEMPLATE)
    rendering = ConversationRendering(student, teacher)
    for messages in CONVERSATIONS:
        row = render_conversation(student, messages)
        conv = rendering.teacher_conversation(row.prompt_ids, row.response_ids, row.loss_mask, row.turn_index)
        assert conv.excluded is None, conv.detail
        trained = row.response_ids[row.loss_mask == 1]
        # the teacher's sequence holds the student's trained ids, token for token, at the body positions ...
        np.testing.assert_array_equal(conv.response_ids[conv.body_positions], trained)
        # ... inside the teacher's own rendering of the conversation: each token's text where the teacher's
        # template puts it (the sequence decodes to that rendering, through the last trained turn)
        full = np.concatenate([conv.prompt_ids, conv.response_ids])
        text = teacher.decode(full)
        assert teacher.text(as_read(messages)).startswith(text) and text.endswith(teacher.decode(trained[-1:]))
        for position in conv.body_positions:
            at = len(teacher.decode(full[: len(conv.prompt_ids) + position]))
            token = teacher.decode(conv.response_ids[position : position + 1])
            assert text[at : at + len(token)] == token
        assert "Q: " in text and "A:" in text  # the teacher's role markers, not the student's


# ---------------------------------------------------------------- annotate
def write_conversations(store, tokenizer, template, student, rows: list[ConversationRow]) -> str:
    from opd_cache import RolloutWriter

    with RolloutWriter(store, tokenizer, student=str(student), worker_id="agent0", flush_rows=len(rows)) as writer:
        for row in rows:
            writer.append_conversation(row, behavior_logprobs=np.where(row.loss_mask == 1, -0.5, 0.0))
    (shard_id,) = writer.shards
    return shard_id


def teacher_targets_by_hand(model, teacher: ChatRenderer, messages: list[Message], k: int):
    """The teacher's own rendering scored directly: top-k and token log-probs at its trained (loss mask 1) tokens."""
    own = render_conversation(teacher, messages)
    ids = torch.tensor(np.concatenate([own.prompt_ids, own.response_ids]), dtype=torch.long)[None]
    with torch.no_grad():
        logprobs = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
    positions = len(own.prompt_ids) + np.nonzero(own.loss_mask)[0]  # the trained tokens, by hand
    predicting = logprobs[positions - 1]  # the position before a token predicts it
    top = predicting.topk(k, dim=-1)
    token = predicting[torch.arange(len(positions)), ids[0, positions]]
    return top.indices.numpy(), top.values.numpy(), token.numpy()


def test_a_different_template_teacher_annotates_the_trained_positions_of_its_own_rendering(local_store, tokenizer):
    student, teacher = renderer(tokenizer, TOOLS_TEMPLATE), renderer(tokenizer, ROLES_TEMPLATE)
    single = [Message("user", "What is 2 + 2?"), Message("assistant", " #### 4")]  # a single-turn row (no mask)
    rows = [render_conversation(student, m) for m in CONVERSATIONS] + [render_conversation(student, single)]
    rows.append(unreadable_row(student))
    shard_id = write_conversations(local_store, tokenizer, TOOLS_TEMPLATE, STUDENT, rows)
    cfg = load_config(
        overrides={
            "store.uri": local_store.uri,
            "annotate.teacher": str(TEACHER),
            "annotate.top_k": K,
            "annotate.chat_template": str(ROLES_TEMPLATE),
            "rollout.agent.chat_template": str(TOOLS_TEMPLATE),  # what the rows were rendered with
        }
    )
    annotator = Annotator(cfg, local_store, progress=False)
    assert annotator.run().annotated == [shard_id]
    rollout, _ = read_shard(local_store, layout.rollout_path(shard_id))
    part, _ = read_shard(local_store, layout.annotated_path(shard_id, "teacher"), kind=ANNOTATED)
    lengths = list_lengths(part["teacher_token_logprob"])
    np.testing.assert_array_equal(lengths, trained_lengths(rollout))  # targets exactly at the trained positions
    assert rollout["loss_mask"][3].as_py() is None  # the single-turn row is stored without a mask
    split = np.cumsum(lengths)[:-1]
    ids = np.split(flat_values(part["teacher_topk_ids"]).reshape(-1, K), split)
    lps = np.split(flat_values(part["teacher_topk_logprobs"]).reshape(-1, K), split)
    token = np.split(flat_values(part["teacher_token_logprob"]), split)
    flags = np.split(flat_values(part[TARGET_FLAGS]), split)  # one row is excluded: the part says which

    model = load_causal_lm(TEACHER).eval()
    for r, messages in enumerate(CONVERSATIONS):
        hand_ids, hand_lps, hand_token = teacher_targets_by_hand(model, teacher, as_read(messages), K)
        np.testing.assert_array_equal(ids[r], hand_ids)
        np.testing.assert_allclose(lps[r], hand_lps, atol=1e-5)
        np.testing.assert_allclose(token[r], hand_token, atol=1e-5)
        assert (flags[r] == SAME_TOKENIZER).all()
    # the single-turn row: scored in the student's rendering, as without a teacher template
    hand_ids, hand_lps, hand_token = teacher_targets_by_hand(model, student, single, K)
    np.testing.assert_array_equal(ids[3], hand_ids)
    np.testing.assert_allclose(token[3], hand_token, atol=1e-5)
    assert (flags[3] == SAME_TOKENIZER).all() and (flags[4] == EXCLUDED).all()
    # the different rendering changes what the teacher predicts: the student's own rendering gives other targets
    other = teacher_targets_by_hand(model, student, CONVERSATIONS[0], K)[2]
    assert not np.allclose(other, token[0], atol=1e-3)


def test_the_same_template_keeps_todays_path_and_parts(local_store, tokenizer):
    from opd_cache.annotate.rerender import conversation_rendering

    student = renderer(tokenizer, TOOLS_TEMPLATE)
    shard_id = write_conversations(
        local_store, tokenizer, TOOLS_TEMPLATE, STUDENT, [render_conversation(student, m) for m in CONVERSATIONS]
    )
    parts = {}
    for name, template in (("plain", None), ("same", str(TOOLS_TEMPLATE))):
        overrides = {"annotate.chat_template": template} if template else {}
        cfg = load_config(
            overrides={
                "store.uri": local_store.uri,
                "annotate.teacher": str(TEACHER),
                "annotate.teacher_name": name,
                "annotate.top_k": K,
                "rollout.agent.chat_template": str(TOOLS_TEMPLATE),
                **overrides,
            }
        )
        assert conversation_rendering(cfg, load_tokenizer(TEACHER), None) is None  # no re-rendering
        Annotator(cfg, local_store, progress=False).run()
        parts[name], _ = read_shard(local_store, layout.annotated_path(shard_id, name), kind=ANNOTATED)
    assert parts["same"].equals(parts["plain"])
    # a second worker of the teacher "same" that reads conversations in another template is refused
    cfg = load_config(
        overrides={
            "store.uri": local_store.uri,
            "annotate.teacher": str(TEACHER),
            "annotate.teacher_name": "same",
            "annotate.chat_template": str(ROLES_TEMPLATE),
        }
    )
    with pytest.raises(StoreError, match="chat_template_fingerprint"):
        Annotator(cfg, local_store, progress=False)


def test_a_cross_tokenizer_teacher_annotates_multi_turn_rows_the_trainer_consumes(local_store):
    from opd_cache.train import run_train

    bpe = load_tokenizer(STUDENT_BPE)
    student = renderer(bpe, TOOLS_TEMPLATE)
    rows = [render_conversation(student, m) for m in CONVERSATIONS]
    rows.append(unreadable_row(student))
    shard_id = write_conversations(local_store, bpe, TOOLS_TEMPLATE, STUDENT_BPE, rows)
    cfg = load_config(
        overrides={
            "store.uri": local_store.uri,
            "annotate.teacher": str(TEACHER),
            "annotate.top_k": K,
            "annotate.cross_tokenizer": True,
            "annotate.chat_template": str(ROLES_TEMPLATE),
            "annotate.student_chat_template": str(TOOLS_TEMPLATE),
            "train.max_steps": 1,
            "train.global_batch_samples": len(rows),
            "train.lr": 1e-3,
        }
    )
    annotator = Annotator(cfg, local_store, progress=False)
    assert annotator.run().annotated == [shard_id]
    rollout, _ = read_shard(local_store, layout.rollout_path(shard_id))
    part, _ = read_shard(local_store, layout.annotated_path(shard_id, "teacher"), kind=ANNOTATED)
    lengths = list_lengths(part["teacher_token_logprob"])
    np.testing.assert_array_equal(lengths, trained_lengths(rollout))
    flags = np.split(flat_values(part[TARGET_FLAGS]), np.cumsum(lengths)[:-1])
    assert all(not (f & EXCLUDED).any() for f in flags[:3]) and (flags[3] == EXCLUDED).all()
    kept = np.concatenate(flags[:3])
    assert (kept[-1] & GROUP_END) and (kept & TOPK_VALID).mean() > 0.5  # most positions one to one
    assert annotator.rendering.cross.stats.reasons == {NOT_RECOVERED: 1}
    # the teacher's sequence is its own rendering (its template, its tokens), and each group of the student's
    # trained tokens spells the text of the teacher's tokens aligned with it
    rendering, char = annotator.rendering, load_tokenizer(TEACHER)
    for row, messages in zip(rows, CONVERSATIONS):
        conv = rendering.teacher_conversation(row.prompt_ids, row.response_ids, row.loss_mask, row.turn_index)
        text = rendering.teacher.decode(np.concatenate([conv.prompt_ids, conv.response_ids]))
        assert text.startswith("Q: ") and rendering.teacher.text(as_read(messages)).startswith(text)
        trained, teacher_ids = row.response_ids[row.loss_mask == 1], conv.response_ids[conv.body_positions]
        for g in range(conv.alignment.num_groups):
            ours = bpe.decode(trained[conv.alignment.student_group == g])
            assert ours == char.decode(teacher_ids[conv.alignment.teacher_group == g]), (g, ours)

    before = load_causal_lm(STUDENT_BPE).state_dict()
    result = run_train(cfg, local_store)
    assert result.step == 1
    after = load_causal_lm(local_store.local_path(layout.policy_dir(local_store.latest_version()))).state_dict()
    assert any(not torch.equal(before[name], after[name]) for name in before)  # the step moved the student


def test_the_agent_rollouts_rows_read_back_and_are_annotated_in_the_teachers_template(local_store):
    """Rows `opd rollout` sampled (rollout.agent: sampled ids, cut turns, malformed calls) all read back."""
    from opd_cache.rollout import run_rollout
    from tests.test_agent_rollout import agent_config

    cfg = agent_config(local_store, max_samples=16, flush_rows=16)
    cfg = cfg.model_copy(update={"annotate": cfg.annotate.model_copy(update={"chat_template": str(ROLES_TEMPLATE)})})
    run_rollout(cfg, local_store)
    annotator = Annotator(cfg, local_store, progress=False)
    (shard_id,) = annotator.run().annotated
    rollout, _ = read_shard(local_store, layout.rollout_path(shard_id))
    part, _ = read_shard(local_store, layout.annotated_path(shard_id, "teacher"), kind=ANNOTATED)
    assert rollout["loss_mask"].null_count < rollout.num_rows  # multi-turn rows were sampled
    np.testing.assert_array_equal(list_lengths(part["teacher_token_logprob"]), trained_lengths(rollout))
    assert TARGET_FLAGS not in part.schema.names  # no row excluded: a plain same-tokenizer part
    # the environment's tool definitions reach both renderings (a template may render them)
    from opd_cache.rollout.environment import CalculatorEnvironment

    tools = CalculatorEnvironment(require_tool=True).tools
    assert annotator.rendering.student.tools == tools and annotator.rendering.teacher.tools == tools
