"""The synthetic arithmetic task of the CPU demo: "What is 37 + 48?".

Both operands run from 10 to 99, so every question has the same number of
characters (and, with the shipped character tokenizer, the same number of
tokens: no padding anywhere). The 8,100 ordered pairs are shuffled once with a
fixed seed and split into 7,700 training and 400 held-out prompts.

Two answer formats put the number at the same position:

    teacher (GSM8K-style, what the strict parser wants):  " #### 85"
    student (the demo's "wrong" format):                   " ans= 85"

so a student that already adds correctly only has to learn the format from the
teacher (a number at another position makes relearning slower: 560-580 steps in
a pilot run before this project).
"""

from __future__ import annotations

import random

import pyarrow as pa

from opd_cache.tasks.prompts import verl_prompt_table

DATA_SOURCE = "arithmetic"
OPERAND_RANGE = range(10, 100)
NUM_TEST = 400
SPLIT_SEED = 1234

QUESTION_FORMAT = "What is {a} + {b}?"
TEACHER_FORMAT = " #### {answer}"
STUDENT_FORMAT = " ans= {answer}"


def question(a: int, b: int) -> str:
    return QUESTION_FORMAT.format(a=a, b=b)


def teacher_answer(answer: int | str) -> str:
    return TEACHER_FORMAT.format(answer=answer)


def student_answer(answer: int | str) -> str:
    return STUDENT_FORMAT.format(answer=answer)


def split_pairs(seed: int = SPLIT_SEED, num_test: int = NUM_TEST) -> dict[str, list[tuple[int, int]]]:
    """All operand pairs, shuffled with `seed` and split into {"train": [...], "test": [...]}."""
    pairs = [(a, b) for a in OPERAND_RANGE for b in OPERAND_RANGE]
    random.Random(seed).shuffle(pairs)
    return {"train": pairs[num_test:], "test": pairs[:num_test]}


def verl_row(a: int, b: int, split: str, index: int) -> dict:
    """One prompt in verl's preprocessed format."""
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": question(a, b)}],
        "ability": "math",
        "reward_model": {"ground_truth": str(a + b), "style": "rule"},
        "extra_info": {"split": split, "index": index, "a": a, "b": b},
    }


def make_tables(seed: int = SPLIT_SEED, num_test: int = NUM_TEST) -> dict[str, pa.Table]:
    """{"train": table, "test": table} in verl's parquet format."""
    return {
        split: verl_prompt_table([verl_row(a, b, split, i) for i, (a, b) in enumerate(pairs)])
        for split, pairs in split_pairs(seed, num_test).items()
    }
