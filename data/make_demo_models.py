"""Train the tiny teacher and student of the CPU demo and save them to data/models/.

The demo's story: the student already adds correctly but writes
its answer in another format (" ans= 85"), so the strict GSM8K parser
(`#### 85`) scores it near 0 while a lenient parser (last number) finds it
right. The teacher writes " #### 85". On-policy distillation alone, with no task
reward, should teach the student the teacher's format. Both formats put the
number at the same position, which makes relearning fast and reliable (in a
pilot run before this project, a number at another position took 560-580 steps
to relearn, and one seed in three missed the target within 1,000 steps).

Both models are Llama-style with the shipped character tokenizer, trained with
plain supervised next-token loss on the chat-templated prompt followed by the
answer and <eos> (the loss covers the answer tokens only; the prompt's operands
are random and cannot be predicted). Deterministic for a given seed and thread
count; a few minutes on two CPU cores.

    python data/make_demo_models.py                   # writes data/models/{teacher,student}/ and README.md
    python data/make_demo_models.py --out-dir /tmp/models --teacher-steps 200
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from opd_cache.models import build_tiny_model, load_causal_lm, save_causal_lm
from opd_cache.tasks.arithmetic import student_answer, teacher_answer
from opd_cache.tasks.prompts import PromptSet, load_prompts
from opd_cache.tasks.rewards import get_reward_fn
from opd_cache.tokenizer import load_tokenizer

DATA = Path(__file__).resolve().parent
TOKENIZER = DATA / "tokenizer"
TRAIN_PROMPTS = DATA / "arithmetic" / "train.parquet"
TEST_PROMPTS = DATA / "arithmetic" / "test.parquet"
# " #### 198" + <eos> is 10 tokens: the longest answer.
MAX_NEW_TOKENS = 10


def make_batch_tensors(prompts: PromptSet, tokenizer, answer_format) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids [N, T] (prompt + answer + <eos>, right-padded) and labels [N, T] (-100 outside the answer)."""
    rows, label_rows = [], []
    for prompt_ids, truth in zip(prompts.prompt_ids, prompts.ground_truth):
        answer_ids = tokenizer(answer_format(truth), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        rows.append(prompt_ids + answer_ids)
        label_rows.append([-100] * len(prompt_ids) + answer_ids)
    width = max(map(len, rows))
    input_ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    for i, (row, label_row) in enumerate(zip(rows, label_rows)):
        input_ids[i, : len(row)] = torch.tensor(row)
        labels[i, : len(label_row)] = torch.tensor(label_row)
    return input_ids, labels


def supervise(model, input_ids, labels, steps: int, batch_size: int, lr: float, seed: int, name: str) -> None:
    """AdamW with linear warm-up then cosine decay to zero; next-token cross-entropy on labelled positions."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    warmup = max(1, steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps))
    )
    generator = torch.Generator().manual_seed(seed)
    model.train()
    start = time.time()
    for step in range(steps):
        index = torch.randint(0, len(input_ids), (batch_size,), generator=generator)
        logits = model(input_ids=input_ids[index]).logits
        # Position t predicts token t+1.
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[index][:, 1:].flatten(), ignore_index=-100)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        if step % 100 == 0 or step == steps - 1:
            print(f"  {name} step {step:5d}  loss {loss.item():.4f}  ({time.time() - start:.0f} s)", flush=True)
    model.eval()


@torch.no_grad()
def eval_greedy(
    model, tokenizer, prompts: PromptSet, max_new_tokens: int = MAX_NEW_TOKENS, batch_size: int = 512
) -> dict:
    """Greedy decoding on every prompt; mean strict and lenient accuracy with each row's reward function."""
    totals = {"strict": 0, "lenient": 0}
    for start in range(0, len(prompts), batch_size):
        rows = prompts.prompt_ids[start : start + batch_size]
        batch = tokenizer.pad({"input_ids": rows}, return_tensors="pt")  # left padding
        out = model.generate(
            **batch,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        texts = tokenizer.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
        for offset, text in enumerate(texts):
            i = start + offset
            result = get_reward_fn(prompts.data_source[i])(text, prompts.ground_truth[i])
            for key in totals:
                totals[key] += result[key]
    return {key: value / len(prompts) for key, value in totals.items()}


def add_recipe_options(parser: argparse.ArgumentParser, *, seed: int, threads: int) -> None:
    """The options of `supervise` and the CPU threads it uses (data/make_bpe_student.py takes them too)."""
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=seed)
    parser.add_argument("--threads", type=int, default=threads)


def recipe_model(tokenizer, num_layers: int, seed: int):
    """A demo model: a tiny llama of hidden size 64, 4 heads and tied embeddings over `tokenizer`'s vocabulary."""
    return build_tiny_model(
        "llama",
        len(tokenizer),
        hidden_size=64,
        num_layers=num_layers,
        num_heads=4,
        intermediate_size=256,
        tie_word_embeddings=True,
        seed=seed,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", type=Path, default=DATA / "models")
    parser.add_argument("--teacher-steps", type=int, default=1000)
    parser.add_argument("--student-steps", type=int, default=1200)
    add_recipe_options(parser, seed=0, threads=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    tokenizer = load_tokenizer(TOKENIZER)
    train = load_prompts(TRAIN_PROMPTS, tokenizer)
    test = load_prompts(TEST_PROMPTS, tokenizer)
    specs = {
        "teacher": dict(num_layers=3, answer_format=teacher_answer, steps=args.teacher_steps, seed=args.seed),
        "student": dict(num_layers=2, answer_format=student_answer, steps=args.student_steps, seed=args.seed + 1),
    }
    results = {}
    start = time.time()
    for name, spec in specs.items():
        model = recipe_model(tokenizer, spec["num_layers"], spec["seed"])
        input_ids, labels = make_batch_tensors(train, tokenizer, spec["answer_format"])
        supervise(model, input_ids, labels, spec["steps"], args.batch_size, args.lr, spec["seed"], name)
        out = args.out_dir / name
        save_causal_lm(model, tokenizer, out)
        # Evaluate what was saved, as the demo will load it.
        accuracy = eval_greedy(load_causal_lm(out), load_tokenizer(out), test)
        params = sum(p.numel() for p in model.parameters())
        results[name] = {"params": params, "layers": spec["num_layers"], "steps": spec["steps"], **accuracy}
        print(
            f"{name}: {params} parameters, held-out strict {accuracy['strict']:.3f}, lenient {accuracy['lenient']:.3f}"
        )
    elapsed = time.time() - start
    print(f"done in {elapsed:.0f} s")
    write_readme(args, results, elapsed, len(test))


def write_readme(args, results: dict, elapsed: float, num_test: int) -> None:
    rows = "\n".join(
        f"| {name} | {r['layers']} | {r['params']:,} | {r['steps']} | {r['strict']:.3f} | {r['lenient']:.3f} |"
        for name, r in results.items()
    )
    command = (
        f"python data/make_demo_models.py --teacher-steps {args.teacher_steps} --student-steps {args.student_steps} "
        f"--batch-size {args.batch_size} --lr {args.lr} --seed {args.seed} --threads {args.threads}"
    )
    text = f"""# Demo models

Tiny Llama-style models for the CPU demo, trained by `data/make_demo_models.py` with the character tokenizer
in `data/tokenizer/` on the arithmetic task in `data/arithmetic/` (hidden 64, 4 heads, ffn 256, tied embeddings;
AdamW {args.lr} with warm-up and cosine decay, batch {args.batch_size}).

- `teacher/` answers in the GSM8K format: `What is 37 + 48?\\n` → ` #### 85<eos>`.
- `student/` computes the same sums but answers ` ans= 85<eos>` (the number at the same position), so the
  strict `#### N` parser scores it near 0 and the lenient last-number parser near 1.

Greedy accuracy on the {num_test} held-out prompts (`data/arithmetic/test.parquet`), measured on the saved checkpoints:

| model | layers | parameters | steps | strict | lenient |
|---|---|---|---|---|---|
{rows}

Rebuild (the last build took {elapsed / 60:.0f} min with {args.threads} CPU thread(s); the results are deterministic for a
given seed, thread count and torch version):

    {command}

```json
{json.dumps(results, indent=2)}
```
"""
    (args.out_dir / "README.md").write_text(text)


if __name__ == "__main__":
    main()
