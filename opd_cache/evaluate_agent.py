"""Evaluation of an agent student: tool-call success, final-answer accuracy and KL at its trained positions.

Each held-out prompt becomes one greedy conversation with the run's environment (`rollout.agent`), run by the
same loop as `opd rollout` (rollout/environment.py `run_conversations`), and is scored three ways:

- tool-call success: the share of conversations in which the model made at least one well-formed tool call
  that the environment answered without an error (`[calc(37+48)]` -> `= 85`);
- final-answer accuracy: the task's reward function (strict `#### N` and lenient parsers) on the last assistant
  message, i.e. the answer given after reading the tool result;
- KL: the mean per-token full-vocabulary KL(teacher ‖ model) over the trained positions of the model's own
  conversations (`loss_mask = 1`: its sampled tokens; tool results and template text are context only).

The environment is built from the run's options except `require_tool`, which is off: the evaluation measures
whether the model calls the tool unprompted, so a conversation ends at the first answer given without a call.

`evaluate_agent_run` scores the teacher, the student before training (version 0) and the store's newest policy,
and checks the demo bar of issue #28 (`agent_bar`): tool-call success and strict accuracy each ≥ 80% of the
teacher's, KL at least 5× lower than before.

    opd eval-agent --config examples/arithmetic_agent_cpu/config.yaml    # or: python -m opd_cache.evaluate_agent
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from opd_cache.config import AgentConfig, Config, SamplingConfig, load_config
from opd_cache.engine import SampleRequest
from opd_cache.evaluate import eval_engine, first_prompts, load_teacher, masked_sequence_kl, resolve_model
from opd_cache.rollout.agent import AgentSampler, engine_generate_fn, environment_prompt, run_conversations
from opd_cache.storage.scratch import owned_temp_prefix
from opd_cache.tasks.prompts import PromptSet, load_prompts
from opd_cache.tasks.rewards import compute_score
from opd_cache.tokenizer import load_tokenizer

# issue #28's bar for the multi-turn demo
BAR_FRACTION_OF_TEACHER = 0.8
BAR_KL_FACTOR = 5.0


@dataclass
class AgentEvalResult:
    tool_success: float  # share of conversations with at least one successful tool call
    strict: float  # final answer correct under the strict parser (share of conversations)
    lenient: float
    kl: float | None  # mean KL(teacher ‖ model) per trained token of the model's conversations; None without one
    num_prompts: int
    turns: float  # mean assistant turns per conversation
    trained_tokens: float  # mean trained (sampled) tokens per conversation
    end_reasons: dict[str, int]
    example: str  # the first conversation's response text, for eyeballing


def evaluation_sampler(agent: AgentConfig, tokenizer, max_new_tokens: int) -> AgentSampler:
    """The run's environment, template and limits, with `require_tool` off (module docstring)."""
    options = {**agent.environment_options, "require_tool": False}
    return AgentSampler.from_config(
        agent.model_copy(update={"environment_options": options}), tokenizer, max_new_tokens
    )


def evaluate_agent_model(
    model_path: str | os.PathLike,
    prompts: PromptSet,
    tokenizer,
    sampler: AgentSampler,
    *,
    teacher=None,
    device: str = "auto",
    seed: int = 0,
) -> AgentEvalResult:
    """One greedy conversation per prompt with `model_path`'s model, scored (module docstring)."""
    engine = eval_engine(model_path, tokenizer, device, seed=seed)
    # greedy = sampling from the top-1 distribution (as evaluate_model does)
    sampling = SamplingConfig(temperature=1.0, top_k=1, max_new_tokens=sampler.limits.max_new_tokens)
    greedy = SampleRequest(sampling, seed=seed)
    envs = [sampler.environment() for _ in range(len(prompts))]
    inputs = [environment_prompt(prompts, p) for p in range(len(prompts))]
    rows = run_conversations(engine_generate_fn(engine, greedy), envs, inputs, sampler.renderer, sampler.limits)
    tool_success, strict, lenient = [], [], []
    for p, (env, row) in enumerate(zip(envs, rows)):
        tool_success.append(env.calls > env.failed_calls)
        answers = [m for m in row.messages if m.role == "assistant"]
        final = answers[-1].content if answers and not answers[-1].tool_calls else ""
        score = compute_score(prompts.data_source[p], final or "", prompts.ground_truth[p])
        strict.append(score["strict"])
        lenient.append(score["lenient"])
    kl = None
    if teacher is not None:
        total, count = masked_sequence_kl(
            engine.model,
            teacher,
            [r.prompt_ids.tolist() for r in rows],
            [r.response_ids.tolist() for r in rows],
            [r.loss_mask for r in rows],
            engine.device,
        )
        kl = total / max(count, 1)
    return AgentEvalResult(
        tool_success=float(np.mean(tool_success)),
        strict=float(np.mean(strict)),
        lenient=float(np.mean(lenient)),
        kl=kl,
        num_prompts=len(prompts),
        turns=float(np.mean([sum(m.role == "assistant" for m in r.messages) for r in rows])),
        trained_tokens=float(np.mean([r.trained_tokens for r in rows])),
        end_reasons=dict(Counter(r.end_reason for r in rows)),
        example=sampler.renderer.decode(rows[0].response_ids) if rows else "",
    )


