"""The bad-input matrix (docs/reliability.md, "Bad inputs"): every bad input is answered by the real CLI with
exit status 2 and exactly one line `error: <message>` naming the flag, file or field, and leaves the store as
it was (every file hashed before and after). Shards that fail validation are quarantined instead, and the
stage goes on.

One store is prepared per module with the real CLI on the shipped tiny models: two rollout shards,
annotated and trained (resume states of steps 1 and 2, policy versions 1 and 2), then a third shard rolled
out by policy version 2 and annotated, not yet trained. Each test works on a copy.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

import opd_cache.cli  # noqa: F401  (registers every command on `app`)
from opd_cache.cli.common import app
from opd_cache.losses import LOSSES, POLICY_GRADIENT
from opd_cache.storage.schema import ROLLOUT, read_shard, write_shard
from opd_cache.storage.store import Store

REPO = Path(__file__).resolve().parents[1]
STUDENT = REPO / "data" / "models" / "student"
TEACHER = REPO / "data" / "models" / "teacher"
TRAIN_PROMPTS = REPO / "data" / "arithmetic" / "train.parquet"
PENDING = "v000002-w00-000002"  # the third shard: annotated, not trained yet
TRAIN_MORE = ["--max-steps", "3", "--global-batch-samples", "8"]  # trains PENDING on a clean copy
ROLLOUT_ONE = ["--worker-id", "w01", "--max-shards", "1", "--flush-rows", "4", "--n", "2", "--max-new-tokens", "4"]

runner = CliRunner()


def opd(*args):
    return runner.invoke(app, [str(a) for a in args])


def assert_refused(result, message: str) -> None:
    """Exit status 2 and stderr is exactly the one line `error: <message>`."""
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    assert result.stderr == f"error: {message}\n"
    assert "Traceback" not in result.output


def assert_refused_like(result, pattern: str) -> None:
    """As assert_refused, where part of the message is another library's text (`pattern` is a regex)."""
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    assert re.fullmatch(f"error: {pattern}\n", result.stderr), result.stderr
    assert "Traceback" not in result.output


def snapshot(root: Path) -> dict[str, str]:
    """sha256 of every file under `root` (temporary files included: none may be left behind)."""
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


# ---------------------------------------------------------------------------------------------- the store


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> Path:
    """The first 32 prompts of the shipped arithmetic task (loading all 7,700 takes seconds per command)."""
    path = tmp_path_factory.mktemp("prompts") / "train-32.parquet"
    pq.write_table(pq.read_table(TRAIN_PROMPTS).slice(0, 32), path)
    return path


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, prompts) -> Path:
    root = tmp_path_factory.mktemp("prepared") / "store"
    rollout = [
        "rollout",
        "--store",
        root,
        "--student",
        STUDENT,
        "--prompts",
        prompts,
        "--n",
        "2",
        "--max-new-tokens",
        "6",
        "--flush-rows",
        "8",
        "--set",
        "rollout.batch_prompts=4",
    ]
    steps = [
        [*rollout, "--max-shards", "2"],
        ["annotate", "--store", root, "--teacher", TEACHER, "--top-k", "4"],
        # stops when the data runs out (not at max-steps): no train/DONE, as for a trainer that will go on
        [
            "train",
            "--store",
            root,
            "--max-steps",
            "10",
            "--global-batch-samples",
            "8",
            "--lr",
            "1e-3",
            "--set",
            "train.save_every=1",
        ],
        [*rollout, "--max-shards", "3"],
        ["annotate", "--store", root, "--teacher", TEACHER],
    ]
    for args in steps:
        result = opd(*args)
        assert result.exit_code == 0, (args, result.output, result.exception)
    assert (root / f"annotated/v000002/{PENDING}/teacher.arrow").exists() and not (root / "train/DONE").exists()
    assert sorted(os.listdir(root / "train/state")) == ["step-000001", "step-000002"]
    return root


@pytest.fixture
def store(prepared, tmp_path) -> Path:
    copy = tmp_path / "store"
    shutil.copytree(prepared, copy)
    return copy


@pytest.fixture(scope="module")
def tokenizer_vocab() -> dict[str, int]:
    return json.loads((REPO / "data/tokenizer/tokenizer.json").read_text())["model"]["vocab"]


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def test_control_the_commands_of_the_matrix_work_on_an_undamaged_copy(store, prompts):
    """The refusals below are caused by the damage each test makes, not by the commands themselves."""
    result = opd("rollout", "--store", store, "--prompts", prompts, *ROLLOUT_ONE)
    assert result.exit_code == 0, result.output
    assert (store / "rollouts/v000002/v000002-w01-000000.arrow").exists()
    result = opd("train", "--store", store, *TRAIN_MORE)
    assert result.exit_code == 0, result.output
    assert "trained 24 samples" in " ".join(result.stdout.split())


