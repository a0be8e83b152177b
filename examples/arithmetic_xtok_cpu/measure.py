"""The cross-tokenizer demo's bar, measured on a finished run of examples/arithmetic_xtok_cpu/config.yaml.

For the student before training (version 0) and the last published policy: greedy answers to the held-out
prompts, scored by the project's evaluator (`evaluate_model`: strict `#### N` and lenient parsers, on text),
and the held-out KL in the teacher's tokenization (`cross_tokenizer_kl`: at every character of the answer, the
teacher's distribution against the student's next-byte distribution; docs/cross-tokenizer.md). The teacher is
scored the same way for its strict accuracy. Prints one JSON object; `--check` exits 1 when the bar is missed
(strict ≥ 0.8 × the teacher's, KL at least 5× lower).

    python examples/arithmetic_xtok_cpu/measure.py runs/xtok/store [--check]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from opd_cache.annotate.cross_kl import cross_tokenizer_kl
from opd_cache.config import SamplingConfig, load_config
from opd_cache.engine import SampleRequest
from opd_cache.evaluate import eval_engine, evaluate_model, first_prompts, policy_folder
from opd_cache.models import load_causal_lm
from opd_cache.storage.store import Store
from opd_cache.tasks.prompts import load_prompts
from opd_cache.tokenizer import load_tokenizer

CONFIG = "examples/arithmetic_xtok_cpu/config.yaml"
STRICT_SHARE, KL_DROP = 0.8, 5.0  # issue #27's bar, the same as the same-tokenizer demo's


def measure_version(path, tokenizer, prompts, teacher, teacher_tok, max_new_tokens: int) -> dict:
    """Strict and lenient accuracy (greedy) and the next-byte KL on the same greedy answers."""
    engine = eval_engine(path, tokenizer, "cpu")
    # the evaluator's greedy answers, generated again for the KL (greedy decoding gives the same ids)
    result = evaluate_model(path, prompts, tokenizer, max_new_tokens=max_new_tokens, engine=engine)
    greedy = SampleRequest(SamplingConfig(temperature=1.0, top_k=1, max_new_tokens=max_new_tokens), n=1, seed=0)
    responses = engine.generate(prompts.prompt_ids, greedy)
    kl = cross_tokenizer_kl(
        engine.model, tokenizer, teacher, teacher_tok, prompts.prompt_ids, [r.token_ids for r in responses]
    )
    return {
        "strict": result.strict,
        "lenient": result.lenient,
        "example": result.example,
        "kl": kl.kl,
        "kl_positions": kl.positions,
        "kl_excluded_rows": kl.excluded_rows,
    }


def measure(store_uri: str, config: str = CONFIG) -> dict:
    cfg = load_config(config, overrides={"store.uri": store_uri})
    store = Store(store_uri)
    run = store.manifest.require()
    tokenizer = load_tokenizer(run.student)
    teacher_tok = load_tokenizer(cfg.annotate.teacher)
    teacher = load_causal_lm(cfg.annotate.teacher).eval()
    prompts = first_prompts(load_prompts(cfg.eval.prompts, tokenizer), cfg.eval.max_prompts)
    last = store.latest_version()
    tic = time.monotonic()
    before = measure_version(run.student, tokenizer, prompts, teacher, teacher_tok, cfg.eval.max_new_tokens)
    after = measure_version(
        policy_folder(store, last), tokenizer, prompts, teacher, teacher_tok, cfg.eval.max_new_tokens
    )
    teacher_prompts = first_prompts(load_prompts(cfg.eval.prompts, teacher_tok), cfg.eval.max_prompts)
    teacher_acc = evaluate_model(
        cfg.annotate.teacher, teacher_prompts, teacher_tok, max_new_tokens=cfg.eval.max_new_tokens
    )
    report = {
        "store": store_uri,
        "version": last,
        "prompts": len(prompts),
        "before": before,
        "after": after,
        "teacher": {"strict": teacher_acc.strict, "lenient": teacher_acc.lenient},
        "strict_share": after["strict"] / max(teacher_acc.strict, 1e-9),
        "kl_drop": before["kl"] / max(after["kl"], 1e-12),
        "seconds": round(time.monotonic() - tic, 1),
    }
    report["passed"] = report["strict_share"] >= STRICT_SHARE and report["kl_drop"] >= KL_DROP
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("store", help="the store of a finished run of the example")
    parser.add_argument("--config", default=CONFIG)
    parser.add_argument("--check", action="store_true", help="exit 1 when the bar is missed")
    args = parser.parse_args()
    torch.set_num_threads(1)  # tiny models: one forward pass at a time, and the machine is shared
    report = measure(args.store, args.config)
    print(json.dumps(report, indent=2))
    if args.check and not report["passed"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
