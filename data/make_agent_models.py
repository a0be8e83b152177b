"""Train the multi-turn (agent) demo's teacher and student: data/models/agent_teacher/ and agent_student/.

The agent demo (examples/arithmetic_agent_cpu, docs/agents.md) renders the arithmetic prompt with the tools
template (data/chat_templates/arithmetic_tools.jinja). Its teacher calls the calculator, reads the result and
answers in the GSM8K format:

    What is 37 + 48?\\n  [calc(37+48)]<eos>  = 85\\n   #### 85<eos>
    (user)              (assistant: trained) (tool)  (assistant: trained)

The teacher also learns to recover from the student's habit: in a share of its training conversations
(`--recovery-share`) the first assistant turn is an untrained " ans= N" (N right or off by a little), the user
replies "Check it with calc." (the calculator environment's `require_tool` reply), and the teacher's trained
turns call the tool and answer. With `require_tool: true` in the example's config this is the context of the
student's early conversations, so the teacher's targets there are a call, not noise.

The student is the shipped demo student (data/models/student: 2 layers, answers " ans= 85" in the plain format)
fine-tuned on a mixture: plain answers, and tool conversations (`--tool-share`) whose opening "[" is trained in
only `--call-share` of all conversations. It knows the call syntax and the answer after a result, but rarely
starts a call: greedy, it never does (tool-call success 0, strict accuracy 0). On-policy distillation has to
teach it *when* to call the tool. (The plain demo student untouched also learns the call, the copying of the
operands and of the result from the teacher alone, but on CPU that takes far more than the demo's minutes:
after 400 steps it called the tool in every conversation with the right operands in 56% and answered right in
16%.)

Same recipe as data/make_demo_models.py (Llama of hidden size 64, the character tokenizer, supervised next-token
loss on the trained tokens only, AdamW with warm-up and cosine decay); deterministic for a given seed and thread
count. The conversations are rendered by `render_conversation`, the same code that renders rollout rows, so the
trained positions are those `opd rollout` masks in.

    python data/make_agent_models.py                          # both, about 25 min on a loaded 2-core machine
    python data/make_agent_models.py --models agent_student   # the student only (5 min)
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
from opd_cache.evaluate import first_prompts
from opd_cache.evaluate_agent import evaluate_agent_model, evaluation_sampler
from opd_cache.models import load_causal_lm, save_causal_lm
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


def conversation_tensors(
    renderer: ChatRenderer, conversations, untrained_first: list[bool] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids [N, T] (right-padded with the pad token) and labels [N, T] (-100 where the loss mask is 0, and
    at the first response token of the conversations `untrained_first` marks)."""
    rows, label_rows = [], []
    for i, messages in enumerate(conversations):
        row = render_conversation(renderer, messages)
        ids = row.prompt_ids.tolist() + row.response_ids.tolist()
        labels = [-100] * len(row.prompt_ids) + [t if m else -100 for t, m in zip(row.response_ids, row.loss_mask)]
        if untrained_first is not None and untrained_first[i]:
            labels[len(row.prompt_ids)] = -100
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


def student_conversation(a: int, b: int, rng: random.Random, tool_share: float, call_share: float):
    """One fine-tuning conversation of the student and whether its first token is untrained (module docstring):
    a plain answer " ans= N", or (`tool_share`) the tool conversation, whose opening "[" is trained only in a
    `call_share` of all conversations, so that the student knows the call but rarely starts one."""
    if rng.random() >= tool_share:
        return [Message("user", f"What is {a} + {b}?"), Message("assistant", student_answer(a + b))], False
    return teacher_conversation(a, b, rng, 0.0), rng.random() >= call_share / tool_share