# ---------------------------------------------------------------------------------------------- CLI and config
# every flag refused here names itself in one line and leaves the store as it was
REFUSED_FLAGS = {
    "unknown_set_key": (
        ["train", "--set", "train.lrr=1"],
        "invalid configuration: unknown config key 'train.lrr' (value 1, from --set train.lrr=1); check the "
        "spelling against "
        "`docs/configuration.md`",
    ),
    "set_without_value": (
        ["train", "--set", "train.lr"],
        "--set 'train.lr': expected dotted.key=value, e.g. --set train.lr=3e-4",
    ),
    "negative_staleness": (
        ["train", "--max-staleness", "-1"],
        "invalid configuration: config key 'max_staleness' = -1 (from --max-staleness): Input should be "
        "greater than or equal to 0",
    ),
    "retired_stage_staleness": (
        ["train", "--set", "train.max_staleness=1"],
        "--set train.max_staleness=1: config key 'train.max_staleness' was retired; set the top-level "
        "max_staleness instead (one bound for rollout, annotate and train)",
    ),
    "unknown_loss": (
        ["train", "--loss", "kl_forward"],
        f"--loss 'kl_forward' is not a loss; use one of {', '.join([*LOSSES, POLICY_GRADIENT])}",
    ),
    "k1_without_policy_gradient": (
        ["train", "--loss", "k1"],
        "--loss k1 --tail bucket: divergence='k1' is not a loss on its own: its gradient, grad log "
        "q(sampled), is zero in expectation; use it as the reward of policy-gradient OPD "
        "(divergence='pg', or 'k1' with policy_gradient=True, plus behavior_logprobs; or pg_loss()), "
        "or pick k2, k3 or abs",
    ),
    "union_support_without_student_topk": (
        ["train", "--support", "union"],
        "--support union needs the student's top-k ids in the rollout shards (student_topk_ids), but "
        "run.json has no student_topk: roll out with rollout.student_topk > 0 or use --support teacher",
    ),
    "two_batch_units": (
        ["train", "--global-batch-samples", "8", "--global-batch-tokens", "100"],
        "invalid configuration: train: global_batch_samples and global_batch_tokens "
        "(--global-batch-samples, --global-batch-tokens): give only one of them",
    ),
    "teacher_name_that_escapes_the_store": (
        ["annotate", "--teacher", TEACHER, "--teacher-name", "../../x"],
        "invalid teacher name '../../x': use 1-64 characters from letters, digits, '_', '-', '.' "
        "(starting with a letter or digit, no '..')",
    ),
}


@pytest.mark.parametrize("command, message", REFUSED_FLAGS.values(), ids=REFUSED_FLAGS.keys())
def test_bad_flag_is_refused_and_changes_nothing(store, command, message):
    stage, *flags = command
    before = snapshot(store)
    assert_refused(opd(stage, "--store", store, *flags), message)
    assert snapshot(store) == before


def test_wrong_type_in_yaml(store, tmp_path):
    config = tmp_path / "bad.yaml"
    config.write_text("train:\n  max_steps: many\n")
    before = snapshot(store)
    assert_refused(
        opd("train", "--store", store, "--config", config),
        f"invalid configuration: config key 'train.max_steps' = 'many' (from --config {config}): Input should be a "
        f"valid integer, unable to parse string as an integer",
    )
    assert snapshot(store) == before


def test_yaml_that_is_not_utf8(store, tmp_path):
    config = tmp_path / "latin1.yaml"
    data = "train:\n  lr: 1e-3  # café\n".encode("latin-1")
    config.write_bytes(data)
    assert_refused(
        opd("train", "--store", store, "--config", config),
        f"--config {config}: line 2 is not valid UTF-8 (byte {data.index('é'.encode('latin-1'))})",
    )


def test_yaml_syntax_error_is_one_line(store, tmp_path):
    config = tmp_path / "broken.yaml"
    config.write_text("train: [1, 2\n")
    assert_refused(
        opd("train", "--store", store, "--config", config),
        f"--config {config}: not valid YAML at line 2, column 1: expected ',' or ']', but got '<stream end>'",
    )


