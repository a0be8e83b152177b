"""Cross-tokenizer alignment (opd_cache/annotate/cross_tokenizer.py, cross_targets.py) on real tokenizers.

Four tokenizer families (tests/cross_tokenizer_tokenizers.py): the shipped character tokenizer, a byte-level
BPE, a Metaspace unigram with byte fallback and a Llama-2-style SentencePiece layout. Hypothesis draws texts
(random Unicode, and whitespace-heavy ASCII for pairs with the ASCII-only character tokenizer); every property
is checked on every ordered pair.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from opd_cache.annotate import cross_tokenizer as xt
from opd_cache.annotate.cross_targets import map_topk, row_targets, student_targets
from opd_cache.annotate.cross_tokenizer import AlignmentError, CrossTokenizer, align_offsets
from opd_cache.engine import TeacherScores
from opd_cache.target_flags import EXCLUDED, GROUP_END, TOPK_VALID
from tests import cross_tokenizer_tokenizers as toks

FAMILIES = ("char", "bpe", "unigram", "sp_legacy")
PAIRS = list(itertools.permutations(FAMILIES, 2))
PROPERTY = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])

_cross: dict = {}


def cross(student: str, teacher: str) -> CrossTokenizer:
    if (student, teacher) not in _cross:
        _cross[student, teacher] = CrossTokenizer(toks.get(student), toks.get(teacher), student, teacher)
    return _cross[student, teacher]


# whitespace-heavy ASCII: runs of spaces, tabs and newlines between short words and digits
ascii_text = st.lists(
    st.sampled_from(
        ["a", "b", "xyz", "0", "19", "#", "+", "=", "?", ".", " ", "  ", "   ", "\n", "\n\n", "\t", " \t "]
    ),
    min_size=1,
    max_size=16,
).map("".join)
unicode_text = st.text(
    alphabet=st.characters(blacklist_categories=("Cs", "Cc"), blacklist_characters="\x00") | st.sampled_from(" \n\t"),
    min_size=1,
    max_size=30,
)


def text_for(pair) -> st.SearchStrategy[str]:
    return ascii_text if "char" in pair else unicode_text | ascii_text


def student_ids(student: str, text: str, cuts: list[int] | None = None) -> list[int]:
    """The student's ids of `text`: its canonical encoding, or (byte-level BPE only) pieces encoded one by one,
    which is a valid but non-canonical token sequence, like a sample."""
    tok = toks.get(student)
    if not cuts or student != "bpe":
        return tok(text, add_special_tokens=False)["input_ids"]
    points = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    return [
        i for a, b in itertools.pairwise(points) if b > a for i in tok(text[a:b], add_special_tokens=False)["input_ids"]
    ]


def spelled_text(c: CrossTokenizer, teacher_ids: np.ndarray) -> bytes:
    return b"".join(c.teacher_bytes.spell(teacher_ids))


# --------------------------------------------------------------------------- align_offsets on its own
def test_align_offsets_cuts_where_both_have_a_boundary():
    # " #### 146" as a BPE that merges numbers cuts it ('Ġ####' 'Ġ14' '6') against the nine characters
    student = np.array([[0, 5], [5, 8], [8, 9]])
    teacher = np.array([[i, i + 1] for i in range(9)])
    s_group, t_group, groups = align_offsets(student, teacher, 9)
    assert groups == 3
    assert s_group.tolist() == [0, 1, 2]
    assert t_group.tolist() == [0, 0, 0, 0, 0, 1, 1, 1, 2]


def test_align_offsets_keeps_overlapping_and_empty_tokens_together():
    # a teacher whose two tokens share a character's offsets, and an empty token: no boundary inside either
    student = np.array([[0, 1], [1, 2], [2, 3]])
    teacher = np.array([[0, 2], [0, 2], [2, 2], [2, 3]])
    s_group, t_group, groups = align_offsets(student, teacher, 3)
    assert (s_group.tolist(), t_group.tolist(), groups) == ([0, 0, 1], [0, 0, 0, 1], 2)


@pytest.mark.parametrize(
    "teacher, message",
    [
        ([[0, 1], [2, 3]], "leave byte 1 of 3 uncovered"),
        ([[0, 1], [1, 2]], "cover 2 of 3 bytes"),
        ([[1, 3]], "leave byte 0 of 3 uncovered"),
        ([[0, 2], [1, 3], [0, 1]], "not in text order"),
    ],
)
def test_align_offsets_refuses_offsets_that_do_not_tile_the_text(teacher, message):
    with pytest.raises(AlignmentError, match=message):
        align_offsets(np.array([[0, 3]]), np.array(teacher), 3)


# --------------------------------------------------------------------------- properties on real tokenizers
def check_groups(c: CrossTokenizer, ids: list[int], row) -> None:
    """Groups partition both sequences, each group spells the same bytes on both sides, and no byte offset
    inside a group ends a token on both sides (the groups are the finest common cut)."""
    a = row.alignment
    m, n = len(ids), len(row.response_ids)
    assert len(a.student_group) == m and len(a.teacher_group) == n
    for groups in (a.student_group, a.teacher_group):
        assert np.array_equal(np.unique(groups), np.arange(a.num_groups))  # every group, on both sides
        assert (np.diff(groups) >= 0).all()  # contiguous, in order
    student_spelled = c.student_bytes.spell(ids)
    teacher_spelled = c.teacher_bytes.spell(row.response_ids)
    text = b"".join(student_spelled)
    phantom = spelled_text(c, row.response_ids)[: -len(text)] if text else b""
    assert phantom in (b"", c.teacher_bytes.phantom_prefix)
    for g in range(a.num_groups):
        s_pieces = [p for p, k in zip(student_spelled, a.student_group) if k == g]
        t_pieces = [p for p, k in zip(teacher_spelled, a.teacher_group) if k == g]
        s_join, t_join = b"".join(s_pieces), b"".join(t_pieces)
        assert t_join == (phantom + s_join if g == 0 else s_join), f"group {g}: {s_pieces} vs {t_pieces}"
        # internal ends (relative to the group's start) that both sides share: none
        s_ends = set(np.cumsum([len(p) for p in s_pieces])[:-1].tolist())
        t_ends = np.cumsum([len(p) for p in t_pieces])[:-1] - (len(phantom) if g == 0 else 0)
        assert not s_ends & set(t_ends[t_ends > 0].tolist()), f"group {g} could be cut further"


@pytest.mark.parametrize("pair", PAIRS, ids=["-".join(p) for p in PAIRS])
def test_groups_partition_both_tokenizations(pair):
    c = cross(*pair)

    @PROPERTY
    @given(text=text_for(pair), cuts=st.lists(st.integers(0, 40), max_size=6))
    def check(text, cuts):
        ids = student_ids(pair[0], text, cuts)
        row = c.align_response(ids)
        if row.alignment is None:  # only the round-trip refusals may exclude a row: check it really fails
            assert row.excluded in (xt.UNPAIRED_SPECIAL, xt.TEACHER_UNKNOWN, xt.ROUND_TRIP), (row.excluded, row.detail)
            return
        check_groups(c, ids, row)

    check()


@pytest.mark.parametrize("pair", PAIRS, ids=["-".join(p) for p in PAIRS])
def test_group_logprobs_sum_to_the_teacher_sequence_and_one_to_one_positions_are_direct(pair):
    """The group log-probs (at GROUP_END) add up to the teacher's log-prob of its whole response; at a
    one-to-one position the targets are the teacher's own numbers at its position, read directly."""
    c = cross(*pair)
    table = c.vocab_map.teacher_to_student
    eos = toks.get(pair[0]).eos_token_id

    @PROPERTY
    @given(text=text_for(pair), seed=st.integers(0, 2**16))
    def check(text, seed):
        ids = student_ids(pair[0], text) + [eos]
        row = c.align_response(ids)
        assume(row.alignment is not None)
        n, k, rng = len(row.response_ids), 6, np.random.default_rng(seed)
        token_lp = np.log(rng.uniform(0.01, 1, n)).astype(np.float32)
        topk_ids = rng.integers(0, len(toks.get(pair[1])), (n, k))
        topk_ids[:, 0] = row.response_ids  # the teacher's own token is usually in its top-k
        topk_lp = np.sort(np.log(rng.dirichlet(np.ones(k + 1), size=n)[:, :k]), axis=1)[:, ::-1].astype(np.float32)
        t = row_targets(row.alignment, np.array(ids), row.response_ids, token_lp, topk_ids, topk_lp, table)

        ends = (t.target_flags & GROUP_END) != 0
        assert ends.sum() == row.alignment.num_groups and ends[-1]
        assert t.token_logprob[~ends].tolist() == [0.0] * int((~ends).sum())
        assert np.isclose(t.token_logprob.astype(np.float64).sum(), token_lp.astype(np.float64).sum(), rtol=1e-6)
        assert t.target_flags[-1] == TOPK_VALID | GROUP_END  # eos pairs with eos: one token on both sides

        s_size = np.bincount(row.alignment.student_group)
        t_size = np.bincount(row.alignment.teacher_group)
        for i in np.nonzero(t.target_flags & TOPK_VALID)[0]:
            g = row.alignment.student_group[i]
            assert s_size[g] == 1 and t_size[g] == 1
            j = int(np.nonzero(row.alignment.teacher_group == g)[0][0])
            assert t.token_logprob[i] == token_lp[j]  # bit for bit: a one-token group's sum is that token
            expected = {}  # the teacher's top-k at j in student ids, by a direct dictionary walk
            for tid, lp in zip(topk_ids[j].tolist(), topk_lp[j].astype(np.float64).tolist()):
                sid = int(table[tid]) if 0 <= tid < len(table) else -1
                if sid >= 0:
                    expected[sid] = np.logaddexp(expected[sid], lp) if sid in expected else lp
            if ids[i] not in expected and len(expected) < k:
                expected[ids[i]] = float(token_lp[j])  # the sampled token, exact, when the top-k missed it
            got = {int(a): float(b) for a, b in zip(t.topk_ids[i], t.topk_logprobs[i]) if np.isfinite(b)}
            assert got.keys() == expected.keys()
            assert np.allclose([got[key] for key in expected], list(expected.values()), atol=1e-6)
            assert all(t.topk_ids[i][~np.isfinite(t.topk_logprobs[i])] == t.topk_ids[i][0])  # pads repeat entry 0

    check()


