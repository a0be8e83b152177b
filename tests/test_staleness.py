"""One staleness rule (opd_cache/flow/staleness.py) and one configuration home for it (the top-level max_staleness)."""

from __future__ import annotations

import pytest

from opd_cache.config import DEFAULT_MAX_STALENESS, load_config
from opd_cache.flow.staleness import is_too_stale, staleness_window
from opd_cache.launch.run import sync_overrides, write_resolved_config
from tests.conftest import REPO

DEMO = REPO / "examples/arithmetic_cpu/config.yaml"


def bounds(cfg) -> tuple[int, int, int, int]:
    return cfg.max_staleness, cfg.rollout.max_staleness, cfg.annotate.max_staleness, cfg.train.max_staleness


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
    assert bounds(load_config()) == (DEFAULT_MAX_STALENESS,) * 4
    assert bounds(load_config(sets=["max_staleness=5"])) == (5, 5, 5, 5)
    assert bounds(load_config(DEMO)) == (2, 2, 2, 2)
    assert capsys.readouterr().err == ""  # the demo's configuration uses no deprecated key


def test_the_per_stage_keys_still_work_with_a_deprecation_message(capsys):
    cfg = load_config(sets=["train.max_staleness=1", "rollout.max_staleness=0"])
    # each overrides its own stage; annotate follows the trainer's bound as it did when it read it from run.json
    assert bounds(cfg) == (2, 0, 1, 1)
    err = capsys.readouterr().err
    assert (
        "warning: config key 'rollout.max_staleness' is deprecated: set the top-level max_staleness (one bound "
        "for rollout, annotate and train); rollout.max_staleness still overrides it for that stage\n"
    ) in err
    assert "'train.max_staleness' is deprecated" in err and "annotate.max_staleness" not in err
    # next to the top-level key, a stage key overrides only its stage
    assert bounds(load_config(sets=["max_staleness=4", "train.max_staleness=1"])) == (4, 4, 4, 1)
    assert bounds(load_config(sets=["annotate.max_staleness=3"])) == (2, 2, 3, 2)


def test_a_stage_flag_sets_its_stage_without_a_warning(capsys):
    cfg = load_config(overrides={"train.max_staleness": 7})  # `opd train --max-staleness 7`
    assert cfg.train.max_staleness == 7 and capsys.readouterr().err == ""


@pytest.mark.parametrize(
    "sets",
    [[], ["train.max_staleness=1"], ["max_staleness=3", "rollout.max_staleness=0"], ["annotate.max_staleness=5"]],
)
def test_the_config_opd_run_hands_its_stages_gives_each_the_same_bound(tmp_path, sets, capsys):
    cfg = load_config(DEMO, sets=sets)
    again = load_config(write_resolved_config(cfg, tmp_path / "config.yaml"))
    assert bounds(again)[1:] == bounds(cfg)[1:]
    if not sets:
        assert capsys.readouterr().err == ""


def test_sync_is_staleness_zero_everywhere():
    assert bounds(sync_overrides(load_config(DEMO))) == (0, 0, 0, 0)
    assert bounds(sync_overrides(load_config(DEMO, sets=["train.max_staleness=3"]))) == (0, 0, 0, 0)
