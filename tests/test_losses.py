"""opd_cache.losses on materialised logits: exactness against naive full-vocabulary
implementations written here, properties (hypothesis), policy-gradient OPD,
aggregation across micro-batches, diagnostics and every error message."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from opd_cache.losses import (
    AGGREGATIONS,
    LOSSES,
    P_TAIL_MIN,
    TAILS,
    LossConfig,
    aggregate,
    aggregation_weights,
    pg_loss,
    token_losses,
)

BETAS = [0.0, 0.1, 0.5, 0.9, 1.0]
DIVERGENCES = ["forward_kl", "reverse_kl", "jsd"]
HYPOTHESIS = settings(max_examples=30, deadline=None, derandomize=True)


# --- naive references (float64, plain autograd, independent of the module) ---


def full_divergence(logq: torch.Tensor, logp: torch.Tensor, divergence: str, beta: float) -> torch.Tensor:
    """Divergence between distributions given by log-probs over the last dim (TRL's JSD convention)."""
    p, q = logp.exp(), logq.exp()
    if divergence == "forward_kl" or (divergence == "jsd" and beta == 0.0):
        return (p * (logp - logq)).sum(-1)
    if divergence == "reverse_kl" or (divergence == "jsd" and beta == 1.0):
        return (q * (logq - logp)).sum(-1)
    m = beta * p + (1 - beta) * q
    return beta * (p * (logp - m.log())).sum(-1) + (1 - beta) * (q * (logq - m.log())).sum(-1)


def naive_bucket(logits, ids, teacher_lp, divergence, beta=0.5, tail="bucket"):
    """Row by row: the unique support S, the buckets, the divergence; float64 autograd."""
    logq = logits.double().log_softmax(-1)
    vocab = logits.shape[1]
    out = []
    for row in range(logits.shape[0]):
        lp = {}
        for i, v in zip(ids[row].tolist(), teacher_lp[row].double().tolist()):
            lp.setdefault(i, v)  # first occurrence wins
        support = torch.tensor(sorted(lp))
        lp_s = torch.tensor([lp[i] for i in sorted(lp)], dtype=torch.float64)
        lq_s = logq[row, support]
        if tail == "renorm":
            lp_b, lq_b = lp_s - lp_s.logsumexp(0), lq_s - lq_s.logsumexp(0)
        elif tail == "none":
            out.append((lp_s.exp() * (lp_s - lq_s)).sum().clamp_min(0))
            continue
        elif len(support) == vocab:  # S is the whole vocabulary: no tail bucket
            lp_b, lq_b = lp_s, lq_s
        else:
            outside = torch.ones(vocab, dtype=torch.bool)
            outside[support] = False
            q_tail = logq[row, outside].exp().sum()
            p_tail = (1 - lp_s.exp().sum()).clamp_min(P_TAIL_MIN)
            lp_b = torch.cat([lp_s, p_tail.log()[None]])
            lq_b = torch.cat([lq_s, q_tail.log()[None]])
        out.append(full_divergence(lq_b, lp_b, divergence, beta))
    return torch.stack(out)


def teacher_topk(n, vocab, k, seed=0, scale=2.0):
    g = torch.Generator().manual_seed(seed)
    teacher_lp = (torch.randn(n, vocab, generator=g, dtype=torch.float64) * scale).log_softmax(-1)
    values, ids = teacher_lp.topk(k, dim=1)
    return teacher_lp, ids, values.float()


def student(n, vocab, seed=1, scale=2.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, vocab, generator=g) * scale).requires_grad_()


def grad_of(loss_fn, logits):
    x = logits.detach().clone().requires_grad_()
    (value,) = torch.autograd.grad(loss_fn(x).sum(), [x])
    return value


def split_options(kwargs: dict) -> tuple[LossConfig, dict]:
    """(LossConfig of the option keys, the remaining keyword arguments: the tensors)."""
    names = {f.name for f in dataclasses.fields(LossConfig)}
    return LossConfig(**{k: v for k, v in kwargs.items() if k in names}), {
        k: v for k, v in kwargs.items() if k not in names
    }


# --- exactness against the full-vocabulary divergence (k = V) ---


