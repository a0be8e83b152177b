"""The hybrid loss on cross-tokenizer targets (opd_cache/losses/cross_tokenizer.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from opd_cache.annotate.cross_targets import map_topk
from opd_cache.losses import LossConfig, fused_token_losses, token_losses
from opd_cache.losses.cross_tokenizer import SpanTermConfig, cross_tokenizer_token_losses, fused_cross_tokenizer_losses
from opd_cache.storage.quantize import quantize_logprobs
from opd_cache.target_flags import EXCLUDED, GROUP_END, SAME_TOKENIZER, TOPK_VALID

CONFIGS = [
    LossConfig(),
    LossConfig(divergence="reverse_kl"),
    LossConfig(divergence="jsd", beta=0.3, tail="renorm"),
    LossConfig(tail="none"),
    LossConfig(divergence="k3"),
    LossConfig(divergence="k2"),
    LossConfig(divergence="abs"),
    LossConfig(divergence="pg"),
    LossConfig(divergence="pg", importance_cap=2.0),
]
CONFIG_IDS = ["forward_kl", "reverse_kl", "jsd-renorm", "fkl-none", "k3", "k2", "abs", "pg", "pg-cap"]


def make_case(n=29, vocab=40, hidden=12, k=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    teacher = torch.log_softmax(torch.randn(n, vocab, generator=g) * 2, -1)
    top = teacher.topk(k)
    sampled = torch.randint(0, vocab, (n,), generator=g)
    return {
        "hidden": torch.randn(n, hidden, generator=g),
        "weight": torch.randn(vocab, hidden, generator=g) * 0.5,
        "ids": top.indices,
        "lps": top.values,
        "sampled": sampled,
        "teacher_token": teacher.gather(1, sampled[:, None])[:, 0],
        "behavior": -torch.rand(n, generator=g) * 2,
        "token_weights": torch.rand(n, generator=g),
    }


def keywords(case, flags=None):
    out = dict(sampled_ids=case["sampled"], teacher_token_logprobs=case["teacher_token"])
    out["behavior_logprobs"] = case["behavior"]
    if flags is not None:
        out["target_flags"] = flags
    return out


# --------------------------------------------------------------------------- same tokenizer: today's loss exactly
@pytest.mark.parametrize("config", CONFIGS, ids=CONFIG_IDS)
def test_same_tokenizer_targets_give_todays_loss_bit_for_bit(config):
    """Every position TOPK_VALID | GROUP_END (one-token groups): values, gradients and diagnostics are
    identical (torch.equal, not a tolerance) to token_losses / fused_token_losses on both paths."""
    case = make_case()
    flags = torch.full((len(case["sampled"]),), SAME_TOKENIZER, dtype=torch.uint8)
    logits = (case["hidden"] @ case["weight"].t()).requires_grad_()
    today = token_losses(logits, case["ids"], case["lps"], config, **keywords(case))
    (grad_today,) = torch.autograd.grad(today.sum(), logits)
    hybrid = cross_tokenizer_token_losses(logits, case["ids"], case["lps"], config, **keywords(case, flags))
    (grad_hybrid,) = torch.autograd.grad(hybrid.sum(), logits)
    assert torch.equal(today, hybrid) and torch.equal(grad_today, grad_hybrid)

    for chunk_size in (7, 1024):
        cfg = LossConfig(**{**config.__dict__, "chunk_size": chunk_size})
        h, w = case["hidden"].clone().requires_grad_(), case["weight"].clone().requires_grad_()
        loss_a, per_a, diag_a = fused_token_losses(
            h, w, case["ids"], case["lps"], case["token_weights"], cfg, return_diagnostics=True, **keywords(case)
        )
        grads_a = torch.autograd.grad(loss_a, (h, w))
        loss_b, per_b, diag_b = fused_cross_tokenizer_losses(
            h, w, case["ids"], case["lps"], case["token_weights"], cfg, return_diagnostics=True, **keywords(case, flags)
        )
        grads_b = torch.autograd.grad(loss_b, (h, w))
        assert torch.equal(loss_a, loss_b) and torch.equal(per_a, per_b)
        assert all(torch.equal(a, b) for a, b in zip(grads_a, grads_b))
        assert set(diag_b) - set(diag_a) == {"topk_share", "span_groups"}
        assert all(torch.equal(diag_a[key], diag_b[key]) for key in diag_a), [
            key for key in diag_a if not torch.equal(diag_a[key], diag_b[key])
        ]
        assert diag_b["topk_share"] == 1.0 and diag_b["span_groups"] == (0 if config.kind == "topk" else 29)


# --------------------------------------------------------------------------- aligned groups: against a reference
# group sizes of the 29 positions: one-token groups, longer groups, and an excluded row of three positions
GROUP_SIZES = [1, 3, 1, 1, 5, 2, 1, 4, 1, 2, 1, 3, 1]
EXCLUDED_ROW = (26, 29)


def aligned_flags(rule: str = "one_to_one") -> torch.Tensor:
    """Flags as the target builder writes them: GROUP_END at group ends, TOPK_VALID at one-token groups
    ("one_to_one") or at every group's first position ("group_start"); one one-token group without a top-k."""
    flags, start = [], 0
    for g, size in enumerate(GROUP_SIZES):
        group = [0] * size
        group[-1] |= GROUP_END
        if (size == 1 and g != 6) or rule == "group_start":
            group[0] |= TOPK_VALID
        flags += group
        start += size
    flags += [EXCLUDED] * (EXCLUDED_ROW[1] - EXCLUDED_ROW[0])
    return torch.tensor(flags, dtype=torch.uint8)


