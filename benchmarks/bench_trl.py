"""`opd run` vs TRL's GKDTrainer on the demo task: wall time and held-out KL at equal samples (issue #14).

    /tmp/trl/venv/bin/python benchmarks/bench_trl.py              # the measurement in docs/benchmarks.md
    /tmp/trl/venv/bin/python benchmarks/bench_trl.py --steps 20   # a smoke run
    /tmp/trl/venv/bin/python benchmarks/bench_trl.py --opd-steps 450   # opd at an equal wall-time budget

TRL is not a dependency of the project: install it in its own virtual environment that sees the system's
torch and transformers (docs/benchmarks.md, "TRL's GKD trainer"), and run this script with that python.
The opd side runs `opd run` with the same interpreter; the TRL side runs in a fresh child process.

The workload is the demo's (examples/arithmetic_cpu/config.yaml, built by `opd_cache.launch.demo.demo_config`):
the 2-layer student, the 3-layer teacher, data/arithmetic/train.parquet, `--steps` optimizer steps × 64
samples (16 prompts × 4 samples), sampling temperature 1.0, at most 10 new tokens, AdamW lr 1e-3 with 30
steps of warm-up and cosine decay to 1e-4, gradient clipping 1.0, seed 0. Both sides:

  opd   `opd run` on the demo config with only the step count changed and the evaluator off (it would
        share the cores while training): rollout, annotate (teacher top-8) and train as separate
        processes, one thread each, max_staleness 2, forward KL on the teacher's top-8 plus a tail bucket.
  trl   `trl.experimental.gkd.GKDTrainer`, lmbda = 1 (every batch sampled by the current student: fully
        on-policy), beta = 0 (TRL's generalized JSD at beta 0 is KL(teacher ‖ student), our forward_kl) on
        the teacher's FULL vocabulary, token-mean over the batch's response tokens, seq_kd off, float32,
        no gradient checkpointing (TRL defaults to it, and to bf16: turned off to match opd). The
        prompts are the ones opd's rollout worker draws (its PromptStream, in its order, each prompt 4
        times in a row, a sequential sampler), so each step sees 16 prompts × 4 samples as opd's does.
        One process with `--trl-threads` torch threads: one TRL run per value (default 1 and every core);
        the faster one is the baseline of the ratios. Under load, 2 threads on 2 shared cores can be
        several times slower than 1 (each parallel region waits for a descheduled thread).

The runs go one at a time, opd between the TRL runs. Timed from the outside, from launching each
command: "to last step" (launch to the last optimizer step's end: imports, model loads and start-up
included), "steps" (first to last optimizer step), "total" (launch to the process's exit: saving and
shutdown included), and CPU seconds of every process each side started.
Held-out quality: ONE evaluation for every final student, opd_cache.evaluate.evaluate_model (the
evaluator of `opd run` and `opd eval`): greedy answers to the 200 held-out prompts, strict and lenient
accuracy, and per-token KL(teacher ‖ student) over the full vocabulary on the student's own answers.

Results: a table on stdout with ratios vs TRL measured in the same run, and benchmarks/results/bench_trl.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_pipeline import Clock, child_env, measure, run_pipeline
from common import write_results

from opd_cache.config import Config
from opd_cache.evaluate import evaluate_model, first_prompts, load_teacher, resolve_model
from opd_cache.launch.demo import demo_config, ensure_demo_models
from opd_cache.rollout.prompt_stream import PromptStream
from opd_cache.tasks.prompts import load_prompts
from opd_cache.tokenizer import load_tokenizer

RESULTS = ROOT / "benchmarks" / "results" / "bench_trl.json"
TARGET = 0.6  # issue #14: opd's wall time <= 0.6x TRL's at equal samples and equal held-out KL


# ---------------------------------------------------------------------- the TRL side's inputs
def trl_prompt_rows(cfg: Config, steps: int, tokenizer) -> list[list[int]]:
    """The prompt ids TRL trains on, in order: the prompts opd's rollout worker draws, each `n` times in a row.

    opd's rollout takes `batch_prompts` prompts per generate() call from its PromptStream and samples `n`
    answers for each; a batch of 64 rows is 16 prompts × 4 samples. With a sequential sampler, TRL's step s
    sees the same 16 prompts as opd's s-th rollout batch (opd may train them a step or two later).
    """
    prompts = load_prompts(cfg.rollout.prompts, tokenizer)
    n = cfg.rollout.n
    per_step = cfg.train.global_batch_samples // n
    stream = PromptStream(len(prompts), cfg.rollout.seed, cfg.rollout.worker_id)
    return [list(prompts.prompt_ids[i]) for i in stream.take(0, steps * per_step) for _ in range(n)]


def collate_prompts(rows: list[dict], pad_token_id: int) -> dict[str, torch.Tensor]:
    """A batch of prompts for GKDTrainer, left-padded for generate().

    With lmbda = 1 GKDTrainer replaces input_ids, attention_mask and labels by the student's samples
    before the loss, so the batch carries only the prompts. No "labels" on purpose: the HF Trainer would
    count their non-masked tokens as the loss's divisor (num_items_in_batch) before sampling; without them
    the loss is the mean over the sampled response tokens, as opd's token-mean.
    """
    width = max(len(r["prompt_ids"]) for r in rows)
    ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for row, r in enumerate(rows):
        length = len(r["prompt_ids"])
        ids[row, width - length :] = torch.tensor(r["prompt_ids"])
        mask[row, width - length :] = 1
    return {"prompts": ids, "prompt_attention_mask": mask, "input_ids": ids, "attention_mask": mask}


def trl_spec(cfg: Config, steps: int, out: Path, prompts_file: Path, threads: int) -> dict:
    """Everything the TRL child needs, from the same resolved config as the opd run."""
    t = cfg.train
    return {
        "student": cfg.rollout.student,
        "teacher": cfg.annotate.teacher,
        "prompts_file": str(prompts_file),
        "output_dir": str(out / "student"),
        "steps": steps,
        "batch": t.global_batch_samples,
        "lr": t.lr,
        "min_lr": t.min_lr,
        "warmup_steps": t.warmup_steps,
        "schedule": t.schedule,
        "weight_decay": t.weight_decay,
        "betas": list(t.betas),
        "grad_clip": t.grad_clip,
        "temperature": cfg.rollout.sampling.temperature,
        "max_new_tokens": cfg.rollout.sampling.max_new_tokens,
        "seed": t.seed,
        "threads": threads,
    }


# ---------------------------------------------------------------------- the TRL child process
def trl_worker(spec: dict) -> dict:
    """Train with GKDTrainer (in this fresh process); wall-clock stamps of the phases and of every step."""
    torch.set_num_threads(spec["threads"])
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl.experimental.gkd import GKDConfig, GKDTrainer

    stamps = {"imported": time.time()}
    tokenizer = AutoTokenizer.from_pretrained(spec["student"])
    student = AutoModelForCausalLM.from_pretrained(spec["student"], dtype=torch.float32)
    teacher = AutoModelForCausalLM.from_pretrained(spec["teacher"], dtype=torch.float32)
    rows = json.loads(Path(spec["prompts_file"]).read_text())
    dataset = Dataset.from_dict({"prompt_ids": rows})
    step_times: list[float] = []

    class StepClock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            step_times.append(time.time())
            if state.global_step % 50 == 0:  # progress in run.log (stdout carries the result)
                print(f"step {state.global_step}/{state.max_steps}", file=sys.stderr, flush=True)

    schedule = (
        {"lr_scheduler_type": "cosine_with_min_lr", "lr_scheduler_kwargs": {"min_lr": spec["min_lr"]}}
        if spec["schedule"] == "cosine"
        else {"lr_scheduler_type": "constant_with_warmup"}
    )
    args = GKDConfig(
        output_dir=spec["output_dir"],
        max_steps=spec["steps"],
        per_device_train_batch_size=spec["batch"],
        gradient_accumulation_steps=1,
        learning_rate=spec["lr"],
        warmup_steps=spec["warmup_steps"],
        **schedule,
        weight_decay=spec["weight_decay"],
        adam_beta1=spec["betas"][0],
        adam_beta2=spec["betas"][1],
        max_grad_norm=spec["grad_clip"],
        lmbda=1.0,  # every batch sampled by the current student
        beta=0.0,  # KL(teacher || student) on the full vocabulary
        seq_kd=False,
        temperature=spec["temperature"],
        max_new_tokens=spec["max_new_tokens"],
        train_sampling_strategy="sequential",  # the prompts in opd's rollout order (trl_prompt_rows)
        dataloader_drop_last=True,
        seed=spec["seed"],
        # TRL's defaults differ from opd's here: gradient checkpointing on (and generate() then runs without
        # its KV cache) and bfloat16 autocast; opd's trainer runs neither (activation_checkpointing false, float32)
        gradient_checkpointing=False,
        use_cpu=True,
        bf16=False,
        fp16=False,
        save_strategy="no",
        report_to=[],
        logging_steps=max(1, spec["steps"] // 10),
        disable_tqdm=True,
    )
    trainer = GKDTrainer(
        model=student,
        teacher_model=teacher,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        data_collator=lambda batch: collate_prompts(batch, tokenizer.pad_token_id),
        callbacks=[StepClock()],
    )
    stamps["loaded"] = time.time()
    output = trainer.train()
    stamps["trained"] = time.time()
    trainer.save_model(spec["output_dir"])  # safetensors + config + tokenizer: what evaluate_model loads
    stamps["saved"] = time.time()
    losses = [r["loss"] for r in trainer.state.log_history if "loss" in r]
    return {
        "stamps": stamps,
        "step_times": step_times,
        "steps": trainer.state.global_step,
        "trained_samples": trainer.state.global_step * spec["batch"],
        "first_loss": losses[0] if losses else None,
        "last_loss": losses[-1] if losses else None,
        "train_runtime_s": output.metrics.get("train_runtime"),
    }


def run_trl(out: Path, spec: dict, python: str, timeout: float) -> dict:
    """The TRL child, timed from the outside like `opd run`."""
    spec_path = out / "spec.json"
    spec_path.write_text(json.dumps(spec, indent=2))
    argv = [python, str(Path(__file__).resolve()), "--trl-worker", str(spec_path)]
    print(f"[trl] {' '.join(argv)}", flush=True)
    env = child_env(spec["threads"])
    with Clock() as clock, open(out / "run.log", "wb") as log:
        proc = subprocess.run(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=log, env=env, timeout=timeout)
    clock_record = clock.record(proc.returncode, argv[1:])
    if proc.returncode != 0:
        raise SystemExit(f"the TRL run failed (status {proc.returncode}): see {out / 'run.log'}")
    child = json.loads(proc.stdout.decode().strip().splitlines()[-1])
    steps = child["step_times"]
    return {
        **{k: clock_record[k] for k in ("status", "wall_s", "cpu_s", "load_avg", "command")},
        "time_to_last_step_s": steps[-1] - clock_record["start"],
        "train_span_s": steps[-1] - steps[0],
        "seconds_per_step": (steps[-1] - steps[0]) / (len(steps) - 1),
        "startup_s": child["stamps"]["loaded"] - clock_record["start"],
        "steps": child["steps"],
        "trained_samples": child["trained_samples"],
        "first_loss": child["first_loss"],
        "last_loss": child["last_loss"],
        "model": spec["output_dir"],
    }


# ---------------------------------------------------------------------- report
def _ratio(a, b):
    return None if a is None or b is None or not b else a / b


def table(results: dict, baseline: str) -> str:
    """One row per run; the ratios are against `baseline`, the faster TRL run of this benchmark."""
    base = results[baseline]
    rows = [
        "| | to last step (s) | ratio | steps (s) | ratio | total (s) | ratio | CPU (s) | load | samples "
        "| held-out KL | strict | lenient |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    e = results["before"]["eval"]
    rows.append(f"| student v0 | | | | | | | | | 0 | {e['kl']:.4f} | {e['strict']:.3f} | {e['lenient']:.3f} |")
    for name, r in results.items():
        if name == "before":
            continue
        label = "`opd run`" if name == "opd" else f"TRL GKDTrainer, {r['threads']} thread(s)"
        cells = [label + (" (baseline)" if name == baseline else "")]
        for key in ("time_to_last_step_s", "train_span_s", "wall_s"):
            cells += [f"{r[key]:.1f}", f"{_ratio(r[key], base[key]):.2f}×"]
        cells += [f"{r['cpu_s']:.0f}", f"{r['load_avg']:.1f}", f"{r['trained_samples']:,}"]
        e = r["eval"]
        cells += [f"{e['kl']:.4f}", f"{e['strict']:.3f}", f"{e['lenient']:.3f}"]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=400, help="optimizer steps × 64 samples on each side")
    parser.add_argument(
        "--opd-steps",
        type=int,
        help="optimizer steps of the opd side only (default: --steps): opd at an equal wall-time budget "
        "instead of equal samples, its cosine schedule stretched over its own steps",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trl-python", default=sys.executable, help="the python with trl installed")
    parser.add_argument(
        "--trl-threads",
        type=int,
        nargs="+",
        default=sorted({1, os.cpu_count() or 1}),
        help="torch threads of the TRL process, one TRL run per value (default: 1 and every core); "
        "the faster run is the baseline",
    )
    parser.add_argument("--out", type=Path, help="folder for the runs (default: a temp folder, removed)")
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an extra setting of the opd side's config, as `opd run --set` (e.g. train.publish_every=1); "
        "TRL's side reads the same config, so a train.lr change applies to both",
    )
    parser.add_argument("--trl-worker", type=Path, help=argparse.SUPPRESS)  # the child process's mode
    args = parser.parse_args()
    if args.trl_worker:
        print(json.dumps(trl_worker(json.loads(args.trl_worker.read_text()))), flush=True)
        return

    from rich.console import Console

    ensure_demo_models(Console())
    out = args.out or Path(tempfile.mkdtemp(prefix="opd-bench-trl-"))
    out.mkdir(parents=True, exist_ok=True)
    opd_steps = args.opd_steps or args.steps
    timeout = 120 + max(args.steps, opd_steps) * 6.0  # a hung run fails the benchmark instead of blocking it
    torch.set_num_threads(1)
    cfg = demo_config(out / "opd", args.seed, [f"train.max_steps={opd_steps}", "run.evaluate=false", *args.set])
    tokenizer = load_tokenizer(cfg.rollout.student)
    prompts_file = out / "trl-prompts.json"
    prompts_file.write_text(json.dumps(trl_prompt_rows(cfg, args.steps, tokenizer)))

    # one run at a time (two cores); the opd run sits between the TRL runs, so that drift of the machine's
    # load during the benchmark shows as a difference between the TRL runs
    trl_names = [f"trl-t{t}" for t in args.trl_threads]
    order = [trl_names[0], "opd", *trl_names[1:]]
    results: dict[str, dict] = {}
    specs = {}
    for name in order:
        shutil.rmtree(out / name, ignore_errors=True)
        (out / name).mkdir(parents=True)
        if name == "opd":
            clock = run_pipeline("opd", out / "opd", cfg, timeout=timeout)
            if clock["status"] != 0:
                raise SystemExit(f"`opd run` failed (status {clock['status']}): see {out / 'opd' / 'logs'}")
            opd = measure(out / "opd" / "store", clock)
            opd["model"], opd["version"], _ = resolve_model(str(out / "opd" / "store"))
            results["opd"] = {k: v for k, v in opd.items() if k not in ("curve", "final", "final_is_last_version")}
        else:
            threads = args.trl_threads[trl_names.index(name)]
            specs[name] = trl_spec(cfg, args.steps, out / name, prompts_file, threads)
            results[name] = {"threads": threads, **run_trl(out / name, specs[name], args.trl_python, timeout)}
        r = results[name]
        print(f"[{name}] {r['wall_s']:.0f} s, {r['steps']} steps, load {r['load_avg']:.1f}", flush=True)

    # one evaluation for every model: the project's evaluator, the demo's held-out prompts
    print("evaluating the students on the held-out prompts…", flush=True)
    prompts = first_prompts(load_prompts(cfg.eval.prompts, tokenizer), cfg.eval.max_prompts)
    teacher = load_teacher(cfg.annotate.teacher, tokenizer, "cpu")
    results = {"before": {"model": cfg.rollout.student}, **results}
    for r in results.values():
        result = evaluate_model(r["model"], prompts, tokenizer, teacher=teacher, max_new_tokens=cfg.eval.max_new_tokens)
        r["eval"] = result.__dict__

    baseline = min(trl_names, key=lambda n: results[n]["time_to_last_step_s"])
    opd, trl = results["opd"], results[baseline]
    ratio = _ratio(opd["time_to_last_step_s"], trl["time_to_last_step_s"])
    doc = {
        "steps": args.steps,
        "opd_steps": opd_steps,
        "global_batch_samples": cfg.train.global_batch_samples,
        "seed": args.seed,
        "order": order,
        "baseline": baseline,
        "opd_threads_per_stage": cfg.run.threads_per_stage,
        "eval_prompts": len(prompts),
        "machine": platform.platform(),
        "cpus": os.cpu_count(),
        "load_average_at_end": os.getloadavg(),
        "versions": {"torch": torch.__version__, "trl": _version("trl"), "transformers": _version("transformers")},
        "target": TARGET,
        "ratio_to_last_step": ratio,
        "ratio_train_span": _ratio(opd["train_span_s"], trl["train_span_s"]),
        "ratio_total": _ratio(opd["wall_s"], trl["wall_s"]),
        "ratio_kl": _ratio(opd["eval"]["kl"], trl["eval"]["kl"]),
        "runs": results,
        "opd_sets": args.set,
        "opd_config": cfg.model_dump(mode="json"),
        "trl_specs": specs,
    }
    steps_title = f"{args.steps} steps" if opd_steps == args.steps else f"opd {opd_steps} steps, TRL {args.steps}"
    print(f"\n## opd vs TRL GKDTrainer ({steps_title} × {cfg.train.global_batch_samples} samples)\n")
    print(table(results, baseline))
    print(
        f"\nopd / TRL ({baseline}), launch to last step: {ratio:.2f}× (target ≤ {TARGET}×); held-out KL opd "
        f"{opd['eval']['kl']:.4f} vs TRL {trl['eval']['kl']:.4f}"
    )
    write_results(args.results, doc)
    if not args.out:
        shutil.rmtree(out, ignore_errors=True)


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


if __name__ == "__main__":
    main()
