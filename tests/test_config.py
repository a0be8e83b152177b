"""Typed configs: YAML < flags < --set, and one clear message per bad key or value."""

from __future__ import annotations

import pytest
import yaml

from opd_cache.config import ConfigError, load_config, parse_set


def test_layers_yaml_then_flags_then_set(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  lr: 0.001\n  max_steps: 5\nrollout:\n  n: 2\n")
    cfg = load_config(
        path,
        overrides={"train.max_steps": 7, "rollout.n": None},
        sets=["train.lr=3e-4", "rollout.sampling.temperature=0.7"],
    )
    assert cfg.train.lr == 3e-4  # --set beats the file
    assert cfg.train.max_steps == 7  # a flag beats the file
    assert cfg.rollout.n == 2  # a flag not given (None) leaves the file's value
    assert cfg.rollout.sampling.temperature == 0.7
    assert cfg.annotate.top_k == 32  # defaults fill the rest


def test_set_parses_yaml_values():
    assert parse_set("a.b=3") == ("a.b", 3)
    assert parse_set("a.b=true") == ("a.b", True)
    assert parse_set("a.b=[1, 2]") == ("a.b", [1, 2])
    assert parse_set("a.b=hello") == ("a.b", "hello")
    with pytest.raises(ConfigError, match=r"--set 'lr': expected dotted.key=value"):
        parse_set("lr")


def test_unknown_key_names_the_key_and_value(tmp_path):
    with pytest.raises(
        ConfigError, match=r"unknown config key 'train.learning_rate' \(value 0.1, from --set train.learning_rate=0.1\)"
    ):
        load_config(sets=["train.learning_rate=0.1"])
    path = tmp_path / "c.yaml"
    path.write_text("trian:\n  lr: 1\n")
    with pytest.raises(
        ConfigError, match=r"invalid configuration: unknown config key 'trian' \(value .*, from --config .*c.yaml\)"
    ):
        load_config(path)


def test_wrong_types_and_ranges_name_key_value_and_expectation():
    with pytest.raises(
        ConfigError, match=r"config key 'rollout.n' = 'many' \(from --set rollout.n=many\): Input should be a valid"
    ):
        load_config(sets=["rollout.n=many"])
    with pytest.raises(
        ConfigError,
        match=r"config key 'max_staleness' = -1 \(from --set max_staleness=-1\): Input should be",
    ):
        load_config(sets=["max_staleness=-1"])
    with pytest.raises(
        ConfigError,
        match=r"config key 'train.tail' = 'tails' \(from the flag of train.tail\): Input should be 'bucket'",
    ):
        load_config(overrides={"train.tail": "tails"})


def test_conflicting_options_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="global_batch_samples and global_batch_tokens .* give only one of them"):
        load_config(sets=["train.global_batch_samples=8", "train.global_batch_tokens=1024"])
    assert load_config(sets=["train.global_batch_tokens=1024"]).train.global_batch_samples is None
    with pytest.raises(ConfigError, match=r"worker_index 2 must be < num_workers 2"):
        load_config(sets=["annotate.worker_index=2", "annotate.num_workers=2"])
    with pytest.raises(ConfigError, match=r"--config .*nope.yaml: file not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [unclosed\n")
    with pytest.raises(ConfigError, match=r"--config .*bad.yaml: not valid YAML"):
        load_config(bad)


def test_a_dumped_config_loads_again(tmp_path):
    # what `opd run` writes for its stages and `--print-config` prints: global_batch_samples is null there
    cfg = load_config(sets=["train.global_batch_tokens=1024", "rollout.sampling.stop=[x]", "train.betas=[0.8, 0.9]"])
    path = tmp_path / "resolved.yaml"
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    again = load_config(path)
    assert again == cfg
    assert again.train.global_batch_samples is None and again.train.global_batch_tokens == 1024
