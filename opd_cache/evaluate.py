"""Evaluation of a student: task accuracy (strict and lenient parsers) and teacher–student KL.

- Accuracy: the student answers held-out prompts (greedy, or `n` samples for
  mean@n) and the task's reward function scores each answer with the strict
  (`#### N`) and the lenient (last number) parser.
- KL: on the student's own answers, the mean per-token full-vocabulary
  KL(teacher ‖ student) — the quantity forward-KL distillation minimises, measured
  without any top-k truncation.

`evaluate_store` follows a store and evaluates each newly published policy
version into `metrics/eval-<worker>.jsonl` (the evaluator process of `opd run`).
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from opd_cache.config import SamplingConfig
from opd_cache.engine import Response, SampleRequest, resolve_device
from opd_cache.models import load_causal_lm
from opd_cache.observe.metrics import MetricsLog
from opd_cache.observe.tracking import eval_metrics
from opd_cache.rollout.hf_generate import HFGenerator, right_pad
from opd_cache.storage import layout
from opd_cache.storage.retention import VersionHold
from opd_cache.storage.scratch import owned_temp_prefix
from opd_cache.storage.store import Store
from opd_cache.tasks.prompts import PromptSet, load_prompts
from opd_cache.tasks.rewards import compute_score
from opd_cache.tokenizer import check_compatible, load_tokenizer


@dataclass
class EvalResult:
    strict: float  # mean strict accuracy over prompts × samples
    lenient: float
    kl: float | None  # mean per-token KL(teacher ‖ student) on the student's answers; None without a teacher
    num_prompts: int
    n: int
    response_tokens: float  # mean answer length
    example: str  # the first answer, for eyeballing


def first_prompts(prompts: PromptSet, max_prompts: int | None) -> PromptSet:
    if max_prompts is None or len(prompts) <= max_prompts:
        return prompts
    keep = slice(0, max_prompts)
    return PromptSet(
        prompt_ids=prompts.prompt_ids[keep],
        data_source=prompts.data_source[keep],
        ground_truth=prompts.ground_truth[keep],
        extra=prompts.extra[keep],
        row_index=prompts.row_index[keep],
        source=prompts.source,
        messages=prompts.messages[keep],
    )


def sequence_kl(
    student, teacher, prompt_ids: list[list[int]], responses: list[Response], device, batch_size: int = 64
) -> tuple[float, int]:
    """Sum over response tokens of KL(teacher ‖ student) (full vocabulary), and the token count."""
    response_ids = [r.token_ids.tolist() for r in responses]
    return masked_sequence_kl(student, teacher, prompt_ids, response_ids, None, device, batch_size)


@torch.inference_mode()
def masked_sequence_kl(
    student,
    teacher,
    prompt_ids: list[list[int]],
    response_ids: list[list[int]],
    masks: list | None,
    device,
    batch_size: int = 64,
) -> tuple[float, int]:
    """Sum of KL(teacher ‖ student) (full vocabulary) over the response tokens whose mask is 1 (every token
    when `masks` is None, or a row's mask is None: a conversation's trained positions), and their count.

    Sequences are right-padded; row t of a response is predicted at position
    prompt_len + t - 1 (the off-by-one every teacher-forced scorer must get right).
    """
    total, count = 0.0, 0
    for start in range(0, len(response_ids), batch_size):
        batch = range(start, min(start + batch_size, len(response_ids)))
        seqs = [list(prompt_ids[i]) + list(response_ids[i]) for i in batch]
        ids, mask = right_pad(seqs, device)
        s_logits = student(input_ids=ids, attention_mask=mask).logits.float()
        t_logits = teacher(input_ids=ids, attention_mask=mask).logits.float()
        vocab = min(s_logits.shape[-1], t_logits.shape[-1])  # padded embedding rows are not tokens
        for row, i in enumerate(batch):
            p_len, r_len = len(prompt_ids[i]), len(response_ids[i])
            if r_len == 0:
                continue
            pos = slice(p_len - 1, p_len - 1 + r_len)
            log_q = F.log_softmax(s_logits[row, pos, :vocab], dim=-1)
            log_p = F.log_softmax(t_logits[row, pos, :vocab], dim=-1)
            per_token = (log_p.exp() * (log_p - log_q)).sum(-1)
            if masks is not None and masks[i] is not None:
                keep = torch.as_tensor(np.asarray(masks[i]) == 1, device=per_token.device)
                per_token = per_token[keep]
            total += float(per_token.sum())
            count += len(per_token)
    return total, count


def eval_engine(model_path, tokenizer, device: str = "auto", seed: int = 0) -> HFGenerator:
    """The hf engine that evaluates checkpoints (stops at the tokenizer's EOS, samples only its vocabulary)."""
    return HFGenerator(
        model_path,
        tokenizer=tokenizer,
        device=device,
        eos_token_ids=[tokenizer.eos_token_id],
        pad_token_id=tokenizer.pad_token_id,
        vocab_limit=len(tokenizer),
        seed=seed,
    )


def evaluate_model(
    student_path: str | os.PathLike,
    prompts: PromptSet,
    tokenizer,
    *,
    teacher=None,
    n: int = 1,
    greedy: bool = True,
    max_new_tokens: int = 32,
    device: str = "auto",
    seed: int = 0,
    engine: HFGenerator | None = None,
) -> EvalResult:
    """Score one student checkpoint on `prompts` (pass `engine` to reuse a loaded model)."""
    if engine is None:
        engine = eval_engine(student_path, tokenizer, device, seed=seed)
    else:
        engine.load_policy(student_path)
    # greedy = sampling from the top-1 distribution: one code path for both
    sampling = SamplingConfig(temperature=1.0, top_k=1 if greedy else 0, max_new_tokens=max_new_tokens)
    responses = engine.generate(prompts.prompt_ids, SampleRequest(sampling, n=1 if greedy else n, seed=seed))
    per_prompt = len(responses) // len(prompts)
    texts = tokenizer.batch_decode([r.token_ids for r in responses], skip_special_tokens=True)
    scores = [
        compute_score(prompts.data_source[i // per_prompt], text, prompts.ground_truth[i // per_prompt])
        for i, text in enumerate(texts)
    ]
    kl = None
    if teacher is not None:
        prompt_of = [prompts.prompt_ids[i // per_prompt] for i in range(len(responses))]
        total, count = sequence_kl(engine.model, teacher, prompt_of, responses, engine.device)
        kl = total / max(count, 1)
    return EvalResult(
        strict=float(np.mean([s["strict"] for s in scores])),
        lenient=float(np.mean([s["lenient"] for s in scores])),
        kl=kl,
        num_prompts=len(prompts),
        n=per_prompt,
        response_tokens=float(np.mean([len(r.token_ids) for r in responses])),
        example=texts[0] if texts else "",
    )


def load_teacher(path: str | os.PathLike, student_tokenizer, device: str = "auto"):
    teacher = load_causal_lm(path).to(resolve_device(device)).eval()
    check_compatible(
        student_tokenizer, load_tokenizer(path), teacher.get_input_embeddings().num_embeddings, "student", str(path)
    )
    return teacher


def model_store(model: str, s3_endpoint: str | None = None) -> Store | None:
    """The store `model` names (a URI, or a folder with run.json); None for a checkpoint folder."""
    if "://" in model or Store(model).manifest.exists():
        return Store(model, s3_endpoint=s3_endpoint)  # the endpoint of store.s3_endpoint, like the other stages
    return None


def resolve_model(
    model: str, s3_endpoint: str | None = None, download_to: Path | None = None
) -> tuple[str, int | None, Store | None]:
    """A checkpoint folder, or a store (then its newest published version, or the student for version 0).

    A remote store's version is downloaded under `download_to` (default: a new temp folder the caller owns)."""
    store = model_store(model, s3_endpoint)
    if store is not None:
        run = store.manifest.require()
        version = store.latest_version()
        if version == 0:
            return run.student, 0, store
        return str(policy_folder(store, version, download_to)), version, store
    if not Path(model).exists():
        raise FileNotFoundError(f"--model {model}: no such checkpoint folder or store")
    return model, None, None


def policy_folder(store: Store, version: int, download_to: Path | None = None) -> Path:
    """The local folder of published policy `version` (evaluators and the examples' measure scripts load it).

    A remote store's version is downloaded under `download_to` (default: a new temp folder, which outlives the
    call: the caller loads from it later); a caller that evaluates and moves on passes a TemporaryDirectory.
    """
    rel = layout.policy_dir(version)
    in_store = store.local_dir(rel)  # a local store: loaded in place
    if in_store is not None:
        return in_store
    if download_to is None:
        download_to = Path(tempfile.mkdtemp(prefix=owned_temp_prefix("opd-eval-")))
    return store.download_dir(rel, download_to / rel)


def evaluate_store(
    store: Store,
    prompts_path: str,
    *,
    teacher_path: str | None,
    max_prompts: int = 200,
    max_new_tokens: int = 32,
    every: int = 1,
    follow: bool = True,
    poll_seconds: float = 2.0,
    device: str = "auto",
    worker: str = "0",
    echo: Callable[[str], None] | None = None,
    tracker=None,
) -> list[dict]:
    """Evaluate version 0 and then every `every`-th published version (and the last) into the metrics.

    `echo` receives one line per evaluated version (the CLI prints it: the evaluator's log in `opd run`);
    `tracker` (opd_cache.observe.tracking.Tracker, from train.report_to) each result, with the version as its step."""
    run = store.manifest.require()
    tokenizer = load_tokenizer(run.student)
    prompts = first_prompts(load_prompts(prompts_path, tokenizer), max_prompts)
    teacher = load_teacher(teacher_path, tokenizer, device) if teacher_path else None
    log = MetricsLog(store, "eval", worker)
    # the trainer's retention keeps the versions still to evaluate (opd_cache/storage/retention.py)
    hold = VersionHold(store, f"eval-{worker}", ttl_s=max(600.0, 30 * poll_seconds))
    hold.hold(1, every=every)
    bell = store.bell(layout.POLICY, layout.TRAIN)  # a new version, DONE: wake at once (storage/bells.py)
    done_versions = {r["version"] for r in log.records()}
    engine = None
    results = []
    versions = [0]
    while True:
        finished = store.is_done()  # read before listing: a version published before DONE is still seen
        versions += store.policy_versions(after=versions[-1])  # only the new ones: no listing of policy/
        # every `every`-th version, and the final one once training is done
        todo = [v for v in versions if v not in done_versions and (v % every == 0 or (finished and v == versions[-1]))]
        hold.hold(*(todo or [versions[-1] + 1]), every=every)
        for version in todo:
            if version and not store.is_published(version):
                continue  # deleted by retention while its hold had expired (an evaluator stopped for long)
            tic = time.monotonic()
            # a remote store's version is downloaded for this evaluation only (a run evaluates dozens of them)
            with tempfile.TemporaryDirectory(prefix=owned_temp_prefix("opd-eval-")) as downloads:
                path = run.student if version == 0 else policy_folder(store, version, Path(downloads))
                if engine is None:
                    engine = eval_engine(path, tokenizer, device)
                result = evaluate_model(
                    path, prompts, tokenizer, teacher=teacher, max_new_tokens=max_new_tokens, engine=engine
                )
            if echo is not None:
                echo(
                    f"eval v{version}: strict {result.strict:.3f}, lenient {result.lenient:.3f}"
                    + (f", KL {result.kl:.4f}" if result.kl is not None else "")
                    + f" on {result.num_prompts} prompts ({time.monotonic() - tic:.1f} s)"
                )
            # cpu_s: the evaluator's CPU since its previous record, which `opd plan --from-store --cores` models
            record = {"version": version, **asdict(result), "seconds": round(time.monotonic() - tic, 3)}
            record["cpu_s"] = log.cpu_lap()
            log.log(record, flush=True)
            if tracker is not None:
                tracker.log(eval_metrics(record), step=version)
            results.append(record)
            done_versions.add(version)
        if finished or not follow:
            hold.release()
            return results
        bell.wait(poll_seconds)
