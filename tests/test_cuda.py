"""The default suite's loss and trainer checks on a CUDA device: `pytest -m cuda` (scripts/gpu_check.sh runs it).

Why a module of its own rather than a switch that moves the default tests to the GPU: the loss tests build their
inputs with CPU `torch.Generator`s and compare them with CPU references, so a global default device would fail
them on device mismatches, not on what the GPU computes. Here the same problems (the helpers of
tests/test_fused_losses.py, tests/test_losses.py and tests/test_trainer.py) are built on the CPU, moved to CUDA,
and each result is compared with the CPU's, with tolerances for a different order of float32 reductions. (The
default suite's trainer and HF-engine tests already run on CUDA where there is one: `device: auto`.)
Without CUDA every test here is deselected by default (pyproject.toml's `-m 'not cuda'`) and skips under -m cuda.
"""

from __future__ import annotations

import pytest
import torch

from opd_cache.losses import LossConfig, fused_token_losses, token_losses
from tests.test_fused_losses import (
    MODES,
    check_fused_against_reference,
    chunked,
    make_options,
    reference,
    untied_problem,
)
from tests.test_losses import TOPK_MODES, naive_bucket, student, teacher_topk
from tests.test_trainer import config, final_weights, make_store, metrics, teacher  # noqa: F401

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
CUDA = torch.device("cuda")


@pytest.fixture(autouse=True)
def exact_float32_matmuls():
    """TF32 off (torch's default for matmuls, kept explicit): the CPU references are float32."""
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = before


def to_cuda(options: dict) -> dict:
    return {k: v.to(CUDA) if isinstance(v, torch.Tensor) else v for k, v in options.items()}


def leaf(t: torch.Tensor, device) -> torch.Tensor:
    return t.detach().to(device).requires_grad_()


def close(cuda_value: torch.Tensor, cpu_value: torch.Tensor, tol: float = 1e-4) -> None:
    torch.testing.assert_close(cuda_value.detach().cpu(), cpu_value.detach(), atol=tol, rtol=tol)


# ---------------------------------------------------------------- losses
@pytest.mark.parametrize("mode", list(MODES))
def test_fused_on_cuda_equals_materialised_on_cpu(mode):
    check_fused_against_reference(mode, CUDA, close)


@pytest.mark.parametrize("mode", list(MODES))
def test_materialised_on_cuda_equals_cpu(mode):
    options = make_options(mode, seed=2)
    hidden, weight, _ = untied_problem(seed=2)
    logits = (hidden @ weight.t()).detach().requires_grad_()
    expected = token_losses(logits, **options)
    (expected_grad,) = torch.autograd.grad(expected.sum(), [logits])
    on_cuda = leaf(logits, CUDA)
    got = token_losses(on_cuda, **to_cuda(options))
    (got_grad,) = torch.autograd.grad(got.sum(), [on_cuda])
    close(got, expected)
    close(got_grad, expected_grad)


@pytest.mark.parametrize("divergence,tail,beta", TOPK_MODES)
def test_topk_tails_on_cuda_match_the_naive_float64_reference(divergence, tail, beta):
    n, vocab, k = 7, 41, 5
    _, ids, values = teacher_topk(n, vocab, k, seed=5)
    logits = student(n, vocab, seed=6, scale=3.0)
    expected = naive_bucket(logits, ids, values, divergence, beta, tail)
    config_ = LossConfig(divergence=divergence, tail=tail, beta=beta)
    got = token_losses(leaf(logits, CUDA), ids.to(CUDA), values.to(CUDA), config_)
    close(got.double(), expected.detach(), tol=1e-5)


