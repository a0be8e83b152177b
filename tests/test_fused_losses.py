"""fused_token_losses (hidden states -> loss, chunked, gradients in the forward) against
token_losses on materialised logits: values and gradients for every mode, tied and
untied output layers, chunk sizes, N = 0, token weights, FSDP2, and its errors."""

from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from opd_cache.losses import LossConfig, aggregation_weights, fused_token_losses, token_losses

REPO = Path(__file__).resolve().parents[1]
N, V, H, K = 12, 37, 8, 5
CHUNKS = [4, 12, 5, 64]  # divide N, divide N, do not, larger than N


MODES = {
    "forward_kl-bucket": dict(divergence="forward_kl"),
    "reverse_kl-bucket": dict(divergence="reverse_kl"),
    "jsd-bucket": dict(divergence="jsd", beta=0.5),
    "jsd0-bucket": dict(divergence="jsd", beta=0.0),
    "jsd1-bucket": dict(divergence="jsd", beta=1.0),
    "forward_kl-renorm": dict(divergence="forward_kl", tail="renorm"),
    "reverse_kl-renorm": dict(divergence="reverse_kl", tail="renorm"),
    "jsd-renorm": dict(divergence="jsd", tail="renorm", beta=0.1),
    "forward_kl-none": dict(divergence="forward_kl", tail="none"),
    "forward_kl-bucket-union": dict(divergence="forward_kl", union=True),
    "jsd-renorm-union": dict(divergence="jsd", tail="renorm", beta=0.9, union=True),
    "forward_kl-bucket-full": dict(divergence="forward_kl", full=True),
    "k2": dict(divergence="k2"),
    "k3": dict(divergence="k3"),
    "abs": dict(divergence="abs"),
    "pg": dict(divergence="pg", clip_high=0.28),
    "pg-importance_cap": dict(divergence="pg", importance_cap=1.5),
}


def make_options(mode: str, n: int = N, vocab: int = V, seed: int = 0) -> dict:
    """Teacher-side inputs for `mode` (all tensors), plus the mode's `config` (a LossConfig)."""
    options = dict(MODES[mode])
    full, union = options.pop("full", False), options.pop("union", False)
    options = dict(config=LossConfig(**options))
    g = torch.Generator().manual_seed(seed)
    teacher = (torch.randn(n, vocab, generator=g) * 2).log_softmax(-1)
    k = vocab if full else K
    values, ids = teacher.topk(k, dim=1)
    options.update(teacher_topk_ids=ids, teacher_topk_logprobs=values)
    if union:
        extra = torch.cat([ids[:, 1:3], torch.randint(0, vocab, (n, 3), generator=g)], 1)
        options.update(support_ids=extra, support_teacher_logprobs=teacher.gather(1, extra))
    sampled = torch.randint(0, vocab, (n,), generator=g)
    options.update(sampled_ids=sampled, teacher_token_logprobs=teacher.gather(1, sampled[:, None]).squeeze(1))
    options.update(behavior_logprobs=-2.0 + 0.5 * torch.randn(n, generator=g))
    return options


def chunked(options: dict, chunk_size: int) -> dict:
    """`options` with its config's chunk_size set."""
    return {**options, "config": dataclasses.replace(options["config"], chunk_size=chunk_size)}


def untied_problem(n=N, seed=0):
    g = torch.Generator().manual_seed(seed + 100)
    hidden = torch.randn(n, H, generator=g).requires_grad_()
    weight = (torch.randn(V, H, generator=g) * 0.7).requires_grad_()
    weights = torch.rand(n, generator=g)
    return hidden, weight, weights


def reference(hidden, weight, weights, options):
    per_token = token_losses(hidden @ weight.t(), **options)
    return (weights * per_token).sum(), per_token


def close(a, b):
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def check_fused_against_reference(mode: str, device, close) -> None:
    """fused_token_losses on `device` equals the materialised reference on the CPU at every chunk size:
    loss, per-token losses (detached) and both gradients, compared by `close(on_device, on_cpu)`."""
    options = make_options(mode)
    hidden, weight, weights = untied_problem()
    ref_loss, ref_per_token = reference(hidden, weight, weights, options)
    ref_grads = torch.autograd.grad(ref_loss, [hidden, weight])
    h, w = (t.detach().to(device).requires_grad_() for t in (hidden, weight))
    on_device = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in options.items()}
    for chunk in CHUNKS:
        loss, per_token = fused_token_losses(h, w, token_weights=weights.to(device), **chunked(on_device, chunk))
        grads = torch.autograd.grad(loss, [h, w])
        assert loss.device == per_token.device == h.device
        assert not per_token.requires_grad
        for got, want in zip((loss, per_token, *grads), (ref_loss, ref_per_token, *ref_grads)):
            close(got.detach().cpu(), want.detach())


