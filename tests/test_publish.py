"""Background publishing (opd_cache/train/publish.py): weights copied, step goes on, errors surface, dtype, retention."""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from typer.testing import CliRunner

from opd_cache.cli import app
from opd_cache.losses import LossConfig
from opd_cache.models import build_tiny_model, load_causal_lm
from opd_cache.storage import layout
from opd_cache.storage.store import Store, StoreError
from opd_cache.train import run_train
from opd_cache.train.checkpoint import complete_states, verify_ledger
from opd_cache.train.objective import DistillationObjective
from opd_cache.train.publish import PolicyPublisher
from tests.test_trainer import config, make_store, metrics


@pytest.fixture
def student_path(tiny_model_factory):
    return tiny_model_factory("student", seed=0)


@pytest.fixture(scope="module")
def teacher(tokenizer):
    return build_tiny_model(vocab_size=len(tokenizer), seed=1, tie_word_embeddings=False)


def objective_of(model) -> DistillationObjective:
    return DistillationObjective(model, LossConfig(divergence="forward_kl", tail="bucket"))


def weights_of(store: Store, version: int) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in load_causal_lm(store.local_path(layout.policy_dir(version))).state_dict().items()}


def test_published_weights_are_those_of_submit_time_while_training_goes_on(local_store, tokenizer, monkeypatch):
    model = build_tiny_model(vocab_size=len(tokenizer), seed=3)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    publisher = PolicyPublisher(local_store, model, tokenizer)
    entered, go_on = threading.Event(), threading.Event()
    real_publish = PolicyPublisher._publish

    def late_writer(self, *args, **kwargs):  # the writer thread starts only once training went on
        entered.set()
        assert go_on.wait(30)
        return real_publish(self, *args, **kwargs)

    monkeypatch.setattr(PolicyPublisher, "_publish", late_writer)
    publisher.submit(1, objective_of(model))  # returns with the write still to come
    assert entered.wait(30)
    assert local_store.latest_version() == 0  # not visible while it is being written
    with torch.no_grad():  # the next optimizer steps change the parameters in place
        for p in model.parameters():
            p.add_(1.0)
    go_on.set()
    publisher.wait()
    assert local_store.latest_version() == 1
    published = weights_of(local_store, 1)
    assert published.keys() == expected.keys()
    for name in expected:
        assert torch.equal(published[name], expected[name]), name
    publisher.close()


def test_one_publication_in_flight_the_next_waits_for_it(local_store, tokenizer, monkeypatch):
    model = build_tiny_model(vocab_size=len(tokenizer), seed=3)
    publisher = PolicyPublisher(local_store, model, tokenizer)
    order, gate = [], threading.Event()
    real_publish = Store.publish_policy

    def recorded(self, version, *args, **kwargs):
        order.append(("start", version))
        if version == 1:
            assert gate.wait(30)
        real_publish(self, version, *args, **kwargs)
        order.append(("end", version))

    monkeypatch.setattr(Store, "publish_policy", recorded)
    publisher.submit(1, objective_of(model))
    second = threading.Thread(target=publisher.submit, args=(2, objective_of(model)))
    second.start()
    second.join(0.5)
    assert second.is_alive()  # submit(2) waits for version 1
    gate.set()
    second.join(30)
    publisher.close()
    assert order == [("start", 1), ("end", 1), ("start", 2), ("end", 2)]
    assert local_store.policy_versions() == [1, 2] and local_store.latest_version() == 2


def test_an_error_of_the_writer_is_raised_in_the_trainer_thread(local_store, tokenizer, monkeypatch):
    model = build_tiny_model(vocab_size=len(tokenizer), seed=3)
    publisher = PolicyPublisher(local_store, model, tokenizer)

    def disk_full(self, version, *args, **kwargs):
        raise StoreError(f"cannot write {self.path(layout.policy_dir(version))}: No space left on device")

    monkeypatch.setattr(Store, "publish_policy", disk_full)
    publisher.submit(1, objective_of(model))
    with pytest.raises(StoreError, match=r"policy/v000001: No space left on device"):
        publisher.wait()
    publisher.close()
    assert local_store.latest_version() == 0
    assert list(local_store.local_path("policy").iterdir()) == []  # its draft folder removed


