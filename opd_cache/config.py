"""Typed configuration of every stage.

One YAML file can hold all sections (`store`, `rollout`, `annotate`, `train`,
`run`, `eval`); each stage reads the sections it needs. Values are layered:

    defaults  <  YAML file (--config)  <  stage flags  <  --set dotted.key=value

Unknown keys and wrong types fail with a message naming the key, the value and
what was expected (pydantic does the checking; `format_validation_error`
turns its report into one line per problem).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator


class ConfigError(ValueError):
    """A configuration the user must fix; the message says which key and what was expected."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class StoreConfig(Section):
    """Where the stages meet: a directory or an object-store prefix."""

    uri: str = "store"  # a directory, file://…, s3://bucket/prefix, gs://…
    s3_endpoint: str | None = None  # e.g. http://127.0.0.1:9000 for MinIO / moto


class SamplingConfig(Section):
    """How the student samples during rollout."""

    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)  # 0 = no top-k filtering
    max_new_tokens: int = Field(256, ge=1)
    stop: list[str] = []


class RolloutConfig(Section):
    """`opd rollout`: the student samples responses and publishes rollout shards."""

    student: str | None = None  # version 0; defaults to run.json's student
    prompts: str | None = None
    n: int = Field(4, ge=1)  # samples per prompt
    sampling: SamplingConfig = SamplingConfig()
    max_prompt_tokens: int = Field(1024, ge=1)
    truncate_prompts: bool = False  # skip (and count) over-long prompts instead of failing
    batch_prompts: int = Field(16, ge=1)  # prompts per generate() call
    flush_rows: int = Field(256, ge=1)
    flush_seconds: float = Field(60.0, gt=0)
    max_samples: int | None = Field(None, ge=1)
    max_shards: int | None = Field(None, ge=1)
    worker_id: str = "w00"
    engine: Literal["hf", "vllm"] = "hf"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    device: str = "auto"
    attn_implementation: str = "sdpa"
    tensor_parallel_size: int = Field(1, ge=1)
    student_topk: int = Field(0, ge=0)  # record the student's top-k ids per position (union support)
    seed: int = 0
    follow: bool = False  # keep running until the trainer's DONE marker
    max_buffer_samples: int = Field(4096, ge=1)  # pause while the unconsumed backlog is larger
    max_staleness: int = Field(2, ge=0)  # pause while the loaded policy is further behind LATEST
    poll_seconds: float = Field(1.0, gt=0)  # wait between store checks (new policy, backlog); each is a LIST on S3
    trust_remote_code: bool = False


class AnnotateConfig(Section):
    """`opd annotate`: the teacher scores rollout shards (top-k log-probs per token)."""

    teacher: str | None = None
    teacher_name: str = "teacher"
    top_k: int = Field(32, ge=1)
    dtype: Literal["float16", "float32"] = "float32"  # storage dtype of the top-k log-probs
    model_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    max_tokens_per_batch: int = Field(16384, ge=1)
    max_shards: int | None = Field(None, ge=1)
    worker_index: int = Field(0, ge=0)
    num_workers: int = Field(1, ge=1)  # > 1: the static split (crc32 of the shard id); 1: claim shards by leases
    worker_id: str | None = None  # this worker's name in leases and metrics (None: <teacher_name>-<worker_index>)
    lease_seconds: float | None = Field(30.0, gt=0)  # a shard's lease expiry (None: no leases, take every shard)
    engine: Literal["hf", "vllm"] = "hf"
    device: str = "auto"
    attn_implementation: str = "sdpa"
    tensor_parallel_size: int = Field(1, ge=1)
    padding_side: Literal["right", "left"] = "right"  # hf engine; both give the same log-probs
    head_chunk_tokens: int | None = Field(None, ge=1)  # positions per output-layer chunk (None: 256 MiB of logits)
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)  # vllm engine
    compression: Literal["none", "zstd", "lz4"] = "none"
    # "packed": ids bit-packed at ceil(log2 V) bits, log-probs as 8-bit codes, tail mass exact (docs/annotate.md)
    codec: Literal["none", "packed"] = "none"
    routing_key: str = "data_source"
    # multi-teacher routing: routing-key value -> teacher name. Without routing one teacher annotates
    # every row; with routing a row whose key is not listed goes to `default_teacher` (None: no teacher).
    routing: dict[str, str] = {}
    default_teacher: str | None = None
    follow: bool = False
    max_staleness: int | None = Field(None, ge=0)  # skip shards the trainer can no longer use
    poll_seconds: float = Field(1.0, gt=0)  # wait between listings of new rollout shards; each is a LIST on S3
    trust_remote_code: bool = False

    @model_validator(mode="after")
    def _worker_in_range(self):
        if self.worker_index >= self.num_workers:
            raise ValueError(f"worker_index {self.worker_index} must be < num_workers {self.num_workers}")
        return self