@pytest.mark.parametrize("mode", list(MODES))
def test_fused_equals_materialised_untied(mode):
    check_fused_against_reference(mode, torch.device("cpu"), close)


@pytest.mark.parametrize("mode", list(MODES))
def test_fused_equals_materialised_tied_embeddings(mode):
    """The output layer is the embedding matrix: both uses accumulate into one gradient."""
    options = make_options(mode, seed=1)
    g = torch.Generator().manual_seed(7)
    embedding = (torch.randn(V, H, generator=g) * 0.7).requires_grad_()
    mix = torch.randn(H, H, generator=g).requires_grad_()
    input_ids = torch.randint(0, V, (N,), generator=g)
    weights = torch.rand(N, generator=g)

    def hidden_states():
        return torch.tanh(embedding[input_ids] @ mix)

    ref_loss, _ = reference(hidden_states(), embedding, weights, options)
    ref_grads = torch.autograd.grad(ref_loss, [embedding, mix])
    for chunk in CHUNKS:
        loss, _ = fused_token_losses(hidden_states(), embedding, token_weights=weights, **chunked(options, chunk))
        grads = torch.autograd.grad(loss, [embedding, mix])
        close(loss, ref_loss)
        close(grads[0], ref_grads[0])
        close(grads[1], ref_grads[1])


@pytest.mark.parametrize("mode", ["forward_kl-bucket", "k3", "pg"])
def test_no_tokens(mode):
    options = make_options(mode, n=0)
    hidden, weight, _ = untied_problem(n=0)
    loss, per_token = fused_token_losses(hidden, weight, **chunked(options, 4))
    loss.backward()
    assert loss.item() == 0.0 and per_token.shape == (0,)
    assert hidden.grad.shape == (0, H)
    assert torch.equal(weight.grad, torch.zeros(V, H))


def test_default_weights_are_ones_and_grad_output_scales():
    options = make_options("reverse_kl-bucket")
    hidden, weight, _ = untied_problem()
    loss, per_token = fused_token_losses(hidden, weight, **chunked(options, 5))
    close(loss, per_token.sum())
    (3.0 * loss).backward()
    ref_loss, _ = reference(hidden, weight, torch.ones(N), options)
    ref_grads = torch.autograd.grad(3.0 * ref_loss, [hidden, weight])
    close(hidden.grad, ref_grads[0])
    close(weight.grad, ref_grads[1])


def test_loss_combines_with_other_terms_in_one_graph():
    options = make_options("jsd-bucket")
    hidden, weight, weights = untied_problem()
    fused, _ = fused_token_losses(hidden, weight, token_weights=weights, **chunked(options, 5))
    (fused + hidden.square().sum() + 2.0 * weight.sum()).backward()
    ref_loss, _ = reference(hidden, weight, weights, options)
    ref = torch.autograd.grad(ref_loss + hidden.square().sum() + 2.0 * weight.sum(), [hidden, weight])
    close(hidden.grad, ref[0])
    close(weight.grad, ref[1])


def test_frozen_weight_or_hidden_gets_no_gradient():
    options = make_options("forward_kl-bucket")
    hidden, weight, weights = untied_problem()
    loss, _ = fused_token_losses(hidden, weight.detach(), token_weights=weights, **options)
    (grad,) = torch.autograd.grad(loss, [hidden])
    ref_loss, _ = reference(hidden, weight, weights, options)
    close(grad, torch.autograd.grad(ref_loss, [hidden], retain_graph=True)[0])
    loss, _ = fused_token_losses(hidden.detach(), weight, token_weights=weights, **options)
    (grad,) = torch.autograd.grad(loss, [weight])
    close(grad, torch.autograd.grad(ref_loss, [weight])[0])


def test_works_under_no_grad():
    options = make_options("k2")
    hidden, weight, weights = untied_problem()
    with torch.no_grad():
        loss, per_token = fused_token_losses(hidden, weight, token_weights=weights, **chunked(options, 5))
    assert not loss.requires_grad
    ref_loss, ref_per_token = reference(hidden, weight, weights, options)
    close(loss, ref_loss.detach())
    close(per_token, ref_per_token.detach())