def reference_losses(logits, case, flags, config, span):
    """The hybrid written out group by group with plain torch (no fused machinery)."""
    logq = torch.log_softmax(logits.float(), -1)
    s = logq.gather(1, case["sampled"][:, None])[:, 0]
    per_token = [logits.new_zeros(())] * len(flags)
    flags = flags.tolist()
    start = 0
    for i, f in enumerate(flags):
        if f & EXCLUDED:
            start = i + 1
            continue
        if config.kind == "topk" and f & TOPK_VALID:
            one = token_losses(logits[i : i + 1], case["ids"][i : i + 1], case["lps"][i : i + 1], config)[0]
            per_token[i] = per_token[i] + one
        if f & GROUP_END:
            members = list(range(start, i + 1))
            single_topk = len(members) == 1 and f & TOPK_VALID
            if config.kind == "sampled" or not single_topk:
                s_g, t_g = s[members].sum(), case["teacher_token"][i]
                if config.policy_gradient:
                    b_g = case["behavior"][members].sum()
                    s_prox = s_g.detach() if config.importance_cap else b_g
                    ratio = torch.exp(s_g - s_prox)
                    reward = t_g - b_g
                    value = torch.maximum(
                        -reward * ratio, -reward * ratio.clamp(1 - config.clip_low, 1 + config.clip_high)
                    )
                    if config.importance_cap:
                        value = value * torch.exp(s_prox - b_g).clamp(max=config.importance_cap)
                else:
                    name = config.divergence if config.kind == "sampled" else span.estimator
                    d = t_g - s_g
                    value = {
                        "k2": 0.5 * d**2,
                        "abs": d.abs(),
                        "k3": (d.clamp(-20, 20).exp() - d.clamp(-20, 20) - 1).clamp(-10, 10),
                    }[name]
                    value = value if config.kind == "sampled" else span.weight * value
                per_token[i] = per_token[i] + value
            start = i + 1
    return torch.stack(per_token)


