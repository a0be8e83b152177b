"""`opd run` on a store that already holds a run: never a silent attach (issue #26).

A finished run, or a run of another config, is refused in one line with the three choices; `--resume` continues
it (DONE cleared), `--overwrite` deletes it and its stage logs; an unfinished run of the same config continues;
another store's logs/config.yaml is never overwritten. The refusals come before any stage starts, so these
tests run `opd run` itself in-process and need no model.
"""

from __future__ import annotations

import yaml
from typer.testing import CliRunner

import opd_cache.cli  # noqa: F401  (registers the commands)
from opd_cache.cli.common import app
from opd_cache.config import load_config
from opd_cache.launch.attach import check_store_run, config_differences, record_run_config
from opd_cache.storage.layout import LAUNCH_CONFIG
from opd_cache.storage.store import Store
from tests.conftest import REPO
from tests.helpers import tiny_run_config, write_config

CHOICES = "pass --resume to continue it{}, --overwrite to delete it and start afresh, or another --store"


def opd(*args: str):
    return CliRunner().invoke(app, list(args), env={"COLUMNS": "300"})


def one_line(text: str) -> str:
    lines = text.strip().splitlines()
    assert len(lines) == 1, text
    return lines[0]


def started_run(tmp_path, steps: int = 4, done: bool = True) -> tuple[Store, str]:
    """A store as `opd run` leaves it: run.json, its recorded config, progress at `steps` (and train/DONE)."""
    config = write_config(tmp_path, tiny_run_config(str(tmp_path / "store"), steps=steps, batch=16))
    store = Store(tmp_path / "store")
    store.manifest.ensure(student=str(tmp_path / "student"), tokenizer_fingerprint="fp-test")
    record_run_config(store, load_config(config))
    store.write_progress({"step": steps})
    if done:
        store.mark_done("max_steps")
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "config.yaml").write_text("store:\n  uri: " + str(tmp_path / "store") + "\n")
    (tmp_path / "logs" / "train.log").write_text("step 4/4\n")
    return store, str(config)


def test_a_finished_run_is_refused_with_the_three_choices(tmp_path):
    store, config = started_run(tmp_path)
    before = (tmp_path / "logs" / "config.yaml").read_text()
    out = opd("run", "--config", config, "--train-max-steps", "8", "--logs", str(tmp_path / "logs"))
    assert out.exit_code == 2
    assert one_line(out.stderr) == (
        f"error: store {store.uri} holds a finished run (train/DONE at step 4); "
        + CHOICES.format(" to a higher --train-max-steps than 4")
    )
    assert (tmp_path / "logs" / "config.yaml").read_text() == before  # the other run's logs are untouched
    assert store.is_done()


def test_a_run_of_another_config_is_refused_naming_what_differs(tmp_path):
    store, config = started_run(tmp_path, done=False)
    out = opd("run", "--config", config, "--train-lr", "0.5", "--set", "rollout.n=3", "--logs", str(tmp_path / "logs"))
    assert out.exit_code == 2
    assert one_line(out.stderr) == (
        f"error: store {store.uri} holds a run of another config (rollout.n 4 there, 3 here; "
        f"train.lr 0.001 there, 0.5 here); " + CHOICES.format("")
    )


def test_resume_and_overwrite_decide(tmp_path):
    store, config = started_run(tmp_path)
    cfg = load_config(config, overrides={"train.max_steps": 8})
    continued = check_store_run(store, cfg, resume=True)
    assert (continued.action, continued.message) == (
        "continue",
        f"store {store.uri}: continuing run {store.manifest.read().run_id} from step 4",
    )
    # not past the finished step: nothing to continue
    same = load_config(config)
    message = check_store_run.__name__
    try:
        check_store_run(store, same, resume=True)
    except ValueError as e:
        message = str(e)
    assert message == (
        f"--resume: the run in {store.uri} finished at step 4 and --train-max-steps is 4: give a higher --train-max-steps to continue it"
    )
    assert check_store_run(store, cfg, overwrite=True).action == "overwrite"
    # an unfinished run of the same config (a restart after a crash) continues without a flag
    store.clear_done()
    assert check_store_run(store, same).action == "continue"
    # the step limit, worker counts, the evaluator are how the run goes on, not another run
    cfg.run.rollout_workers, cfg.eval.max_prompts, cfg.train.poll_seconds = 3, 5, 1.0
    assert config_differences(yaml.safe_load(store.read_bytes(LAUNCH_CONFIG)), cfg) == []


