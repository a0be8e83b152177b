"""What tokens spell and the vocabulary map between two tokenizers (opd_cache/annotate/vocab_map.py)."""

from __future__ import annotations

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from opd_cache.annotate.cross_targets import map_topk
from opd_cache.annotate.vocab_map import build_vocabulary_map, byte_level_alphabet, require_fast, token_bytes
from opd_cache.tokenizer import tokenizer_fingerprint
from tests import cross_tokenizer_tokenizers as toks


@pytest.mark.parametrize("name", sorted(toks.TOKENIZERS))
def test_spelled_bytes_are_what_the_tokenizer_decodes(name):
    """Every token that is whole UTF-8 decodes, after an anchor token, to exactly the bytes the table says
    (the anchor keeps SentencePiece decoders from stripping a leading space)."""
    tok = toks.get(name)
    table = token_bytes(tok, name)
    anchor = next(i for i, b in enumerate(table.spelled) if b == b"x" and i not in table.byte_fallback_ids)
    checked = 0
    for i, spelled in enumerate(table.spelled):
        if spelled is None:
            assert i in table.special_ids
            continue
        try:
            text = spelled.decode("utf-8")
        except UnicodeDecodeError:  # one byte of a longer character: checked by the alignment tests instead
            continue
        assert tok.decode([anchor, i], clean_up_tokenization_spaces=False) == "x" + text, (
            i,
            tok.convert_ids_to_tokens(i),
        )
        checked += 1
    assert checked >= 0.35 * len(tok)


def test_byte_level_alphabet_is_gpt2s():
    alphabet = byte_level_alphabet()
    assert len(alphabet) == 256 and sorted(alphabet.values()) == list(range(256))
    assert (alphabet["Ġ"], alphabet["Ċ"], alphabet["ĉ"], alphabet["A"]) == (0x20, 0x0A, 0x09, 0x41)
    assert set(alphabet) == set(pre_tokenizers.ByteLevel.alphabet())


def test_leading_space_markers_map_to_each_other():
    """A BPE 'Ġword' and a SentencePiece '▁word' both spell ' word': the map pairs them."""
    bpe, unigram = toks.get("bpe"), toks.get("unigram")
    vocab_map = build_vocabulary_map(bpe, unigram)
    pairs = [
        (t_id, bpe.convert_tokens_to_ids("Ġ" + token[1:]))
        for token, t_id in unigram.get_vocab().items()
        if token.startswith("▁") and len(token) > 1 and "Ġ" + token[1:] in bpe.get_vocab()
    ]
    assert len(pairs) >= 10
    for t_id, s_id in pairs:
        assert vocab_map.teacher_to_student[t_id] == s_id
    assert vocab_map.teacher_to_student[unigram.convert_tokens_to_ids("▁")] == bpe.convert_tokens_to_ids("Ġ")


def test_byte_fallback_tokens_map_to_byte_level_tokens():
    bpe, unigram = toks.get("bpe"), toks.get("unigram")
    vocab_map = build_vocabulary_map(bpe, unigram)
    to_char = {b: c for c, b in byte_level_alphabet().items()}
    for byte in range(256):
        t_id = unigram.convert_tokens_to_ids(f"<0x{byte:02X}>")
        assert vocab_map.teacher_to_student[t_id] == bpe.convert_tokens_to_ids(to_char[byte]), byte
    newline = vocab_map.teacher_to_student[unigram.convert_tokens_to_ids("<0x0A>")]
    assert bpe.convert_ids_to_tokens(int(newline)) == "Ċ"


def test_two_teacher_tokens_with_one_spelling_share_a_student_id_and_their_mass():
    """SentencePiece keeps '<0x61>' beside 'a': both map to the student's 'a', and their probabilities add."""
    teacher, student = toks.get("sp_legacy"), toks.get("bpe")
    vocab_map = build_vocabulary_map(student, teacher)
    byte_a, plain_a = teacher.convert_tokens_to_ids("<0x61>"), teacher.convert_tokens_to_ids("a")
    assert (
        vocab_map.teacher_to_student[byte_a]
        == vocab_map.teacher_to_student[plain_a]
        == student.convert_tokens_to_ids("a")
    )
    ids, lp, mapped, _ = map_topk(np.array([[plain_a, byte_a]]), np.log([[0.5, 0.25]]), vocab_map.teacher_to_student)
    assert ids[0, 0] == student.convert_tokens_to_ids("a") and np.isclose(np.exp(lp[0, 0]), 0.75)
    assert np.isneginf(lp[0, 1]) and np.isclose(mapped[0], 0.75)
    # the other way round, the student's regular 'a' is the one a teacher 'a' maps to (not its '<0x61>')
    reverse = build_vocabulary_map(teacher, student)
    assert reverse.teacher_to_student[student.convert_tokens_to_ids("a")] == plain_a


