"""Typed configuration of every stage.

One YAML file can hold all sections (`store`, `rollout`, `annotate`, `train`,
`run`, `eval`); each stage reads the sections it needs. Values are layered:

    defaults  <  YAML file (--config)  <  stage flags  <  --set dotted.key=value

Unknown keys and wrong types fail with a message naming the key, the value and
what was expected (pydantic does the checking; `format_validation_error` in
config_sources.py turns its report into one line per problem, naming where each value was given).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from opd_cache.config_sources import ConfigError, format_validation_error, key_sources, leaf_keys, parse_set

DEFAULT_MAX_STALENESS = 2  # the top-level max_staleness (the rule itself: opd_cache/flow/staleness.py)


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class StoreConfig(Section):
    """Where the stages meet: a directory or an object-store prefix."""

    uri: str = Field("store", description="where the stages meet: a directory, file://…, s3://bucket/prefix, gs://…")
    s3_endpoint: str | None = Field(
        None,
        validate_default=True,
        description="S3-compatible server of s3:// stores (MinIO, Ceph, moto), e.g. http://127.0.0.1:9000; "
        "unset: the AWS_ENDPOINT_URL environment variable, else AWS itself (credentials: AWS_ACCESS_KEY_ID / "
        "AWS_SECRET_ACCESS_KEY or an instance role)",
    )

    @field_validator("s3_endpoint", mode="before")
    @classmethod
    def _endpoint_from_environment(cls, value: str | None) -> str | None:
        """The one place the environment names the endpoint: every Store gets it from this key."""
        return value if value is not None else os.environ.get("AWS_ENDPOINT_URL") or None


class SamplingConfig(Section):
    """How the student samples during rollout."""

    temperature: float = Field(1.0, gt=0, description="sampling temperature")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling mass")
    top_k: int = Field(0, ge=0, description="0 = no top-k filtering")
    max_new_tokens: int = Field(256, ge=1, description="response length limit, in tokens")
    stop: list[str] = Field([], description="stop strings: a response ends at the first one")


class AgentConfig(Section):
    """Multi-turn rollouts: the student converses with an environment and its tools (docs/agents.md)."""

    environment: Literal["calculator"] | None = Field(
        None, description="environment of multi-turn rollouts (calculator); unset: single-turn rollouts"
    )
    environment_options: dict[str, bool | int | str] = Field(
        {}, description="keyword arguments of the environment, e.g. {require_tool: true, max_calls: 4}"
    )
    chat_template: str | None = Field(
        None, description="jinja chat template that renders tool calls (default: the student tokenizer's)"
    )
    max_turns: int = Field(4, ge=1, description="assistant turns per conversation")
    max_tokens: int = Field(512, ge=1, description="tokens per conversation, prompt included")


class RolloutConfig(Section):
    """`opd rollout`: the student samples responses and publishes rollout shards."""

    student: str | None = Field(
        None, description="student model folder or hub id (policy version 0); defaults to run.json's student"
    )
    prompts: str | None = Field(None, description="prompt file: parquet, JSONL or a datasets folder")
    n: int = Field(4, ge=1, description="samples per prompt")
    sampling: SamplingConfig = SamplingConfig()
    agent: AgentConfig = AgentConfig()  # multi-turn rollouts; sampling.max_new_tokens is then per turn
    max_prompt_tokens: int = Field(1024, ge=1, description="prompt length limit, in tokens")
    truncate_prompts: bool = Field(False, description="skip (and count) over-long prompts instead of failing")
    batch_prompts: int = Field(16, ge=1, description="prompts per generate() call")
    flush_rows: int = Field(256, ge=1, description="publish a shard every N rows")
    flush_seconds: float = Field(60.0, gt=0, description="...or every S seconds")
    max_samples: int | None = Field(None, ge=1, description="stop when this worker has N rows in all")
    max_shards: int | None = Field(None, ge=1, description="stop when this worker has N shards in all")
    worker_id: str = Field("w00", description="worker name in shard ids")
    engine: Literal["hf", "vllm"] = Field("hf", description="sampling engine (hf runs on CPU or GPU)")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="dtype of the student's weights")
    device: str = Field("auto", description="auto: cuda if available, else cpu")
    attn_implementation: str = Field(
        "sdpa", description="attention kernel of the hf engine (transformers' attn_implementation)"
    )
    tensor_parallel_size: int = Field(1, ge=1, description="GPUs per vllm engine")
    student_topk: int = Field(0, ge=0, description="record the student's top-k ids per position (union support)")
    seed: int = Field(0, description="seed of the prompt order and of sampling")
    follow: bool = Field(False, description="keep running until the trainer's DONE marker")
    max_buffer_samples: int = Field(4096, ge=1, description="pause while the unconsumed backlog is larger")
    poll_seconds: float = Field(
        1.0,
        gt=0,
        description="longest wait between store checks (new policy, backlog; each a LIST on S3); a local store's "
        "bells wake it at once",
    )
    claim_seconds: float = Field(
        60.0,
        ge=5,
        description="a worker's claim on schedule slots (claims/<worker>.json) stops counting for the others once "
        "it is not refreshed for S seconds (its worker died); refreshed every S/3",
    )
    trust_remote_code: bool = Field(False, description="let transformers run the model repository's own code")


class AnnotateConfig(Section):
    """`opd annotate`: the teacher scores rollout shards (top-k log-probs per token)."""

    teacher: str | None = Field(None, description="teacher checkpoint folder or hub id")
    teacher_name: str = Field("teacher", description="name of its parts: `annotated/<shard>/<NAME>.arrow`")
    top_k: int = Field(32, ge=1, description="teacher log-probs kept per response token")
    dtype: Literal["float16", "float32"] = Field("float32", description="storage dtype of the top-k log-probs")
    model_dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="dtype of the teacher's weights"
    )
    max_tokens_per_batch: int = Field(16384, ge=1, description="padded tokens per forward pass (hf engine)")
    max_shards: int | None = Field(None, ge=1, description="stop after annotating this many shards")
    worker_index: int = Field(0, ge=0, description="this worker's index i in 0..n-1")
    num_workers: int = Field(
        1, ge=1, description="> 1: the static split (crc32 of the shard id) over n workers; 1: claim shards by leases"
    )
    worker_id: str | None = Field(
        None, description="this worker's name in leases and metrics (None: <teacher_name>-<worker_index>)"
    )
    lease_seconds: float | None = Field(
        30.0, gt=0, description="a shard's lease expiry (None: no leases, take every shard)"
    )
    engine: Literal["hf", "vllm"] = Field("hf", description="scoring engine")
    device: str = Field("auto", description="auto: cuda if available, else cpu")
    attn_implementation: str = Field(
        "sdpa", description="attention kernel of the hf engine (transformers' attn_implementation)"
    )
    tensor_parallel_size: int = Field(1, ge=1, description="GPUs per vllm engine")
    padding_side: Literal["right", "left"] = Field("right", description="hf engine; both give the same log-probs")
    head_chunk_tokens: int | None = Field(
        None, ge=1, description="positions per output-layer chunk (None: 256 MiB of logits)"
    )
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1, description="vllm engine")
    compression: Literal["none", "zstd", "lz4"] = Field(
        "none", description="Arrow IPC compression of the annotated parts"
    )
    codec: Literal["none", "packed"] = Field(
        "none",
        description='"packed": ids as a bitmap or bit-packed at ceil(log2 V) bits, log-probs as 8-bit codes, the top-k mass and the sampled token log-prob as 16-bit codes (docs/annotate.md)',
    )
    routing_key: str = Field(
        "data_source", description="the rollout column whose value picks the teacher of a row (see routing)"
    )
    routing: dict[str, str] = Field(
        {},
        description="multi-teacher routing: routing-key value -> teacher name. Without routing one teacher annotates every row; with routing a row whose key is not listed goes to `default_teacher` (None: no teacher).",
    )
    default_teacher: str | None = Field(
        None, description="teacher of the rows whose routing-key value is not in routing"
    )
    follow: bool = Field(False, description="keep annotating new shards until the trainer's train/DONE marker")
    poll_seconds: float = Field(
        1.0,
        gt=0,
        description="longest wait between listings of new rollout shards (each a LIST on S3); a local store's "
        "bells wake it at once",
    )
    trust_remote_code: bool = Field(False, description="let transformers run the model repository's own code")
    cross_tokenizer: bool = Field(
        False,
        description="allow a teacher whose tokenizer differs from the student's: align the two tokenizations and "
        "store targets at the student's positions (docs/cross-tokenizer.md)",
    )
    chat_template: str | None = Field(
        None,
        description="the teacher's jinja chat template for multi-turn rows: each conversation is recovered from the "
        "student's rendering and re-rendered with it (docs/agents.md); unset: the student's template",
    )
    student_chat_template: str | None = Field(
        None,
        description="the jinja chat template the multi-turn rollouts were rendered with, to recover their messages "
        "(unset: rollout.agent.chat_template, else the student tokenizer's)",
    )
    cross_tokenizer_topk: Literal["one_to_one", "group_start"] = Field(
        "one_to_one",
        description="cross-tokenizer: where the top-k is a target: one_to_one (a group of one token on both "
        "sides) or group_start (also the first position of every longer group)",
    )

    @model_validator(mode="after")
    def _worker_in_range(self):
        if self.worker_index >= self.num_workers:
            raise ValueError(f"worker_index {self.worker_index} must be < num_workers {self.num_workers}")
        return self


class TrainConfig(Section):
    """`opd train`: the FSDP2 student trainer (losses: docs/losses.md)."""

    # The loss keys' defaults are LossConfig's too (opd_cache/losses/config.py reads them from here).
    student: str | None = Field(None, description="student model (version 0); defaults to run.json's student")
    loss: str = Field(
        "forward_kl", description="forward_kl | reverse_kl | jsd | k2 | k3 | abs | pg (policy-gradient OPD)"
    )
    tail: Literal["bucket", "renorm", "none"] = "bucket"
    support: Literal["teacher", "union"] = "teacher"
    beta: float = Field(0.5, ge=0, le=1, description="JSD mixture weight (0 = forward KL, 1 = reverse KL)")
    aggregation: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"] = "token-mean"
    max_steps: int = Field(100, ge=1, description="optimizer steps to train in total")
    publish_every: int = Field(1, ge=1, description="publish a policy version every N steps")
    save_every: int = Field(10, ge=1, description="write a resume state every N steps")
    global_batch_samples: int | None = Field(64, ge=1, description="rows per optimizer step")
    global_batch_tokens: int | None = Field(
        None, ge=1, description="prompt+response tokens per optimizer step (instead of global_batch_samples)"
    )
    micro_batch_tokens: int = Field(8192, ge=1, description="padded tokens per micro-batch and rank")
    lr: float = Field(1e-5, gt=0, description="peak learning rate")
    min_lr: float = Field(0.0, ge=0, description="learning rate at the end of the cosine schedule")
    warmup_steps: int = Field(0, ge=0, description="steps of linear warm-up to lr")
    schedule: Literal["constant", "cosine"] = Field("constant", description="learning rate after the warm-up")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas")
    grad_clip: float = Field(1.0, gt=0, description="largest gradient norm")
    chunk_size: int = Field(1024, ge=1, description="tokens per chunk of the fused loss")
    clip_low: float = Field(
        0.2,
        ge=0,
        description="policy-gradient OPD: the ratio is clipped to [1 - clip_low, 1 + clip_high]",
    )
    clip_high: float = Field(0.28, ge=0, description="upper clip of the policy-gradient ratio")
    importance_cap: float | None = Field(None, gt=0, description="truncated IS weight min(exp(s - s_behavior), c)")
    task_reward_weight: float = Field(0.0, ge=0, description="0 = pure distillation; >0 adds GRPO task loss")
    distill_weight: float = Field(1.0, ge=0, description="λ in total = task loss + λ·distillation")
    span_weight: float = Field(
        1.0, ge=0, description="cross-tokenizer parts: weight of the span term on groups without a top-k target"
    )
    span_estimator: Literal["k2", "k3", "abs"] = Field(
        "k2", description="cross-tokenizer parts: the span term's estimator of the group KL (docs/cross-tokenizer.md)"
    )
    activation_checkpointing: bool = Field(
        False, description="recompute activations in the backward pass (less memory)"
    )
    mixed_precision: Literal["auto", "off", "bf16"] = Field(
        "auto", description="auto: bf16 on a GPU that supports it, else off"
    )
    device: str = Field("auto", description="auto: cuda if available, else cpu")
    seed: int = Field(0, description="torch seed of the trainer")
    follow: bool = Field(False, description="wait for new shards until max_steps (else train what is there)")
    poll_seconds: float = Field(
        1.0,
        gt=0,
        description="longest wait between listings of new annotated parts (each a LIST on S3); a local store's "
        "bells wake it at once",
    )
    report_to: list[Literal["tensorboard", "wandb"]] = Field(
        [],
        description='experiment trackers that receive every train metric, and the evaluator\'s (docs/train.md, "Experiment tracking")',
    )
    tensorboard: bool = Field(False, description="deprecated: the same as report_to [tensorboard]")
    trust_remote_code: bool = Field(False, description="let transformers run the model repository's own code")
    idle_timeout: float | None = Field(
        None,
        gt=0,
        description="--follow stops (and writes train/DONE) after this many seconds without admissible data; None = wait forever",
    )
    keep_states: int = Field(2, ge=1, description="resume states kept in train/state/")
    keep_versions: int | None = Field(
        3,
        ge=1,
        description="policy versions kept up to LATEST, plus those a live reader holds (docs/reliability.md); None keeps all",
    )
    publish_dtype: Literal["bfloat16", "float16", "float32"] | None = Field(
        None,
        description="dtype of the published weights; None: the training dtype (float32). Recorded in each version's config.json",
    )
    prefetch_batches: int = Field(2, ge=1, description="decoded steps queued ahead of the trainer")

    @model_validator(mode="after")
    def _one_batch_unit(self):
        # a null global_batch_samples is no batch unit (a dumped config holds one: it must load again)
        samples_given = "global_batch_samples" in self.model_fields_set and self.global_batch_samples is not None
        if self.global_batch_tokens is not None and samples_given:
            raise ValueError(
                "global_batch_samples and global_batch_tokens (--global-batch-samples, --global-batch-tokens): "
                "give only one of them"
            )
        if self.global_batch_tokens is not None:
            object.__setattr__(self, "global_batch_samples", None)
        return self

    @field_validator("report_to", mode="before")
    @classmethod
    def _one_or_more_trackers(cls, value):
        if isinstance(value, str):  # --set train.report_to=wandb, or wandb,tensorboard; "none" for no tracker
            return [name.strip() for name in value.split(",") if name.strip() not in ("", "none")]
        return value

    @model_validator(mode="after")
    def _tensorboard_alias(self):
        trackers = list(dict.fromkeys([*self.report_to, *(["tensorboard"] if self.tensorboard else [])]))
        if trackers != self.report_to:
            object.__setattr__(self, "report_to", trackers)
        return self


class EvalConfig(Section):
    """`opd eval` and the evaluator process of `opd run`."""

    prompts: str | None = Field(None, description="prompt file (parquet/JSONL/datasets folder)")
    teacher: str | None = Field(None, description="teacher checkpoint: also report KL(teacher ‖ student)")
    max_prompts: int = Field(200, ge=1, description="evaluate the first N prompts")
    n: int = Field(1, ge=1, description="samples per prompt (mean@n); n > 1 needs greedy false")
    greedy: bool = Field(True, description="greedy decoding, else sampling")
    max_new_tokens: int = Field(32, ge=1, description="response length limit, in tokens")


class RunConfig(Section):
    """`opd run`: the three stages as processes on one store."""

    rollout_workers: int = Field(1, ge=1, description="rollout processes")
    annotate_workers: int = Field(1, ge=1, description="per teacher")
    teachers: dict[str, str] = Field(
        {}, description="name -> checkpoint; empty = annotate.teacher_name -> annotate.teacher"
    )
    max_restarts: int = Field(3, ge=0, description="per stage, before the run fails")
    sync: bool = Field(False, description="lockstep generate -> annotate -> train (max_staleness 0)")
    evaluate: bool = Field(True, description="run an evaluator process on eval.prompts")
    eval_every: int = Field(1, ge=1, description="evaluate every N-th published version (and the last)")
    threads_per_stage: int = Field(1, ge=1, description="OMP threads of each stage process")
    fork_stages: bool = Field(
        True,
        description="fork the stages (not vLLM ones) from one process that imported torch, transformers and "
        "pyarrow once (launch/forkserver.py), instead of a fresh interpreter each",
    )
    drain_seconds: float = Field(60.0, ge=0, description="after training: time for the evaluator to finish")


class StageResources(Section):
    """What one worker of a stage asks Ray for (`opd run --launcher ray`)."""

    num_cpus: float = Field(1.0, ge=0, description="CPUs one worker asks Ray for")
    num_gpus: float = Field(0.0, ge=0, description="GPUs one worker asks Ray for")
    resources: dict[str, float] = Field({}, description='custom Ray resources, e.g. {"teacher_node": 1}')


class RayConfig(Section):
    """`opd run --launcher ray`: stages as Ray actors (docs/scale-out.md)."""

    address: str | None = Field(
        None, description='a running cluster ("auto", "ray://head:10001"); None: start one on this machine'
    )
    rollout: StageResources = StageResources()
    annotate: StageResources = StageResources()
    train: StageResources = StageResources()
    eval: StageResources = StageResources()
    train_world_size: int = Field(1, ge=1, description="trainer ranks (FSDP2), one actor each, in one placement group")
    scale_poll_seconds: float = Field(
        2.0, gt=0, description="how often the launcher reads `opd scale`'s desired counts"
    )
    shared_filesystem: bool = Field(
        False, description="a local store path that every node mounts (else: refused on a multi-node cluster)"
    )


class Config(Section):
    """The whole configuration: the keys every stage reads, then one section per stage (and the launchers')."""

    max_staleness: int = Field(
        DEFAULT_MAX_STALENESS,
        ge=0,
        description="versions a row may lag behind the policy it trains (0 = synchronous): rollout pauses, annotate "
        "skips, the trainer expires beyond it (opd_cache/flow/staleness.py); one bound for the three stages",
    )
    store: StoreConfig = StoreConfig()
    rollout: RolloutConfig = RolloutConfig()
    annotate: AnnotateConfig = AnnotateConfig()
    train: TrainConfig = TrainConfig()
    eval: EvalConfig = EvalConfig()
    run: RunConfig = RunConfig()
    ray: RayConfig = RayConfig()


def _assign(tree: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"config key {dotted!r}: {part!r} is a value, not a section")
        node = child
    node[parts[-1]] = value


# Keys of earlier releases that now fail with a message naming their replacement (after a release of deprecation).
RETIRED_KEYS = {
    "rollout.max_staleness": "max_staleness",
    "annotate.max_staleness": "max_staleness",
    "train.max_staleness": "max_staleness",
}


def _refuse_retired_keys(keys: list[str], source: str) -> None:
    for key in keys:
        if key in RETIRED_KEYS:
            raise ConfigError(
                f"{source}: config key {key!r} was retired; set the top-level {RETIRED_KEYS[key]} instead "
                f"(one bound for rollout, annotate and train)"
            )


def load_config(
    path: str | Path | None = None,
    overrides: dict[str, Any] | None = None,
    sets: list[str] | None = None,
    flag_names: dict[str, str] | None = None,
) -> Config:
    """Build the config: defaults < YAML file < `overrides` (stage flags, dotted keys) < `sets`.

    `flag_names` (dotted key -> the flag that set it) lets an invalid value name its flag, as a value from the file
    names the file and one from --set names the --set."""
    tree: dict = {}
    file_keys: list[tuple[str, ...]] = []
    if path is not None:
        path = Path(path)
        if not path.exists():
            raise ConfigError(f"--config {path}: file not found")
        data = path.read_bytes()
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            line = data.count(b"\n", 0, e.start) + 1
            raise ConfigError(f"--config {path}: line {line} is not valid UTF-8 (byte {e.start})") from None
        try:
            loaded = yaml.safe_load(text) or {}  # safe_load: a config file cannot construct Python objects
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            problem = getattr(e, "problem", None) or " ".join(str(e).split())
            raise ConfigError(f"--config {path}: not valid YAML{at}: {problem}") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"--config {path}: expected a mapping of sections, got {type(loaded).__name__}")
        _refuse_retired_keys([".".join(key) for key in leaf_keys(loaded)], f"--config {path}")
        tree = loaded
        file_keys = list(leaf_keys(tree))
    for key, value in (overrides or {}).items():
        if value is not None:
            _refuse_retired_keys([key], "overrides")
            _assign(tree, key, value)
    for assignment in sets or []:
        key, value = parse_set(assignment)
        _refuse_retired_keys([key], f"--set {assignment}")
        _assign(tree, key, value)
    try:
        return Config.model_validate(tree)
    except ValidationError as e:
        sources = key_sources(path, file_keys, overrides, sets, flag_names)
        raise ConfigError(format_validation_error(e, sources=sources)) from None