def test_second_backward_is_refused():
    options = make_options("forward_kl-bucket")
    hidden, weight, _ = untied_problem()
    loss, _ = fused_token_losses(hidden, weight, **options)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="one backward pass per forward"):
        loss.backward()


def test_low_precision_inputs_compute_in_float32():
    options = make_options("forward_kl-bucket")
    hidden, weight, weights = untied_problem()
    h16 = hidden.detach().bfloat16().requires_grad_()
    w16 = weight.detach().bfloat16().requires_grad_()
    loss, per_token = fused_token_losses(h16, w16, token_weights=weights, **chunked(options, 5))
    loss.backward()
    h32, w32 = h16.detach().float().requires_grad_(), w16.detach().float().requires_grad_()
    ref_loss, ref_per_token = reference(h32, w32, weights, options)
    ref_loss.backward()
    assert loss.dtype == per_token.dtype == torch.float32
    close(loss, ref_loss.detach())
    close(per_token, ref_per_token.detach())
    assert h16.grad.dtype == w16.grad.dtype == torch.bfloat16
    close(h16.grad, h32.grad.bfloat16())
    close(w16.grad, w32.grad.bfloat16())


def test_diagnostics_match_token_losses_over_weighted_tokens():
    options = make_options("forward_kl-bucket-union")
    hidden, weight, weights = untied_problem()
    weights[3] = 0.0  # a padding token: not in the diagnostics
    _, _, diag = fused_token_losses(
        hidden, weight, token_weights=weights, return_diagnostics=True, **chunked(options, 5)
    )
    rows = weights != 0
    selected = {k: (v[rows] if isinstance(v, torch.Tensor) else v) for k, v in options.items()}
    _, ref = token_losses((hidden @ weight.t())[rows], **selected, return_diagnostics=True)
    assert diag.keys() == ref.keys()
    assert diag["tokens"].item() == N - 1
    for key in ref:
        close(diag[key].float(), ref[key].float())


