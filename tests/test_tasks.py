"""The arithmetic task, the reward parsers, prompt loading (formats and errors) and GSM8K row conversion."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from opd_cache.tasks import arithmetic
from opd_cache.tasks.prompts import load_prompts, verl_prompt_table
from opd_cache.tasks.rewards import (
    compute_score,
    get_reward_fn,
    lenient_answer,
    register_reward,
    score,
    strict_answer,
)
from opd_cache.tokenizer import load_tokenizer
from tests.conftest import DATA, load_data_script


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


# ---------------------------------------------------------------- the arithmetic task
def test_arithmetic_split_is_deterministic_disjoint_and_complete():
    splits = arithmetic.split_pairs()
    assert len(splits["train"]) == 7700 and len(splits["test"]) == 400
    train, test = set(splits["train"]), set(splits["test"])
    assert not train & test
    assert train | test == {(a, b) for a in range(10, 100) for b in range(10, 100)}
    assert arithmetic.split_pairs() == splits
    assert arithmetic.split_pairs(seed=5)["test"] != splits["test"]


def test_shipped_parquet_matches_the_generator():
    for split, table in arithmetic.make_tables().items():
        shipped = pq.read_table(DATA / "arithmetic" / f"{split}.parquet")
        assert shipped.equals(table), split
    row = pq.read_table(DATA / "arithmetic" / "test.parquet").slice(0, 1).to_pylist()[0]
    a, b = row["extra_info"]["a"], row["extra_info"]["b"]
    assert row["prompt"] == [{"role": "user", "content": f"What is {a} + {b}?"}]
    assert row["data_source"] == "arithmetic"
    assert row["reward_model"] == {"ground_truth": str(a + b), "style": "rule"}


def test_templated_arithmetic_prompts_all_have_the_same_length(tokenizer):
    for split in ("train", "test"):
        prompts = load_prompts(DATA / "arithmetic" / f"{split}.parquet", tokenizer)
        assert {len(ids) for ids in prompts.prompt_ids} == {17}


def test_teacher_and_student_formats_put_the_number_at_the_same_position(tokenizer):
    for answer in (20, 85, 198):
        teacher, student = arithmetic.teacher_answer(answer), arithmetic.student_answer(answer)
        assert len(teacher) == len(student)
        assert teacher.index(str(answer)) == student.index(str(answer)) == 6
        assert strict_answer(teacher) == str(answer) and strict_answer(student) is None
        assert lenient_answer(student) == str(answer)
    # " #### 198" + <eos> is the longest answer: 10 tokens.
    assert len(tokenizer(arithmetic.teacher_answer(198) + "<eos>", add_special_tokens=False)["input_ids"]) == 10


# ---------------------------------------------------------------- rewards
@pytest.mark.parametrize(
    "text, expected",
    [
        (" #### 85", "85"),
        ("####85", "85"),
        ("so the total is 12.\n#### 1,234", "1234"),
        ("#### 12 wait, no: #### 85", "85"),  # the last marker counts
        ("#### $18", "18"),
        ("#### -3", "-3"),
        ("#### 3.50 dollars", "3.50"),
        ("#### 85<eos>", "85"),
        ("#### 12 then ####", None),  # the last marker has no number
        ("#### abc 85", None),
        ("## 85", None),
        (" ans= 85", None),
        ("", None),
    ],
)
def test_strict_answer(text, expected):
    assert strict_answer(text) == expected


@pytest.mark.parametrize(
    "text, expected",
    [
        (" ans= 85", "85"),
        ("37 + 48 = 85.", "85"),
        ("It costs 1,000 dollars, then 12", "12"),
        ("#### 7 and more text 3.25", "3.25"),
        ("temperature -4", "-4"),
        ("no digits here", None),
    ],
)
def test_lenient_answer(text, expected):
    assert lenient_answer(text) == expected


def test_score():
    assert score(" #### 85", "85") == {"strict": 1, "lenient": 1}
    assert score(" ans= 85", "85") == {"strict": 0, "lenient": 1}
    assert score(" #### 58", "85") == {"strict": 0, "lenient": 0}
    assert score(" #### 85.0", "85") == {"strict": 1, "lenient": 1}
    assert score(" #### 1,234", "1234") == {"strict": 1, "lenient": 1}
    assert score("#### 85 #### 86", "85")["strict"] == 0
    with pytest.raises(ValueError, match="ground_truth is None"):
        score(" #### 85", None)


def test_math_verify_makes_lenient_more_lenient():
    pytest.importorskip("math_verify", reason="math-verify is an optional extra (pip install opd-cache[math])")
    # The last number is 3, but math-verify finds the boxed answer.
    assert score("The answer is \\boxed{85}. Check: 3", "85") == {"strict": 0, "lenient": 1}
    assert score("The answer is \\boxed{84}. Check: 3", "85") == {"strict": 0, "lenient": 0}


def test_reward_registry():
    assert get_reward_fn("arithmetic") is score
    assert get_reward_fn("openai/gsm8k") is score
    assert get_reward_fn("never-registered") is score
    assert get_reward_fn(None) is score
    register_reward("test/exact", lambda text, truth: {"strict": int(text == truth), "lenient": 1})
    assert compute_score("test/exact", "85", "85") == {"strict": 1, "lenient": 1}
    assert compute_score("test/exact", " #### 85", "85") == {"strict": 0, "lenient": 1}
    assert compute_score("arithmetic", " #### 85", "85") == {"strict": 1, "lenient": 1}


# ---------------------------------------------------------------- load_prompts: formats
def test_load_prompts_verl_parquet(tokenizer):
    path = DATA / "arithmetic" / "test.parquet"
    prompts = load_prompts(path, tokenizer)
    rows = pq.read_table(path).to_pylist()
    assert len(prompts) == 400 and prompts.num_skipped_too_long == 0
    assert prompts.row_index == list(range(400))
    assert prompts.data_source == ["arithmetic"] * 400
    for i in (0, 17, 399):
        a, b = rows[i]["extra_info"]["a"], rows[i]["extra_info"]["b"]
        assert tokenizer.decode(prompts.prompt_ids[i]) == f"What is {a} + {b}?\n"
        assert prompts.ground_truth[i] == str(a + b)
        assert json.loads(prompts.extra[i]) == rows[i]["extra_info"]
    table = prompts.to_arrow()
    assert table.schema.field("prompt_ids").type == pa.list_(pa.int32())
    assert table.column("prompt_ids").to_pylist() == prompts.prompt_ids


GSM8K_LIKE = [
    {"question": "Tom has 3 apples and buys 4 more. How many?", "answer": "3 + 4 = <<3+4=7>>7\n#### 7"},
    {"question": "A shop sells 1,200 pens a day. How many in 2 days?", "answer": "1,200 * 2 = 2,400\n#### 2,400"},
    {"question": "What is 5 + 5?", "answer": "10"},  # no #### part: the whole answer is the ground truth
]


def test_load_prompts_question_answer_jsonl(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "qa.jsonl", GSM8K_LIKE)
    prompts = load_prompts(path, tokenizer)
    assert len(prompts) == 3
    assert prompts.ground_truth == ["7", "2400", "10"]
    assert prompts.data_source == [None, None, None]
    assert tokenizer.decode(prompts.prompt_ids[0]) == GSM8K_LIKE[0]["question"] + "\n"
    assert json.loads(prompts.extra[1]) == {"answer": GSM8K_LIKE[1]["answer"]}


def test_load_prompts_without_chat_template_uses_plain_text(tmp_path, tokenizer_path):
    tokenizer = load_tokenizer(tokenizer_path)
    tokenizer.chat_template = None
    prompts = load_prompts(write_jsonl(tmp_path / "qa.jsonl", GSM8K_LIKE), tokenizer)
    assert tokenizer.decode(prompts.prompt_ids[2]) == "What is 5 + 5?"


def test_load_prompts_custom_prompt_key(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "p.jsonl", [{"text": "Hi there", "data_source": "arithmetic"}])
    prompts = load_prompts(path, tokenizer, prompt_key="text")
    assert tokenizer.decode(prompts.prompt_ids[0]) == "Hi there\n"
    assert prompts.data_source == ["arithmetic"] and prompts.ground_truth == [None]


def test_load_prompts_datasets_folders(tmp_path, tokenizer):
    datasets = pytest.importorskip("datasets")
    rows = arithmetic.make_tables()["test"].slice(0, 5).to_pylist()
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    prompts = load_prompts(tmp_path / "saved", tokenizer)
    assert len(prompts) == 5
    assert prompts.ground_truth == [r["reward_model"]["ground_truth"] for r in rows]
    assert tokenizer.decode(prompts.prompt_ids[0]) == rows[0]["prompt"][0]["content"] + "\n"

    both = datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(rows[:3]), "test": datasets.Dataset.from_list(GSM8K_LIKE)}
    )
    both.save_to_disk(str(tmp_path / "splits"))
    with pytest.raises(ValueError, match=r"has splits \['test', 'train'\]: pass split= to choose one"):
        load_prompts(tmp_path / "splits", tokenizer)
    assert load_prompts(tmp_path / "splits", tokenizer, split="test").ground_truth == ["7", "2400", "10"]

    # A plain folder of parquet files goes through datasets.load_dataset.
    (tmp_path / "folder").mkdir()
    pq.write_table(verl_prompt_table(rows), tmp_path / "folder" / "part-0.parquet")
    assert load_prompts(tmp_path / "folder", tokenizer).prompt_ids == prompts.prompt_ids


# ---------------------------------------------------------------- load_prompts: errors
def test_empty_prompt_is_refused(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "e.jsonl", [{"question": "What is 1 + 1?"}, {"question": "  "}])
    with pytest.raises(
        ValueError, match=rf"prompts file {path}: row 1: prompt is empty \(no text in column 'question'\)"
    ):
        load_prompts(path, tokenizer)


def test_prompt_with_zero_tokens_after_template_is_refused(tmp_path, tokenizer_path):
    tokenizer = load_tokenizer(tokenizer_path)
    tokenizer.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'system' %}{{ m['content'] }}{% endif %}{% endfor %}"
    )
    path = write_jsonl(tmp_path / "z.jsonl", [{"question": "What is 1 + 1?"}])
    with pytest.raises(
        ValueError, match=rf"prompts file {path}: row 0: prompt is empty \(0 tokens after the chat template\)"
    ):
        load_prompts(path, tokenizer)


def test_too_long_prompts_are_refused_or_skipped_and_counted(tmp_path, tokenizer, caplog):
    rows = [{"question": "short"}, {"question": "x" * 40}, {"question": "tiny"}, {"question": "y" * 50}]
    path = write_jsonl(tmp_path / "long.jsonl", rows)
    with pytest.raises(
        ValueError,
        match=rf"prompts file {path}: row 1: prompt has 41 tokens, more than "
        r"max_prompt_tokens=20 \(2 rows are too long; truncate=True",
    ):
        load_prompts(path, tokenizer, max_prompt_tokens=20)
    with caplog.at_level(logging.WARNING, logger="opd_cache.tasks.prompts"):
        prompts = load_prompts(path, tokenizer, max_prompt_tokens=20, truncate=True)
    assert len(prompts) == 2 and prompts.num_skipped_too_long == 2
    assert prompts.row_index == [0, 2]
    assert [tokenizer.decode(ids) for ids in prompts.prompt_ids] == ["short\n", "tiny\n"]
    assert "skipped 2 of 4 prompts longer than 20 tokens" in caplog.text
    with pytest.raises(ValueError, match=r"all 4 prompts are longer than max_prompt_tokens=3"):
        load_prompts(path, tokenizer, max_prompt_tokens=3, truncate=True)


def test_missing_columns_are_named(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "m.jsonl", [{"query": "What?", "label": "1"}])
    with pytest.raises(
        ValueError,
        match=rf"prompts file {path}: missing column 'prompt' \(verl chat messages\) or "
        r"'question' \(plain text\); found columns: query, label",
    ):
        load_prompts(path, tokenizer)
    with pytest.raises(ValueError, match=r"prompt_key 'text' is not a column; found columns: query, label"):
        load_prompts(path, tokenizer, prompt_key="text")


def test_reward_model_without_ground_truth_is_refused(tmp_path, tokenizer):
    rows = [{"prompt": [{"role": "user", "content": "Hi"}], "reward_model": {"style": "rule"}}]
    path = write_jsonl(tmp_path / "r.jsonl", rows)
    with pytest.raises(ValueError, match=r"row 0: reward_model has no 'ground_truth' \(found: \['style'\]\)"):
        load_prompts(path, tokenizer)


def test_malformed_chat_messages_are_refused(tmp_path, tokenizer):
    rows = [{"prompt": [{"role": "user", "content": "Hi"}]}, {"prompt": [{"content": "no role"}]}]
    path = write_jsonl(tmp_path / "c.jsonl", rows)
    with pytest.raises(ValueError, match=r"row 1: column 'prompt' must be a list of chat messages"):
        load_prompts(path, tokenizer)


def test_non_utf8_jsonl_is_refused_with_its_line(tmp_path, tokenizer):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b'{"question": "fine"}\n{"question": "caf\xe9"}\n')
    with pytest.raises(ValueError, match=rf"prompts file {path}: line 2 is not valid UTF-8 \(byte 38\)"):
        load_prompts(path, tokenizer)


def test_invalid_json_line_is_refused_with_its_line(tmp_path, tokenizer):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"question": "fine"}\n\n{"question": oops}\n')
    with pytest.raises(ValueError, match=rf"prompts file {path}: line 3 is not valid JSON"):
        load_prompts(path, tokenizer)


def test_chat_data_needs_a_chat_template(tokenizer_path):
    tokenizer = load_tokenizer(tokenizer_path)
    tokenizer.chat_template = None
    path = DATA / "arithmetic" / "test.parquet"
    with pytest.raises(
        ValueError,
        match=rf"prompts file {path}: column 'prompt' holds chat messages but tokenizer "
        r".* has no chat template",
    ):
        load_prompts(path, tokenizer)


def test_missing_file_and_unknown_format(tmp_path, tokenizer):
    with pytest.raises(ValueError, match=r"prompts file .*nope.parquet does not exist"):
        load_prompts(tmp_path / "nope.parquet", tokenizer)
    (tmp_path / "p.csv").write_text("question\nhi\n")
    with pytest.raises(ValueError, match=r"unknown format; expected .parquet, .jsonl, .json or a datasets folder"):
        load_prompts(tmp_path / "p.csv", tokenizer)


# ---------------------------------------------------------------- GSM8K preparation
def test_gsm8k_row_conversion_round_trips_through_load_prompts(tmp_path, tokenizer):
    prepare = load_data_script("prepare_gsm8k")
    row = {
        "question": "Natalia sold clips to 48 of her friends in April, and then half as many in May. How many in all?",
        "answer": "In May she sold 48/2 = <<48/2=24>>24 clips.\nAltogether 48+24 = <<48+24=72>>72 clips.\n#### 72",
    }
    converted = prepare.gsm8k_row_to_verl(row, 3, "train")
    assert converted == {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": row["question"] + " " + prepare.INSTRUCTION}],
        "ability": "math",
        "reward_model": {"ground_truth": "72", "style": "rule"},
        "extra_info": {"split": "train", "index": 3, "answer": row["answer"], "question": row["question"]},
    }
    pq.write_table(verl_prompt_table([converted]), tmp_path / "gsm8k.parquet")
    prompts = load_prompts(tmp_path / "gsm8k.parquet", tokenizer)
    assert prompts.ground_truth == ["72"] and prompts.data_source == ["openai/gsm8k"]
    assert tokenizer.decode(prompts.prompt_ids[0]) == converted["prompt"][0]["content"] + "\n"
    assert compute_score("openai/gsm8k", "... so 72 in all.\n#### 72", "72") == {"strict": 1, "lenient": 1}

    with pytest.raises(ValueError, match=r"gsm8k test row 9: the answer has no '#### <number>' part"):
        prepare.gsm8k_row_to_verl({"question": "q", "answer": "just 5"}, 9, "test")