def test_non_canonical_student_tokens_align_by_what_they_spell():
    """A sample need not be the tokenizer's own encoding: 'What' as 'Wh' 'at' still spells the same text."""
    c = cross("bpe", "char")
    ids = student_ids("bpe", "What is 37?", cuts=[2, 5, 6])
    assert ids != toks.get("bpe")("What is 37?", add_special_tokens=False)["input_ids"]
    row = c.align_response(ids)
    check_groups(c, ids, row)
    assert spelled_text(c, row.response_ids) == b"What is 37?"


# --------------------------------------------------------------------------- the round trip
@pytest.mark.parametrize(
    "student, teacher, text, reason",
    [
        ("bpe", "char", "naïve café", xt.TEACHER_UNKNOWN),  # the character tokenizer has no 'ï': <unk>
        ("unigram", "char", "a\tb", xt.TEACHER_UNKNOWN),  # nor a tab
        ("bpe", "unigram", "\x00", None),  # byte fallback spells any byte
        ("unigram", "bpe", "x\u00a0y", None),  # a no-break space survives byte-level BPE
    ],
)
def test_round_trip_failures_are_flagged_never_aligned(student, teacher, text, reason):
    c = cross(student, teacher)
    row = c.align_response(student_ids(student, text))
    assert row.excluded == reason
    assert (row.alignment is None) == (reason is not None)


