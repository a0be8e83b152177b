"""Conversations with tool calls as rows: rendering with chat templates, the loss mask, turn by turn == whole,
tool-call parsing (rollout/conversation.py, messages.py, tool_calls.py)."""

from __future__ import annotations

import re

import numpy as np
import pytest

from opd_cache.rollout.conversation import (
    ChatRenderer,
    ConversationBuilder,
    TemplateError,
    layout,
    render_conversation,
)
from opd_cache.rollout.messages import Message, MessageError, ToolCall, check_conversation, tool_names_of
from opd_cache.rollout.tool_calls import ToolCallError, detect_tool_call_format, parse_assistant_text
from opd_cache.tokenizer import load_tokenizer

from .conftest import DATA, TOKENIZER_DIR

DEMO_TEMPLATE = DATA / "chat_templates" / "arithmetic_tools.jinja"

# Qwen2.5's tool-calling template, shortened: tools in the system prompt, <tool_call> blocks, consecutive tool
# results in one user turn (so a tool message's own rendering is not a prefix of the next one's).
QWEN_TEMPLATE = r"""
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}{{- messages[0].content + '\n\n' }}{%- endif %}
    {{- '# Tools\n<tools>' }}
    {%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}
    {{- '\n</tools><|im_end|>\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'user' or (message.role == 'assistant' and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}{{- '\n' + message.content }}{%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
            {{- '\n<tool_call>\n{"name": "' + tool_call.name + '", "arguments": ' + tool_call.arguments | tojson + '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
"""

# Llama 3.1's JSON tool calling, shortened: the call is the whole assistant message, results in "ipython" turns.
LLAMA_TEMPLATE = r"""
{{- bos_token }}
{%- for message in messages %}
    {%- if message.role == 'assistant' and message.tool_calls %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
        {%- for call in message.tool_calls %}
            {{- '{"name": "' + call.function.name + '", "parameters": ' + call.function.arguments | tojson + '}' }}
        {%- endfor %}
        {{- '<|eot_id|>' }}
    {%- elif message.role == 'tool' %}
        {{- '<|start_header_id|>ipython<|end_header_id|>\n\n' + message.content + '<|eot_id|>' }}
    {%- else %}
        {{- '<|start_header_id|>' + message.role + '<|end_header_id|>\n\n' + message.content | trim + '<|eot_id|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}
"""

# Like Qwen3: the reasoning of assistant turns before the last user message is dropped, so earlier turns render
# differently once a later user message exists (not incremental).
THINKING_TEMPLATE = r"""
{%- set ns = namespace(last_user=0) %}
{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}
{%- for m in messages %}
    {%- if m.role == 'assistant' %}
        {%- set content = m.content %}
        {%- if loop.index0 < ns.last_user and '</think>' in content %}
            {%- set content = content.split('</think>')[-1] %}
        {%- endif %}
        {{- '<|im_start|>assistant\n' + content + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
"""