def test_resume_and_overwrite_on_the_command_line(tmp_path):
    store, config = started_run(tmp_path)
    out = opd("run", "--config", config, "--resume", "--overwrite")
    assert out.exit_code == 2 and one_line(out.stderr) == (
        "error: --resume and --overwrite contradict each other: --resume continues the store's run"
    )
    empty = Store(tmp_path / "empty")
    out = opd("run", "--config", config, "--store", empty.uri, "--resume", "--logs", str(tmp_path / "l2"))
    assert out.exit_code == 2 and one_line(out.stderr) == (
        f"error: --resume: store {empty.uri} holds no run to continue; leave out --resume to start one"
    )


def test_overwrite_deletes_the_run_and_its_stage_logs_only(tmp_path):
    from opd_cache.launch.attach import overwrite_run

    store, _ = started_run(tmp_path)
    (tmp_path / "logs" / "notes.txt").write_text("mine")
    overwrite_run(store, tmp_path / "logs")
    assert store.manifest.read() is None and not store.is_done() and not store.list_files("", recursive=True)
    assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == ["notes.txt"]


def test_another_stores_logs_are_never_overwritten(tmp_path):
    _, config = started_run(tmp_path)
    other = tmp_path / "other"
    out = opd("run", "--config", config, "--store", str(other), "--logs", str(tmp_path / "logs"))
    assert out.exit_code == 2 and one_line(out.stderr) == (
        f"error: --logs {tmp_path / 'logs'}: its config.yaml is the run in {tmp_path / 'store'}'s, not this "
        f"store's ({other}); choose another --logs"
    )


def test_a_store_no_opd_run_recorded_is_compared_on_its_student(tmp_path):
    store = Store(tmp_path / "store")
    store.manifest.ensure(student=str(tmp_path / "someone-else"), tokenizer_fingerprint="fp-test")
    cfg = load_config(write_config(tmp_path, tiny_run_config(str(tmp_path / "store"), steps=4, batch=16)))
    try:
        check_store_run(store, cfg)
        message = None
    except ValueError as e:
        message = str(e)
    assert message is not None and message.startswith(
        f"store {store.uri} holds a run of another config (rollout.student {str(tmp_path / 'someone-else')!r} there"
    )


def test_the_example_config_has_its_own_store():
    example = yaml.safe_load((REPO / "examples/arithmetic_cpu/config.yaml").read_text())
    assert example["store"]["uri"] == "runs/arithmetic/store"  # not the demo's runs/demo/store


def test_opd_run_says_where_the_store_and_the_logs_are(tmp_path, monkeypatch):
    import opd_cache.launch.run as local_launcher

    started = []
    monkeypatch.setattr(local_launcher, "supervise", lambda cfg, path, logs, quiet: started.append(logs) or 0)
    config = write_config(tmp_path, tiny_run_config(str(tmp_path / "store"), steps=4, batch=16))
    out = opd("run", "--config", str(config))
    assert out.exit_code == 0, out.output
    assert out.stderr == f"opd run: store {tmp_path / 'store'}, logs {tmp_path / 'logs'}\n"
    assert started == [tmp_path / "logs"]
    # what a later `opd run` on this store is compared with
    assert yaml.safe_load(Store(tmp_path / "store").read_bytes(LAUNCH_CONFIG))["train"]["max_steps"] == 4


def test_rays_token_auth_notice_is_hidden_while_the_launcher_starts_its_ray():
    import logging

    from ray._private.authentication import authentication_token_setup as token_setup

    from opd_cache.launch.ray_launcher import RAY_TOKEN_AUTH_LOGGER, quiet_token_auth_notice

    assert token_setup.logger.name == RAY_TOKEN_AUTH_LOGGER  # the logger Ray's notice goes through
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    token_setup.logger.addHandler(handler)
    try:
        with quiet_token_auth_notice():
            token_setup._warn_token_auth_enabled()  # what ray.init says when it starts a one-machine cluster
        assert seen == []
        token_setup._warn_token_auth_enabled()  # elsewhere Ray's logging is as it was
        assert len(seen) == 1 and seen[0].startswith("Token authentication is enabled for this Ray cluster")
    finally:
        token_setup.logger.removeHandler(handler)
