"""Train the cross-tokenizer demo's student: the demo student's job (" ans= 85") with the BPE tokenizer.

The character-level teacher in data/models/teacher/ and this student share no tokenizer, so distilling one
into the other needs `annotate.cross_tokenizer` (docs/cross-tokenizer.md; examples/arithmetic_xtok_cpu/).
Same recipe as data/make_demo_models.py (2 layers, hidden 64, supervised on the answer tokens), with the
107-token byte-level BPE of data/tokenizer_bpe/, plus `--varied-prefixes` more copies of the training prompts
whose answer starts with a random prefix (` ` + 1-6 random letters or punctuation, never a digit or `#` + ` `)
that is given, not learned: the loss covers the sum and <eos> only. The student's own answer stays
` ans= 85` (strict 0), but it learns to add wherever its answer starts. Without them it added only 4 tokens
after the question (` ans= ` is `Ġ` `ans` `=` `Ġ` here); with the teacher's ` #### ` forced in front (6 tokens
when written a character at a time, as the distilled student writes it) it scored 0.000, and the distilled
student lost its sums and did not relearn them in 800 steps (docs/cross-tokenizer.md, "The demo").

    python data/make_bpe_student.py                         # writes data/models/student_bpe/
    python data/make_bpe_student.py --steps 200 --out /tmp/student_bpe
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import string
import time
from pathlib import Path

import torch

from opd_cache.models import load_causal_lm, save_causal_lm
from opd_cache.tasks.arithmetic import student_answer
from opd_cache.tasks.prompts import load_prompts
from opd_cache.tokenizer import load_tokenizer

DATA = Path(__file__).resolve().parent


def demo_recipe():
    """data/make_demo_models.py as a module (its batch builder, training loop and greedy evaluation)."""
    spec = importlib.util.spec_from_file_location("make_demo_models", DATA / "make_demo_models.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# the characters of a varied prefix's word: letters and punctuation, never a digit (the sum's), a space (the
# word is one pre-token) or `#` (the teacher's marker: the student never sees it)
PREFIX_CHARACTERS = "".join(c for c in string.ascii_letters + string.punctuation if c != "#")


def varied_prefix(rng: random.Random, max_word: int = 6) -> str:
    """An answer prefix other than the student's own: ' ' + a random word of 1-`max_word` characters + ' '."""
    return " " + "".join(rng.choice(PREFIX_CHARACTERS) for _ in range(rng.randint(1, max_word))) + " "


def varied_prefix_tensors(prompts, tokenizer, copies: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`copies` rows a prompt: prompt + a varied prefix + the sum + <eos>, the loss on the sum and <eos> only.

    The prefix is given, never a target, so the student's greedy answer stays ` ans= N`; the sum sits 3 to 8
    tokens after the question instead of always 4.
    """
    rng = random.Random(seed)
    rows, label_rows = [], []
    for _ in range(copies):
        for prompt_ids, truth in zip(prompts.prompt_ids, prompts.ground_truth):
            prefix_ids = tokenizer(varied_prefix(rng), add_special_tokens=False)["input_ids"]
            answer_ids = tokenizer(str(truth), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            rows.append(prompt_ids + prefix_ids + answer_ids)
            label_rows.append([-100] * (len(prompt_ids) + len(prefix_ids)) + answer_ids)
    return padded(rows, tokenizer.pad_token_id), padded(label_rows, -100)


def padded(rows: list[list[int]], value: int) -> torch.Tensor:
    out = torch.full((len(rows), max(map(len, rows))), value, dtype=torch.long)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(row)
    return out


def stacked(a: torch.Tensor, b: torch.Tensor, value: int) -> torch.Tensor:
    """`a` over `b`, the narrower one right-padded with `value`."""
    width = max(a.shape[1], b.shape[1])
    pad = torch.nn.functional.pad
    return torch.cat([pad(a, (0, width - a.shape[1]), value=value), pad(b, (0, width - b.shape[1]), value=value)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=DATA / "models" / "student_bpe")
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument(
        "--varied-prefixes", type=int, default=2, help="copies of the training prompts with a random answer prefix"
    )
    recipe = demo_recipe()
    recipe.add_recipe_options(parser, seed=1, threads=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tokenizer = load_tokenizer(DATA / "tokenizer_bpe")
    train = load_prompts(recipe.TRAIN_PROMPTS, tokenizer)
    test = load_prompts(recipe.TEST_PROMPTS, tokenizer)
    model = recipe.recipe_model(tokenizer, num_layers=2, seed=args.seed)
    start = time.time()
    input_ids, labels = recipe.make_batch_tensors(train, tokenizer, student_answer)
    if args.varied_prefixes:
        extra_ids, extra_labels = varied_prefix_tensors(train, tokenizer, args.varied_prefixes, args.seed)
        input_ids = stacked(input_ids, extra_ids, tokenizer.pad_token_id)
        labels = stacked(labels, extra_labels, -100)
    recipe.supervise(model, input_ids, labels, args.steps, args.batch_size, args.lr, args.seed, "student_bpe")
    save_causal_lm(model, tokenizer, args.out)
    accuracy = recipe.eval_greedy(load_causal_lm(args.out), load_tokenizer(args.out), test)
    params = sum(p.numel() for p in model.parameters())
    print(
        f"student_bpe: {params} parameters, {args.steps} steps in {time.time() - start:.0f} s, held-out strict "
        f"{accuracy['strict']:.3f}, lenient {accuracy['lenient']:.3f} -> {args.out}"
    )


if __name__ == "__main__":
    main()