@pytest.mark.parametrize(
    "divergence,beta",
    [("forward_kl", 0.5), ("reverse_kl", 0.5)] + [("jsd", b) for b in BETAS],
)
def test_full_support_bucket_equals_full_vocabulary_divergence(divergence, beta):
    n, vocab = 6, 23
    teacher_lp, ids, values = teacher_topk(n, vocab, vocab)
    logits = student(n, vocab)
    ours = token_losses(logits, ids, values, LossConfig(divergence=divergence, tail="bucket", beta=beta))
    ref = full_divergence(logits.double().log_softmax(-1), teacher_lp, divergence, beta)
    torch.testing.assert_close(ours.double(), ref, atol=1e-5, rtol=0)
    g_ours = grad_of(lambda x: token_losses(x, ids, values, LossConfig(divergence=divergence, beta=beta)), logits)
    g_ref = grad_of(lambda x: full_divergence(x.double().log_softmax(-1), teacher_lp, divergence, beta), logits)
    torch.testing.assert_close(g_ours, g_ref.float(), atol=1e-5, rtol=0)


@pytest.mark.parametrize("tail", ["renorm", "none"])
def test_full_support_other_tails_equal_full_forward_kl(tail):
    n, vocab = 5, 17
    teacher_lp, ids, values = teacher_topk(n, vocab, vocab, seed=3)
    logits = student(n, vocab, seed=4)
    ours = token_losses(logits, ids, values, LossConfig(divergence="forward_kl", tail=tail))
    ref = full_divergence(logits.double().log_softmax(-1), teacher_lp, "forward_kl", 0.5)
    torch.testing.assert_close(ours.double(), ref, atol=1e-5, rtol=0)


def test_jsd_endpoints_follow_trl_convention():
    n, vocab, k = 4, 30, 6
    _, ids, values = teacher_topk(n, vocab, k)
    logits = student(n, vocab)
    fkl = token_losses(logits, ids, values, LossConfig(divergence="forward_kl"))
    rkl = token_losses(logits, ids, values, LossConfig(divergence="reverse_kl"))
    torch.testing.assert_close(token_losses(logits, ids, values, LossConfig(divergence="jsd", beta=0.0)), fkl)
    torch.testing.assert_close(token_losses(logits, ids, values, LossConfig(divergence="jsd", beta=1.0)), rkl)


# --- exactness of the top-k tails against the naive row-by-row construction ---

TOPK_MODES = [
    ("forward_kl", "bucket", 0.5),
    ("reverse_kl", "bucket", 0.5),
    ("jsd", "bucket", 0.1),
    ("jsd", "bucket", 0.9),
    ("forward_kl", "renorm", 0.5),
    ("reverse_kl", "renorm", 0.5),
    ("jsd", "renorm", 0.5),
    ("forward_kl", "none", 0.5),
]


