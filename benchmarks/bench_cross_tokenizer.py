"""Cross-tokenizer OPD vs the same-tokenizer path: annotation throughput, the flags' bytes, the loss step.

    python benchmarks/bench_cross_tokenizer.py           # 400 held-out prompts x 4 answers
    python benchmarks/bench_cross_tokenizer.py --quick   # a smoke run

The same texts are annotated both ways, in one process, by the shipped character-level teacher
(data/models/teacher, hf engine, CPU): the held-out arithmetic prompts (data/arithmetic/test.parquet) with the
demo's two answer formats (" ans= N" and " #### N", right and off by one).

(a) Annotation, per student response token: same-tokenizer = the char tokenizer's rows straight to
    `Scorer.score`; cross-tokenizer = the BPE student's rows (data/tokenizer_bpe) through
    `CrossTokenizerAnnotation.score` (align with `CrossTokenizer.teacher_rows`, score the teacher's rows,
    `student_targets`), with the time split into its three steps. Best of --rounds.
(b) Bytes per student token of the part as stored, with and without the `target_flags` column, plain and packed.
(c) The loss step (forward + backward, hidden states -> loss) of `fused_token_losses` vs
    `fused_cross_tokenizer_losses` on the same N positions, with the flags of (a) tiled to N; V = 400, H = 64.

Ratios are cross / same in one run, so the machine's load cancels out to first order; the load average is
recorded. Results: tables on stdout and benchmarks/results/bench_cross_tokenizer.json.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import markdown_table, write_results  # noqa: E402
from opd_cache.annotate.cross_annotate import CrossTokenizerAnnotation  # noqa: E402
from opd_cache.annotate.cross_targets import student_targets  # noqa: E402
from opd_cache.annotate.cross_tokenizer import render_prompt  # noqa: E402
from opd_cache.annotate.engines import make_scorer  # noqa: E402
from opd_cache.config import AnnotateConfig  # noqa: E402
from opd_cache.losses import LossConfig, SpanTermConfig, fused_cross_tokenizer_losses, fused_token_losses  # noqa: E402
from opd_cache.storage import codec  # noqa: E402
from opd_cache.storage.schema import annotated_table  # noqa: E402
from opd_cache.tokenizer import load_tokenizer  # noqa: E402

TEACHER = ROOT / "data/models/teacher"
K = 8


def texts(num_prompts: int, samples: int) -> tuple[list[str], list[str]]:
    rows = pq.read_table(ROOT / "data/arithmetic/test.parquet").to_pylist()[:num_prompts]
    prompts, answers = [], []
    for i, row in enumerate(rows):
        truth = int(row["reward_model"]["ground_truth"])
        for j in range(samples):
            value = truth + (j // 2)  # right, then off by one
            prompts.append(row["prompt"][-1]["content"])
            answers.append(f" ans= {value}" if (i + j) % 2 else f" #### {value}")
    return prompts, answers


def encode_rows(tok, prompts: list[str], answers: list[str]):
    rendered = {p: np.array(render_prompt(tok, [{"role": "user", "content": p}]), dtype=np.int64) for p in set(prompts)}
    responses = [
        np.array(tok(a, add_special_tokens=False)["input_ids"] + [tok.eos_token_id], dtype=np.int64) for a in answers
    ]
    return [rendered[p] for p in prompts], responses


def best_of(rounds: int, fn):
    times, out = [], None
    for _ in range(rounds):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return min(times), out


def part_bytes(scores, flags, vocab: int) -> dict:
    """Bytes of the part (Arrow IPC stream, as stored) per student token, plain and packed, +/- flags."""
    import pyarrow as pa

    def size(table) -> int:
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
        return sink.getvalue().size

    out = {}
    for name, f in (("without_flags", None), ("with_flags", flags)):
        table = annotated_table(
            sample_ids=[str(i) for i in range(len(scores.lengths))],
            lengths=scores.lengths,
            topk_ids=scores.topk_ids,
            topk_logprobs=scores.topk_logprobs,
            token_logprob=scores.token_logprob,
            target_flags=f,
        )
        out[f"plain_{name}"] = size(table) / scores.num_tokens
        out[f"packed_{name}"] = size(codec.encode_annotation(table, vocab)[0]) / scores.num_tokens
    return out


def loss_step(flags: np.ndarray, tokens: int, rounds: int) -> dict:
    g = torch.Generator().manual_seed(0)
    vocab, hidden_size = 400, 64
    hidden = torch.randn(tokens, hidden_size, generator=g)
    weight = (torch.randn(vocab, hidden_size, generator=g) * 0.3).requires_grad_()
    teacher = torch.log_softmax(torch.randn(tokens, vocab, generator=g) * 2, -1).topk(K)
    sampled = torch.randint(0, vocab, (tokens,), generator=g)
    token_lp = -torch.rand(tokens, generator=g) * 3
    tiled = torch.from_numpy(np.resize(flags, tokens))
    weights = torch.full((tokens,), 1.0 / tokens)
    config = LossConfig()
    h = hidden.requires_grad_()

    def same():
        loss, _ = fused_token_losses(
            h,
            weight,
            teacher.indices,
            teacher.values,
            weights,
            config,
            sampled_ids=sampled,
            teacher_token_logprobs=token_lp,
        )
        loss.backward()

    def cross():
        loss, _ = fused_cross_tokenizer_losses(
            h,
            weight,
            teacher.indices,
            teacher.values,
            weights,
            config,
            target_flags=tiled,
            sampled_ids=sampled,
            teacher_token_logprobs=token_lp,
            span=SpanTermConfig(),
        )
        loss.backward()

    same()  # warm-up
    cross()
    t_same, _ = best_of(rounds, same)
    t_cross, _ = best_of(rounds, cross)
    return {"tokens": tokens, "same_ms": t_same * 1e3, "cross_ms": t_cross * 1e3, "ratio": t_cross / t_same}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=400)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--loss-tokens", type=int, default=16384)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/bench_cross_tokenizer.json")
    args = parser.parse_args()
    if args.quick:
        args.prompts, args.rounds, args.loss_tokens = 24, 1, 2048
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()

    char_tok, bpe_tok = load_tokenizer(TEACHER), load_tokenizer(ROOT / "data/tokenizer_bpe")
    prompts, answers = texts(args.prompts, args.samples)
    same_prompts, same_responses = encode_rows(char_tok, prompts, answers)
    cross_prompts, cross_responses = encode_rows(bpe_tok, prompts, answers)
    scorer = make_scorer(AnnotateConfig(teacher=str(TEACHER), device="cpu"), K, len(char_tok))
    cross = CrossTokenizerAnnotation(bpe_tok, char_tok, topk_rule="one_to_one")

    scorer.score(same_prompts[:8], same_responses[:8], K)  # warm-up
    t_same, same_scores = best_of(args.rounds, lambda: scorer.score(same_prompts, same_responses, K))
    t_cross, targets = best_of(args.rounds, lambda: cross.score(scorer, cross_prompts, cross_responses, K))
    # the cross path's three steps, timed on their own
    t_align, rows = best_of(args.rounds, lambda: cross.aligner.teacher_rows(cross_prompts, cross_responses))
    aligned = [r for r in rows if r.alignment is not None]
    t_score, teacher_scores = best_of(
        args.rounds, lambda: scorer.score([r.prompt_ids for r in aligned], [r.response_ids for r in aligned], K)
    )
    t_targets, _ = best_of(
        args.rounds,
        lambda: student_targets(rows, cross_responses, teacher_scores, cross.aligner.vocab_map.teacher_to_student),
    )
    student_tokens = int(sum(len(r) for r in cross_responses))
    same_tokens = same_scores.num_tokens
    annotate = {
        "rows": len(prompts),
        "same_student_tokens": same_tokens,
        "cross_student_tokens": student_tokens,
        "cross_teacher_tokens": int(sum(len(r.response_ids) for r in aligned)),
        "same_rows_per_s": len(prompts) / t_same,
        "cross_rows_per_s": len(prompts) / t_cross,
        "row_time_ratio": t_cross / t_same,
        "same_tokens_per_s": same_tokens / t_same,
        "cross_student_tokens_per_s": student_tokens / t_cross,
        "cross_split_s": {"align": t_align, "score": t_score, "targets": t_targets},
        "alignment": targets.stats.summary(),
    }
    bytes_per_token = part_bytes(targets.scores, targets.target_flags, len(bpe_tok))
    loss = loss_step(targets.target_flags, args.loss_tokens, max(args.rounds, 3))
    result = {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "threads": args.threads},
        "load_avg_before": load_before,
        "load_avg_after": os.getloadavg(),
        "args": vars(args) | {"out": str(args.out)},
        "annotate": annotate,
        "bytes_per_student_token": bytes_per_token,
        "loss_step": loss,
    }

    print(
        markdown_table(
            ["path", "rows/s", "student tokens/s", "time ratio"],
            "lrrr",
            [
                [
                    "same tokenizer (char)",
                    f"{annotate['same_rows_per_s']:,.0f}",
                    f"{annotate['same_tokens_per_s']:,.0f}",
                    "1.00",
                ],
                [
                    "cross tokenizer (BPE student)",
                    f"{annotate['cross_rows_per_s']:,.0f}",
                    f"{annotate['cross_student_tokens_per_s']:,.0f}",
                    f"{annotate['row_time_ratio']:.2f}",
                ],
            ],
        )
    )
    split = annotate["cross_split_s"]
    print(
        f"\ncross split: align {split['align']:.3f} s, score {split['score']:.3f} s, targets {split['targets']:.3f} s"
    )
    print("bytes per student token:", {k: round(v, 2) for k, v in bytes_per_token.items()})
    print(
        f"loss step ({loss['tokens']} tokens): same {loss['same_ms']:.1f} ms, cross {loss['cross_ms']:.1f} ms, "
        f"ratio {loss['ratio']:.2f}"
    )
    print(f"load average before {load_before}, after {result['load_avg_after']}")
    write_results(args.out, result)


if __name__ == "__main__":
    main()
