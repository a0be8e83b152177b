"""Train the tiny teacher of the multi-turn (agent) demo and save it to data/models/agent_teacher/.

The agent demo (examples/arithmetic_agent_cpu, docs/agents.md) renders the arithmetic prompt with the tools
template (data/chat_templates/arithmetic_tools.jinja). Its teacher calls the calculator, reads the result and
answers in the GSM8K format:

    What is 37 + 48?\\n  [calc(37+48)]<eos>  = 85\\n   #### 85<eos>
    (user)              (assistant: trained) (tool)  (assistant: trained)

The student is the shipped demo student (data/models/student), trained on the plain format: it answers
" ans= 85" at once and never calls the tool. On-policy distillation alone has to teach it the call, the reading
of the result and the answer format.

The teacher also learns to recover from the student's habit: in a share of the training conversations
(`--recovery-share`) the first assistant turn is an untrained " ans= N" (N right or off by a little), the user
replies "Check it with calc." (the calculator environment's `require_tool` reply), and the teacher's trained
turns call the tool and answer. With `require_tool: true` in the example's config this is the context of the
student's early conversations, so the teacher's targets there are a call, not noise.

Same recipe as data/make_demo_models.py (a 3-layer Llama of hidden size 64, the character tokenizer,
supervised next-token loss on the trained tokens only, AdamW with warm-up and cosine decay); deterministic for a
given seed and thread count; a few minutes on two CPU cores. The conversations are rendered by
`render_conversation`, the same code that renders rollout rows, so the trained positions are those `opd rollout`
masks in.

    python data/make_agent_models.py          # writes data/models/agent_teacher/ (its README.md included)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import time
from pathlib import Path

import torch

from opd_cache.config import AgentConfig
from opd_cache.evaluate import _subset
from opd_cache.evaluate_agent import evaluate_agent_model, evaluation_sampler
from opd_cache.models import save_causal_lm
from opd_cache.rollout.conversation import ChatRenderer, render_conversation
from opd_cache.rollout.environment import CALC_TOOL, REQUIRE_TOOL_REPLY
from opd_cache.rollout.messages import Message, ToolCall
from opd_cache.tasks.arithmetic import student_answer, teacher_answer
from opd_cache.tasks.prompts import load_prompts
from opd_cache.tokenizer import load_tokenizer

DATA = Path(__file__).resolve().parent
TOKENIZER = DATA / "tokenizer"
TOOLS_TEMPLATE = DATA / "chat_templates" / "arithmetic_tools.jinja"
TRAIN_PROMPTS = DATA / "arithmetic" / "train.parquet"
TEST_PROMPTS = DATA / "arithmetic" / "test.parquet"
STUDENT = DATA / "models" / "student"
MAX_NEW_TOKENS = 16  # per assistant turn: "[calc(99+99)]" + <eos> is 14 tokens


def demo_recipe():
    """data/make_demo_models.py as a module (its model builder, options and training loop: the shared recipe)."""
    spec = importlib.util.spec_from_file_location("make_demo_models", DATA / "make_demo_models.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def teacher_conversation(a: int, b: int, rng: random.Random, recovery_share: float) -> list[Message]:
    """One training conversation of the teacher (module docstring); untrained turns have weight 0."""
    total = a + b
    messages = [Message("user", f"What is {a} + {b}?")]
    if rng.random() < recovery_share:  # the student's habit, then the environment's reply
        guess = total + rng.choice([0, 0, -10, -1, 1, 10])
        messages += [Message("assistant", student_answer(guess), trained=False), Message("user", REQUIRE_TOOL_REPLY)]
    return messages + [
        Message("assistant", "", [ToolCall("calc", f"{a}+{b}")]),
        Message("tool", str(total)),
        Message("assistant", teacher_answer(total)),
    ]


def conversation_tensors(renderer: ChatRenderer, conversations) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids [N, T] (right-padded with the pad token) and labels [N, T] (-100 where the loss mask is 0)."""
    rows, label_rows = [], []
    for messages in conversations:
        row = render_conversation(renderer, messages)
        ids = row.prompt_ids.tolist() + row.response_ids.tolist()
        labels = [-100] * len(row.prompt_ids) + [t if m else -100 for t, m in zip(row.response_ids, row.loss_mask)]
        rows.append(ids)
        label_rows.append(labels)
    width = max(map(len, rows))
    pad = renderer.tokenizer.pad_token_id
    input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    for i, (row, label_row) in enumerate(zip(rows, label_rows)):
        input_ids[i, : len(row)] = torch.tensor(row)
        labels[i, : len(label_row)] = torch.tensor(label_row)
    return input_ids, labels