@pytest.mark.parametrize("divergence,tail,beta", TOPK_MODES)
def test_topk_tails_match_naive(divergence, tail, beta):
    n, vocab, k = 7, 41, 5
    _, ids, values = teacher_topk(n, vocab, k, seed=5)
    logits = student(n, vocab, seed=6, scale=3.0)

    def ours(x):
        return token_losses(x, ids, values, LossConfig(divergence=divergence, tail=tail, beta=beta))

    def ref(x):
        return naive_bucket(x, ids, values, divergence, beta, tail)

    torch.testing.assert_close(ours(logits).double(), ref(logits), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad_of(ours, logits), grad_of(ref, logits).float(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("divergence,tail", [("forward_kl", "bucket"), ("reverse_kl", "renorm"), ("jsd", "bucket")])
def test_union_support_counts_duplicates_once(divergence, tail):
    n, vocab, k, k_s = 6, 29, 4, 5
    teacher_lp, ids, values = teacher_topk(n, vocab, k, seed=7)
    logits = student(n, vocab, seed=8)
    # the student's top-k overlaps the teacher's top-k on some ids
    extra_ids = torch.cat([ids[:, :2], logits.detach().topk(k_s - 2).indices], 1)
    extra_lp = teacher_lp.gather(1, extra_ids).float()
    config = LossConfig(divergence=divergence, tail=tail)
    ours = token_losses(logits, ids, values, config, support_ids=extra_ids, support_teacher_logprobs=extra_lp)
    ref = naive_bucket(logits, torch.cat([ids, extra_ids], 1), torch.cat([values, extra_lp], 1), divergence, 0.5, tail)
    torch.testing.assert_close(ours.double(), ref, atol=1e-5, rtol=1e-5)
    # an extra support made only of duplicates changes nothing
    same = token_losses(logits, ids, values, config, support_ids=ids.flip(1), support_teacher_logprobs=values.flip(1))
    torch.testing.assert_close(same, token_losses(logits, ids, values, config))


def test_union_covering_the_vocabulary_drops_the_tail():
    n, vocab = 3, 12
    teacher_lp, ids, values = teacher_topk(n, vocab, 7, seed=9)
    rest = teacher_lp.topk(vocab, dim=1).indices[:, 4:]  # overlaps ids[:, 4:7], covers the rest
    logits = student(n, vocab)
    ours = token_losses(
        logits, ids, values, support_ids=rest, support_teacher_logprobs=teacher_lp.gather(1, rest).float()
    )
    ref = full_divergence(logits.double().log_softmax(-1), teacher_lp, "forward_kl", 0.5)
    torch.testing.assert_close(ours.double(), ref, atol=1e-5, rtol=0)


def test_tail_is_stable_when_the_support_holds_almost_all_student_mass():
    """log q_tail from a log-sum-exp over the complement, not log(1 - sum q_S)."""
    vocab = 50
    logits = torch.full((1, vocab), -40.0)
    logits[0, :3] = torch.tensor([10.0, 9.0, 8.0])  # q_tail ~ 1e-21: 1 - sum(q_S) rounds to 0
    ids = torch.arange(3)[None]
    values = torch.log(torch.tensor([[0.5, 0.3, 0.1]]))  # p_tail = 0.1
    ours = token_losses(logits.requires_grad_(), ids, values, LossConfig(divergence="forward_kl"))
    ref = naive_bucket(logits, ids, values, "forward_kl")
    assert torch.isfinite(ours).all()
    torch.testing.assert_close(ours.double(), ref, rtol=1e-6, atol=0)
    assert ours.item() > 4.0  # the tail term 0.1 * log(0.1 / 1e-21) dominates


# --- sampled-token estimators ---


def test_sampled_estimators_match_formulas_and_verl_clamps():
    n, vocab = 8, 19
    teacher_lp, _, _ = teacher_topk(n, vocab, 1)
    logits = student(n, vocab, scale=4.0)
    sampled = torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(0))
    t = teacher_lp.gather(1, sampled[:, None]).squeeze(1).float()
    t[0] = -60.0  # t - s << -20: k3's inner clamp
    t[1] = 0.0
    logits.data[1, sampled[1]] = -30.0  # t - s >> 20: k3's outer clamp at 10

    def s_of(x):
        return x.log_softmax(-1).gather(1, sampled[:, None]).squeeze(1)

    def k3_ref(x):
        d = (t - s_of(x)).clamp(-20, 20)
        return (d.exp() - d - 1).clamp(-10, 10)

    refs = {
        "k2": lambda x: 0.5 * (s_of(x) - t) ** 2,
        "abs": lambda x: (s_of(x) - t).abs(),
        "k3": k3_ref,
    }
    for name, ref in refs.items():

        def ours(x, name=name):
            return token_losses(x, config=LossConfig(divergence=name), sampled_ids=sampled, teacher_token_logprobs=t)

        torch.testing.assert_close(ours(logits), ref(logits), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(grad_of(ours, logits), grad_of(ref, logits), atol=1e-5, rtol=1e-5)
    k3 = token_losses(logits, config=LossConfig(divergence="k3"), sampled_ids=sampled, teacher_token_logprobs=t)
    assert k3[1].item() == 10.0


# --- policy-gradient OPD ---


def test_pg_loss_on_policy_gradient_is_minus_reward():
    s = torch.tensor([-1.0, -2.0, -0.5], requires_grad=True)
    t = torch.tensor([-0.5, -3.0, -0.5])
    loss = pg_loss(s, s.detach(), t)
    (grad,) = torch.autograd.grad(loss.sum(), [s])
    torch.testing.assert_close(loss, -(t - s.detach()))  # ratio 1: loss = -reward
    torch.testing.assert_close(grad, -(t - s.detach()))  # d/ds = -reward * ratio


def test_pg_loss_clips_like_ppo():
    s_b = torch.zeros(4)
    s = torch.log(torch.tensor([1.5, 1.5, 0.5, 0.5])).requires_grad_()  # ratios 1.5 and 0.5
    t = torch.tensor([1.0, -1.0, 1.0, -1.0])  # rewards +1, -1, +1, -1
    loss = pg_loss(s, s_b, t, clip_low=0.2, clip_high=0.28)
    (grad,) = torch.autograd.grad(loss.sum(), [s])
    # positive reward, ratio above 1 + clip_high: clipped, no gradient
    assert loss[0].item() == pytest.approx(-1.28) and grad[0].item() == 0.0
    # negative reward, ratio above: unclipped (pessimistic), gradient -r * ratio
    assert loss[1].item() == pytest.approx(1.5) and grad[1].item() == pytest.approx(1.5)
    # positive reward, ratio below 1 - clip_low: unclipped, gradient -r * ratio
    assert loss[2].item() == pytest.approx(-0.5) and grad[2].item() == pytest.approx(-0.5)
    # negative reward, ratio below: clipped, no gradient
    assert loss[3].item() == pytest.approx(0.8) and grad[3].item() == 0.0


def test_pg_loss_truncated_importance_weight():
    s_b = torch.tensor([-3.0, -1.0])
    s = torch.tensor([-1.0, -1.5], requires_grad=True)  # exp(s - s_b) = e^2 (capped at 2), e^-0.5
    t = torch.tensor([-2.0, -0.5])
    loss = pg_loss(s, s_b, t, importance_cap=2.0)
    (grad,) = torch.autograd.grad(loss.sum(), [s])
    weight = torch.tensor([2.0, math.exp(-0.5)])
    reward = t - s_b
    torch.testing.assert_close(loss, -weight * reward)
    torch.testing.assert_close(grad, -weight * reward)
    # an explicit proximal policy: ratio against it, weight from it
    prox = torch.tensor([-2.0, -1.5])
    loss = pg_loss(s, s_b, t, importance_cap=2.0, proximal_logprobs=prox)
    ratio = torch.exp(s.detach() - prox)
    w = torch.exp(prox - s_b).clamp(max=2.0)
    # the default clip range, LossConfig's (clip_low, clip_high) = (0.2, 0.28)
    expected = w * torch.maximum(-reward * ratio, -reward * ratio.clamp(0.8, 1.28))
    torch.testing.assert_close(loss, expected)


@pytest.mark.parametrize("importance_cap", [None, 1.5])
def test_token_losses_policy_gradient_matches_pg_loss(importance_cap):
    n, vocab = 6, 13
    logits = student(n, vocab)
    g = torch.Generator().manual_seed(2)
    sampled = torch.randint(0, vocab, (n,), generator=g)
    behavior = logits.detach().log_softmax(-1).gather(1, sampled[:, None]).squeeze(1) + 0.3 * torch.randn(
        n, generator=g
    )
    t = torch.randn(n, generator=g) - 2

    def ref(x):
        s = x.log_softmax(-1).gather(1, sampled[:, None]).squeeze(1)
        return pg_loss(s, behavior, t, clip_low=0.2, clip_high=0.28, importance_cap=importance_cap)

    kwargs = dict(sampled_ids=sampled, teacher_token_logprobs=t, behavior_logprobs=behavior)
    clip = dict(clip_high=0.28, importance_cap=importance_cap)
    for options in ({"divergence": "pg"}, {"divergence": "k1", "policy_gradient": True}):

        def ours(x, options=options):
            return token_losses(x, config=LossConfig(**options, **clip), **kwargs)

        torch.testing.assert_close(ours(logits), ref(logits), atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(grad_of(ours, logits), grad_of(ref, logits), atol=1e-6, rtol=1e-6)


# --- the hand-written backward against finite differences ---


@pytest.mark.parametrize(
    "options",
    [
        {"divergence": "forward_kl"},
        {"divergence": "reverse_kl"},
        {"divergence": "jsd", "beta": 0.3},
        {"divergence": "forward_kl", "tail": "renorm"},
        {"divergence": "forward_kl", "tail": "none"},
        {"divergence": "jsd", "union": True},
        {"divergence": "reverse_kl", "full": True},
        {"divergence": "k2"},
        {"divergence": "k3"},
        {"divergence": "pg"},
    ],
    ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()),
)
def test_gradcheck_float64(options):
    options = dict(options)
    n, vocab = 3, 9
    k = vocab if options.pop("full", False) else 3
    teacher_lp, ids, values = teacher_topk(n, vocab, k, seed=11)
    values = values.double()
    logits = torch.randn(n, vocab, dtype=torch.float64, generator=torch.Generator().manual_seed(12), requires_grad=True)
    if options.pop("union", False):
        extra = torch.tensor([[0, 1], [2, 3], [4, 5]])
        options.update(support_ids=extra, support_teacher_logprobs=teacher_lp.gather(1, extra))
    sampled = torch.tensor([1, 4, 7])
    options.update(sampled_ids=sampled, teacher_token_logprobs=teacher_lp.gather(1, sampled[:, None]).squeeze(1))
    options.update(behavior_logprobs=torch.tensor([-2.0, -2.5, -1.9], dtype=torch.float64))
    config, tensors = split_options(options)
    assert torch.autograd.gradcheck(lambda x: token_losses(x, ids, values, config, **tensors), (logits,))


def test_low_precision_logits_are_computed_in_float32():
    n, vocab, k = 4, 33, 5
    _, ids, values = teacher_topk(n, vocab, k)
    logits = student(n, vocab).detach().bfloat16()
    out = token_losses(logits, ids, values.half())
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, token_losses(logits.float(), ids, values.half().float()))


# --- properties (hypothesis) ---


@st.composite
def problems(draw, min_vocab=2):
    vocab = draw(st.integers(min_vocab, 40))
    k = draw(st.integers(1, vocab))
    n = draw(st.integers(1, 4))
    seed = draw(st.integers(0, 2**31 - 1))
    student_scale = draw(st.sampled_from([0.01, 1.0, 5.0, 30.0]))
    teacher_scale = draw(st.sampled_from([0.01, 1.0, 5.0, 30.0]))
    g = torch.Generator().manual_seed(seed)
    teacher_lp = (torch.randn(n, vocab, generator=g, dtype=torch.float64) * teacher_scale).log_softmax(-1)
    values, ids = teacher_lp.topk(k, dim=1)
    logits = torch.randn(n, vocab, generator=g) * student_scale
    near = draw(st.sampled_from([None, 0.0, 1e-6, 1e-3]))
    if near is not None:  # a student (almost) equal to the teacher: where rounding bites
        logits = teacher_lp.float() + 3.0 + near * logits
    return teacher_lp, ids, values.float(), logits


@HYPOTHESIS
@given(problems(), st.sampled_from(DIVERGENCES), st.floats(0, 1), st.sampled_from(["bucket", "renorm"]), st.booleans())
def test_bucket_divergences_are_non_negative(problem, divergence, beta, tail, half):
    _, ids, values, logits = problem
    if half:  # float16 log-probs: the teacher's tail mass may round below zero and be clamped
        values = values.half()
    out = token_losses(logits, ids, values, LossConfig(divergence=divergence, tail=tail, beta=beta))
    assert torch.isfinite(out).all()
    assert (out >= 0).all(), out  # exactly, without any clamp


@HYPOTHESIS
@given(problems(), st.sampled_from(DIVERGENCES), st.floats(0, 1), st.sampled_from(TAILS), st.floats(-5, 5))
def test_zero_when_student_equals_teacher(problem, divergence, beta, tail, shift):
    teacher_lp, ids, values, _ = problem
    if tail == "none" and divergence != "forward_kl":
        return
    logits = teacher_lp.float() + shift  # the same distribution, any logit offset
    out = token_losses(logits, ids, values, LossConfig(divergence=divergence, tail=tail, beta=beta))
    assert out.abs().max().item() < 1e-5


@HYPOTHESIS
@given(problems(), st.sampled_from(DIVERGENCES), st.sampled_from(TAILS), st.integers(0, 2**31 - 1))
def test_invariant_to_permuting_the_support(problem, divergence, tail, seed):
    _, ids, values, logits = problem
    if tail == "none" and divergence != "forward_kl":
        return
    perm = torch.randperm(ids.shape[1], generator=torch.Generator().manual_seed(seed))
    config = LossConfig(divergence=divergence, tail=tail)
    a = token_losses(logits, ids, values, config)
    b = token_losses(logits, ids[:, perm], values[:, perm], config)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@HYPOTHESIS
@given(problems(min_vocab=3))
def test_forward_kl_bucket_is_monotone_in_k(problem):
    teacher_lp, _, _, logits = problem
    vocab = logits.shape[1]
    values, ids = teacher_lp.topk(vocab, dim=1)
    # a teacher whose tail rounds to nothing gets a clamped p_tail; keep honest tails here
    losses = [
        token_losses(logits.double(), ids[:, :k], values[:, :k], LossConfig(divergence="forward_kl"))
        for k in range(1, vocab + 1)
    ]
    full = full_divergence(logits.double().log_softmax(-1), teacher_lp, "forward_kl", 0.5)
    tail_ok = (1 - values.exp().cumsum(1)) > 10 * P_TAIL_MIN
    for k in range(1, vocab):
        rows = tail_ok[:, k - 1]  # rows whose smaller support has an unclamped tail
        assert (losses[k][rows] >= losses[k - 1][rows] - 1e-9).all()
    torch.testing.assert_close(losses[-1], full, atol=1e-9, rtol=1e-9)
    assert (losses[0] <= full + 1e-9).all()


# --- aggregation ---


def ragged_batch(seed=0, batch=8, length=6):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([6, 1, 4, 0, 5, 3, 2, 6])[:batch]
    mask = (torch.arange(length)[None] < lengths[:, None]).float()
    x = torch.randn(batch, length, 5, generator=g)
    return x, mask


@pytest.mark.parametrize("mode", AGGREGATIONS)
def test_aggregate_matches_definitions(mode):
    per_token = torch.rand(8, 6, generator=torch.Generator().manual_seed(3))
    _, mask = ragged_batch()
    got = aggregate(per_token, mask, mode)
    seqs = mask.sum(1) > 0
    if mode == "token-mean":
        want = (per_token * mask).sum() / mask.sum()
    elif mode == "seq-mean-token-mean":
        want = ((per_token * mask).sum(1)[seqs] / mask.sum(1)[seqs]).mean()
    else:
        want = (per_token * mask).sum(1)[seqs].mean()
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("mode", AGGREGATIONS)
def test_micro_batch_split_gives_the_same_gradient(mode):
    x, mask = ragged_batch()
    vocab, k = 11, 3
    g = torch.Generator().manual_seed(4)
    layer = torch.randn(5, vocab, generator=g)
    teacher = (torch.randn(8, 6, vocab, generator=g) * 2).log_softmax(-1)
    values, ids = teacher.topk(k, dim=-1)
    total_tokens, total_seqs = mask.sum(), (mask.sum(1) > 0).sum()
    grads = []
    for parts in (1, 2, 4):
        weight = layer.clone().requires_grad_()
        for rows in torch.arange(8).chunk(parts):
            logits = (x[rows] @ weight).reshape(-1, vocab)
            per_token = token_losses(logits, ids[rows].reshape(-1, k), values[rows].reshape(-1, k)).reshape(
                len(rows), 6
            )
            loss = aggregate(per_token, mask[rows], mode, global_tokens=total_tokens, global_seqs=total_seqs)
            loss.backward()
        grads.append(weight.grad)
    torch.testing.assert_close(grads[1], grads[0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(grads[2], grads[0], atol=1e-6, rtol=1e-6)
    # without the global counts the gradient does depend on the split (the bug this avoids)
    weight = layer.clone().requires_grad_()
    for rows in torch.arange(8).chunk(4):
        logits = (x[rows] @ weight).reshape(-1, vocab)
        per_token = token_losses(logits, ids[rows].reshape(-1, k), values[rows].reshape(-1, k)).reshape(len(rows), 6)
        aggregate(per_token, mask[rows], mode).backward()
    assert not torch.allclose(weight.grad, grads[0], atol=1e-6)


def test_aggregation_weights_sum_to_one_on_the_global_batch():
    _, mask = ragged_batch()
    for mode in ("token-mean", "seq-mean-token-mean"):
        halves = [
            aggregation_weights(mask[rows], mode, global_tokens=mask.sum(), global_seqs=7)
            for rows in torch.arange(8).chunk(2)
        ]
        assert sum(w.sum() for w in halves).item() == pytest.approx(1.0)


# --- diagnostics ---


def test_diagnostics_report_masses_overlap_and_loss_range():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.1, 0.1, 0.05, 0.05], [0.05, 0.05, 0.1, 0.1, 0.3, 0.4]]))
    ids = torch.tensor([[0, 2], [0, 1]])
    values = torch.log(torch.tensor([[0.5, 0.2], [0.6, 0.3]]))
    sampled = torch.tensor([0, 5])
    t = torch.log(torch.tensor([0.5, 0.02]))
    per_token, diag = token_losses(
        logits, ids, values, sampled_ids=sampled, teacher_token_logprobs=t, return_diagnostics=True
    )
    assert diag["tokens"].item() == 2
    assert diag["teacher_mass_support"].item() == pytest.approx((0.7 + 0.9) / 2)
    assert diag["teacher_tail_mass"].item() == pytest.approx((0.3 + 0.1) / 2)
    assert diag["student_mass_support"].item() == pytest.approx((0.5 + 0.1) / 2)
    assert diag["student_tail_mass"].item() == pytest.approx((0.5 + 0.9) / 2)
    # student top-2: {0, 1} and {5, 4}; teacher top-2: {0, 2} and {0, 1}
    assert diag["topk_overlap"].item() == pytest.approx((0.5 + 0.0) / 2)
    k1 = torch.log(torch.tensor([0.4, 0.4])) - t
    assert diag["k1"].item() == pytest.approx(k1.mean().item(), rel=1e-5)
    assert diag["loss_min"].item() == per_token.min().item()
    assert diag["loss_max"].item() == per_token.max().item()
    assert diag["loss_mean"].item() == pytest.approx(per_token.mean().item())