def test_micro_batches_with_global_weights_give_the_full_batch_gradient():
    options = make_options("forward_kl-bucket")
    hidden, weight, _ = untied_problem()
    mask = torch.ones(3, 4)
    mask[1, 2:] = 0
    weights = aggregation_weights(mask, "seq-mean-token-mean").reshape(-1)
    full, _ = fused_token_losses(hidden, weight, token_weights=weights, **options)
    full_grad = torch.autograd.grad(full, [weight])[0]
    for rows in (slice(0, 4), slice(4, 8), slice(8, 12)):
        part = {k: (v[rows] if isinstance(v, torch.Tensor) else v) for k, v in options.items()}
        w = aggregation_weights(mask[rows.start // 4 : rows.stop // 4], "seq-mean-token-mean", global_seqs=3).reshape(
            -1
        )
        loss, _ = fused_token_losses(hidden[rows], weight, token_weights=w, **part)
        loss.backward()
    close(weight.grad, full_grad)


def test_bad_input_raises_a_clear_error():
    options = make_options("forward_kl-bucket")
    hidden, weight, weights = untied_problem()
    nan_hidden = hidden.detach().clone()
    nan_hidden[2, 1] = math.nan
    nan_weight = weight.detach().clone()
    nan_weight[0, 0] = math.nan
    cases = [
        (dict(chunk_size=0), "chunk_size=0 must be a positive int"),
        (dict(hidden=hidden[0]), r"hidden must be a float \[N, H\] tensor"),
        (dict(lm_head_weight=weight[:, :5]), r"lm_head_weight must be \[V, H=8\], got shape \(37, 5\)"),
        (dict(token_weights=weights[:5]), r"token_weights has shape \(5,\), expected \(12,\)"),
        (dict(hidden=nan_hidden), "hidden contains NaN"),
        (dict(lm_head_weight=nan_weight), "lm_head_weight contains NaN"),
        (dict(divergence="k1"), "divergence='k1' is not a loss on its own"),
        (dict(teacher_topk_ids=options["teacher_topk_ids"] + V), r"teacher_topk_ids has ids outside \[0, V=37\)"),
    ]
    base = dict(hidden=hidden, lm_head_weight=weight, token_weights=weights, **options)
    option_names = {f.name for f in dataclasses.fields(LossConfig)}
    for overrides, message in cases:
        tensors = {k: v for k, v in overrides.items() if k not in option_names}
        loss_options = {k: v for k, v in overrides.items() if k in option_names}
        with pytest.raises(ValueError, match=message):  # a bad loss option fails where its LossConfig is built
            fused_token_losses(**{**base, **tensors, "config": dataclasses.replace(base["config"], **loss_options)})


# --- FSDP2: the documented recipe (loss inside the forward of the module that owns the output layer) ---

FSDP_V, FSDP_H, FSDP_N = 40, 8, 16


class TiedStudent(torch.nn.Module):
    """A tied-embedding LM whose forward returns the distillation loss (docs/losses.md, FSDP2)."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(FSDP_V, FSDP_H)
        self.body = torch.nn.Linear(FSDP_H, FSDP_H)
        self.lm_head = torch.nn.Linear(FSDP_H, FSDP_V, bias=False)
        self.lm_head.weight = self.embed.weight

    def hidden(self, ids):
        return torch.tanh(self.body(self.embed(ids)))

    def forward(self, ids, teacher_ids, teacher_logprobs, token_weights):
        # inside the forward FSDP2 has unsharded this module's parameters: lm_head.weight is a plain tensor
        hidden = self.hidden(ids)
        return fused_token_losses(
            hidden, self.lm_head.weight, teacher_ids, teacher_logprobs, token_weights, LossConfig(chunk_size=3)
        )[0]


def fsdp_check(rank: int, world: int, rendezvous: str) -> tuple[float, bool]:
    """Gradients of FSDP2 (world ranks, each a slice of the batch) vs one process on the whole batch."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model, ref = TiedStudent(), TiedStudent()
    ref.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, FSDP_V, (FSDP_N,), generator=g)
    teacher_logprobs, teacher_ids = torch.randn(FSDP_N, FSDP_V, generator=g).log_softmax(-1).topk(4)
    weights = aggregation_weights(torch.ones(FSDP_N))  # token-mean over the global batch
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    try:
        fully_shard(model.body)
        fully_shard(model)
        rows = slice(rank * FSDP_N // world, (rank + 1) * FSDP_N // world)
        # FSDP2 averages gradients over ranks and the weights already divide by the global count: scale by world
        model(ids[rows], teacher_ids[rows], teacher_logprobs[rows], world * weights[rows]).backward()
        hidden = ref.hidden(ids)
        (weights * token_losses(hidden @ ref.lm_head.weight.t(), teacher_ids, teacher_logprobs)).sum().backward()
        worst = max(
            (p.grad.full_tensor() - q.grad).abs().max().item() for p, q in zip(model.parameters(), ref.parameters())
        )
        try:  # outside the forward the weight is a sharded DTensor again
            fused_token_losses(hidden, model.lm_head.weight, teacher_ids, teacher_logprobs)
            refused = False
        except ValueError as e:
            refused = "sharded DTensor" in str(e)
        # both ranks leave their last collective before either tears gloo down (a rank destroying the group
        # while its peer is still inside a collective aborts with "terminate called without an active exception")
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return worst, refused


def test_fsdp2_loss_inside_forward_with_tied_embeddings(tmp_path):
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.fail("a previous test left a default process group initialised")
    worst, refused = fsdp_check(0, 1, str(tmp_path / "rendezvous"))
    assert worst < 1e-5
    assert refused


FSDP_SCRIPT = """
import sys, torch, torch.multiprocessing as mp
from tests.test_fused_losses import fsdp_check

def worker(rank, path):
    torch.set_num_threads(1)
    worst, refused = fsdp_check(rank, 2, path)
    if rank == 0:
        print("RESULT", worst, refused)

if __name__ == "__main__":
    mp.spawn(worker, args=(sys.argv[1],), nprocs=2)
"""


@pytest.mark.slow
def test_fsdp2_two_ranks_reduce_the_full_batch_gradient(tmp_path):
    """Two gloo ranks (two fresh processes: about 30 s of CPU, hence `slow`)."""
    script = tmp_path / "fsdp_check.py"
    script.write_text(FSDP_SCRIPT)
    out = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "rendezvous")],
        cwd=REPO, capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    result = [line for line in out.stdout.splitlines() if line.startswith("RESULT")][0].split()
    assert float(result[1]) < 1e-5, result
    assert result[2] == "True"