def test_student_tokens_that_spell_invalid_utf8_are_excluded():
    """A response cut inside a character (max_new_tokens) cannot be re-tokenized: flagged, with its count."""
    c = cross("bpe", "unigram")
    ids = student_ids("bpe", "東")
    assert len(ids) > 1  # the character is several byte tokens
    rows = c.teacher_rows([[5], [5]], [ids[:-1], ids])
    assert rows[0].excluded == xt.INVALID_UTF8 and rows[1].alignment is not None


def test_a_teacher_normalizer_that_changes_the_text_is_a_round_trip_failure():
    from tokenizers import normalizers

    teacher = toks.get("bpe")
    lowered = type(teacher)(tokenizer_object=teacher.backend_tokenizer, eos_token="<eos>")
    lowered.backend_tokenizer.normalizer = normalizers.Lowercase()
    c = CrossTokenizer(toks.get("char"), lowered, "char", "lowercasing-bpe")
    row = c.align_response(student_ids("char", "Hello"))
    assert row.excluded == xt.ROUND_TRIP and "'Hello'" in row.detail
    assert c.align_response(student_ids("char", "hello")).alignment is not None


def test_literal_special_token_text_stays_text():
    """A student that writes the characters '<eos>' wrote text: the teacher must not read its own eos there."""
    c = cross("char", "bpe")
    ids = toks.get("char").convert_tokens_to_ids(list("a<eos>b"))  # seven characters
    row = c.align_response(ids)
    assert row.alignment is not None
    assert toks.get("bpe").eos_token_id not in row.response_ids.tolist()
    assert spelled_text(c, row.response_ids) == b"a<eos>b"