# --- every error message ---


def error_cases():
    n, vocab = 3, 7
    logits = torch.randn(n, vocab)
    ids = torch.tensor([[0, 1], [2, 3], [4, 5]])
    lp = torch.full((n, 2), -1.0)
    sampled = torch.tensor([0, 1, 2])
    t = torch.full((n,), -1.0)
    nan_lp = lp.clone()
    nan_lp[1, 0] = math.nan
    nan_logits = logits.clone()
    nan_logits[0, 3] = math.nan
    k2 = dict(divergence="k2", sampled_ids=sampled)
    pg = dict(divergence="pg", sampled_ids=sampled, teacher_token_logprobs=t)
    return [
        (dict(divergence="kl"), "unknown divergence 'kl'; expected one of"),
        (dict(tail="bucket2"), "unknown tail 'bucket2'; expected one of"),
        (dict(pg, divergence="k1"), "divergence='k1' is not a loss on its own.*policy_gradient=True"),
        (dict(divergence="k2", policy_gradient=True), "policy_gradient=True needs divergence='k1' or 'pg'"),
        (dict(divergence="reverse_kl", tail="none"), "tail='none' .* supports divergence='forward_kl' only"),
        (dict(divergence="jsd", beta=1.5), r"beta=1.5 must be in \[0, 1\]"),
        (dict(pg, clip_low=1.0), r"clip_low=1.0 must be in \[0, 1\)"),
        (dict(divergence="pg", clip_high=-0.1), "clip_high=-0.1 must be >= 0"),
        (dict(divergence="pg", importance_cap=0.0), "importance_cap=0.0 must be > 0"),
        (dict(student_logits=logits[0]), r"student_logits must be a float \[N, V\] tensor"),
        (dict(student_logits=nan_logits), "student_logits contains NaN"),
        (dict(teacher_topk_ids=None, teacher_topk_logprobs=None), "divergence='forward_kl' needs teacher_topk_ids"),
        (dict(teacher_topk_logprobs=None), "pass teacher_topk_ids and teacher_topk_logprobs together"),
        (
            dict(teacher_topk_ids=torch.arange(8).repeat(3, 1), teacher_topk_logprobs=torch.zeros(3, 8)),
            "k=8 columns but the vocabulary has V=7 ids; k must be <= V",
        ),
        (dict(teacher_topk_ids=ids + 2), r"teacher_topk_ids has ids outside \[0, V=7\): min 2, max 7"),
        (dict(teacher_topk_ids=ids - 1), r"teacher_topk_ids has ids outside \[0, V=7\): min -1, max 4"),
        (dict(teacher_topk_ids=ids.float()), "teacher_topk_ids must hold integer token ids"),
        (dict(teacher_topk_ids=ids[:2]), r"teacher_topk_ids has shape \(2, 2\), expected \(3, 2\)"),
        (dict(teacher_topk_ids=ids[0]), r"teacher_topk_ids must be \[N, k\]"),
        (dict(teacher_topk_logprobs=lp[:, :1]), r"teacher_topk_logprobs has shape \(3, 1\), expected \(3, 2\)"),
        (dict(teacher_topk_logprobs=nan_lp), "teacher_topk_logprobs contains NaN"),
        (dict(support_ids=ids), "pass support_ids and support_teacher_logprobs together"),
        (dict(support_ids=ids + 6, support_teacher_logprobs=lp), r"support_ids has ids outside \[0, V=7\)"),
        (dict(support_ids=ids[0], support_teacher_logprobs=lp), r"support_ids must be \[N, k_s\]"),
        (dict(support_ids=ids, support_teacher_logprobs=nan_lp), "support_teacher_logprobs contains NaN"),
        (dict(divergence="k3", teacher_token_logprobs=t), r"divergence='k3' needs sampled_ids \(\[N\]\)"),
        (dict(divergence="abs", sampled_ids=sampled), r"divergence='abs' needs teacher_token_logprobs \(\[N\]\)"),
        (dict(k2, sampled_ids=sampled + 5, teacher_token_logprobs=t), r"sampled_ids has ids outside \[0, V=7\)"),
        (dict(k2, teacher_token_logprobs=t[:2]), r"teacher_token_logprobs has shape \(2,\), expected \(3,\)"),
        (dict(k2, teacher_token_logprobs=t.long()), "teacher_token_logprobs must be a float tensor"),
        (pg, r"policy-gradient OPD needs behavior_logprobs"),
        (dict(pg, behavior_logprobs=t * math.nan), "behavior_logprobs contains NaN"),
    ], dict(student_logits=logits, teacher_topk_ids=ids, teacher_topk_logprobs=lp)


