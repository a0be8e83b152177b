"""Every flag `opd` had before its stage flags were generated from the config still works.

TODAY is the command-line surface recorded from the hand-written commands (commit 9fc5bb5): per command,
every flag (aliases included) and, for a flag that sets a config key, the key and a value to give it. Each flag
must appear in the command's --help, and `--print-config` must show the flag's value under the same key.
"""

from __future__ import annotations

import re

import pytest
import yaml
from typer.testing import CliRunner

import opd_cache.cli  # noqa: F401  (registers the commands)
from opd_cache.cli.common import app
from opd_cache.config import Config

# flag -> (config key, arguments after the flag, the key's expected value); None: the flag sets no config key.
# A flag given as "--no-x" is checked on a config file that sets the key to true.
TODAY: dict[str, dict[str, tuple | None]] = {
    "rollout": {
        "--store": ("store.uri", ["s1"], "s1"),
        "--student": ("rollout.student", ["m1"], "m1"),
        "--prompts": ("rollout.prompts", ["p.jsonl"], "p.jsonl"),
        "--n": ("rollout.n", ["3"], 3),
        "--max-new-tokens": ("rollout.sampling.max_new_tokens", ["9"], 9),
        "--temperature": ("rollout.sampling.temperature", ["0.5"], 0.5),
        "--top-p": ("rollout.sampling.top_p", ["0.9"], 0.9),
        "--flush-rows": ("rollout.flush_rows", ["7"], 7),
        "--flush-seconds": ("rollout.flush_seconds", ["2.5"], 2.5),
        "--max-samples": ("rollout.max_samples", ["11"], 11),
        "--max-shards": ("rollout.max_shards", ["5"], 5),
        "--worker-id": ("rollout.worker_id", ["w07"], "w07"),
        "--engine": ("rollout.engine", ["vllm"], "vllm"),
        "--follow": ("rollout.follow", [], True),
        "--no-follow": ("rollout.follow", [], False),
        "--truncate-prompts": ("rollout.truncate_prompts", [], True),
        "--no-truncate-prompts": ("rollout.truncate_prompts", [], False),
        "--max-prompt-tokens": ("rollout.max_prompt_tokens", ["77"], 77),
        "--student-topk": ("rollout.student_topk", ["4"], 4),
        "--seed": ("rollout.seed", ["3"], 3),
        "--set": ("rollout.n", ["rollout.n=6"], 6),
        "--config": None,
    },
    "annotate": {
        "--store": ("store.uri", ["s1"], "s1"),
        "--teacher": ("annotate.teacher", ["t1"], "t1"),
        "--teacher-name": ("annotate.teacher_name", ["t2"], "t2"),
        "--top-k": ("annotate.top_k", ["8"], 8),
        "--dtype": ("annotate.dtype", ["float16"], "float16"),
        "--max-tokens-per-batch": ("annotate.max_tokens_per_batch", ["100"], 100),
        "--max-shards": ("annotate.max_shards", ["2"], 2),
        "--worker-index": ("annotate.worker_index", ["1", "--num-workers", "2"], 1),
        "--num-workers": ("annotate.num_workers", ["3"], 3),
        "--engine": ("annotate.engine", ["vllm"], "vllm"),
        "--follow": ("annotate.follow", [], True),
        "--set": ("annotate.top_k", ["annotate.top_k=5"], 5),
        "--config": None,
    },
    "train": {
        "--store": ("store.uri", ["s1"], "s1"),
        "--student": ("train.student", ["m1"], "m1"),
        "--loss": ("train.loss", ["reverse_kl"], "reverse_kl"),
        "--tail": ("train.tail", ["renorm"], "renorm"),
        "--support": ("train.support", ["union"], "union"),
        "--beta": ("train.beta", ["0.25"], 0.25),
        "--max-steps": ("train.max_steps", ["12"], 12),
        "--max-staleness": ("max_staleness", ["0"], 0),
        "--publish-every": ("train.publish_every", ["3"], 3),
        "--global-batch-samples": ("train.global_batch_samples", ["16"], 16),
        "--global-batch-tokens": ("train.global_batch_tokens", ["1000"], 1000),
        "--micro-batch-tokens": ("train.micro_batch_tokens", ["512"], 512),
        "--lr": ("train.lr", ["0.001"], 0.001),
        "--follow": ("train.follow", [], True),
        "--no-follow": ("train.follow", [], False),
        "--set": ("train.lr", ["train.lr=3e-4"], 3e-4),
        "--config": None,
    },
    "run": {
        "--store": ("store.uri", ["s1"], "s1"),
        "--sync": ("run.sync", [], True),
        "--logs": None,
        "--quiet": None,
        "--set": ("train.lr", ["train.lr=3e-4"], 3e-4),
        "--config": None,
    },
    "eval": {
        "--prompts": ("eval.prompts", ["p.jsonl"], "p.jsonl"),
        "--teacher": ("eval.teacher", ["t1"], "t1"),
        "--n": ("eval.n", ["3"], 3),  # n > 1 implies --sample
        "--greedy": ("eval.greedy", [], True),
        "--sample": ("eval.greedy", [], False),
        "--max-prompts": ("eval.max_prompts", ["5"], 5),
        "--max-new-tokens": ("eval.max_new_tokens", ["8"], 8),
        "--set": ("eval.n", ["eval.n=2"], 2),
        "--model": None,
        "--device": None,
        "--json": None,
        "--follow": None,
        "--every": None,
        "--config": None,
    },
    "replay": {
        "--store": ("store.uri", ["s1"], "s1"),
        "--student": ("train.student", ["m1"], "m1"),
        "--loss": ("train.loss", ["jsd"], "jsd"),
        "--max-steps": ("train.max_steps", ["12"], 12),
        "--global-batch-samples": ("train.global_batch_samples", ["16"], 16),
        "--lr": ("train.lr", ["0.001"], 0.001),
        "--publish-every": ("train.publish_every", ["3"], 3),
        "--set": ("train.lr", ["train.lr=3e-4"], 3e-4),
        **dict.fromkeys(
            ["--from", "--epochs", "--seed", "--shuffle", "--no-shuffle", "--min-version", "--max-version"], None
        ),
        **dict.fromkeys(["--teacher", "--data-source", "--config"], None),
    },
    "demo": dict.fromkeys(["--out", "--seed", "--quiet", "--overwrite", "--set"]),
    "check-engines": dict.fromkeys(
        ["--model", "--dtype", "--prompts", "--num-prompts", "--max-new-tokens", "--top-k", "--device"]
        + ["--tolerance", "--seed"]
    ),
    "export": dict.fromkeys(["--to", "--format", "--overwrite", "--tokenizer", "--no-text", "--teacher"]),
    "inspect": dict.fromkeys(["--sample", "--tokenizer", "--teacher", "--json"]),
    "migrate": dict.fromkeys(["--dry-run"]),  # --store: still accepted, hidden (STORE names the store)
    "report": dict.fromkeys(["--out"]),
    "verify": dict.fromkeys(["--json"]),
}
# what a command needs besides the flag under test
REQUIRED = {"eval": ["--model", "m0"], "replay": ["--from", "src", "--store", "dst"]}