def test_special_tokens_pair_by_role_and_an_unpaired_one_excludes_the_row():
    c = cross("unigram", "bpe")  # eos '</s>' against '<eos>'
    ids = student_ids("unigram", "hi") + [toks.get("unigram").eos_token_id]
    row = c.align_response(ids)
    assert row.response_ids[-1] == toks.get("bpe").eos_token_id
    assert row.alignment.student_group[-1] == row.alignment.teacher_group[-1] == row.alignment.num_groups - 1
    unk = c.align_response([toks.get("unigram").unk_token_id])
    assert unk.excluded == xt.UNPAIRED_SPECIAL and "<unk>" in unk.detail


# --------------------------------------------------------------------------- the demo pair, end to end
def test_demo_pair_worked_example():
    """The example of docs/cross-tokenizer.md: the BPE student writes ' #### 146<eos>' in seven tokens."""
    student, teacher = toks.get("demo_bpe"), toks.get("char")
    c = CrossTokenizer(student, teacher, "bpe", "char")
    ids = student(" #### 146", add_special_tokens=False)["input_ids"] + [student.eos_token_id]
    assert student.convert_ids_to_tokens(ids) == ["Ġ", "####", "Ġ", "1", "4", "6", "<eos>"]
    row = c.teacher_rows(
        [student.apply_chat_template([{"role": "user", "content": "What is 66 + 80?"}])["input_ids"]], [ids]
    )[0]
    assert teacher.decode(row.prompt_ids) == "What is 66 + 80?\n"
    assert teacher.convert_ids_to_tokens(row.response_ids.tolist()) == list(" #### 146") + ["<eos>"]
    assert row.alignment.student_group.tolist() == [0, 1, 2, 3, 4, 5, 6]
    assert row.alignment.teacher_group.tolist() == [0, 1, 1, 1, 1, 2, 3, 4, 5, 6]
    n = len(row.response_ids)
    scores = TeacherScores.zeros(np.array([n]), 2)
    scores.token_logprob[:] = -np.arange(1, n + 1) / 8
    scores.topk_ids[:] = row.response_ids[:, None]
    scores.topk_logprobs[:] = [-0.1, -3.0]
    for rule, topk_at in (("one_to_one", [0, 2, 3, 4, 5, 6]), ("group_start", [0, 1, 2, 3, 4, 5, 6])):
        targets = student_targets([row], [ids], scores, c.vocab_map.teacher_to_student, rule)
        assert np.nonzero(targets.target_flags & TOPK_VALID)[0].tolist() == topk_at
        assert (targets.target_flags & GROUP_END).all()
        assert np.allclose(targets.scores.token_logprob, [-1 / 8, -14 / 8, -6 / 8, -7 / 8, -8 / 8, -9 / 8, -10 / 8])
    assert targets.stats.one_to_one == 6 and targets.stats.groups == 7