@pytest.mark.parametrize("index", range(len(error_cases()[0])))
def test_bad_input_raises_a_clear_error(index):
    cases, base = error_cases()
    overrides, message = cases[index]
    with pytest.raises(ValueError, match=message):
        config, tensors = split_options({**base, **overrides})
        token_losses(**tensors, config=config)


def test_loss_config_errors():
    cases = [
        (dict(chunk_size=0), "chunk_size=0 must be a positive int"),
        (dict(aggregation="mean"), "unknown aggregation mode 'mean'; expected one of"),
        (dict(distill_weight=-1.0), "distill_weight=-1.0 must be >= 0"),
        (dict(importance_cap=-1.0), "importance_cap=-1.0 must be > 0"),
        # the clip range is checked whenever it is used: policy-gradient OPD or the GRPO task loss
        (dict(task_reward_weight=1.0, clip_low=1.0), r"clip_low=1.0 must be in \[0, 1\)"),
    ]
    for options, message in cases:
        with pytest.raises(ValueError, match=message):
            LossConfig(**options)
    LossConfig(clip_low=1.0)  # forward KL without a task loss never clips
    n, vocab = 2, 5
    with pytest.raises(TypeError, match="config must be a LossConfig, got str 'jsd'"):
        token_losses(torch.zeros(n, vocab), torch.zeros(n, 1, dtype=torch.long), torch.zeros(n, 1), "jsd")