def test_missing_config_file(store, tmp_path):
    assert_refused(
        opd("annotate", "--store", store, "--config", tmp_path / "nope.yaml"),
        f"--config {tmp_path / 'nope.yaml'}: file not found",
    )


def test_worker_index_out_of_range(store):
    assert_refused(
        opd("annotate", "--store", store, "--teacher", TEACHER, "--worker-index", "3", "--num-workers", "2"),
        "invalid configuration: annotate: worker_index 3 must be < num_workers 2 (from --worker-index and "
        "--num-workers)",
    )


def test_top_k_larger_than_the_vocabulary(store, tokenizer_vocab):
    before = snapshot(store)
    assert_refused(
        opd("annotate", "--store", store, "--teacher", TEACHER, "--top-k", "1000"),
        f"--top-k 1000 is larger than the vocabulary of teacher {TEACHER} ({len(tokenizer_vocab)} tokens)",
    )
    assert snapshot(store) == before


def test_student_topk_larger_than_the_vocabulary(store, prompts, tokenizer_vocab):
    before = snapshot(store)
    assert_refused(
        opd("rollout", "--store", store, "--prompts", prompts, *ROLLOUT_ONE, "--student-topk", "1000"),
        f"student_topk 1000 is larger than the vocabulary ({len(tokenizer_vocab)} tokens)",
    )
    assert snapshot(store) == before


def test_worker_id_with_a_slash(store, prompts):
    assert_refused(
        opd("rollout", "--store", store, "--prompts", prompts, "--worker-id", "a/../b"),
        "invalid worker id 'a/../b': use 1-32 letters, digits or '_' (it becomes part of shard names)",
    )


# ---------------------------------------------------------------------------------------------- prompt files
def test_empty_prompt(store, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"question": "What is 1 + 2?"}\n{"question": "   "}\n')
    before = snapshot(store)
    assert_refused(
        opd("rollout", "--store", store, "--prompts", prompts, *ROLLOUT_ONE),
        f"prompts file {prompts}: row 1: prompt is empty (no text in column 'question')",
    )
    assert snapshot(store) == before


def test_over_long_prompt(store, tmp_path, tokenizer):
    rows = [{"question": "What is 1 + 2?"}, {"question": "What is " + " + ".join(["12"] * 40) + "?"}]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    texts = tokenizer.apply_chat_template(
        [[{"role": "user", "content": r["question"]}] for r in rows], add_generation_prompt=True, tokenize=False
    )
    lengths = [len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]
    before = snapshot(store)
    assert_refused(
        opd("rollout", "--store", store, "--prompts", prompts, *ROLLOUT_ONE, "--max-prompt-tokens", lengths[0]),
        f"prompts file {prompts}: row 1: prompt has {lengths[1]} tokens, more than "
        f"max_prompt_tokens={lengths[0]} (1 rows are too long; truncate=True / --truncate-prompts skips them)",
    )
    assert snapshot(store) == before


def test_prompt_file_that_is_not_utf8(store, tmp_path):
    data = '{"question": "What is 1 + 2?"}\n{"question": "Combien font 2 + 2, café?"}\n'.encode("latin-1")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_bytes(data)
    bad_byte = data.index("é".encode("latin-1"))
    assert_refused(
        opd("rollout", "--store", store, "--prompts", prompts, *ROLLOUT_ONE),
        f"prompts file {prompts}: line 2 is not valid UTF-8 (byte {bad_byte})",
    )


def test_prompt_file_without_a_prompt_column(store, tmp_path):
    prompts = tmp_path / "prompts.parquet"
    pq.write_table(pa.table({"text": ["What is 1 + 2?"], "answer": ["3"]}), prompts)
    before = snapshot(store)
    assert_refused(
        opd("rollout", "--store", store, "--prompts", prompts, *ROLLOUT_ONE),
        f"prompts file {prompts}: missing column 'prompt' (verl chat messages) or 'question' (plain "
        f"text); found columns: text, answer",
    )
    assert snapshot(store) == before


def test_truncated_prompt_parquet(store, tmp_path):
    prompts = tmp_path / "prompts.parquet"
    prompts.write_bytes(TRAIN_PROMPTS.read_bytes()[:500])
    assert_refused_like(
        opd("rollout", "--store", store, "--prompts", prompts, *ROLLOUT_ONE),
        re.escape(f"prompts file {prompts}: not a readable parquet file (") + r"[^\n]+\)",
    )