class TrainConfig(Section):
    """`opd train`: the FSDP2 student trainer (losses: docs/losses.md)."""

    student: str | None = None
    loss: str = "forward_kl"  # forward_kl | reverse_kl | jsd | k2 | k3 | abs | pg (policy-gradient OPD)
    tail: Literal["bucket", "renorm", "none"] = "bucket"
    support: Literal["teacher", "union"] = "teacher"
    beta: float = Field(0.5, ge=0, le=1)
    aggregation: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"] = "token-mean"
    max_steps: int = Field(100, ge=1)
    max_staleness: int = Field(2, ge=0)
    publish_every: int = Field(1, ge=1)
    save_every: int = Field(10, ge=1)
    global_batch_samples: int | None = Field(64, ge=1)
    global_batch_tokens: int | None = Field(None, ge=1)
    micro_batch_tokens: int = Field(8192, ge=1)
    lr: float = Field(1e-5, gt=0)
    min_lr: float = Field(0.0, ge=0)
    warmup_steps: int = Field(0, ge=0)
    schedule: Literal["constant", "cosine"] = "constant"
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float = Field(1.0, gt=0)
    chunk_size: int = Field(1024, ge=1)  # tokens per chunk of the fused loss
    # policy-gradient OPD and off-policy correction
    clip_low: float = Field(0.2, ge=0)
    clip_high: float = Field(0.28, ge=0)
    importance_cap: float | None = Field(None, gt=0)  # truncated IS weight min(exp(s - s_behavior), c)
    task_reward_weight: float = Field(0.0, ge=0)  # 0 = pure distillation; >0 adds GRPO task loss
    distill_weight: float = Field(1.0, ge=0)  # λ in total = task loss + λ·distillation
    activation_checkpointing: bool = False
    mixed_precision: Literal["auto", "off", "bf16"] = "auto"
    device: str = "auto"
    seed: int = 0
    follow: bool = False
    # wait between listings of new annotated parts; on a local store 0.1 is cheap
    poll_seconds: float = Field(1.0, gt=0)
    # experiment trackers that receive every train metric, and the evaluator's (docs/train.md, "Experiment tracking")
    report_to: list[Literal["tensorboard", "wandb"]] = []
    tensorboard: bool = False  # deprecated: the same as report_to [tensorboard]
    trust_remote_code: bool = False
    # --follow stops (and writes train/DONE) after this many seconds without admissible data; None = wait forever
    idle_timeout: float | None = Field(None, gt=0)
    keep_states: int = Field(2, ge=1)  # resume states kept in train/state/
    prefetch_batches: int = Field(2, ge=1)  # decoded steps queued ahead of the trainer

    @model_validator(mode="after")
    def _one_batch_unit(self):
        if self.global_batch_tokens is not None and "global_batch_samples" in self.model_fields_set:
            raise ValueError("set only one of global_batch_samples and global_batch_tokens")
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

    prompts: str | None = None
    teacher: str | None = None
    max_prompts: int = Field(200, ge=1)
    n: int = Field(1, ge=1)
    greedy: bool = True
    max_new_tokens: int = Field(32, ge=1)


