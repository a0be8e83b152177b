"""What `opd` says: help readable at 80 columns, `--version`, errors that name their cause, output in a pipe.

Issue #26 ("every command says the right thing"): flag names cut at 80 columns, `--help <bool>`, config errors
blaming the file for a `--set`, "run `opd rollout` first" for a mistyped path, Rich wrapping piped lines.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from typer.testing import CliRunner

import opd_cache
import opd_cache.cli  # noqa: F401  (registers the commands)
from opd_cache.cli.common import app
from tests.conftest import REPO

COMMANDS = sorted(info.name or info.callback.__name__ for info in app.registered_commands)


def opd(*args: str, columns: int = 80):
    return CliRunner().invoke(app, list(args), env={"COLUMNS": str(columns)})


def option_names(command: str) -> list[str]:
    """Every option name of a command as click knows it (--flag, --no-flag, aliases), but the hidden ones (the
    older spellings kept for scripts: `opd report --store`)."""
    import typer.main

    click_command = typer.main.get_command(app).commands[command]
    return [
        name
        for param in click_command.params
        if param.param_type_name == "option" and not param.hidden
        for name in (*param.opts, *param.secondary_opts)
    ]


@pytest.mark.parametrize("command", COMMANDS)
def test_help_at_80_columns_shows_every_flag_name_in_full(command):
    out = opd(command, "--help")
    assert out.exit_code == 0, out.output
    lines = out.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80, [line for line in lines if len(line) > 80]
    assert "…" not in out.stdout.replace("file://…", "").replace("gs://…", "")  # nothing cut short
    names = option_names(command)
    assert names, command
    for name in names:
        assert re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", out.stdout), f"opd {command}: {name} not shown"
    help_line = next(line for line in lines if "--help" in line)
    assert "<bool>" not in help_line and "Show this message and exit." in help_line


def test_generated_flags_are_grouped_by_config_section():
    out = opd("run", "--help")
    titles = [line for line in out.stdout.splitlines() if line and not line.startswith(" ") and line.endswith(":")]
    assert titles[:2] == ["Arguments:", "Options:"], titles  # STORE, then the command's own options
    for section in ("Store", "Rollout", "Annotate", "Train", "Eval", "Run"):
        assert f"{section} config keys:" in titles, (section, titles)
    # a long generated name stands alone on its line, its help on the next
    assert re.search(r"^  --rollout-sampling-max-new-tokens <int>\n {10,}\S", out.stdout, re.MULTILINE)


def test_replay_help_describes_the_command_in_whole_sentences():
    out = opd("replay", "--help")
    assert "Train on the annotated shards of existing stores, which are only read: no\n  rollout, no teacher." in (
        out.stdout
    )
    assert "--from STORE" in out.stdout and "--set KEY=VALUE" in out.stdout


def test_version_prints_the_package_version():
    out = opd("--version")
    assert out.exit_code == 0 and out.stdout == f"opd {opd_cache.__version__}\n"
    console_script = subprocess.run(
        [sys.executable, "-m", "opd_cache.cli", "--version"], capture_output=True, text=True, timeout=120
    )
    assert console_script.stdout == f"opd {opd_cache.__version__}\n"


# ---------------------------------------------------------------- config errors name where the value came from
def test_a_config_error_names_the_set_the_flag_or_the_file(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("train:\n  max_steps: 5\n  lr: fast\n")
    out = opd("train", "--config", str(config), "--set", "train.max_stepz=5", "--print-config", columns=200)
    assert out.exit_code == 2
    assert "unknown config key 'train.max_stepz' (value 5, from --set train.max_stepz=5)" in out.stderr
    assert f"config key 'train.lr' = 'fast' (from --config {config})" in out.stderr  # both problems, each its own
    out = opd("train", "--config", str(config), "--lr", "-1", "--print-config", columns=200)
    assert out.exit_code == 2 and "config key 'train.lr' = -1.0 (from --lr): " in out.stderr  # the flag wins
    out = opd("train", "--config", str(config), "--set", "train.lr=x", "--lr", "1", "--print-config", columns=200)
    assert "config key 'train.lr' = 'x' (from --set train.lr=x)" in out.stderr  # --set wins over the flag


# ---------------------------------------------------------------- store paths
def test_a_store_path_that_does_not_exist_says_so_in_every_command(tmp_path):
    nope = tmp_path / "nope"
    for args in (
        ["verify", str(nope)],
        ["train", "--store", str(nope)],
        ["report", "--store", str(nope)],
        ["export", str(nope), "--to", str(tmp_path / "out")],
    ):
        out = opd(*args, columns=300)
        assert out.exit_code == 2, (args, out.output)
        assert f"store {nope} does not exist (no such folder): check the path" in out.stderr, (args, out.stderr)
    out = opd("replay", "--from", str(nope), "--store", str(tmp_path / "dst"), columns=300)
    assert out.exit_code == 2 and f"--from {nope}: store {nope} does not exist (no such folder)" in out.stderr
    assert not (tmp_path / "dst").exists() and not (tmp_path / "out").exists()


def test_a_folder_that_is_no_store_says_so(tmp_path):
    (tmp_path / "notes").mkdir()
    out = opd("report", "--store", str(tmp_path / "notes"), columns=300)
    assert out.exit_code == 2
    assert f"{tmp_path / 'notes'} holds no run (run.json is missing): not a store" in out.stderr
    out = opd("inspect", str(tmp_path / "notes"), columns=300)
    assert out.exit_code == 2 and "opd inspect takes a store (a folder with run.json) or a shard" in out.stderr


# ---------------------------------------------------------------- output in a pipe
def test_lines_printed_into_a_pipe_are_not_wrapped_at_80_columns():
    long_path = "runs/" + "a-long-folder-name/" * 8 + "plots"
    script = f"from opd_cache.cli.common import console; console.print('plots: {long_path}')"
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.stdout == f"plots: {long_path}\n"  # one line, as a log or `| tee` needs it


def test_export_refuses_a_tokenizer_with_no_text(tmp_path):
    out = opd("export", str(tmp_path), "--to", str(tmp_path / "out"), "--tokenizer", "tok", "--no-text", columns=200)
    assert out.exit_code == 2 and "--tokenizer and --no-text contradict each other" in out.stderr


def test_scale_refuses_a_finished_run(local_store):
    local_store.manifest.ensure(student="student", tokenizer_fingerprint="fp-test")
    local_store.mark_done("max_steps at step 3")
    out = opd("scale", "--store", local_store.uri, "--annotate", "2", columns=300)
    assert out.exit_code == 2 and "is finished" in out.stderr and "nothing changed" in out.stderr
    assert not local_store.exists("launch/scale.json")
