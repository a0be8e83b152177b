"""One staleness rule (opd_cache/flow/staleness.py) and one configuration home for it (the top-level max_staleness)."""

from __future__ import annotations

import pytest
import yaml

from opd_cache.config import DEFAULT_MAX_STALENESS, ConfigError, load_config
from opd_cache.flow.staleness import is_too_stale, staleness_window
from opd_cache.launch.run import sync_overrides, write_resolved_config
from tests.conftest import REPO

DEMO = REPO / "examples/arithmetic_cpu/config.yaml"


def test_the_rule_and_its_window():
    # a row of version v is usable at version V while V - v <= max_staleness
    assert not is_too_stale(3, 5, 2) and is_too_stale(2, 5, 2)
    assert not is_too_stale(5, 5, 0) and is_too_stale(4, 5, 0)
    assert not is_too_stale(0, 10**6, None)  # no bound
    assert not is_too_stale(6, 5, 0)  # newer than the reference (a resumed trainer): never stale
    assert staleness_window(5, 2) == (3, 5) and staleness_window(1, 4) == (0, 1)
    low, high = staleness_window(7, 3)
    assert all(not is_too_stale(v, 7, 3) for v in range(low, high + 1)) and is_too_stale(low - 1, 7, 3)


def test_one_top_level_bound_for_the_three_stages(capsys):
    assert load_config().max_staleness == DEFAULT_MAX_STALENESS
    assert load_config(sets=["max_staleness=5"]).max_staleness == 5
    assert load_config(DEMO).max_staleness == 2
    assert capsys.readouterr().err == ""  # the demo's configuration uses no retired key


@pytest.mark.parametrize("stage", ["rollout", "annotate", "train"])
def test_a_retired_per_stage_key_is_one_line_naming_it_and_its_source(tmp_path, stage):
    expected = (
        f"config key '{stage}.max_staleness' was retired; set the top-level max_staleness instead "
        f"(one bound for rollout, annotate and train)"
    )
    with pytest.raises(ConfigError) as raised:
        load_config(sets=[f"{stage}.max_staleness=1"])
    assert str(raised.value) == f"--set {stage}.max_staleness=1: {expected}"
    path = tmp_path / "old.yaml"
    path.write_text(f"max_staleness: 2\n{stage}:\n  max_staleness: 1\n")
    with pytest.raises(ConfigError) as raised:
        load_config(path)
    assert str(raised.value) == f"--config {path}: {expected}"


def test_the_stage_flag_sets_the_top_level_bound():
    from typer.testing import CliRunner

    import opd_cache.cli  # noqa: F401  (registers the commands)
    from opd_cache.cli.common import app

    for command in ("rollout", "annotate", "train", "run"):
        out = CliRunner().invoke(app, [command, "--max-staleness", "7", "--print-config"])
        assert out.exit_code == 0, out.output
        printed = yaml.safe_load(out.stdout)
        assert printed["max_staleness"] == 7 and all("max_staleness" not in printed[s] for s in ("rollout", "train"))


@pytest.mark.parametrize("sets", [[], ["max_staleness=1"], ["max_staleness=0"]])
def test_the_config_opd_run_hands_its_stages_has_the_same_bound(tmp_path, sets, capsys):
    cfg = load_config(DEMO, sets=sets)
    again = load_config(write_resolved_config(cfg, tmp_path / "config.yaml"))
    assert again.max_staleness == cfg.max_staleness and again == cfg
    assert capsys.readouterr().err == ""


def test_sync_is_staleness_zero():
    assert sync_overrides(load_config(DEMO)).max_staleness == 0
    assert sync_overrides(load_config(DEMO, sets=["max_staleness=3"])).max_staleness == 0