def test_loss_config_pg_is_k1_with_policy_gradient():
    pg = LossConfig(divergence="pg", clip_high=0.3)
    assert pg == LossConfig(divergence="k1", policy_gradient=True, clip_high=0.3)
    assert (pg.divergence, pg.policy_gradient, pg.kind) == ("k1", True, "sampled")
    assert LossConfig().kind == "topk"


def test_loss_config_from_train_config_takes_every_loss_key():
    from opd_cache.config import TrainConfig

    assert LossConfig.from_train_config(TrainConfig()) == LossConfig()
    assert TrainConfig().clip_high == LossConfig().clip_high == 0.28  # the one default users have always run
    keys = dict(tail="renorm", beta=0.3, aggregation="seq-mean-token-sum", chunk_size=7, clip_low=0.1,
                clip_high=0.4, importance_cap=2.0, distill_weight=0.5, task_reward_weight=1.5)  # fmt: skip
    config = LossConfig.from_train_config(TrainConfig(loss="jsd", **keys))
    assert config == LossConfig(divergence="jsd", **keys)
    # every option but the "pg" spelling's flag comes from a train key
    assert {f.name for f in dataclasses.fields(LossConfig)} == {"divergence", "policy_gradient", *keys}
    assert LossConfig.from_train_config(TrainConfig(loss="pg")) == LossConfig(divergence="pg")


