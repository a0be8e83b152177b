"""The shipped character tokenizer, fingerprints and compatibility checks, tiny models, and the demo models."""

from __future__ import annotations

import json
import shutil
import string
from pathlib import Path

import pytest
import torch

from opd_cache.models import build_tiny_model, load_causal_lm, save_causal_lm
from opd_cache.tasks.prompts import load_prompts
from opd_cache.tasks.rewards import score
from opd_cache.tokenizer import check_compatible, first_vocab_difference, load_tokenizer, tokenizer_fingerprint
from tests.conftest import DATA, load_data_script


def edited_tokenizer(tmp_path: Path, edit) -> Path:
    """A copy of the shipped tokenizer with `edit(tokenizer_json_dict)` applied to its tokenizer.json."""
    out = tmp_path / "edited"
    shutil.copytree(DATA / "tokenizer", out)
    spec = json.loads((out / "tokenizer.json").read_text())
    edit(spec)
    (out / "tokenizer.json").write_text(json.dumps(spec))
    return out


# ---------------------------------------------------------------- tokenizer
def test_shipped_tokenizer_is_character_level_and_round_trips(tokenizer):
    assert len(tokenizer) <= 128
    assert tokenizer.pad_token_id == 0 and tokenizer.eos_token == "<eos>"
    assert tokenizer.padding_side == "left"
    text = string.printable.replace("\t", "").replace("\r", "").replace("\x0b", "").replace("\x0c", "")
    text = "What is 37 + 48?\n #### 85 -- " + text
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text)  # one token per character, nothing merged or stripped
    assert tokenizer.unk_token_id not in ids
    assert tokenizer.decode(ids) == text
    # Special tokens written in text are single ids; decoding can drop them.
    ids = tokenizer(" #### 85<eos>", add_special_tokens=False)["input_ids"]
    assert ids[-1] == tokenizer.eos_token_id and len(ids) == 9
    assert tokenizer.decode(ids, skip_special_tokens=True) == " #### 85"
    # Characters outside printable ASCII become <unk>.
    assert tokenizer("é", add_special_tokens=False)["input_ids"] == [tokenizer.unk_token_id]


def test_left_padding(tokenizer):
    batch = tokenizer.pad({"input_ids": [[5, 6, 7], [8]]}, return_tensors="pt")
    assert batch["input_ids"].tolist() == [[5, 6, 7], [0, 0, 8]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [0, 0, 1]]


def test_chat_template_renders_user_then_assistant(tokenizer):
    messages = [{"role": "user", "content": "What is 37 + 48?"}]
    assert tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == "What is 37 + 48?\n"
    full = messages + [{"role": "assistant", "content": " #### 85"}]
    assert tokenizer.apply_chat_template(full, tokenize=False) == "What is 37 + 48?\n #### 85<eos>"


def test_make_tokenizer_script_rebuilds_the_shipped_tokenizer(tmp_path, tokenizer):
    rebuilt_dir = tmp_path / "tok"
    load_data_script("make_tokenizer").build_tokenizer().save_pretrained(rebuilt_dir)
    assert not (rebuilt_dir / "config.json").exists()
    rebuilt = load_tokenizer(rebuilt_dir)
    assert rebuilt.get_vocab() == tokenizer.get_vocab()
    assert tokenizer_fingerprint(rebuilt) == tokenizer_fingerprint(tokenizer)
    assert rebuilt.chat_template == tokenizer.chat_template


def test_fingerprint_ignores_padding_side_and_template_but_not_vocabulary(tmp_path, tokenizer_path, tokenizer):
    fingerprint = tokenizer_fingerprint(tokenizer)
    assert len(fingerprint) == 16 and int(fingerprint, 16) >= 0
    other = load_tokenizer(tokenizer_path, padding_side="right")
    other.chat_template = "{{ messages[0]['content'] }}"
    assert other.padding_side == "right"
    assert tokenizer_fingerprint(other) == fingerprint

    # Two ids swapped: same token set, different meaning.
    def swap(spec):
        vocab = spec["model"]["vocab"]
        vocab["a"], vocab["b"] = vocab["b"], vocab["a"]

    swapped = load_tokenizer(edited_tokenizer(tmp_path, swap))
    assert tokenizer_fingerprint(swapped) != fingerprint

    renamed_eos = load_tokenizer(tokenizer_path)
    renamed_eos.eos_token = "<pad>"
    assert tokenizer_fingerprint(renamed_eos) != fingerprint


def test_first_vocab_difference_names_the_first_differing_id(tmp_path, tokenizer_path, tokenizer):
    assert first_vocab_difference(tokenizer, load_tokenizer(tokenizer_path)) is None

    def swap(spec):
        vocab = spec["model"]["vocab"]
        vocab["a"], vocab["b"] = vocab["b"], vocab["a"]

    swapped = load_tokenizer(edited_tokenizer(tmp_path, swap))
    a_id = tokenizer.convert_tokens_to_ids("a")
    assert first_vocab_difference(tokenizer, swapped, "X", "Y") == f"id {a_id} is 'a' in X but 'b' in Y"

    bigger = load_tokenizer(tokenizer_path)
    bigger.add_tokens(["<extra>"], special_tokens=True)
    assert (
        first_vocab_difference(tokenizer, bigger, "X", "Y") == f"id {len(tokenizer)} is absent in X but '<extra>' in Y"
    )

    eos = load_tokenizer(tokenizer_path)
    eos.eos_token = "<unk>"
    assert first_vocab_difference(tokenizer, eos, "X", "Y") == "eos_token is '<eos>' in X but '<unk>' in Y"