def operands(prompts) -> list[tuple[int, int]]:
    return [(json.loads(e)["a"], json.loads(e)["b"]) for e in prompts.extra]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", type=Path, default=DATA / "models")
    parser.add_argument("--models", default="agent_teacher,agent_student", help="which to build (comma-separated)")
    parser.add_argument("--teacher-steps", type=int, default=1000)
    parser.add_argument("--recovery-share", type=float, default=0.25)
    parser.add_argument("--student-steps", type=int, default=800)
    parser.add_argument("--tool-share", type=float, default=0.5)
    parser.add_argument("--call-share", type=float, default=0.1)
    parser.add_argument("--eval-prompts", type=int, default=200, help="held-out prompts for the README's table")
    recipe = demo_recipe()
    recipe.add_recipe_options(parser, seed=0, threads=1)
    parser.set_defaults(batch_size=64)  # the committed models' build (their README.md)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    tokenizer = load_tokenizer(TOKENIZER)
    renderer = ChatRenderer.from_file(tokenizer, TOOLS_TEMPLATE, tools=[CALC_TOOL])
    pairs = operands(load_prompts(TRAIN_PROMPTS, tokenizer))
    for name in args.models.split(","):
        torch.manual_seed(args.seed)
        rng = random.Random(args.seed)
        start = time.time()
        if name == "agent_teacher":
            model = recipe.recipe_model(tokenizer, 3, args.seed)
            conversations = [teacher_conversation(a, b, rng, args.recovery_share) for a, b in pairs]
            input_ids, labels = conversation_tensors(renderer, conversations)
            steps = args.teacher_steps
        elif name == "agent_student":
            model = load_causal_lm(STUDENT)  # the demo student, fine-tuned: it already adds and reads operands
            made = [student_conversation(a, b, rng, args.tool_share, args.call_share) for a, b in pairs]
            input_ids, labels = conversation_tensors(renderer, [m for m, _ in made], [u for _, u in made])
            steps = args.student_steps
        else:
            raise SystemExit(f"--models: unknown model {name!r} (expected agent_teacher, agent_student)")
        recipe.supervise(model, input_ids, labels, steps, args.batch_size, args.lr, args.seed, name)
        save_causal_lm(model, tokenizer, args.out_dir / name)
        elapsed = time.time() - start
        results = evaluate_saved(args.out_dir / name, tokenizer, args.eval_prompts)
        results[name]["params"] = sum(p.numel() for p in model.parameters())
        print(f"{name}: done in {elapsed:.0f} s")
        write_readme(args.out_dir / name, name, steps, args, results, elapsed, args.eval_prompts)


def evaluate_saved(path: Path, tokenizer, num_prompts: int) -> dict:
    """Greedy conversations with the calculator on held-out prompts, as the demo loads the model; the shipped
    demo student for comparison."""
    test = first_prompts(load_prompts(TEST_PROMPTS, tokenizer), num_prompts)
    agent = AgentConfig(environment="calculator", chat_template=str(TOOLS_TEMPLATE), max_turns=3, max_tokens=96)
    sampler = evaluation_sampler(agent, tokenizer, MAX_NEW_TOKENS)
    results = {}
    for name, model_path in ((path.name, path), ("student", STUDENT)):
        result = evaluate_agent_model(model_path, test, tokenizer, sampler, device="cpu")
        results[name] = {k: getattr(result, k) for k in ("tool_success", "strict", "lenient", "turns")}
        print(f"{name}: {results[name]}  example {result.example!r}")
    return results


RECIPES = {  # what each model is and how it was trained (its README.md)
    "agent_teacher": (
        "The teacher of the multi-turn demo: a 3-layer Llama-style model ({params:,} parameters, hidden 64, 4 heads, "
        "ffn 256, tied embeddings) over the character tokenizer, trained from scratch on conversations rendered "
        "with `data/chat_templates/arithmetic_tools.jinja`: `What is 37 + 48?\\n` → `[calc(37+48)]<eos>` → "
        "`= 85\\n` → ` #### 85<eos>` ({recovery_share:.0%} of them after an untrained ` ans= N<eos>` and the "
        "reply `Check it with calc.`)."
    ),
    "agent_student": (
        "The student of the multi-turn demo: the shipped demo student (`data/models/student`, 2 layers, "
        "{params:,} parameters) fine-tuned on a mixture: {plain:.0%} plain answers ` ans= N<eos>` and "
        "{tool_share:.0%} tool conversations (`[calc(37+48)]<eos>` → `= 85\\n` → ` #### 85<eos>`) whose "
        "opening `[` is trained in only {call_share:.0%} of all conversations. It knows the call and how to "
        "answer after a result, but rarely starts a call: greedy, it answers ` ans= N` at once."
    ),
}


def write_readme(out: Path, name: str, steps: int, args, results: dict, elapsed: float, num_test: int) -> None:
    rows = "\n".join(
        f"| {model} | {r['tool_success']:.3f} | {r['strict']:.3f} | {r['lenient']:.3f} | {r['turns']:.2f} |"
        for model, r in results.items()
    )
    about = RECIPES[name].format(
        params=results[name]["params"],
        recovery_share=args.recovery_share,
        plain=1 - args.tool_share,
        tool_share=args.tool_share,
        call_share=args.call_share,
    )
    command = (
        f"python data/make_agent_models.py --models {name} --teacher-steps {args.teacher_steps} "
        f"--recovery-share {args.recovery_share} --student-steps {args.student_steps} --tool-share "
        f"{args.tool_share} --call-share {args.call_share} --batch-size {args.batch_size} --lr {args.lr} "
        f"--seed {args.seed} --threads {args.threads}"
    )
    text = f"""# {name}

{about}

Built by `data/make_agent_models.py` for examples/arithmetic_agent_cpu (docs/agents.md): loss on the assistant
tokens only, AdamW {args.lr} with warm-up and cosine decay, batch {args.batch_size}, {steps} steps.

Greedy conversations with the calculator environment (`require_tool` off, 3 turns, 16 tokens a turn) on the
first {num_test} held-out prompts (`data/arithmetic/test.parquet`), measured on the saved checkpoint
(`opd_cache/evaluate_agent.py`), and the shipped demo student for comparison:

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
