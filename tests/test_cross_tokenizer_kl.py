"""The held-out KL across tokenizers (opd_cache/annotate/cross_kl.py), the measure of the cross-tokenizer demo's
bar: KL(teacher ‖ the student's next byte) at the teacher's positions."""

from __future__ import annotations

import math

import pytest
import torch

from opd_cache.annotate.cross_kl import StudentBytes, cross_tokenizer_kl, teacher_events
from opd_cache.annotate.cross_tokenizer import CrossTokenizer
from opd_cache.config import SamplingConfig
from opd_cache.engine import SampleRequest
from opd_cache.evaluate import eval_engine, sequence_kl
from opd_cache.models import build_tiny_model, load_causal_lm
from opd_cache.tasks.prompts import load_prompts
from opd_cache.tokenizer import load_tokenizer
from tests.conftest import REPO

TEACHER = REPO / "data/models/teacher"
TEST_PROMPTS = REPO / "data/arithmetic/test.parquet"


def sampled(model_path, tok, count=12, seed=0):
    prompts = [[int(i) for i in p] for p in load_prompts(TEST_PROMPTS, tok).prompt_ids[:count]]
    engine = eval_engine(model_path, tok, "cpu", seed=seed)
    sampling = SamplingConfig(temperature=1.0, top_k=0, max_new_tokens=10)
    return engine, prompts, engine.generate(prompts, SampleRequest(sampling, n=1, seed=seed))


def test_with_one_tokenizer_it_is_the_per_token_kl_of_the_evaluator():
    """Every position is a token boundary: the next-byte KL is evaluate.sequence_kl's full-vocabulary KL."""
    tok = load_tokenizer(REPO / "data/tokenizer")
    engine, prompts, responses = sampled(REPO / "data/models/student", tok)
    teacher = load_causal_lm(TEACHER).eval()
    total, count = sequence_kl(engine.model, teacher, prompts, responses, "cpu")
    result = cross_tokenizer_kl(engine.model, tok, teacher, tok, prompts, [r.token_ids for r in responses])
    assert result.positions == count and result.rows == len(prompts) and result.excluded_rows == 0
    assert result.kl == pytest.approx(total / count, rel=1e-5)
    assert result.kl > 0.5  # the student answers " ans= N", the teacher " #### N": far apart


@pytest.fixture(scope="module")
def bpe_side():
    """A random 2-layer model over the demo BPE, and its next-byte view against the character teacher."""
    student_tok, teacher_tok = load_tokenizer(REPO / "data/tokenizer_bpe"), load_tokenizer(REPO / "data/tokenizer")
    model = build_tiny_model(vocab_size=len(student_tok), seed=3, hidden_size=32, num_layers=2).eval()
    xt = CrossTokenizer(student_tok, teacher_tok)
    events = {s: 256 + k for k, s in enumerate(sorted(xt.vocab_map.special))}
    return StudentBytes(model, xt, events, "cpu"), student_tok, xt


@pytest.mark.parametrize("partial", [b" ", b" #", b" ##", b" ###", b"##", b" a", b" an", b"Wha", b"What"])
def test_the_next_byte_distribution_sums_every_spelling(bpe_side, partial):
    """P(u) = P(u[:-1] then the byte u[-1]): the mass after a partial text, summed over the next events, is the
    mass its last byte got one byte earlier. This holds only if every way of spelling u is counted: tokens
    running past u, and tokens ending inside it (` ##` as `Ġ` `##` or `Ġ` `#` `#`) continued by others."""
    side, tok, _ = bpe_side
    state = tuple(tok("What is 1 + 2?\n", add_special_tokens=False)["input_ids"])
    with torch.inference_mode():
        whole = side.mass(state, partial).sum()
        before = side.mass(state, partial[:-1])[partial[-1]]
        assert float(whole) == pytest.approx(float(before), rel=1e-9)
        assert 0 < float(whole) < 1
        q = side.next_event(state, partial)
    alphabet = sorted({w[0] for w in side_spelled(bpe_side) if w})
    assert float(q.sum()) == pytest.approx(1.0) and bool((q[alphabet] > 0).all())  # each character is a token


def test_at_a_boundary_it_is_the_mass_of_the_tokens_starting_with_each_byte(bpe_side):
    side, tok, _ = bpe_side
    state = tuple(tok("What is 1 + 2?\n", add_special_tokens=False)["input_ids"])
    with torch.inference_mode():
        probs = side.probs(state)
        q = side.next_event(state, b"")
    hashes = [i for i, w in enumerate(side_spelled(bpe_side)) if w and w[:1] == b"#"]
    assert len(hashes) == 3  # '#', '##', '####'
    assert float(q[ord("#")]) == pytest.approx(float(probs[hashes].sum()), rel=1e-12)
    assert float(q[256 + 1]) == pytest.approx(float(probs[tok.eos_token_id]), rel=1e-12)  # eos: its own event


def side_spelled(bpe_side):
    return bpe_side[2].student_bytes.spelled


def test_the_shipped_bpe_student_is_measured_against_the_character_teacher():
    tok = load_tokenizer(REPO / "data/tokenizer_bpe")
    engine, prompts, responses = sampled(REPO / "data/models/student_bpe", tok, count=8)
    teacher_tok = load_tokenizer(REPO / "data/tokenizer")
    result = cross_tokenizer_kl(
        engine.model, tok, load_causal_lm(TEACHER).eval(), teacher_tok, prompts, [r.token_ids for r in responses]
    )
    text = tok.batch_decode([r.token_ids for r in responses], skip_special_tokens=False)
    chars = sum(len(teacher_tok(t.replace("<eos>", ""), add_special_tokens=False)["input_ids"]) for t in text)
    assert result.rows + result.excluded_rows == len(prompts)
    assert result.positions >= chars - 1 and math.isfinite(result.kl) and result.kl > 0.5


def test_a_teacher_of_longer_tokens_is_refused_with_one_line():
    bpe, char = load_tokenizer(REPO / "data/tokenizer_bpe"), load_tokenizer(REPO / "data/tokenizer")
    xt = CrossTokenizer(char, bpe)
    with pytest.raises(ValueError, match=r"^teacher tokenizer .*one byte each.*spells b'"):
        teacher_events(xt, {}, 257)