def opd(*args: str):
    result = CliRunner().invoke(app, list(args), env={"COLUMNS": "300"})  # wide: no flag name is wrapped
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result


def test_every_command_of_today_is_listed():
    out = opd("--help")
    assert out.exit_code == 0
    for command in TODAY:
        assert re.search(rf"^  {command} ", out.stdout, re.MULTILINE), command


@pytest.mark.parametrize("command", TODAY)
def test_every_flag_of_today_is_in_the_help(command):
    out = opd(command, "--help")
    assert out.exit_code == 0, out.output
    missing = [flag for flag in TODAY[command] if not re.search(rf"(?<![\w-]){flag}(?![\w-])", out.stdout)]
    assert not missing, f"opd {command} --help does not list {missing}"


def lookup(config: dict, key: str):
    for part in key.split("."):
        config = config[part]
    return config


CASES = [(command, flag, *case) for command, flags in TODAY.items() for flag, case in flags.items() if case]


@pytest.mark.parametrize("command, flag, key, args, expected", CASES, ids=[f"{c[0]} {c[1]}" for c in CASES])
def test_flag_sets_the_same_config_key_as_today(command, flag, key, args, expected, tmp_path):
    extra = []
    if flag.startswith("--no-") or flag == "--sample" or flag == "--greedy":
        config = tmp_path / "c.yaml"
        section, _, name = key.rpartition(".")
        config.write_text(yaml.safe_dump({section: {name: flag == "--sample" or flag.startswith("--no-")}}))
        extra = ["--config", str(config)]
    out = opd(command, *REQUIRED.get(command, []), *extra, flag, *args, "--print-config")
    assert out.exit_code == 0, out.output
    printed = yaml.safe_load(out.stdout)
    Config.model_validate(printed)  # the printed config is a complete, valid config file
    assert lookup(printed, key) == expected


# the sections each command reads, so every key of them is one of its flags
SECTIONS = {
    "rollout": ("rollout", ["store", "rollout"]),
    "annotate": ("annotate", ["store", "annotate"]),
    "train": ("train", ["store", "train"]),
    "replay": ("train", ["store", "train"]),
    "eval": ("eval", ["eval"]),
    "run": ("run", ["store", "rollout", "annotate", "train", "eval", "run"]),
}
# the top-level keys each command reads (flags without a section: --max-staleness)
TOP_LEVEL = dict.fromkeys(["rollout", "annotate", "train", "run"], ["max_staleness"])