def test_teacher_scores_from_a_real_model(tiny_model_factory):
    """Score the teacher's inputs with a real (tiny) model: the group log-probs add up to the model's log-prob
    of the response, computed directly from its logits; one-to-one positions are that computation's numbers."""
    import torch

    from opd_cache.annotate.hf_score import HFScorer
    from opd_cache.models import load_causal_lm

    student, teacher = toks.get("demo_bpe"), toks.get("char")
    c = CrossTokenizer(student, teacher, "bpe", "char")
    prompts = [
        student.apply_chat_template([{"role": "user", "content": q}])["input_ids"]
        for q in ("What is 1 + 2?", "What is 66 + 80?")
    ]
    responses = [
        student(a, add_special_tokens=False)["input_ids"] + [student.eos_token_id] for a in (" ans= 3", " #### 146")
    ]
    rows = c.teacher_rows(prompts, responses)
    path = tiny_model_factory("student", seed=0)  # any model of the character vocabulary (shared with other tests)
    scorer = HFScorer(load_causal_lm(path))
    scores = scorer.score([r.prompt_ids for r in rows], [r.response_ids for r in rows], k=4)
    targets = student_targets(rows, responses, scores, c.vocab_map.teacher_to_student)
    model = load_causal_lm(path).eval()
    start = 0
    for row, response in zip(rows, responses):
        ids = torch.tensor(np.concatenate([row.prompt_ids, row.response_ids]))[None]
        with torch.no_grad():
            logprobs = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
        p = len(row.prompt_ids)
        direct = logprobs[p - 1 : -1].gather(1, torch.tensor(row.response_ids)[:, None])[:, 0].numpy()
        mine = targets.scores.token_logprob[start : start + len(response)]
        assert np.isclose(mine.astype(np.float64).sum(), direct.astype(np.float64).sum(), atol=1e-4)
        flags = targets.target_flags[start : start + len(response)]
        for i in np.nonzero(flags & TOPK_VALID)[0]:
            j = int(np.nonzero(row.alignment.teacher_group == row.alignment.student_group[i])[0][0])
            assert np.isclose(mine[i], direct[j], atol=1e-5)
        start += len(response)


# --------------------------------------------------------------------------- the prompt
def test_prompt_is_rerendered_with_the_teachers_template():
    """The conversation behind the student's prompt ids is recovered from its template (here with a system
    message) and rendered with the teacher's own template."""
    from transformers import PreTrainedTokenizerFast

    chat_student = PreTrainedTokenizerFast(
        tokenizer_object=toks.get("bpe").backend_tokenizer,
        eos_token="<eos>",
        chat_template=(
            "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
        ),
    )
    c = CrossTokenizer(chat_student, toks.get("char"), "chat-bpe", "char")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 1 + 2?\nThink."}]
    prompt = chat_student.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
    assert c.recover_messages(prompt) == messages
    assert toks.get("char").decode(c.prompt_ids(prompt)) == "Be brief.\nWhat is 1 + 2?\nThink.\n"
    rows = c.teacher_rows([chat_student("no template here")["input_ids"]], [[5]])
    assert rows[0].excluded == xt.PROMPT_NOT_RENDERED and "does not match" in rows[0].detail