CALC = {"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}


def char_tokenizer(special: list[str], eos: str | None = None, bos: str | None = None):
    """The shipped character tokenizer plus whole-token specials (as a real chat tokenizer has them)."""
    tokenizer = load_tokenizer(TOKENIZER_DIR)
    tokenizer.add_tokens(special, special_tokens=True)
    if eos:
        tokenizer.eos_token = eos
    if bos:
        tokenizer.bos_token = bos
    return tokenizer


@pytest.fixture(scope="module")
def demo():
    return ChatRenderer.from_file(load_tokenizer(TOKENIZER_DIR), DEMO_TEMPLATE)


@pytest.fixture(scope="module")
def qwen():
    tokenizer = char_tokenizer(["<|im_start|>", "<|im_end|>"], eos="<|im_end|>")
    return ChatRenderer(tokenizer, QWEN_TEMPLATE, tools=[CALC])


@pytest.fixture(scope="module")
def llama():
    tokenizer = char_tokenizer(
        ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        eos="<|eot_id|>",
        bos="<|begin_of_text|>",
    )
    return ChatRenderer(tokenizer, LLAMA_TEMPLATE, tools=[CALC])


def calc(arguments, call_id=None) -> ToolCall:
    return ToolCall("calc", arguments, call_id)


# Per template: a conversation and the assistant bodies (text the student samples) written out by hand.
CASES = {
    "demo": (
        [
            Message("user", "What is 37 + 48?"),
            Message("assistant", "", [calc("37+48")]),
            Message("tool", "85"),
            Message("assistant", "", [calc("85*2"), calc("1+1")]),
            Message("tool", "170"),
            Message("tool", "2"),
            Message("assistant", " #### 85"),
        ],
        ["[calc(37+48)]<eos>", "[calc(85*2)][calc(1+1)]<eos>", " #### 85<eos>"],
    ),
    "qwen": (
        [
            Message("system", "Use the tool."),
            Message("user", "What is 37 + 48?"),
            Message("assistant", "Let me compute.", [calc({"expression": "37+48"}, "c1")]),
            Message("tool", "85", tool_call_id="c1"),
            Message("assistant", "", [calc({"expression": "85*2"}), calc({"expression": "1+1"})]),
            Message("tool", "170"),
            Message("tool", "2"),
            Message("assistant", "#### 85"),
        ],
        [
            'Let me compute.\n<tool_call>\n{"name": "calc", "arguments": {"expression": "37+48"}}\n</tool_call>'
            "<|im_end|>",
            '<tool_call>\n{"name": "calc", "arguments": {"expression": "85*2"}}\n</tool_call>\n<tool_call>\n'
            '{"name": "calc", "arguments": {"expression": "1+1"}}\n</tool_call><|im_end|>',
            "#### 85<|im_end|>",
        ],
    ),
    "llama": (
        [
            Message("user", "What is 37 + 48?"),
            Message("assistant", "", [calc({"expression": "37+48"})]),
            Message("tool", "85"),
            Message("assistant", "#### 85"),
        ],
        ['{"name": "calc", "parameters": {"expression": "37+48"}}<|eot_id|>', "#### 85<|eot_id|>"],
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_templates_render_round_trip_and_mask_exactly_the_assistant_turns(request, name):
    renderer = request.getfixturevalue(name)
    messages, bodies = CASES[name]
    row = render_conversation(renderer, messages)
    text = renderer.text(messages)
    assistants = [i for i, m in enumerate(messages) if m.role == "assistant"]

    # decode(render) == the template's text, up to the last assistant turn's end-of-turn token
    decoded = renderer.decode(np.concatenate([row.prompt_ids, row.response_ids]))
    assert decoded == text[: text.rindex(bodies[-1]) + len(bodies[-1])]
    assert renderer.decode(row.prompt_ids) == renderer.text(messages[: assistants[0]], add_generation_prompt=True)
    # the mask is exactly the bodies, each with its message's turn index
    runs = np.split(np.arange(len(row.loss_mask)), np.nonzero(np.diff(row.loss_mask))[0] + 1)
    trained = [run for run in runs if row.loss_mask[run[0]]]
    assert [renderer.decode(row.response_ids[run]) for run in trained] == bodies
    assert [set(row.turn_index[run].tolist()) for run in trained] == [{i} for i in assistants]
    assert row.response_ids[0] == row.response_ids[trained[0][0]]  # the response starts with the first body
    assert np.all(np.diff(row.turn_index) >= 0) and row.turn_index.min() == assistants[0]
    # every body parses back into its message (the template's tool-call format is the parser's)
    for i, body in zip(assistants, bodies):
        parsed = parse_assistant_text(body[: -len(renderer.end_of_turn[0])], renderer.tool_call_format)
        assert (parsed.content, parsed.tool_calls) == (
            messages[i].content,
            [ToolCall(c.name, c.arguments) for c in messages[i].tool_calls],
        )


@pytest.mark.parametrize("name", list(CASES))
def test_rendering_turn_by_turn_equals_rendering_the_whole_conversation(request, name):
    renderer = request.getfixturevalue(name)
    messages, bodies = CASES[name]
    # the property that makes it hold: at every assistant turn, what the student was prompted with is a prefix
    # of the whole conversation's rendering
    whole = renderer.text(messages)
    for i, m in enumerate(messages):
        if m.role == "assistant":
            assert whole.startswith(renderer.text(messages[:i], add_generation_prompt=True))
    assert layout(renderer, messages).incremental

    first = next(i for i, m in enumerate(messages) if m.role == "assistant")
    builder = ConversationBuilder(renderer, messages[:first])
    rng = np.random.default_rng(0)
    sampled_logprobs = []
    position, body = first, 0
    while position < len(messages):
        ids = renderer.encode(bodies[body])
        logprobs = -rng.random(len(ids)).astype(np.float32)
        sampled_logprobs.append(logprobs)
        message = builder.add_assistant(ids, logprobs)
        assert (message.content, message.tool_calls) == (
            messages[position].content,
            [ToolCall(c.name, c.arguments) for c in messages[position].tool_calls],
        )
        end = next((j for j in range(position + 1, len(messages)) if messages[j].role == "assistant"), len(messages))
        if end > position + 1:
            builder.add_messages(messages[position + 1 : end])
        position, body = end, body + 1
    live, whole_row = builder.row(), render_conversation(renderer, messages)
    assert live.prompt_ids.tolist() == whole_row.prompt_ids.tolist()
    assert live.response_ids.tolist() == whole_row.response_ids.tolist()
    assert live.loss_mask.tolist() == whole_row.loss_mask.tolist()
    assert live.turn_index.tolist() == whole_row.turn_index.tolist()
    # the sampled log-probs sit at the trained positions, 0.0 elsewhere
    assert np.array_equal(live.behavior_logprobs[live.loss_mask == 1], np.concatenate(sampled_logprobs))
    assert not live.behavior_logprobs[live.loss_mask == 0].any()
    assert whole_row.behavior_logprobs is None  # rendered from text: nobody sampled it


def test_the_demo_template_agrees_with_the_shipped_one_on_single_turn_rows(demo, tokenizer):
    """The multi-turn demo's prompts are the single-turn demo's (opd rollout's prompt ids) and an answer without
    a tool call renders as before."""
    messages = [Message("user", "What is 37 + 48?"), Message("assistant", " #### 85")]
    shipped = tokenizer.apply_chat_template([m.to_template() for m in messages], tokenize=False)
    assert demo.text(messages) == shipped
    prompt = tokenizer.apply_chat_template([messages[0].to_template()], add_generation_prompt=True, tokenize=False)
    row = render_conversation(demo, messages)
    assert row.prompt_ids.tolist() == tokenizer(prompt, add_special_tokens=False)["input_ids"]
    assert demo.decode(row.response_ids) == " #### 85<eos>" and row.loss_mask.all()


def test_the_demo_tool_syntax_fits_the_character_vocabulary(demo):
    """Every character the demo template writes around tool calls is a token of the shipped alphabet."""
    vocabulary = demo.tokenizer.get_vocab()
    for character in "[]()=+-*/ 0123456789\n":
        assert character in vocabulary
    row = render_conversation(demo, CASES["demo"][0])
    assert demo.tokenizer.unk_token_id not in row.response_ids.tolist() + row.prompt_ids.tolist()


def test_untrained_assistant_turns_are_context(demo):
    messages = [
        Message("user", "What is 1 + 1?"),
        Message("assistant", " #### 2", trained=False),  # a worked example: context only
        Message("user", "What is 37 + 48?"),
        Message("assistant", "", [calc("37+48")]),
        Message("tool", "85"),
        Message("assistant", " #### 85", trained=False),
    ]
    row = render_conversation(demo, messages)
    # the prompt runs to the first *trained* turn's header; trailing untrained tokens are dropped
    assert demo.decode(row.prompt_ids) == "What is 1 + 1?\n #### 2<eos>What is 37 + 48?\n"
    assert demo.decode(row.response_ids) == "[calc(37+48)]<eos>" and row.loss_mask.all()
    with pytest.raises(MessageError, match="no assistant message to train on"):
        render_conversation(demo, [messages[0], messages[1]])


def test_a_template_that_rerenders_earlier_turns_is_split_by_offsets():
    tokenizer = char_tokenizer(["<|im_start|>", "<|im_end|>"], eos="<|im_end|>")
    renderer = ChatRenderer(tokenizer, THINKING_TEMPLATE)
    messages = [
        Message("user", "Q1"),
        Message("assistant", "<think>a</think>A1"),
        Message("user", "Q2"),
        Message("assistant", "<think>b</think>A2"),
    ]
    text = renderer.text(messages)
    assert "<think>a</think>" not in text  # dropped from the earlier turn: not incremental
    lay = layout(renderer, messages)
    assert not lay.incremental
    row = render_conversation(renderer, messages)
    assert renderer.decode(np.concatenate([row.prompt_ids, row.response_ids])) == text.rstrip("\n")
    runs = np.split(np.arange(len(row.loss_mask)), np.nonzero(np.diff(row.loss_mask))[0] + 1)
    bodies = [renderer.decode(row.response_ids[run]) for run in runs if row.loss_mask[run[0]]]
    assert bodies == ["A1<|im_end|>", "<think>b</think>A2<|im_end|>"]  # what the final rendering trains


def test_a_template_without_the_end_of_turn_token_is_refused(demo):
    renderer = ChatRenderer(
        demo.tokenizer, "{%- for m in messages -%}{{- m['content'] + '\\n' -}}{%- endfor -%}", tool_call_format="demo"
    )
    with pytest.raises(TemplateError, match=r"message 1: the template ends the assistant turn with none of"):
        render_conversation(renderer, [Message("user", "hi"), Message("assistant", "yo")])


# ---------------------------------------------------------------- tool-call parsing
def test_tool_call_formats_are_detected_from_templates(demo, qwen, llama):
    assert (demo.tool_call_format, qwen.tool_call_format, llama.tool_call_format) == ("demo", "hermes", "llama")
    assert detect_tool_call_format("{{ messages[0]['content'] }}") is None
    with pytest.raises(ValueError, match="declares tool_call_format 'xml'"):
        detect_tool_call_format("{# tool_call_format: xml #}")


@pytest.mark.parametrize(
    "fmt, text, message",
    [
        ("hermes", '<tool_call>\n{"name": "calc", "arguments": {"x": 1}\n</tool_call>', "block 0 is not valid JSON"),
        ("hermes", '<tool_call>\n{"arguments": {}}\n</tool_call>', 'block 0 has no "name"'),
        ("hermes", '<tool_call>\n{"name": "calc"}\n', "block 0 is not closed with </tool_call>"),
        ("hermes", '<tool_call>{"name": "a"}</tool_call> and more', "text after the tool calls"),
        ("hermes", '<tool_call>["calc"]</tool_call>', "must be a JSON object"),
        ("hermes", "</tool_call>", "without an opening <tool_call>"),
        ("llama", '{"name": "calc", "parameters": {"x": 1}', "tool call 0 is not valid JSON"),
        ("llama", '{"name": "calc", "parameters": [1]}', "arguments of 'calc' must be an object"),
        ("demo", "[calc(37+48", "tool call 0 is not closed with ')]'"),
        ("demo", "[calc(1)] #### 2", "text after the tool calls"),
    ],
)
def test_malformed_tool_calls_are_clear_errors(fmt, text, message):
    with pytest.raises(ToolCallError, match=re.escape(message)):
        parse_assistant_text(text, fmt)


def test_tool_calls_parse_in_each_format():
    hermes = parse_assistant_text(
        'Sure.\n<tool_call>\n{"name": "calc", "arguments": {"expression": "1+2"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "search", "arguments": {"q": "x"}}\n</tool_call>',
        "hermes",
    )
    assert hermes.content == "Sure." and [(c.name, c.arguments) for c in hermes.tool_calls] == [
        ("calc", {"expression": "1+2"}),
        ("search", {"q": "x"}),
    ]
    llama = parse_assistant_text(
        '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "arguments": {}}', "llama"
    )
    assert [c.name for c in llama.tool_calls] == ["a", "b"] and llama.content == ""
    assert parse_assistant_text("The answer is 3.", "llama").tool_calls == []
    demo = parse_assistant_text("[calc(37+48)]", "demo")
    assert demo.tool_calls == [ToolCall("calc", "37+48")] and demo.content == ""
    assert parse_assistant_text(" #### 85", "demo") == Message("assistant", " #### 85")


def test_a_renderer_keeps_unparsable_output_as_content_with_the_reason(demo):
    message = demo.parse_assistant("[calc(1+")
    assert message.content == "[calc(1+" and message.tool_calls == []
    assert "not closed" in message.parse_error


# ---------------------------------------------------------------- messages
def test_openai_messages_are_read_strictly():
    message = Message.from_dict(
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "calc", "arguments": '{"expression": "1+2"}'}}
            ],
        },
        "m",
    )
    assert message.tool_calls == [ToolCall("calc", {"expression": "1+2"}, "c1")] and message.content == ""
    assert Message.from_dict({"role": "developer", "content": [{"type": "text", "text": "hi"}]}, "m").role == "system"
    assert not Message.from_dict({"role": "assistant", "content": "x", "weight": 0}, "m").trained
    for value, error in [
        (
            {"role": "robot", "content": "x"},
            r"m: unknown role 'robot' \(expected one of system, user, assistant, tool\)",
        ),
        ({"role": "user", "content": [{"type": "image_url"}]}, "content part of type 'image_url'"),
        (
            {"role": "user", "content": "x", "tool_calls": [{"function": {"name": "a"}}]},
            "a user message has tool_calls",
        ),
        ({"role": "assistant", "tool_calls": [{"function": {}}]}, "tool call 0: a tool call needs a function name"),
        ({"role": "assistant", "content": "x", "weight": 2}, "'weight' must be 0 or 1"),
        ("hello", "a message must be an object"),
    ]:
        with pytest.raises(MessageError, match=error):
            Message.from_dict(value, "m")


def test_conversations_are_checked():
    user, answer = Message("user", "q"), Message("assistant", "a")
    call = Message("assistant", "", [ToolCall("search", {})])
    with pytest.raises(MessageError, match="message 1 is a tool result that follows no tool call"):
        check_conversation([user, Message("tool", "x"), answer], "c")
    with pytest.raises(MessageError, match=r"message 1 calls unknown tool 'search' \(known tools: calc\)"):
        check_conversation([user, call, Message("tool", "x"), answer], "c", tool_names_of([CALC]))
    with pytest.raises(MessageError, match="message 0 is an assistant turn"):
        check_conversation([answer], "c")
    check_conversation([user, call, Message("tool", "x"), answer], "c", {"search"})
