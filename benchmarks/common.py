"""What the benchmark scripts share: running one measurement in a fresh process, and writing the results JSON.

The scripts import it as `common` (a script's own folder is first on sys.path); each keeps its own timing
(wall or CPU time, best or median of what) and its own ratio table, since those differ by what they measure.
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import Tensor

ROOT = Path(__file__).resolve().parents[1]


def benchmark_parser(
    doc: str, *, quick_help: str, threads: int | None, repeats: int, threads_help: str | None = None
) -> argparse.ArgumentParser:
    """A benchmark's argument parser with the flags they share: --quick, --threads, --repeats."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help=quick_help)
    parser.add_argument("--threads", type=int, default=threads, help=threads_help)
    parser.add_argument("--repeats", type=int, default=repeats)
    return parser


def child_json(cmd: list[str], what: str) -> dict:
    """Run `cmd` (a benchmark's own worker mode) in a fresh process; its last stdout line is its JSON result.

    A fresh process per measurement keeps peak memory and warm caches of one variant out of the next.
    """
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"{what} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def markdown_table(header: list[str], align: str, rows: list[list]) -> str:
    """A Markdown table as the benchmarks print it; `align`: one letter per column, l (text) or r (numbers)."""
    rule = {"l": "---", "r": "---:"}
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(rule[a] for a in align) + "|"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def write_results(path: Path, result: dict) -> None:
    """Write a benchmark's figures to benchmarks/results/ (docs/benchmarks.md quotes them) and say where."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")


def naive_topk_kl(h: Tensor, w: Tensor, ids: Tensor, logprobs: Tensor, weights: Tensor) -> Tensor:
    """The baseline the loss benchmarks beat: top-k forward KL with a tail bucket on the full [N, V] logits.

    Materialises h @ w.T (in float32) and its log-softmax, as a plain PyTorch implementation would.
    """
    logq = (h @ w.t()).float().log_softmax(-1)
    logq_support = logq.gather(1, ids)
    logq_tail = logq.scatter(1, ids, float("-inf")).logsumexp(-1)
    p = logprobs.exp()
    p_tail = (1.0 - p.sum(1)).clamp_min(1e-12)
    kl = (p * (logprobs - logq_support)).sum(1) + p_tail * (p_tail.log() - logq_tail)
    return (weights * kl).sum()