@pytest.mark.parametrize("command", SECTIONS)
def test_every_config_key_is_a_flag_with_its_description_as_help(command):
    from opd_cache.cli.config_flags import config_keys, flag_name

    own, sections = SECTIONS[command]
    out = opd(command, "--help")
    help_text = " ".join(out.stdout.replace("│", " ").split())
    top_level = [(key, Config.model_fields[key]) for key in TOP_LEVEL.get(command, [])]
    for section in [None, *sections]:
        keys = top_level if section is None else config_keys(Config.model_fields[section].annotation, section)
        for key, field in keys:
            if command == "replay" and key == "train.seed":
                continue  # replay's own --seed orders its shards
            flag = flag_name(key, own)
            assert re.search(rf"(?<![\w-]){flag}(?![\w-])", out.stdout), f"opd {command}: no {flag} for {key}"
            if field.description:
                first_words = " ".join(field.description.split()[:4])
                assert first_words in help_text, f"opd {command} {flag}: help does not start {first_words!r}"


def test_generated_flags_parse_like_the_config(tmp_path):
    printed = yaml.safe_load(
        opd(
            "run",
            "--train-betas",
            "[0.8, 0.95]",
            "--rollout-sampling-stop",
            '["</s>", "\\n\\n"]',
            "--teachers",
            "{t1: /models/t1}",
            "--train-report-to",
            "wandb,tensorboard",
            "--no-evaluate",
            "--annotate-top-k",
            "7",
            "--print-config",
        ).stdout
    )
    assert printed["train"]["betas"] == [0.8, 0.95]
    assert printed["rollout"]["sampling"]["stop"] == ["</s>", "\n\n"]
    assert printed["run"]["teachers"] == {"t1": "/models/t1"}
    assert printed["train"]["report_to"] == ["wandb", "tensorboard"]
    assert printed["run"]["evaluate"] is False
    assert printed["annotate"]["top_k"] == 7
    # layering: defaults < --config < flags < --set
    config = tmp_path / "c.yaml"
    config.write_text("train:\n  lr: 0.1\n  max_steps: 9\n")
    printed = yaml.safe_load(
        opd("train", "--config", str(config), "--lr", "0.2", "--set", "train.lr=0.3", "--print-config").stdout
    )
    assert (printed["train"]["lr"], printed["train"]["max_steps"]) == (0.3, 9)
    printed = yaml.safe_load(opd("train", "--config", str(config), "--lr", "0.2", "--print-config").stdout)
    assert printed["train"]["lr"] == 0.2


def test_a_bad_flag_value_is_one_line_naming_the_key():
    out = opd("train", "--tail", "tails", "--print-config")
    assert out.exit_code == 2
    assert "config key 'train.tail' = 'tails' (from --tail): Input should be 'bucket', 'renorm' or 'none'" in out.stderr
    out = opd("rollout", "--n", "many")
    assert out.exit_code == 2 and "Invalid value for '--n': Input should be a valid integer" in out.output


def test_a_new_config_key_becomes_a_flag_and_a_clash_is_refused_at_import():
    """What adding a key does: a section with one more field gives the command one more flag, with its help."""
    import typer
    from pydantic import Field

    import opd_cache.cli.config_flags as config_flags_module
    from opd_cache.config import Section

    class Toy(Section):
        warmup_ratio: float = Field(0.1, ge=0, description="fraction of max_steps spent warming up")
        flag_off: bool = Field(True, description="a switch")

    class ToyConfig(Section):
        toy: Toy = Toy()

    received = {}
    toy = typer.Typer()
    original = config_flags_module.Config
    config_flags_module.Config = ToyConfig
    try:

        @toy.command()
        @config_flags_module.config_flags("toy", sections=("toy",), own_section="toy")
        def toy_command(verbose: bool = typer.Option(False, "--verbose"), *, args) -> None:
            received.update(args.flags, verbose=verbose)

        with pytest.raises(TypeError, match=r"opd toy: --warmup-ratio would set both toy.warmup_ratio and ratio"):
            config_flags_module.config_flags("toy", sections=("toy",), own_section="toy")(
                lambda ratio=typer.Option(0, "--warmup-ratio"), *, args: None
            )
    finally:
        config_flags_module.Config = original
    runner = CliRunner()
    out = runner.invoke(toy, ["--help"], env={"COLUMNS": "300"})
    assert "--warmup-ratio" in out.stdout and "fraction of max_steps spent warming up (default 0.1)" in out.stdout
    assert runner.invoke(toy, ["--warmup-ratio", "0.25", "--no-flag-off"]).exit_code == 0
    assert received == {"toy.warmup_ratio": 0.25, "toy.flag_off": False, "verbose": False}
    received.clear()
    runner.invoke(toy, ["--verbose"])
    assert received == {"verbose": True}  # a flag not given is not in args.flags: the config file's value stays