def test_excluded_rows_get_the_excluded_flag_and_a_count():
    c = cross("bpe", "char")
    responses = [student_ids("bpe", "ok"), student_ids("bpe", "naïve"), []]
    rows = c.teacher_rows([[5]] * 3, responses, messages=[[{"role": "user", "content": "q"}]] * 3)
    aligned = [r for r in rows if r.alignment is not None]
    lengths = np.array([len(r.response_ids) for r in aligned])
    scores = TeacherScores.zeros(lengths, 3)
    targets = student_targets(rows, responses, scores, c.vocab_map.teacher_to_student)
    m0, m1 = len(responses[0]), len(responses[1])
    assert (targets.target_flags[m0 : m0 + m1] == EXCLUDED).all()
    assert not (targets.target_flags[:m0] & EXCLUDED).any()
    assert targets.stats.excluded_rows == 1 and targets.stats.reasons == {xt.TEACHER_UNKNOWN: 1}
    assert targets.stats.summary()["excluded_reasons"] == {xt.TEACHER_UNKNOWN: 1}


def test_map_topk_pads_with_the_first_id_at_minus_infinity():
    table = np.array([10, -1, 11, 10, -1], dtype=np.int32)  # teacher ids 0 and 3 spell the same student token
    ids, lp, mapped, total = map_topk(
        np.array([[0, 1, 2, 3], [1, 4, 1, 4]]), np.log([[0.4, 0.3, 0.2, 0.1], [0.5, 0.2, 0.1, 0.1]]), table
    )
    assert ids[0].tolist() == [10, 11, 10, 10] and np.allclose(np.exp(lp[0, :2]), [0.5, 0.2])
    assert np.isneginf(lp[0, 2:]).all() and np.isclose(mapped[0], 0.7) and np.isclose(total[0], 1.0)
    assert np.isneginf(lp[1, 0])  # nothing mapped: no entry, the position gets no TOPK_VALID


def test_a_batch_of_rows_gives_each_rows_own_targets():
    """student_targets computes all aligned rows in one pass: the same numbers as row by row."""
    c = cross("unigram", "bpe")
    eos = toks.get("unigram").eos_token_id
    texts = ["Hello world", "", "naïve 東京", "x  y\n\nz", "The answer is 42."]
    responses = [student_ids("unigram", t) + [eos] for t in texts] + [[]]
    rows = c.teacher_rows([[5]] * len(responses), responses, messages=[[{"role": "user", "content": "q"}]] * 6)
    rng = np.random.default_rng(0)
    n = sum(len(r.response_ids) for r in rows)
    lengths = np.array([len(r.response_ids) for r in rows if r.alignment is not None])
    scores = TeacherScores(
        lengths,
        rng.integers(0, len(toks.get("bpe")), (n, 4)).astype(np.int32),
        np.sort(np.log(rng.dirichlet(np.ones(5), size=n)[:, :4]), axis=1)[:, ::-1].astype(np.float32),
        -rng.random(n).astype(np.float32),
    )
    table = c.vocab_map.teacher_to_student
    batch = student_targets(rows, responses, scores, table, "group_start")
    start, teacher_start = 0, 0
    for row, response in zip(rows, responses):
        m, t = len(response), len(row.response_ids)
        one = row_targets(
            row.alignment, np.array(response), row.response_ids, scores.token_logprob[teacher_start : teacher_start + t],
            scores.topk_ids[teacher_start : teacher_start + t], scores.topk_logprobs[teacher_start : teacher_start + t],
            table, "group_start",
        )  # fmt: skip
        assert np.array_equal(batch.target_flags[start : start + m], one.target_flags)
        assert np.array_equal(batch.scores.token_logprob[start : start + m], one.token_logprob)
        assert np.array_equal(batch.scores.topk_ids[start : start + m], one.topk_ids)
        assert np.array_equal(batch.scores.topk_logprobs[start : start + m], one.topk_logprobs)
        start, teacher_start = start + m, teacher_start + t
    assert batch.stats.rows == 6 and batch.stats.excluded_rows == 0
