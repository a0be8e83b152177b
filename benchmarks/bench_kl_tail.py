"""Where a student's held-out KL lies: inside the teacher's top-k, or in the shape of the tail (issue #25).

A top-k divergence with a tail bucket sees the teacher through k + 1 buckets: the k tokens of its top-k and
"everything else". The full-vocabulary KL the evaluator measures splits exactly (the chain rule of KL) into

    KL(p ‖ q) = KL over the k + 1 buckets  +  p_tail × KL(p | tail ‖ q | tail)

where the second term is the shape of the mass outside the top-k, which no top-k target constrains. This
script evaluates finished students the way bench_trl.py does (greedy answers to the demo's held-out prompts,
KL(teacher ‖ student) per answer token) and prints both terms for each k, so a gap between an opd student and
TRL's full-vocabulary student can be placed:

    python benchmarks/bench_kl_tail.py --model opd=/tmp/bt/opd/store --model trl=/tmp/bt/trl/student

Each --model is NAME=PATH (a store: its newest policy; or a checkpoint folder). Writes JSON with --out.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from opd_cache.config import SamplingConfig
from opd_cache.engine import SampleRequest
from opd_cache.evaluate import eval_engine, first_prompts, load_teacher, resolve_model
from opd_cache.launch.demo import demo_config
from opd_cache.rollout.hf_generate import right_pad
from opd_cache.tasks.prompts import load_prompts
from opd_cache.tokenizer import load_tokenizer


@torch.inference_mode()
def kl_split(student, teacher, prompt_ids, response_ids, ks: list[int]) -> dict:
    """Mean per-token full KL(teacher ‖ student), and for each k its bucket part and its tail-shape part."""
    full, count = 0.0, 0
    bucket = dict.fromkeys(ks, 0.0)
    teacher_tail = dict.fromkeys(ks, 0.0)
    for start in range(0, len(response_ids), 64):
        batch = range(start, min(start + 64, len(response_ids)))
        ids, mask = right_pad([list(prompt_ids[i]) + list(response_ids[i]) for i in batch], "cpu")
        s_logits = student(input_ids=ids, attention_mask=mask).logits.float()
        t_logits = teacher(input_ids=ids, attention_mask=mask).logits.float()
        vocab = min(s_logits.shape[-1], t_logits.shape[-1])
        for row, i in enumerate(batch):
            p_len, r_len = len(prompt_ids[i]), len(response_ids[i])
            if r_len == 0:
                continue
            pos = slice(p_len - 1, p_len - 1 + r_len)
            log_q = F.log_softmax(s_logits[row, pos, :vocab], dim=-1).double()
            log_p = F.log_softmax(t_logits[row, pos, :vocab], dim=-1).double()
            full += float((log_p.exp() * (log_p - log_q)).sum())
            count += r_len
            for k in ks:
                top = log_p.topk(k, dim=-1).indices
                in_top = torch.zeros_like(log_p, dtype=torch.bool).scatter_(1, top, True)
                p_top, q_top = log_p.exp() * in_top, log_q.exp() * in_top
                p_rest = (1 - p_top.sum(-1)).clamp_min(1e-300)
                q_rest = (1 - q_top.sum(-1)).clamp_min(1e-300)
                inside = (p_top * (log_p - log_q)).sum(-1)
                bucket[k] += float((inside + p_rest * (p_rest.log() - q_rest.log())).sum())
                teacher_tail[k] += float(p_rest.sum())
    result = {"tokens": count, "kl": full / count}
    for k in ks:
        result[f"top{k}"] = {
            "bucket_kl": bucket[k] / count,
            "tail_shape_kl": (full - bucket[k]) / count,
            "teacher_tail_mass": teacher_tail[k] / count,
        }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", action="append", required=True, metavar="NAME=PATH")
    parser.add_argument("--k", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)

    cfg = demo_config(Path("/tmp/opd-kl-tail"), 0, [])
    tokenizer = load_tokenizer(cfg.rollout.student)
    prompts = first_prompts(load_prompts(cfg.eval.prompts, tokenizer), cfg.eval.max_prompts)
    teacher = load_teacher(cfg.annotate.teacher, tokenizer, "cpu")
    sampling = SamplingConfig(temperature=1.0, top_k=1, max_new_tokens=cfg.eval.max_new_tokens)  # greedy

    results = {}
    print(
        f"{'model':<12} {'KL':>8} "
        + " ".join(f"{'top' + str(k) + ' bucket':>12} {'tail shape':>10} {'p_tail':>8}" for k in args.k)
    )
    for spec in args.model:
        name, _, path = spec.partition("=")
        folder, _, _ = resolve_model(path)
        engine = eval_engine(folder, tokenizer, "cpu", seed=0)
        responses = engine.generate(prompts.prompt_ids, SampleRequest(sampling, n=1, seed=0))
        split = kl_split(engine.model, teacher, prompts.prompt_ids, [r.token_ids.tolist() for r in responses], args.k)
        results[name] = {"path": path, **split}
        parts = " ".join(
            f"{split[f'top{k}']['bucket_kl']:>12.5f} {split[f'top{k}']['tail_shape_kl']:>10.5f} "
            f"{split[f'top{k}']['teacher_tail_mass']:>8.5f}"
            for k in args.k
        )
        print(f"{name:<12} {split['kl']:>8.5f} {parts}")
    if args.out:
        args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
