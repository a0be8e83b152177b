"""The loss registry and `LossConfig`, the one object that holds every loss option.

`LossConfig` is a frozen dataclass validated once, in `__post_init__`: a bad
combination (k1 without policy gradient, tail "none" with jsd, a clip range
outside [0, 1), ...) fails where the config is built, with the same one-line
`ValueError` whoever builds it (a test, a benchmark, the trainer's
`check_inputs`). It is a dataclass rather than a pydantic model because the
losses are a plain tensor library whose error messages are part of its
contract (pydantic would wrap them in its own report), and because a frozen
dataclass is free to build per call. The trainer builds it from its
`TrainConfig` in one place, `LossConfig.from_train_config`. Each default is
written once, as the default of the `train` key of the same meaning
(opd_cache/config.py, the bottom layer every package may import; `loss` is
`divergence` here): `opd train` and `LossConfig()` agree by construction.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from opd_cache.config import TrainConfig

_TRAIN_KEYS = TrainConfig.model_fields  # the loss keys of `opd train`, whose defaults LossConfig's are


def _default(key: str):
    """The default of the `train` section's key `key` (docs/configuration.md)."""
    return _TRAIN_KEYS[key].default


@dataclass(frozen=True)
class LossSpec:
    """What a loss name means and what it needs."""

    name: str
    kind: str  # "topk": needs the teacher's top-k; "sampled": needs the sampled token
    description: str


LOSSES: dict[str, LossSpec] = {
    spec.name: spec
    for spec in (
        LossSpec("forward_kl", "topk", "KL(p || q), mode-covering (the usual distillation loss)"),
        LossSpec("reverse_kl", "topk", "KL(q || p), mode-seeking"),
        LossSpec("jsd", "topk", "generalized JSD with beta: m = beta*p + (1-beta)*q"),
        LossSpec("k1", "sampled", "s - t; only valid as the reward of policy-gradient OPD (policy_gradient=True)"),
        LossSpec("k2", "sampled", "0.5 * (s - t)^2"),
        LossSpec("k3", "sampled", "exp(t - s) - (t - s) - 1, clamped as verl does"),
        LossSpec("abs", "sampled", "|s - t|"),
    )
}
# "pg" is shorthand for divergence="k1" with policy_gradient=True (the trainer's `loss: pg`).
POLICY_GRADIENT = "pg"
TAILS = ("bucket", "renorm", "none")
AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")


@dataclass(frozen=True)
class LossConfig:
    """Every option of the distillation loss; validated when built.

    `divergence="pg"` is stored as divergence "k1" with policy_gradient=True,
    so the rest of the code sees one spelling. `token_losses` reads the
    divergence, tail, beta and the policy-gradient options; `fused_token_losses`
    also `chunk_size`; the trainer's objective also `importance_cap` (for top-k
    divergences), `distill_weight`, `task_reward_weight` and `aggregation`.
    """

    divergence: str = _default("loss")  # a LOSSES name, or "pg"
    tail: str = _default("tail")  # top-k divergences: bucket | renorm | none
    beta: float = _default("beta")  # jsd: m = beta*p + (1-beta)*q
    policy_gradient: bool = False  # with divergence "k1": policy-gradient OPD (the same as "pg")
    # PPO clip range of policy-gradient OPD and of the GRPO task loss (clip_high > clip_low: DAPO's "clip-higher")
    clip_low: float = _default("clip_low")
    clip_high: float = _default("clip_high")
    importance_cap: float | None = _default("importance_cap")  # truncated importance weight min(exp(s - s_b), c)
    chunk_size: int = _default("chunk_size")  # tokens per chunk of fused_token_losses: ~chunk_size * V * 4 bytes
    aggregation: str = _default("aggregation")  # how per-token losses sum over the optimizer step (AGGREGATIONS)
    # the trainer's total = distill_weight * distillation + task_reward_weight * task
    distill_weight: float = _default("distill_weight")
    task_reward_weight: float = _default("task_reward_weight")

    def __post_init__(self):
        divergence, policy_gradient = self.divergence, self.policy_gradient
        if divergence == POLICY_GRADIENT:
            divergence, policy_gradient = "k1", True
        tail, beta = self.tail, self.beta
        if divergence not in LOSSES:
            raise ValueError(f"unknown divergence {divergence!r}; expected one of {sorted(LOSSES) + [POLICY_GRADIENT]}")
        if tail not in TAILS:
            raise ValueError(f"unknown tail {tail!r}; expected one of {list(TAILS)}")
        if divergence == "k1" and not policy_gradient:
            raise ValueError(
                "divergence='k1' is not a loss on its own: its gradient, grad log q(sampled), is zero in "
                "expectation; use it as the reward of policy-gradient OPD (divergence='pg', or 'k1' with "
                "policy_gradient=True, plus behavior_logprobs; or pg_loss()), or pick k2, k3 or abs"
            )
        if policy_gradient and divergence != "k1":
            raise ValueError(
                f"policy_gradient=True needs divergence='k1' or 'pg' (its reward is t - s_behavior), got {divergence!r}"
            )
        if LOSSES[divergence].kind == "topk" and tail == "none" and divergence != "forward_kl":
            raise ValueError(
                f"tail='none' (verl's forward_kl_topk) supports divergence='forward_kl' only, got {divergence!r}"
            )
        if divergence == "jsd" and not 0.0 <= beta <= 1.0:
            raise ValueError(f"beta={beta} must be in [0, 1] for divergence='jsd'")
        if policy_gradient or self.task_reward_weight > 0:  # the clip range is used: PG OPD or the task loss
            check_clip_range(self.clip_low, self.clip_high)
        if self.importance_cap is not None and not self.importance_cap > 0.0:
            raise ValueError(f"importance_cap={self.importance_cap} must be > 0 (or None for no importance weight)")
        if not isinstance(self.chunk_size, int) or self.chunk_size <= 0:
            raise ValueError(f"chunk_size={self.chunk_size!r} must be a positive int")
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"unknown aggregation mode {self.aggregation!r}; expected one of {list(AGGREGATIONS)}")
        for name in ("distill_weight", "task_reward_weight"):
            if not getattr(self, name) >= 0.0:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 0")
        normalised = dict(divergence=divergence, policy_gradient=bool(policy_gradient), beta=float(beta))
        normalised.update(clip_low=float(self.clip_low), clip_high=float(self.clip_high))
        for name, value in normalised.items():
            object.__setattr__(self, name, value)  # frozen: the normalised spelling is set once, here

    @property
    def kind(self) -> str:
        """Either "topk" (needs the teacher's top-k) or "sampled" (needs the sampled token)."""
        return LOSSES[self.divergence].kind

    @classmethod
    def from_train_config(cls, cfg: TrainConfig) -> LossConfig:
        """The loss options of `opd train` (the `train` section's loss keys; docs/configuration.md).

        The divergence is the key `loss` (flag --loss); every other loss key has its field's name here, so one
        added to both is carried over without a third edit.
        """
        same_name = [f.name for f in fields(cls) if f.name in _TRAIN_KEYS]
        return cls(divergence=cfg.loss, **{name: getattr(cfg, name) for name in same_name})


def check_clip_range(clip_low: float, clip_high: float) -> None:
    """The PPO clip range [1 - clip_low, 1 + clip_high] must contain 1 and stay positive."""
    if not 0.0 <= clip_low < 1.0:
        raise ValueError(f"clip_low={clip_low} must be in [0, 1)")
    if clip_high < 0.0:
        raise ValueError(f"clip_high={clip_high} must be >= 0")