def agent_bar(teacher: AgentEvalResult, before: AgentEvalResult, after: AgentEvalResult) -> dict:
    """Issue #28's bar: tool-call success and strict accuracy ≥ 80% of the teacher's, KL ÷ ≥ 5 (each checked)."""
    kl_factor = before.kl / after.kl if before.kl is not None and after.kl else None
    checks = {
        "tool_success": after.tool_success >= BAR_FRACTION_OF_TEACHER * teacher.tool_success,
        "strict": after.strict >= BAR_FRACTION_OF_TEACHER * teacher.strict,
        "kl_factor": kl_factor is not None and kl_factor >= BAR_KL_FACTOR,
    }
    return {"checks": checks, "kl_factor": kl_factor, "passed": all(checks.values())}


def evaluate_agent_run(
    cfg: Config,
    prompts_path: str,
    *,
    model: str | None = None,
    max_prompts: int = 200,
    device: str = "auto",
) -> dict:
    """Teacher, student before (version 0) and after (the newest policy of `model`, default the config's store),
    each scored on the same held-out conversations' prompts; plus the bar (`agent_bar`)."""
    if cfg.rollout.agent.environment is None:
        raise ValueError("rollout.agent.environment is unset: the config is not an agent run")
    # a remote store's version is downloaded for this call only
    with tempfile.TemporaryDirectory(prefix=owned_temp_prefix("opd-eval-")) as downloads:
        after_path, version, _ = resolve_model(model or cfg.store.uri, cfg.store.s3_endpoint, Path(downloads))
        tokenizer = load_tokenizer(cfg.rollout.student)
        prompts = first_prompts(load_prompts(prompts_path, tokenizer), max_prompts)
        sampler = evaluation_sampler(cfg.rollout.agent, tokenizer, cfg.rollout.sampling.max_new_tokens)
        teacher = load_teacher(cfg.annotate.teacher, tokenizer, device)
        results = {
            "teacher": evaluate_agent_model(cfg.annotate.teacher, prompts, tokenizer, sampler, device=device),
            "before": evaluate_agent_model(
                cfg.rollout.student, prompts, tokenizer, sampler, teacher=teacher, device=device
            ),
            "after": evaluate_agent_model(after_path, prompts, tokenizer, sampler, teacher=teacher, device=device),
        }
    return {
        "version": version,
        **{name: asdict(result) for name, result in results.items()},
        "bar": agent_bar(results["teacher"], results["before"], results["after"]),
    }


def format_table(report: dict) -> str:
    """The report as a markdown table (one row per model) and the bar's verdict."""
    lines = [
        "| model | tool-call success | strict | lenient | KL (trained tokens) | turns |",
        "|---|---|---|---|---|---|",
    ]
    after = "the checkpoint" if report["version"] is None else f"student v{report['version']}"
    names = {"teacher": "teacher", "before": "student v0", "after": after}
    for key, name in names.items():
        r = report[key]
        kl = "" if r["kl"] is None else f"{r['kl']:.4f}"
        lines.append(
            f"| {name} | {r['tool_success']:.3f} | {r['strict']:.3f} | {r['lenient']:.3f} | {kl} | {r['turns']:.2f} |"
        )
    bar = report["bar"]
    factor = "n/a" if bar["kl_factor"] is None else f"{bar['kl_factor']:.1f}"
    verdict = "PASSED" if bar["passed"] else "NOT MET"
    lines.append(f"\nbar (≥ 80% of the teacher's tool-call success and strict accuracy, KL ÷ ≥ 5): {verdict}")
    lines.append(f"checks {bar['checks']}, KL ÷ {factor}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="the agent run's config (rollout.agent, annotate.teacher)")
    parser.add_argument("--store", default=None, help="the store or checkpoint to evaluate (default: store.uri)")
    parser.add_argument("--prompts", default="data/arithmetic/test.parquet", help="held-out prompts")
    parser.add_argument("--max-prompts", type=int, default=200)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--json", default=None, help="also write the report to this JSON file")
    args = parser.parse_args(argv)
    cfg = load_config(args.config)
    report = evaluate_agent_run(cfg, args.prompts, model=args.store, max_prompts=args.max_prompts, device=args.device)
    print(format_table(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