def test_missing_prompt_file(store, tmp_path):
    assert_refused(
        opd("rollout", "--store", store, "--prompts", tmp_path / "nope.parquet", *ROLLOUT_ONE),
        f"prompts file {tmp_path / 'nope.parquet'} does not exist",
    )


# ---------------------------------------------------------------------------------------------- shards
def _quarantined(store: Path, before: dict, after: dict, rel: str) -> None:
    """`rel` moved, byte for byte, to quarantine/ with a reason; nothing else changed but annotate's metrics and
    the store's bells (empty files whose times wake waiting stages: storage/bells.py)."""
    name = rel.replace("/", "__")
    assert f"quarantine/{name}" in after and rel not in after
    assert after[f"quarantine/{name}"] == before[rel]
    rest = {k: v for k, v in after.items() if not k.startswith(("quarantine/", "metrics/", "bells/"))}
    assert rest == {k: v for k, v in before.items() if k != rel and not k.startswith(("metrics/", "bells/"))}


def without_progress(stderr: str) -> str:
    """stderr less annotate's plain progress lines (`annotate teacher: 0 shards, … pending`, printed off a terminal)."""
    return "".join(
        line for line in stderr.splitlines(keepends=True) if not re.match(r"annotate \S+: \d+ shards, ", line)
    )


def test_truncated_rollout_shard_is_quarantined(store):
    rel = "rollouts/v000002/v000002-w05-000000.arrow"  # e.g. copied in by hand, and cut short
    (store / rel).write_bytes((store / f"rollouts/v000002/{PENDING}.arrow").read_bytes()[:1000])
    before = snapshot(store)
    result = opd("annotate", "--store", store, "--teacher", TEACHER)
    assert result.exit_code == 0, result.output
    assert re.fullmatch(
        re.escape(f"quarantined {rel}: {store / rel}: truncated or not an Arrow IPC stream (") + r"[^\n]+\)\n",
        without_progress(result.stderr),
    ), result.stderr
    assert "annotated 0 shards" in result.stdout and "quarantined 1" in result.stdout
    after = snapshot(store)
    _quarantined(store, before, after, rel)
    reason = (store / "quarantine/rollouts__v000002__v000002-w05-000000.arrow.reason.txt").read_text()
    assert reason.startswith(f"{rel}: {store / rel}: truncated or not an Arrow IPC stream")


def test_shard_from_another_run_is_quarantined(store):
    s = Store(store)
    table, meta = read_shard(s, f"rollouts/v000002/{PENDING}.arrow", kind=ROLLOUT)
    meta.run_id, meta.shard_id = "0therrun0000", "v000002-w07-000000"
    rel = f"rollouts/v000002/{meta.shard_id}.arrow"
    write_shard(s, rel, table, meta)
    before = snapshot(store)
    result = opd("annotate", "--store", store, "--teacher", TEACHER)
    assert result.exit_code == 0, result.output
    run_id = json.loads((store / "run.json").read_text())["run_id"]
    assert without_progress(result.stderr) == (
        f"quarantined {rel}: {store / rel}: belongs to run '0therrun0000', this store is run '{run_id}'\n"
    )
    _quarantined(store, before, snapshot(store), rel)


def test_truncated_annotated_part_is_quarantined_and_the_trainer_goes_on(store):
    """Damaged bytes are never trained on: the part is moved to quarantine/ for annotate to score again."""
    rel = f"annotated/v000002/{PENDING}/teacher.arrow"
    truncate(store / rel)
    before = snapshot(store)
    result = opd("train", "--store", store, *TRAIN_MORE)
    assert result.exit_code == 0, (result.output, result.exception)
    assert f"{store / rel}: truncated or not an Arrow IPC stream (" in " ".join(result.stdout.split())
    after = snapshot(store)
    assert after[f"quarantine/{rel.replace('/', '__')}"] == before[rel] and rel not in after
    assert Store(store).read_progress()["step"] == 2  # PENDING was the only data left: it waits for annotate


