"""Train the cross-tokenizer demo's student: the demo student's job (" ans= 85") with the BPE tokenizer.

The character-level teacher in data/models/teacher/ and this student share no tokenizer, so distilling one
into the other needs `annotate.cross_tokenizer` (docs/cross-tokenizer.md; examples/arithmetic_xtok_cpu/).
Same recipe as data/make_demo_models.py (2 layers, hidden 64, supervised on the answer tokens), with the
400-token byte-level BPE of data/tokenizer_bpe/.

    python data/make_bpe_student.py                         # writes data/models/student_bpe/
    python data/make_bpe_student.py --steps 200 --out /tmp/student_bpe
"""

from __future__ import annotations

import argparse
import importlib.util
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=DATA / "models" / "student_bpe")
    parser.add_argument("--steps", type=int, default=1500)
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