def test_pg_loss_and_aggregation_errors():
    x = torch.zeros(3)
    with pytest.raises(ValueError, match=r"behavior_logprobs has shape \(2,\), expected \(3,\)"):
        pg_loss(x, x[:2], x)
    with pytest.raises(ValueError, match=r"clip_low=-0.1 must be in \[0, 1\)"):
        pg_loss(x, x, x, clip_low=-0.1)
    with pytest.raises(ValueError, match="unknown aggregation mode 'mean'; expected one of"):
        aggregate(x, torch.ones(3), "mean")
    with pytest.raises(ValueError, match=r"mode='seq-mean-token-mean' needs a \[sequences, tokens\] mask"):
        aggregate(x, torch.ones(3), "seq-mean-token-mean")
    with pytest.raises(ValueError, match="global_tokens=2 is smaller than the 3 tokens in this micro-batch"):
        aggregate(x, torch.ones(3), "token-mean", global_tokens=2)
    with pytest.raises(ValueError, match="global_seqs=1 is smaller than the 2 sequences in this micro-batch"):
        aggregate(torch.zeros(2, 3), torch.ones(2, 3), "seq-mean-token-sum", global_seqs=1)
    with pytest.raises(ValueError, match=r"per_token has shape \(3,\) but mask has \(2,\)"):
        aggregate(x, torch.ones(2))


def test_registry_names():
    assert set(LOSSES) == {"forward_kl", "reverse_kl", "jsd", "k1", "k2", "k3", "abs"}
    assert {name for name, spec in LOSSES.items() if spec.kind == "topk"} == {"forward_kl", "reverse_kl", "jsd"}