def test_bf16_inputs_on_cuda_compute_in_float32():
    options = make_options("forward_kl-bucket")
    hidden, weight, weights = untied_problem()
    h16, w16 = (
        hidden.detach().bfloat16().to(CUDA).requires_grad_(),
        weight.detach().bfloat16().to(CUDA).requires_grad_(),
    )
    loss, per_token = fused_token_losses(h16, w16, token_weights=weights.to(CUDA), **to_cuda(chunked(options, 5)))
    loss.backward()
    h32, w32 = h16.detach().float().cpu().requires_grad_(), w16.detach().float().cpu().requires_grad_()
    ref_loss, ref_per_token = reference(h32, w32, weights, options)
    ref_loss.backward()
    assert loss.dtype == per_token.dtype == torch.float32 and h16.grad.dtype == torch.bfloat16
    close(loss, ref_loss)
    close(per_token, ref_per_token)
    close(h16.grad.float(), h32.grad.bfloat16().float(), tol=1e-2)
    close(w16.grad.float(), w32.grad.bfloat16().float(), tol=1e-2)


def test_fused_peak_memory_on_cuda_is_a_chunk_not_the_logits():
    """The fused path's peak is about one [chunk, V] float32 buffer and the gradients, far below [N, V] logits."""
    n, vocab, hidden_size, chunk = 4096, 32768, 64, 256
    options = make_options("forward_kl-bucket", n=n, vocab=vocab)
    g = torch.Generator().manual_seed(0)
    h = torch.randn(n, hidden_size, generator=g).to(CUDA).requires_grad_()
    w = torch.randn(vocab, hidden_size, generator=g).mul_(0.1).to(CUDA).requires_grad_()
    cuda_options = to_cuda(chunked(options, chunk))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    loss, _ = fused_token_losses(h, w, **cuda_options)
    loss.backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    logits_bytes = n * vocab * 4
    # grad_hidden + grad_weight (float32) + a few [chunk, V] buffers: a few % of the logits; the materialised
    # path holds the logits, their float32 log-softmax and their gradient (> 2x logits_bytes)
    assert peak < logits_bytes / 2, (peak, logits_bytes)


# ---------------------------------------------------------------- the trainer
def train(cfg):
    """`opd train`'s entry; every run here must reach its max_steps."""
    from opd_cache.train import train as run_trainer

    result = run_trainer(cfg)
    assert result.step == cfg.train.max_steps, result
    return result


def test_trainer_on_cuda_float32_matches_the_cpu(tmp_path, tiny_model_factory, tokenizer, teacher):  # noqa: F811
    """The same three steps on the CPU and on CUDA (float32, no autocast): same losses, same weights (to ~lr: Adam
    turns float rounding of near-zero gradients into updates of up to lr, see tests/test_trainer.py's config)."""
    student = tiny_model_factory("student", seed=0)
    runs = {}
    for device in ("cpu", "cuda"):
        store = make_store(tmp_path / device, student, tokenizer, teacher, shards=2, rows=12)
        train(config(store, max_steps=3, device=device, mixed_precision="off"))
        runs[device] = ([m["loss"] for m in metrics(store)], final_weights(store))
    assert runs["cuda"][0] == pytest.approx(runs["cpu"][0], abs=1e-4)
    for key, value in runs["cpu"][1].items():
        torch.testing.assert_close(runs["cuda"][1][key], value, atol=1e-3, rtol=0, msg=key)


@pytest.mark.parametrize("mixed_precision", ["off", "bf16"])
def test_trainer_micro_batch_size_does_not_change_the_result_on_cuda(
    tmp_path,
    tiny_model_factory,
    tokenizer,
    teacher,  # noqa: F811
    mixed_precision,
):
    student = tiny_model_factory("student", seed=0)
    losses = []
    for name, micro in (("one", 100_000), ("many", 24)):
        store = make_store(tmp_path / name, student, tokenizer, teacher, shards=1, rows=24)
        options = dict(max_steps=3, micro_batch_tokens=micro, device="cuda", mixed_precision=mixed_precision)
        train(config(store, **options))
        losses.append([m["loss"] for m in metrics(store)])
    # bf16 autocast rounds each micro-batch's matmuls on their own: equal to bf16 precision, not float32's
    assert losses[1] == pytest.approx(losses[0], rel=1e-5 if mixed_precision == "off" else 2e-2)