@pytest.mark.parametrize("config", CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize("rule", ["one_to_one", "group_start"])
def test_hybrid_matches_a_group_by_group_reference_on_both_paths(config, rule):
    case = make_case(seed=1)
    flags = aligned_flags(rule)
    span = SpanTermConfig(weight=0.7, estimator="k3" if config.divergence == "reverse_kl" else "k2")
    logits = (case["hidden"] @ case["weight"].t()).requires_grad_()
    expected = reference_losses(logits, case, flags, config, span)
    (grad_expected,) = torch.autograd.grad((expected * case["token_weights"]).sum(), logits)
    got = cross_tokenizer_token_losses(logits, case["ids"], case["lps"], config, span=span, **keywords(case, flags))
    (grad_got,) = torch.autograd.grad((got * case["token_weights"]).sum(), logits)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)  # float32, two ways of computing log q
    torch.testing.assert_close(grad_got, grad_expected, atol=1e-6, rtol=1e-5)

    # the fused path, in chunks of 3: the 5-position group must get a chunk of its own, never be cut
    h, w = case["hidden"].clone().requires_grad_(), case["weight"].clone().requires_grad_()
    cfg = LossConfig(**{**config.__dict__, "chunk_size": 3})
    loss, per_token = fused_cross_tokenizer_losses(
        h, w, case["ids"], case["lps"], case["token_weights"], cfg, span=span, **keywords(case, flags)
    )
    grad_h, grad_w = torch.autograd.grad(loss, (h, w))
    torch.testing.assert_close(per_token, expected.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad_h, grad_expected @ case["weight"], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(grad_w, grad_expected.t() @ case["hidden"], atol=1e-5, rtol=1e-4)


def test_gradients_only_where_they_should_be():
    case = make_case(seed=2)
    flags = aligned_flags()
    logits = (case["hidden"] @ case["weight"].t()).requires_grad_()
    per_token = cross_tokenizer_token_losses(logits, case["ids"], case["lps"], LossConfig(), **keywords(case, flags))
    (grad,) = torch.autograd.grad(per_token.sum(), logits)
    lo, hi = EXCLUDED_ROW
    assert (grad[lo:hi] == 0).all() and (per_token[lo:hi] == 0).all()  # an excluded row: nothing
    assert (grad[:lo].abs().sum(1) > 0).all()  # every other position gets a gradient

    # a span group's positions share one coefficient c: grad z_i = c * (onehot(sampled_i) - q_i)
    q = torch.softmax(logits.detach(), -1)
    start = sum(GROUP_SIZES[:4])  # the 5-position group
    members = range(start, start + 5)
    coefficients = [float(grad[i, case["sampled"][i]] / (1 - q[i, case["sampled"][i]])) for i in members]
    for i, c in zip(members, coefficients):
        torch.testing.assert_close(grad[i], c * (torch.nn.functional.one_hot(case["sampled"][i], 40) - q[i]))
    assert np.allclose(coefficients, coefficients[0], rtol=1e-5)

    # span weight 0: positions of span groups get no gradient at all, top-k positions theirs unchanged
    per_token_0 = cross_tokenizer_token_losses(
        logits, case["ids"], case["lps"], LossConfig(), span=SpanTermConfig(weight=0.0), **keywords(case, flags)
    )
    (grad_0,) = torch.autograd.grad(per_token_0.sum(), logits)
    topk = (flags & TOPK_VALID) != 0
    assert (grad_0[~topk] == 0).all()
    assert torch.equal(grad_0[topk], grad[topk])


# --------------------------------------------------------------------------- padding unmapped top-k slots
LOSS_SHAPES = [
    LossConfig(),
    LossConfig(divergence="reverse_kl"),
    LossConfig(divergence="jsd"),
    LossConfig(tail="renorm"),
    LossConfig(divergence="reverse_kl", tail="renorm"),
    LossConfig(tail="none"),
]


def padded_rows(seed=3, rows=12, k=6, vocab=30):
    """Top-k rows through the real builder: teacher ids of which some have no student id."""
    rng = np.random.default_rng(seed)
    table = np.where(rng.random(50) < 0.6, rng.permutation(50)[:50] % vocab, -1).astype(np.int32)
    teacher_ids = np.stack([rng.choice(50, k, replace=False) for _ in range(rows)])
    logprobs = np.sort(np.log(rng.dirichlet(np.ones(k + 2), size=rows)[:, :k]), axis=1)[:, ::-1]
    ids, lp, _, _ = map_topk(teacher_ids, logprobs, table)
    keep = np.isfinite(lp[:, 0])
    return ids[keep], lp[keep]


@pytest.mark.parametrize("config", LOSS_SHAPES, ids=["fkl", "rkl", "jsd", "fkl-renorm", "rkl-renorm", "fkl-none"])
def test_padding_with_the_first_id_at_minus_infinity_changes_nothing(config):
    """The loss on a padded row equals the loss on the row's real entries alone (a narrower top-k)."""
    ids, lp = padded_rows()
    assert (~np.isfinite(lp)).any(1).sum() >= 3  # several rows are padded
    logits = torch.randn(len(ids), 30, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    padded = token_losses(logits, torch.from_numpy(ids), torch.from_numpy(lp), config)
    for r in range(len(ids)):
        real = np.isfinite(lp[r])
        compact = token_losses(
            logits[r : r + 1], torch.from_numpy(ids[r : r + 1, real]), torch.from_numpy(lp[r : r + 1, real]), config
        )
        torch.testing.assert_close(padded[r : r + 1], compact, atol=1e-6, rtol=1e-6)


def test_other_paddings_are_not_safe():
    """-inf with a fresh id turns that id into a zero-mass bucket (reverse KL: infinite); a repeated id with a
    finite log-prob counts twice in the top-k mass the packed codec stores. The chosen padding does neither."""
    ids, lp = padded_rows()
    row = int(np.nonzero(~np.isfinite(lp).all(1))[0][0])
    ids, lp = ids[row : row + 1], lp[row : row + 1]
    pad = ~np.isfinite(lp[0])
    logits = torch.randn(1, 30, generator=torch.Generator().manual_seed(5))
    rkl = LossConfig(divergence="reverse_kl")
    fresh = ids.copy()
    fresh[0, pad] = [i for i in range(30) if i not in ids[0]][: int(pad.sum())]
    assert math.isinf(float(token_losses(logits, torch.from_numpy(fresh), torch.from_numpy(lp), rkl)[0]))
    assert math.isfinite(float(token_losses(logits, torch.from_numpy(ids), torch.from_numpy(lp), rkl)[0]))

    finite_repeat = lp.copy()
    finite_repeat[0, pad] = lp[0, 0]
    real_mass = quantize_logprobs(lp[:, ~pad])[1]
    assert quantize_logprobs(lp)[1] == pytest.approx(real_mass)
    assert quantize_logprobs(finite_repeat)[1] > real_mass[0] + 0.1


# --------------------------------------------------------------------------- bad input
def test_bad_flags_and_missing_inputs_are_named():
    case = make_case(n=4)
    logits = case["hidden"] @ case["weight"].t()
    kw = keywords(case)
    with pytest.raises(ValueError, match="the last position ends no group"):
        cross_tokenizer_token_losses(logits, case["ids"], case["lps"], target_flags=torch.tensor([2, 2, 2, 1]), **kw)
    with pytest.raises(ValueError, match="target_flags must hold integer flags"):
        cross_tokenizer_token_losses(logits, case["ids"], case["lps"], target_flags=torch.ones(4), **kw)
    with pytest.raises(ValueError, match=r"target_flags has values outside \[0, 7\]"):
        cross_tokenizer_token_losses(logits, case["ids"], case["lps"], target_flags=torch.tensor([2, 2, 2, 9]), **kw)
    with pytest.raises(ValueError, match="need sampled_ids and teacher_token_logprobs"):
        cross_tokenizer_token_losses(
            logits, case["ids"], case["lps"], target_flags=torch.full((4,), 3), sampled_ids=case["sampled"],
            teacher_token_logprobs=None,
        )  # fmt: skip
    with pytest.raises(ValueError, match="span estimator 'k1'"):
        SpanTermConfig(estimator="k1")
    with pytest.raises(ValueError, match="span weight -1"):
        SpanTermConfig(weight=-1)
