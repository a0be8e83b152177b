"""Turn GSM8K into verl's preprocessed parquet format (for users with access to the Hugging Face hub).

    python data/prepare_gsm8k.py --out-dir data/gsm8k     # writes train.parquet and test.parquet

Each row becomes one user message (the question plus verl's instruction to end
with "####"), `data_source` "openai/gsm8k", and the number after the
solution's `####` as `reward_model.ground_truth`; the full worked solution is
kept in `extra_info.answer`. This mirrors verl's
examples/data_preprocess/gsm8k.py, so files made by either work with both.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from opd_cache.tasks.prompts import verl_prompt_table
from opd_cache.tasks.rewards import strict_answer

DATA_SOURCE = "openai/gsm8k"
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'


def gsm8k_row_to_verl(row: dict, index: int, split: str) -> dict:
    """One GSM8K row {"question", "answer"} → one row of verl's format."""
    ground_truth = strict_answer(row["answer"])
    if ground_truth is None:
        raise ValueError(f"gsm8k {split} row {index}: the answer has no '#### <number>' part: {row['answer'][-80:]!r}")
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": f"{row['question']} {INSTRUCTION}"}],
        "ability": "math",
        "reward_model": {"ground_truth": ground_truth, "style": "rule"},
        "extra_info": {"split": split, "index": index, "answer": row["answer"], "question": row["question"]},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent / "gsm8k")
    parser.add_argument("--dataset", default="openai/gsm8k", help="hub id or local path of GSM8K")
    args = parser.parse_args()

    import datasets
    import pyarrow.parquet as pq

    splits = datasets.load_dataset(args.dataset, "main")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for split, dataset in splits.items():
        rows = [gsm8k_row_to_verl(row, i, split) for i, row in enumerate(dataset)]
        out = args.out_dir / f"{split}.parquet"
        pq.write_table(verl_prompt_table(rows), out)
        print(f"wrote {out}: {len(rows)} prompts")


if __name__ == "__main__":
    main()