class RunConfig(Section):
    """`opd run`: the three stages as processes on one store."""

    rollout_workers: int = Field(1, ge=1)
    annotate_workers: int = Field(1, ge=1)  # per teacher
    teachers: dict[str, str] = {}  # name -> checkpoint; empty = annotate.teacher_name -> annotate.teacher
    max_restarts: int = Field(3, ge=0)  # per stage, before the run fails
    sync: bool = False  # lockstep generate -> annotate -> train (max_staleness 0)
    evaluate: bool = True  # run an evaluator process on eval.prompts
    eval_every: int = Field(1, ge=1)  # evaluate every N-th published version (and the last)
    threads_per_stage: int = Field(1, ge=1)  # OMP threads of each stage process
    drain_seconds: float = Field(60.0, ge=0)  # after training: time for the evaluator to finish


class StageResources(Section):
    """What one worker of a stage asks Ray for (`opd run --launcher ray`)."""

    num_cpus: float = Field(1.0, ge=0)
    num_gpus: float = Field(0.0, ge=0)
    resources: dict[str, float] = {}  # custom Ray resources, e.g. {"teacher_node": 1}


class RayConfig(Section):
    """`opd run --launcher ray`: stages as Ray actors (docs/scale-out.md)."""

    address: str | None = None  # a running cluster ("auto", "ray://head:10001"); None: start one on this machine
    rollout: StageResources = StageResources()
    annotate: StageResources = StageResources()
    train: StageResources = StageResources()  # per rank
    eval: StageResources = StageResources()
    train_world_size: int = Field(1, ge=1)  # trainer ranks (FSDP2), one actor each, in one placement group
    scale_poll_seconds: float = Field(2.0, gt=0)  # how often the launcher reads `opd scale`'s desired counts
    shared_filesystem: bool = False  # a local store path that every node mounts (else: refused on a multi-node cluster)


class Config(Section):
    store: StoreConfig = StoreConfig()
    rollout: RolloutConfig = RolloutConfig()
    annotate: AnnotateConfig = AnnotateConfig()
    train: TrainConfig = TrainConfig()
    eval: EvalConfig = EvalConfig()
    run: RunConfig = RunConfig()
    ray: RayConfig = RayConfig()


def parse_set(assignment: str) -> tuple[str, Any]:
    """`train.lr=3e-4` -> ("train.lr", 0.0003); the value is parsed as YAML (numbers, bools, lists)."""
    key, sep, raw = assignment.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set {assignment!r}: expected dotted.key=value, e.g. --set train.lr=3e-4")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key.strip(), value


def _assign(tree: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"config key {dotted!r}: {part!r} is a value, not a section")
        node = child
    node[parts[-1]] = value


def load_config(
    path: str | Path | None = None, overrides: dict[str, Any] | None = None, sets: list[str] | None = None
) -> Config:
    """Build the config: defaults < YAML file < `overrides` (stage flags, dotted keys) < `sets`."""
    tree: dict = {}
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
        tree = loaded
    for key, value in (overrides or {}).items():
        if value is not None:
            _assign(tree, key, value)
    for assignment in sets or []:
        _assign(tree, *parse_set(assignment))
    try:
        return Config.model_validate(tree)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, source=str(path) if path else None)) from None


def format_validation_error(error: ValidationError, source: str | None = None) -> str:
    lines = []
    for item in error.errors():
        key = ".".join(str(p) for p in item["loc"]) or "(config)"
        value = item.get("input")
        if item["type"] == "extra_forbidden":
            lines.append(
                f"unknown config key {key!r} (value {value!r}); check the spelling against `docs/configuration.md`"
            )
        else:
            lines.append(f"config key {key!r} = {value!r}: {item['msg']}")
    where = f" in {source}" if source else ""
    return f"invalid configuration{where}: " + "; ".join(lines)