def test_a_local_store_gets_the_weights_written_once_in_place_and_moved_in(local_store, tokenizer, monkeypatch):
    """The version folder is the draft the writer filled (the same file, not a copy of it)."""
    model = build_tiny_model(vocab_size=len(tokenizer), seed=3)
    publisher = PolicyPublisher(local_store, model, tokenizer)
    drafts = {}
    real_publish = Store.publish_policy

    def note_the_draft(self, version, local_dir, **kwargs):
        drafts[version] = (Path(local_dir), (Path(local_dir) / "model.safetensors").stat().st_ino, kwargs["draft"])
        return real_publish(self, version, local_dir, **kwargs)

    monkeypatch.setattr(Store, "publish_policy", note_the_draft)
    publisher.submit(1, objective_of(model))
    publisher.close()
    folder, inode, draft = drafts[1]
    assert draft and folder.parent == local_store.local_path("policy") and not folder.exists()
    assert (local_store.local_path("policy/v000001") / "model.safetensors").stat().st_ino == inode
    assert local_store.verify_folder("policy/v000001") == [] and local_store.latest_version() == 1
    assert sorted(p.name for p in local_store.local_path("policy").iterdir()) == ["LATEST", "v000001"]


def test_publish_dtype_bfloat16_is_written_and_recorded(local_store, tokenizer):
    model = build_tiny_model(vocab_size=len(tokenizer), seed=3)
    publisher = PolicyPublisher(local_store, model, tokenizer, dtype="bfloat16")
    publisher.submit(1, objective_of(model))
    publisher.close()
    folder = local_store.local_path("policy/v000001")
    assert json.loads((folder / "config.json").read_text())["dtype"] == "bfloat16"
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(name).dtype for name in f.keys()} == {torch.bfloat16}
    loaded = load_causal_lm(folder).state_dict()
    for name, value in model.state_dict().items():
        torch.testing.assert_close(loaded[name].float(), value.to(torch.bfloat16).float(), rtol=0, atol=0)
    assert local_store.verify_folder("policy/v000001") == []


def test_trainer_publishes_in_the_background_keeps_k_versions_and_n_states(tmp_path, student_path, tokenizer, teacher):
    store = make_store(tmp_path / "store", student_path, tokenizer, teacher, shards=6, rows=8)
    result = run_train(
        config(
            store, max_steps=6, publish_every=1, save_every=1, keep_versions=2, keep_states=2, publish_dtype="bfloat16"
        ),
        store,
    )
    assert result.step == 6 and result.policy_version == 6
    assert store.policy_versions() == [5, 6] and store.list_dirs("policy") == ["v000005", "v000006"]
    assert complete_states(store) == [5, 6] and store.list_dirs("train/state") == ["step-000005", "step-000006"]
    assert [r["policy_version"] for r in metrics(store)] == [1, 2, 3, 4, 5, 6]
    verdict = verify_ledger(store)
    assert verdict["trained"] == 48 and not verdict["duplicates"]
    out = CliRunner().invoke(app, ["inspect", str(store.root)])
    assert out.exit_code == 0, out.output
    assert re.search(r"published: 5.6 \(bfloat16\)", " ".join(out.output.split())), out.output


def test_a_failed_background_publication_stops_the_trainer_before_its_state_and_the_rerun_publishes_it(
    tmp_path, student_path, tokenizer, teacher, monkeypatch
):
    store = make_store(tmp_path / "store", student_path, tokenizer, teacher, shards=4, rows=8)
    reference = make_store(tmp_path / "reference", student_path, tokenizer, teacher, shards=4, rows=8)
    run_train(config(reference, max_steps=4, publish_every=2, save_every=2), reference)
    real_publish = Store.publish_policy

    def fail_version_2(self, version, *args, **kwargs):
        if version == 2:
            raise StoreError(f"cannot write {self.path(layout.policy_dir(version))}: Input/output error")
        return real_publish(self, version, *args, **kwargs)

    monkeypatch.setattr(Store, "publish_policy", fail_version_2)
    with pytest.raises(StoreError, match=r"policy/v000002: Input/output error"):
        run_train(config(store, max_steps=4, publish_every=2, save_every=2), store)
    assert store.latest_version() == 1 and complete_states(store) == [2]  # the state of step 4 was never saved
    monkeypatch.setattr(Store, "publish_policy", real_publish)
    run_train(
        config(store, max_steps=4, publish_every=2, save_every=2), store
    )  # resumes from step 2, publishes version 2
    assert store.policy_versions() == [1, 2] and complete_states(store) == [2, 4]
    assert verify_ledger(store)["trained"] == 32
    for version in (1, 2):
        ours, theirs = weights_of(store, version), weights_of(reference, version)
        for name in theirs:
            torch.testing.assert_close(ours[name], theirs[name], atol=1e-6, rtol=0, msg=name)
