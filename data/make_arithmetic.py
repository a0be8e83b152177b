"""Write the synthetic arithmetic task to data/arithmetic/{train,test}.parquet (verl's format).

Deterministic: the same seed gives the same 7,700 training and 400 held-out prompts.

    python data/make_arithmetic.py
    python data/make_arithmetic.py --out-dir DIR --seed 1234 --num-test 400
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pyarrow.parquet as pq

from opd_cache.tasks.arithmetic import NUM_TEST, SPLIT_SEED, make_tables

DEFAULT_OUT = Path(__file__).resolve().parent / "arithmetic"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--seed", type=int, default=SPLIT_SEED)
    parser.add_argument("--num-test", type=int, default=NUM_TEST)
    args = parser.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for split, table in make_tables(args.seed, args.num_test).items():
        out = args.out_dir / f"{split}.parquet"
        pq.write_table(table, out, compression="zstd")
        print(f"wrote {out}: {table.num_rows} prompts")


if __name__ == "__main__":
    main()