def operands(prompts) -> list[tuple[int, int]]:
    return [(json.loads(e)["a"], json.loads(e)["b"]) for e in prompts.extra]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", type=Path, default=DATA / "models")
    parser.add_argument("--teacher-steps", type=int, default=1000)
    parser.add_argument("--recovery-share", type=float, default=0.25)
    parser.add_argument("--eval-prompts", type=int, default=400, help="held-out prompts for the README's table")
    recipe = demo_recipe()
    recipe.add_recipe_options(parser, seed=0, threads=1)
    parser.set_defaults(batch_size=64)  # the committed teacher's build (its README.md)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    tokenizer = load_tokenizer(TOKENIZER)
    renderer = ChatRenderer.from_file(tokenizer, TOOLS_TEMPLATE, tools=[CALC_TOOL])
    train = load_prompts(TRAIN_PROMPTS, tokenizer)
    rng = random.Random(args.seed)
    conversations = [teacher_conversation(a, b, rng, args.recovery_share) for a, b in operands(train)]
    start = time.time()
    model = recipe.recipe_model(tokenizer, 3, args.seed)
    input_ids, labels = conversation_tensors(renderer, conversations)
    recipe.supervise(model, input_ids, labels, args.teacher_steps, args.batch_size, args.lr, args.seed, "agent_teacher")
    out = args.out_dir / "agent_teacher"
    save_causal_lm(model, tokenizer, out)
    elapsed = time.time() - start

    # Evaluate what was saved, as the demo loads it: greedy conversations with the calculator, held-out prompts.
    test = _subset(load_prompts(TEST_PROMPTS, tokenizer), args.eval_prompts)
    agent = AgentConfig(environment="calculator", chat_template=str(TOOLS_TEMPLATE), max_turns=3, max_tokens=96)
    sampler = evaluation_sampler(agent, tokenizer, MAX_NEW_TOKENS)
    results = {}
    for name, path in (("agent_teacher", out), ("student", STUDENT)):
        result = evaluate_agent_model(path, test, tokenizer, sampler, device="cpu")
        results[name] = {k: getattr(result, k) for k in ("tool_success", "strict", "lenient", "turns")}
        print(f"{name}: {results[name]}  example {result.example!r}")
    results["agent_teacher"]["params"] = sum(p.numel() for p in model.parameters())
    print(f"done in {elapsed:.0f} s")
    write_readme(out, args, results, elapsed, len(test))


def write_readme(out: Path, args, results: dict, elapsed: float, num_test: int) -> None:
    rows = "\n".join(
        f"| {name} | {r['tool_success']:.3f} | {r['strict']:.3f} | {r['lenient']:.3f} | {r['turns']:.2f} |"
        for name, r in results.items()
    )
    command = (
        f"python data/make_agent_models.py --teacher-steps {args.teacher_steps} --recovery-share "
        f"{args.recovery_share} --batch-size {args.batch_size} --lr {args.lr} --seed {args.seed} "
        f"--threads {args.threads}"
    )
    text = f"""# Agent demo teacher

The teacher of the multi-turn demo (examples/arithmetic_agent_cpu, docs/agents.md), trained by
`data/make_agent_models.py`: a 3-layer Llama-style model ({results["agent_teacher"]["params"]:,} parameters,
hidden 64, 4 heads, ffn 256, tied embeddings) over the character tokenizer, on conversations rendered with
`data/chat_templates/arithmetic_tools.jinja`: `What is 37 + 48?\\n` → `[calc(37+48)]<eos>` → `= 85\\n` →
` #### 85<eos>` ({args.recovery_share:.0%} of them after an untrained ` ans= N<eos>` and the reply
`Check it with calc.`). Loss on the assistant tokens only; AdamW {args.lr}, batch {args.batch_size},
{args.teacher_steps} steps.

Greedy conversations with the calculator environment (`require_tool` off, 3 turns, 16 tokens a turn) on the
first {num_test} held-out prompts (`data/arithmetic/test.parquet`), measured on the saved checkpoint
(`opd_cache/evaluate_agent.py`); the agent demo's student, the shipped demo student, for comparison:

| model | tool-call success | strict | lenient | turns |
|---|---|---|---|---|
{rows}

Rebuild (the last build took {elapsed / 60:.1f} min of training with {args.threads} CPU thread(s) on a shared machine;
deterministic for a given seed, thread count and torch version):

    {command}
"""
    (out / "README.md").write_text(text)


if __name__ == "__main__":
    main()