# ---------------------------------------------------------------------------------------------- models
def test_teacher_with_a_different_vocabulary(store, tmp_path, tokenizer_vocab):
    teacher = tmp_path / "teacher-swapped"
    shutil.copytree(TEACHER, teacher)
    spec = json.loads((teacher / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]  # same size, two ids mean other characters
    (teacher / "tokenizer.json").write_text(json.dumps(spec))
    before = snapshot(store)
    assert_refused(
        opd("annotate", "--store", store, "--teacher", teacher, "--teacher-name", "other"),
        f"teacher {teacher} and student {STUDENT} tokenizers differ: id {tokenizer_vocab['a']} is 'b' in "
        f"{teacher} but 'a' in {STUDENT}",
    )
    assert snapshot(store) == before


def test_teacher_with_only_pickle_weights_leaves_run_json_alone(store, tmp_path):
    teacher = tmp_path / "teacher-bin"
    shutil.copytree(TEACHER, teacher)
    (teacher / "model.safetensors").rename(teacher / "pytorch_model.bin")
    before = snapshot(store)
    assert_refused(
        opd("annotate", "--store", store, "--teacher", teacher, "--teacher-name", "t2"),
        f"model {teacher}: no *.safetensors weights in the folder (pickle checkpoints are not loaded)",
    )
    # the refused teacher is not recorded: the trainer would otherwise wait forever for its parts
    assert snapshot(store) == before


def test_corrupt_policy_checkpoint_is_never_loaded(store, prompts):
    """Rollout refuses a version whose files fail their checksums, quarantines them and samples with the previous."""
    rel = "policy/v000002/model.safetensors"
    truncate(store / rel)
    result = opd("rollout", "--store", store, "--prompts", prompts, *ROLLOUT_ONE)
    assert result.exit_code == 0, (result.output, result.exception)
    assert f"policy version 2 is not loaded: {store / rel} failed its checksum (stored " in " ".join(
        result.stderr.split()
    ), result.stderr
    assert (store / f"quarantine/{rel.replace('/', '__')}").exists() and not (store / rel).exists()
    assert (store / "rollouts/v000001/v000001-w01-000000.arrow").exists()  # sampled by version 1


def test_latest_points_at_a_missing_version(store, prompts):
    (store / "policy/LATEST").write_text("7\n")
    before = snapshot(store)
    message = f"{store}/policy/LATEST points at version 7 but {store}/policy/v000007 is missing or incomplete"
    assert_refused(opd("rollout", "--store", store, "--prompts", prompts, *ROLLOUT_ONE), message)
    assert_refused(opd("train", "--store", store, *TRAIN_MORE), message)
    assert snapshot(store) == before


@pytest.mark.parametrize("damage", ["trainer.json", ".metadata", "__0_0.distcp"])
def test_corrupt_resume_state(store, damage):
    """A damaged newest state is quarantined and the trainer resumes from the previous complete one."""
    state = store / "train/state/step-000002"
    if damage == "trainer.json":
        (state / damage).write_text('{"step": 2, ')
    else:
        truncate(state / damage)
    result = opd("train", "--store", store, *TRAIN_MORE)
    assert result.exit_code == 0, (result.output, result.exception)
    assert re.search(
        re.escape(f"warning: resume state step 2 is damaged ({state / damage} failed its checksum (stored ")
        + r"[0-9a-f]{16}, computed [0-9a-f]{16}, \d+ bytes instead of \d+\)\): "
        + re.escape("quarantined; trying the previous complete state"),
        result.stderr,
    ), result.stderr
    assert (store / f"quarantine/train__state__step-000002__{damage}").exists()
    assert "resuming from" in result.stdout and "(step 1, " in result.stdout
    assert Store(store).read_progress()["step"] == 3  # steps 2 and 3 trained again from step 1's state


# ---------------------------------------------------------------------------------------------- the store itself
def test_store_without_run_json(tmp_path):
    assert_refused(
        opd("annotate", "--store", tmp_path / "empty", "--teacher", TEACHER),
        f"store {tmp_path / 'empty'} does not exist (no such folder): check the path; `opd rollout` creates a new "
        f"store",
    )


def test_unreachable_s3_store(prompts, monkeypatch):
    for key, value in {
        "AWS_ACCESS_KEY_ID": "test",
        "AWS_SECRET_ACCESS_KEY": "test",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
    }.items():
        monkeypatch.setenv(key, value)
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result = opd(
        "rollout",
        "--store",
        "s3://bucket/run",
        "--prompts",
        prompts,
        "--student",
        STUDENT,
        "--set",
        f"store.s3_endpoint=http://127.0.0.1:{port}",
    )
    assert_refused_like(
        result, re.escape("cannot read bucket/run/run.json: ") + r"[^\n]*" + re.escape(f"127.0.0.1:{port}") + r"[^\n]*"
    )


def test_store_path_below_a_regular_file(tmp_path, prompts):
    (tmp_path / "a-file").write_text("not a directory")
    assert_refused_like(
        opd(
            "rollout",
            "--store",
            tmp_path / "a-file" / "store",
            "--prompts",
            prompts,
            "--student",
            STUDENT,
            *ROLLOUT_ONE,
        ),
        re.escape(f"cannot read {tmp_path}/a-file/store/run.json: ") + r"[^\n]*Not a directory",
    )


def _can_mount() -> bool:
    # OPD_TEST_NO_MOUNT=1 runs the fallbacks of machines where mounting is not permitted
    return os.geteuid() == 0 and shutil.which("mount") is not None and not os.environ.get("OPD_TEST_NO_MOUNT")


@contextlib.contextmanager
def small_tmpfs(where: Path, size_mb: int):
    """A tmpfs of `size_mb` at `where` (root only); yields False where mounting is not permitted."""
    where.mkdir(parents=True, exist_ok=True)
    if (
        not _can_mount()
        or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(where)], capture_output=True
        ).returncode
        != 0
    ):
        yield False
        return
    try:
        yield True
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)  # -l: memory maps may still be open


