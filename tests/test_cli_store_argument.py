"""The store named one way: the first argument of every command that takes one (issue #26), as `opd inspect`,
`verify` and `export` always took it; `--store` still works (hidden where it is not a config flag) without a
warning, and the worker counts of `opd scale` are named as `opd run` names them (`--rollout-workers`)."""

from __future__ import annotations

import re

import pytest
from typer.testing import CliRunner

import opd_cache.cli  # noqa: F401  (registers the commands)
from opd_cache.cli.common import app

STORE_COMMANDS = ["verify", "inspect", "export", "report", "migrate", "scale", "train", "replay", "run"]


def opd(*args: str):
    return CliRunner().invoke(app, list(args), env={"COLUMNS": "300"})


def test_every_command_with_a_store_takes_it_first():
    for name in STORE_COMMANDS + ["rollout", "annotate", "ingest"]:
        usage = opd(name, "--help").stdout.splitlines()[0]
        assert re.fullmatch(rf"Usage: opd {name} \[OPTIONS\] \[?(STORE|SHARD)\b.*", usage), usage


@pytest.mark.parametrize(
    "args",
    [
        ["report", "{nope}"],
        ["migrate", "{nope}"],
        ["scale", "{nope}", "--annotate-workers", "2"],
        ["train", "{nope}", "--set", "train.student=x"],
    ],
    ids=lambda a: a[0],
)
def test_store_first_or_store_flag_say_the_same(tmp_path, args):
    nope = str(tmp_path / "nope")
    positional = opd(*[a.format(nope=nope) for a in args])
    flag = opd(args[0], "--store", nope, *args[2:])
    assert positional.exit_code == flag.exit_code == 2, positional.output
    assert positional.stderr == flag.stderr  # one message however the store is named, and no warning
    assert positional.stderr.strip().splitlines() == [
        f"error: store {nope} does not exist (no such folder): check the path; `opd rollout` creates a new store"
    ]


def test_two_different_stores_are_refused(tmp_path):
    for command, *more in (["report"], ["train", "--print-config"]):
        out = opd(command, "a", "--store", "b", *more)
        assert out.exit_code == 2 and out.stderr.strip() == (
            "error: STORE a and --store b name two stores: give one of them"
        ), (command, out.output)


def test_the_store_argument_sets_store_uri_in_stage_commands(tmp_path):
    out = opd("replay", str(tmp_path / "dst"), "--from", "src", "--print-config")
    assert out.exit_code == 0 and f"uri: {tmp_path / 'dst'}" in out.stdout
    out = opd("replay", "--from", "src")
    assert out.exit_code == 2 and out.stderr.strip() == (
        "error: opd replay needs its own store: opd replay STORE --from SOURCE (or --store STORE)"
    )
    out = opd("report")
    assert out.exit_code == 2 and out.stderr.strip() == "error: opd report needs a store: opd report STORE"


def test_scale_names_worker_counts_as_opd_run(local_store):
    local_store.manifest.ensure(student="student", tokenizer_fingerprint="fp-test")
    out = opd("scale", local_store.uri, "--rollout-workers", "3", "--annotate-workers", "2")
    assert out.exit_code == 0, out.output
    assert local_store.read_json("launch/scale.json") == {"rollout": 3, "annotate": 2}
    out = opd("scale", "--store", local_store.uri, "--annotate", "4")  # the older names, for scripts
    assert out.exit_code == 0 and local_store.read_json("launch/scale.json") == {"rollout": 3, "annotate": 4}
    help_text = opd("scale", "--help").stdout
    assert "--rollout-workers" in help_text and not re.search(r"--rollout\b(?!-)", help_text)
    out = opd("scale", local_store.uri)
    assert out.exit_code == 2 and out.stderr.strip() == (
        "error: opd scale: give --rollout-workers N and/or --annotate-workers N"
    )


def test_ingest_takes_the_store_then_its_files(tmp_path):
    missing = str(tmp_path / "rows.jsonl")
    first = opd("ingest", str(tmp_path / "store"), missing)
    old = opd("ingest", missing, "--store", str(tmp_path / "store"))  # before: FILE... --store S
    assert first.exit_code == old.exit_code == 2
    assert first.stderr == old.stderr == f"error: {missing}: no such file\n"
    out = opd("ingest", str(tmp_path / "store"))
    assert out.exit_code == 2 and out.stderr.strip() == (
        "error: opd ingest needs a store and at least one file: opd ingest STORE FILE..."
    )