def _with_special(tok: PreTrainedTokenizerFast, token: str) -> PreTrainedTokenizerFast:
    core = Tokenizer.from_str(tok.backend_tokenizer.to_str())
    core.add_special_tokens([token])
    return PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token=tok.eos_token, pad_token=tok.pad_token, unk_token=tok.unk_token
    )


def test_special_tokens_pair_by_role_then_by_content():
    student = _with_special(toks.get("bpe"), "<|im_end|>")  # '<eos>', and <|im_end|> at id 420
    teacher = _with_special(toks.get("unigram"), "<|im_end|>")  # '</s>', and <|im_end|> at another id
    vocab_map = build_vocabulary_map(student, teacher)
    s_end, t_end = student.convert_tokens_to_ids("<|im_end|>"), teacher.convert_tokens_to_ids("<|im_end|>")
    assert s_end != t_end
    assert vocab_map.special[student.eos_token_id] == teacher.eos_token_id
    assert vocab_map.special[student.pad_token_id] == teacher.pad_token_id
    assert vocab_map.special[s_end] == t_end
    assert student.unk_token_id not in vocab_map.special  # unknown text has no counterpart
    assert vocab_map.teacher_to_student[teacher.eos_token_id] == student.eos_token_id
    assert vocab_map.teacher_to_student[teacher.unk_token_id] == -1
    assert token_bytes(student).spelled[s_end] is None


def test_fingerprint_covers_both_tokenizers_and_the_map():
    bpe, unigram = toks.get("bpe"), toks.get("unigram")
    first = build_vocabulary_map(bpe, unigram)
    assert build_vocabulary_map(bpe, unigram).fingerprint == first.fingerprint
    assert build_vocabulary_map(unigram, bpe).fingerprint != first.fingerprint
    assert build_vocabulary_map(bpe, _with_special(unigram, "<extra>")).fingerprint != first.fingerprint
    record = first.record()
    assert record["vocab_map_fingerprint"] == first.fingerprint and record["vocab_map_size"] == first.num_mapped
    # the stored targets are in student ids: the record's tokenizer is the student's, the teacher's beside it
    assert record["tokenizer_fingerprint"] == tokenizer_fingerprint(bpe)
    assert record["teacher_tokenizer_fingerprint"] == tokenizer_fingerprint(unigram)


def test_a_tokenizer_without_offsets_is_named():
    class SlowTokenizer:  # what a slow (Python) tokenizer offers here: no Rust backend
        name_or_path = "org/slow-model"
        is_fast = False

    with pytest.raises(ValueError, match=r"^tokenizer org/slow-model \(SlowTokenizer\) has no offset mapping support"):
        require_fast(SlowTokenizer())


@pytest.mark.parametrize(
    "decoder, message",
    [(decoders.WordPiece(), "decoder 'WordPiece' is not supported"), (None, "has no decoder")],
)
def test_a_decoder_that_cannot_say_what_a_token_spells_is_refused(decoder, message):
    core = Tokenizer(models.WordLevel({"<unk>": 0, "hello": 1, "##s": 2}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    if decoder is not None:
        core.decoder = decoder
    tok = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", name_or_path="tiny-wordpiece")
    with pytest.raises(ValueError, match=rf"^tokenizer tiny-wordpiece.*{message}"):
        token_bytes(tok)


def test_the_demo_bpe_tokenizer_is_what_its_script_builds_and_splits_differently():
    """data/tokenizer_bpe/ is reproducible from data/make_bpe_tokenizer.py, spends fewer tokens than the
    character tokenizer on the demo's prompts and answers, and cuts ' #### 85' elsewhere (the alignment has work):
    '####' is one token, the spaces and the number's digits one token each as in the character tokenizer."""
    from tests.conftest import load_data_script

    script = load_data_script("make_bpe_tokenizer")
    committed = toks.get("demo_bpe")
    assert tokenizer_fingerprint(script.build_tokenizer()) == tokenizer_fingerprint(committed)
    assert committed.chat_template == toks.get("char").chat_template
    assert [committed.pad_token_id, committed.eos_token_id, committed.unk_token_id] == [0, 1, 2]
    report = script.compare(committed, toks.get("char"))
    for key in ("prompt_tokens", "answer_tokens"):
        assert report[key]["bpe"] < report[key]["char"]
    assert report["split"]["bpe"] == ["Ġ", "####", "Ġ", "8", "5"]
    assert report["split"]["char"] == list(" #### 85")