def test_check_compatible(tmp_path, tokenizer_path, tokenizer):
    same = load_tokenizer(tokenizer_path)
    check_compatible(tokenizer, same, teacher_vocab_size=len(tokenizer), student_name="S", teacher_name="T")
    # An embedding padded beyond the tokenizer is fine.
    check_compatible(
        tokenizer, same, teacher_vocab_size=128, student_name="S", teacher_name="T", student_vocab_size=256
    )

    with pytest.raises(
        ValueError, match=r"teacher T: the tokenizer has 99 tokens but the model's embedding has only 64 rows"
    ):
        check_compatible(tokenizer, same, teacher_vocab_size=64, student_name="S", teacher_name="T")
    with pytest.raises(
        ValueError, match=r"student S: the tokenizer has 99 tokens but the model's embedding has only 90"
    ):
        check_compatible(
            tokenizer, same, teacher_vocab_size=99, student_name="S", teacher_name="T", student_vocab_size=90
        )

    def swap(spec):
        vocab = spec["model"]["vocab"]
        vocab["7"], vocab["8"] = vocab["8"], vocab["7"]

    swapped = load_tokenizer(edited_tokenizer(tmp_path, swap))
    seven = tokenizer.convert_tokens_to_ids("7")
    with pytest.raises(ValueError) as error:
        check_compatible(tokenizer, swapped, teacher_vocab_size=99, student_name="S", teacher_name="T")
    assert str(error.value) == f"teacher T and student S tokenizers differ: id {seven} is '8' in T but '7' in S"


def test_load_tokenizer_refuses_a_folder_without_tokenizer_files(tmp_path):
    with pytest.raises(ValueError, match="neither tokenizer.json nor tokenizer_config.json"):
        load_tokenizer(tmp_path)


# ---------------------------------------------------------------- models
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_build_tiny_model_forward_is_seeded(arch, tokenizer):
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    model = build_tiny_model(arch, vocab_size=len(tokenizer), seed=7)
    assert torch.equal(torch.rand(1), before)  # the caller's RNG stream is untouched
    ids = torch.tensor([tokenizer("What is 1 + 2?\n", add_special_tokens=False)["input_ids"]])
    logits = model(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], len(tokenizer))
    assert torch.isfinite(logits).all()
    assert torch.equal(build_tiny_model(arch, vocab_size=len(tokenizer), seed=7)(input_ids=ids).logits, logits)
    assert not torch.equal(build_tiny_model(arch, vocab_size=len(tokenizer), seed=8)(input_ids=ids).logits, logits)
    assert model.get_input_embeddings().weight.data_ptr() == model.get_output_embeddings().weight.data_ptr()


def test_build_tiny_model_refuses_unknown_arch():
    with pytest.raises(ValueError, match="arch 'gpt9' is not supported"):
        build_tiny_model("gpt9", vocab_size=10)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_save_load_round_trip(arch, tmp_path, tokenizer):
    model = build_tiny_model(arch, vocab_size=128, seed=3, pad_token_id=0, eos_token_id=tokenizer.eos_token_id)
    with torch.no_grad():  # make the weights not just the initialiser's
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    save_causal_lm(model, tokenizer, tmp_path / "ckpt")
    files = {p.name for p in (tmp_path / "ckpt").iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= files
    assert not any(name.endswith(".bin") for name in files)

    loaded = load_causal_lm(tmp_path / "ckpt")
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, model(input_ids=ids).logits)
    assert loaded.config.vocab_size == 128 and loaded.dtype == torch.float32

    # A checkpoint folder has config.json beside the tokenizer: load_tokenizer must still give the
    # character tokenizer (AutoTokenizer may pick the model type's own tokenizer class instead).
    reloaded = load_tokenizer(tmp_path / "ckpt")
    text = "What is 37 + 48?\n #### 85"
    assert (
        reloaded(text, add_special_tokens=False)["input_ids"] == tokenizer(text, add_special_tokens=False)["input_ids"]
    )
    assert tokenizer_fingerprint(reloaded) == tokenizer_fingerprint(tokenizer)
    assert reloaded.chat_template == tokenizer.chat_template and reloaded.padding_side == "left"


def test_load_causal_lm_refuses_a_folder_without_safetensors(tmp_path):
    build_tiny_model(vocab_size=16).config.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"no \*.safetensors weights"):
        load_causal_lm(tmp_path)


# ---------------------------------------------------------------- shipped demo models
@torch.no_grad()
def greedy_scores(model_dir: Path, prompts, limit: int) -> dict[str, float]:
    model, tokenizer = load_causal_lm(model_dir), load_tokenizer(model_dir)
    ids = torch.tensor(prompts.prompt_ids[:limit])  # every arithmetic prompt has the same length
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=10,
        do_sample=False,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    texts = tokenizer.batch_decode(out[:, ids.shape[1] :], skip_special_tokens=True)
    scores = [score(text, truth) for text, truth in zip(texts, prompts.ground_truth[:limit])]
    return {key: sum(s[key] for s in scores) / limit for key in ("strict", "lenient")}


def test_shipped_demo_models_tell_the_demo_story(tokenizer):
    teacher_dir, student_dir = DATA / "models" / "teacher", DATA / "models" / "student"
    prompts = load_prompts(DATA / "arithmetic" / "test.parquet", tokenizer)
    for model_dir in (teacher_dir, student_dir):
        assert tokenizer_fingerprint(load_tokenizer(model_dir)) == tokenizer_fingerprint(tokenizer)
        assert (model_dir / "model.safetensors").stat().st_size < 2_000_000
    teacher = greedy_scores(teacher_dir, prompts, 50)
    student = greedy_scores(student_dir, prompts, 50)
    assert teacher["strict"] >= 0.95, teacher
    assert student["strict"] <= 0.1, student
    assert student["lenient"] >= 0.9, student  # the student adds correctly, in the wrong format