def test_read_only_store(store, tmp_path):
    """A store on a file system mounted read-only: the first write names the file and the reason.

    Root ignores file modes, so the store is put on a tmpfs remounted read-only; where mounting is not
    permitted (CI containers without CAP_SYS_ADMIN), `chattr +i` on every folder, or file modes for non-root.
    """
    with small_tmpfs(tmp_path / "ro", 64) as mounted:
        if mounted:
            root = tmp_path / "ro" / "store"
            shutil.copytree(store, root)
            assert subprocess.run(["mount", "-o", "remount,ro", str(tmp_path / "ro")]).returncode == 0
            reason = "Read-only file system"
        else:
            root, reason = store, _make_folders_unwritable(store)
        before = snapshot(root)
        try:
            assert_refused(
                opd("train", "--store", root, *TRAIN_MORE),
                f"cannot write {root}/train/consumed/step-000003.jsonl: {reason} (store {root})",
            )
            assert snapshot(root) == before
        finally:
            if not mounted:
                _make_folders_unwritable(store, undo=True)


def _make_folders_unwritable(root: Path, undo: bool = False) -> str:
    folders = [root, *[p for p in root.rglob("*") if p.is_dir()]]
    if os.geteuid() != 0:
        for folder in folders:
            folder.chmod(0o755 if undo else 0o555)
        return "Permission denied"
    if (
        shutil.which("chattr") is None
        or subprocess.run(["chattr", "+i" if not undo else "-i", *map(str, folders)], capture_output=True).returncode
        != 0
    ):
        pytest.skip("running as root without permission to mount or to chattr +i: cannot make a folder read-only")
    return "Operation not permitted"


def test_disk_full(store, tmp_path):
    """The disk fills up under the trainer: it stops naming the file, leaves no partial file, and the same command
    finishes the step once there is room again.

    A full disk is a small tmpfs filled to the last byte. Where mounting is not permitted, the write limit of
    the process (RLIMIT_FSIZE, SIGXFSZ ignored) makes the same writes fail, with EFBIG instead of ENOSPC; that
    variant runs the CLI in a subprocess so the limit cannot touch pytest's own files.
    """
    with small_tmpfs(tmp_path / "disk", 16) as mounted:
        if not mounted:
            return _disk_full_by_rlimit(store)
        root = tmp_path / "disk" / "store"
        shutil.copytree(store, root)
        filler = tmp_path / "disk" / "filler"
        with open(filler, "wb", buffering=0) as f, contextlib.suppress(OSError):
            while True:  # unbuffered, so the last partial write fills the last page and the next one fails
                f.write(b"\0" * 65536)
        before = snapshot(root)
        assert_refused(
            opd("train", "--store", root, *TRAIN_MORE),
            f"cannot write {root}/train/consumed/step-000003.jsonl: No space left on device (store {root})",
        )
        assert snapshot(root) == before
        filler.unlink()
        result = opd("train", "--store", root, *TRAIN_MORE)
        assert result.exit_code == 0, result.output
        assert (root / "train/consumed/step-000003.jsonl").exists()


def _disk_full_by_rlimit(store: Path) -> None:
    def limit_writes():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (256, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    before = snapshot(store)
    result = subprocess.run(
        [sys.executable, "-m", "opd_cache.cli", "train", "--store", str(store), *TRAIN_MORE],
        capture_output=True,
        text=True,
        preexec_fn=limit_writes,
        cwd=REPO,
        timeout=300,
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: cannot write {store}/train/consumed/step-000003.jsonl: File too large (store {store})"
    )
    assert "Traceback" not in result.stderr
    assert snapshot(store) == before
