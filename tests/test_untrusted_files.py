"""Loading shards, checkpoints and configs runs no code from them (docs/reliability.md, "Untrusted files").

Each attack file here does something observable when it is executed or unpickled (it creates a marker
file); every test first shows that the payload works when loaded the unsafe way, then that the package's
loader refuses it, with a message, and the marker never appears.
"""

from __future__ import annotations

import contextlib
import json
import pickle
import re
import shutil
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

import opd_cache.cli  # noqa: F401  (registers every command on `app`)
from opd_cache.cli.common import app
from opd_cache.observe.metrics import MetricsLog
from opd_cache.storage import layout
from opd_cache.storage.schema import ShardError, read_shard
from opd_cache.storage.store import Store, StoreError, make_shard_id
from tests.conftest import write_random_rollout_shard
from tests.faults import reseal_folder, reseal_shard

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "opd_cache"
TEACHER = REPO / "data" / "models" / "teacher"
STUDENT = REPO / "data" / "models" / "student"

runner = CliRunner()


class OpenFile:
    """Unpickling this object calls `open(path, "w")`: any pickle load that runs code creates `path`."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.fixture
def marker(tmp_path) -> Path:
    return tmp_path / "CODE-WAS-RUN"


def _payload_works(data: bytes, marker: Path) -> None:
    """Control: the attack file does run code when it is unpickled the unsafe way."""
    pickle.loads(data)
    assert marker.exists()
    marker.unlink()


# ---------------------------------------------------------------------------------------------- model weights
def test_pickle_weights_are_refused(tmp_path, marker):
    folder = tmp_path / "model"
    shutil.copytree(TEACHER, folder)
    (folder / "model.safetensors").unlink()
    data = pickle.dumps(OpenFile(marker))
    _payload_works(data, marker)
    (folder / "pytorch_model.bin").write_bytes(data)
    from opd_cache.models import load_causal_lm

    with pytest.raises(
        ValueError,
        match=re.escape(f"model {folder}: no *.safetensors weights in the folder (pickle checkpoints are not loaded)"),
    ):
        load_causal_lm(folder)
    assert not marker.exists()


def test_safetensors_win_over_pickle_weights_beside_them(tmp_path, marker):
    folder = tmp_path / "model"
    shutil.copytree(TEACHER, folder)
    (folder / "pytorch_model.bin").write_bytes(pickle.dumps(OpenFile(marker)))
    from safetensors.torch import load_file

    from opd_cache.models import load_causal_lm

    model = load_causal_lm(folder)
    assert not marker.exists()
    expected = load_file(folder / "model.safetensors")
    state = model.state_dict()
    assert all(torch.equal(state[name], tensor) for name, tensor in expected.items())


def _custom_code_model(folder: Path, marker: Path, model_type: str) -> Path:
    """A model folder whose config.json and tokenizer_config.json point (auto_map) at code in the folder."""
    shutil.copytree(TEACHER, folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(
        model_type=model_type,
        auto_map={"AutoConfig": "custom.CustomConfig", "AutoModelForCausalLM": "custom.CustomModel"},
    )
    (folder / "config.json").write_text(json.dumps(config))
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    tokenizer_config["auto_map"] = {"AutoTokenizer": ["custom.CustomTokenizer", None]}
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    (folder / "custom.py").write_text(
        f"open({str(marker)!r}, 'w').close()\n"
        "from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast\n"
        f"class CustomConfig(LlamaConfig):\n    model_type = {model_type!r}\n"
        "class CustomModel(LlamaForCausalLM):\n    config_class = CustomConfig\n"
        "class CustomTokenizer(PreTrainedTokenizerFast):\n    pass\n"
    )
    return folder


def test_custom_code_module_is_a_working_payload(tmp_path, marker):
    folder = _custom_code_model(tmp_path / "model", marker, "llama")
    sys.path.insert(0, str(folder))
    try:
        import custom  # noqa: F401

        assert marker.exists()
    finally:
        sys.path.remove(str(folder))
        sys.modules.pop("custom", None)


def test_auto_map_of_a_known_architecture_is_ignored(tmp_path, marker):
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

    from opd_cache.models import load_causal_lm
    from opd_cache.tokenizer import load_tokenizer

    folder = _custom_code_model(tmp_path / "model", marker, "llama")
    model = load_causal_lm(folder)
    tokenizer = load_tokenizer(folder)
    assert type(model) is LlamaForCausalLM and isinstance(tokenizer, PreTrainedTokenizerFast)
    assert type(tokenizer).__module__.startswith("transformers.")
    assert not marker.exists()


def test_auto_map_of_an_unknown_architecture_is_refused_without_trust_remote_code(tmp_path, marker):
    folder = _custom_code_model(tmp_path / "teacher", marker, "customlm")
    store = Store(tmp_path / "store")
    from opd_cache.tokenizer import load_tokenizer, tokenizer_fingerprint

    tokenizer = load_tokenizer(STUDENT)
    store.manifest.ensure(
        student=str(STUDENT), tokenizer_fingerprint=tokenizer_fingerprint(tokenizer), vocab_size=len(tokenizer)
    )
    run_json = (tmp_path / "store/run.json").read_bytes()
    result = runner.invoke(app, ["annotate", "--store", str(tmp_path / "store"), "--teacher", str(folder)])
    assert result.exit_code == 2, result.output
    assert result.stderr == (
        f"error: model {folder}: its config.json needs custom Python code from the model folder, "
        f"which runs only with trust_remote_code (e.g. --set annotate.trust_remote_code=true); "
        f"enable it only for a model you trust\n"
    )
    assert not marker.exists()
    assert (tmp_path / "store/run.json").read_bytes() == run_json  # the refused teacher is not recorded


def test_trust_remote_code_is_off_unless_the_user_sets_it():
    from opd_cache.config import Config

    config = Config()
    assert (config.rollout.trust_remote_code, config.annotate.trust_remote_code, config.train.trust_remote_code) == (
        False,
        False,
        False,
    )


# ---------------------------------------------------------------------------------------------- vLLM
@pytest.fixture
def fake_vllm(monkeypatch):
    """Records the keyword arguments of vllm.LLM (vLLM itself needs a GPU; its documented kwargs are used)."""
    calls = []

    class LLM:
        def __init__(self, **kwargs):
            calls.append(kwargs)
            self.model_config = types.SimpleNamespace(dtype=kwargs["dtype"])  # the engines check the loaded dtype

    module = types.ModuleType("vllm")
    module.LLM = LLM
    monkeypatch.setitem(sys.modules, "vllm", module)
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # the generator sets it; restored afterwards
    return calls


def test_vllm_engines_load_safetensors_only(fake_vllm):
    from opd_cache.annotate.vllm_score import VLLMScorer
    from opd_cache.rollout.vllm_generate import VLLMGenerator

    VLLMScorer(str(TEACHER), max_top_k=4)
    VLLMGenerator(str(STUDENT))
    assert [(c["load_format"], c["trust_remote_code"]) for c in fake_vllm] == [("safetensors", False)] * 2


# ---------------------------------------------------------------------------------------------- resume states
def _tiny_training_state(store: Store, step: int = 1):
    """A real resume state (DCP) of a small model after one AdamW step, saved by the trainer's `save_state`."""
    from opd_cache.train.checkpoint import save_state

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(5, 4)).sum().backward()
    optimizer.step()
    save_state(store, step, model, optimizer, {"step": step, "note": "test"})
    return model, optimizer


def _fresh():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def assert_state_refused(store: Store, state: Path, marker: Path, why: str) -> None:
    """The safe reader refuses the resume state of step 1 (at `state`) naming `why`, and the payload never ran."""
    from opd_cache.train.checkpoint import load_state

    model, optimizer = _fresh()
    with pytest.raises(
        StoreError, match=re.escape(f"{state}: the resume state cannot be loaded (") + ".*" + re.escape(why)
    ):
        load_state(store, 1, model, optimizer)
    assert not marker.exists()


def test_resume_state_round_trip(tmp_path):
    """Control: the safe reader loads what the trainer saves (weights and optimizer moments)."""
    from opd_cache.train.checkpoint import load_state

    store = Store(tmp_path / "store")
    saved, _ = _tiny_training_state(store)
    model, optimizer = _fresh()
    assert load_state(store, 1, model, optimizer) == {"step": 1, "note": "test"}
    assert all(torch.equal(a, b) for a, b in zip(saved.state_dict().values(), model.state_dict().values()))
    assert len(optimizer.state) == 2 * 2 and optimizer.param_groups[0]["lr"] == 1e-2


def test_resume_state_metadata_with_code_is_refused(tmp_path, marker):
    store = Store(tmp_path / "store")
    _tiny_training_state(store)
    state = tmp_path / "store/train/state/step-000001"
    (state / ".metadata").write_bytes(pickle.dumps(OpenFile(marker)))
    reseal_folder(state)  # whoever can write the store can rewrite its checksums too
    from torch.distributed.checkpoint import FileSystemReader

    FileSystemReader(str(state)).read_metadata()  # control: DCP's own reader runs the payload
    assert marker.exists()
    marker.unlink()
    assert_state_refused(store, state, marker, "refers to io.open, which a resume state never holds")


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_resume_state_entry_with_code_is_refused(tmp_path, marker):
    """DCP saves non-tensor entries (the optimizer's hyper-parameters) with torch.save and, by default, loads
    them with weights_only=False; here the learning rate entry is replaced by a payload."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    store = Store(tmp_path / "store")
    saved, optimizer = _tiny_training_state(store)
    state = tmp_path / "store/train/state/step-000001"
    model_sd, optim_sd = get_state_dict(saved, optimizer)
    optim_sd["param_groups"][0]["lr"] = OpenFile(marker)
    for name in [p.name for p in state.iterdir() if p.name.startswith(("__", ".metadata"))]:
        (state / name).unlink()
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(state))
    reseal_folder(state)  # whoever can write the store can rewrite its checksums too

    # control: DCP's own loader runs the payload
    from torch.distributed.checkpoint.api import CheckpointException

    model, fresh_optimizer = _fresh()
    target_model, target_optim = get_state_dict(model, fresh_optimizer)
    with contextlib.suppress(Exception, CheckpointException):
        dcp.load({"model": target_model, "optim": target_optim}, checkpoint_id=str(state))
    assert marker.exists()
    marker.unlink()

    assert_state_refused(store, state, marker, "entry 'optim.param_groups.0.lr' is not plain data")


# ---------------------------------------------------------------------------------------------- configs
def test_yaml_config_cannot_construct_python_objects(tmp_path, marker):
    config = tmp_path / "config.yaml"
    config.write_text(f"train:\n  lr: !!python/object/apply:builtins.open [{str(marker)!r}, w]\n")
    import yaml

    yaml.unsafe_load(config.read_text())  # control: an unsafe loader runs it
    assert marker.exists()
    marker.unlink()
    result = runner.invoke(app, ["train", "--store", str(tmp_path / "store"), "--config", str(config)])
    assert result.exit_code == 2
    assert result.stderr == (
        f"error: --config {config}: not valid YAML at line 2, column 7: could not determine a "
        f"constructor for the tag 'tag:yaml.org,2002:python/object/apply:builtins.open'\n"
    )
    result = runner.invoke(
        app,
        [
            "train",
            "--store",
            str(tmp_path / "store"),
            "--set",
            f"train.lr=!!python/object/apply:builtins.open [{marker}, w]",
        ],
    )
    assert result.exit_code == 2 and result.stderr.startswith("error: invalid configuration: config key 'train.lr'")
    assert not marker.exists()


def test_prompt_folder_with_a_loading_script_runs_no_code(tmp_path, marker):
    folder = tmp_path / "prompts"
    folder.mkdir()
    (folder / "prompts.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    result = runner.invoke(
        app, ["rollout", "--store", str(tmp_path / "store"), "--student", str(STUDENT), "--prompts", str(folder)]
    )
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert re.fullmatch(r"error: [^\n]*" + re.escape(str(folder)) + r"[^\n]*\n", result.stderr), result.stderr
    assert not marker.exists() and not (tmp_path / "store").exists()


# ---------------------------------------------------------------------------------------------- shards and paths
def test_shard_with_offsets_outside_its_buffers_is_refused(tmp_path):
    """The Arrow IPC reader trusts list offsets; a crafted file would make later kernels read out of bounds."""
    store = Store(tmp_path / "store")
    table = write_random_rollout_shard(store, shard_id="v000000-w00-000000", num_rows=3, prompt_len=7, seed=3)
    offsets = np.concatenate([[0], np.cumsum([len(r) for r in table["response_ids"].to_pylist()])]).astype(np.int32)
    path = tmp_path / "store/rollouts/v000000/v000000-w00-000000.arrow"
    data = path.read_bytes()
    bad = offsets.copy()
    bad[-1] = 50_000_000
    # response_ids and behavior_logprobs share these offsets: both are patched, so their lengths still agree
    assert data.count(offsets.tobytes()) == 2
    path.write_bytes(data.replace(offsets.tobytes(), bad.tobytes()))
    reseal_shard(path)  # whoever can write the store can rewrite its checksums too
    with pytest.raises(
        ShardError,
        match=re.escape(f"{path}: invalid Arrow data (")
        + ".*"
        + re.escape("Length spanned by list offsets (50000000) larger than values array"),
    ):
        read_shard(store, "rollouts/v000000/v000000-w00-000000.arrow")


@pytest.mark.parametrize(
    "call",
    [
        lambda s: layout.annotated_path("v000001-w00-000001", "../../x"),
        lambda s: layout.annotated_path("v000001-w00-000001/../..", "teacher"),
        lambda s: layout.rollout_path("../../etc/passwd"),
        lambda s: make_shard_id(1, "w0/../..", 1),
        lambda s: MetricsLog(s, "rollout", "../../x"),
    ],
)
def test_names_that_would_leave_the_store_are_refused(tmp_path, call):
    with pytest.raises(ValueError, match=r"^invalid (teacher name|shard id|worker id|worker) "):
        call(Store(tmp_path / "store"))
    assert not (tmp_path / "store").exists()


def test_teacher_name_from_a_tampered_run_json_is_refused(tmp_path):
    from opd_cache.train.shard_data import load_shard, required_teachers

    store = Store(tmp_path / "store")
    write_random_rollout_shard(store, shard_id="v000000-w00-000000")
    run = {**store.manifest.require(), "teachers": {"../../../x": "model"}}
    with pytest.raises(ValueError, match=re.escape("invalid teacher name '../../../x'")):
        load_shard(store, run, "v000000-w00-000000", required_teachers(run))


def test_download_refuses_object_keys_that_leave_the_folder(s3_store, s3_endpoint, tmp_path):
    """S3 keys may contain '..' (pyarrow will not write one, boto3 will): a download must not follow it."""
    import boto3

    s3_store.write_bytes("policy/v000001/config.json", b"{}")
    bucket, _, prefix = s3_store.root.partition("/")
    boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1").put_object(
        Bucket=bucket, Key=f"{prefix}/policy/v000001/../../../escaped.txt", Body=b"x"
    )
    target = tmp_path / "a" / "b" / "c" / "download"
    with pytest.raises(StoreError, match=re.escape("refusing to download a file whose name leaves")):
        s3_store.download_dir("policy/v000001", target)
    assert not list(tmp_path.rglob("escaped.txt"))


# ---------------------------------------------------------------------------------------------- the code itself
def _sources() -> dict[str, str]:
    return {str(p.relative_to(REPO)): p.read_text() for p in sorted(PACKAGE.rglob("*.py"))}


def test_no_unsafe_deserialization_in_the_package():
    """A guard for future code: every way of turning bytes into objects that can run code is accounted for."""
    found = []
    for path, text in _sources().items():
        for number, line in enumerate(text.splitlines(), start=1):
            code = line.split("#", 1)[0]
            if re.search(r"torch\.load\(", code) and "weights_only=True" not in code:
                found.append(f"{path}:{number}: torch.load without weights_only=True")
            if re.search(r"\bpickle\.loads?\(|\bUnpickler\(|\bmarshal\.loads?\(|\bdill\b|\bjoblib\.load", code):
                found.append(f"{path}:{number}: pickle-like load")
            if re.search(r"yaml\.(load|unsafe_load|full_load|load_all)\(", code):
                found.append(f"{path}:{number}: YAML load other than safe_load")
            if re.search(r"(?<![.\w])(eval|exec)\(", code):
                found.append(f"{path}:{number}: eval/exec")
            if re.search(r"trust_remote_code\s*=\s*True", code):
                found.append(f"{path}:{number}: trust_remote_code forced on")
    assert found == []


def test_models_are_loaded_in_one_place():
    """`models.load_causal_lm` (safetensors only) is the only caller of from_pretrained for model weights."""
    callers = [
        path
        for path, text in _sources().items()
        if re.search(r"AutoModel\w*\.from_pretrained\(|ForCausalLM\.from_pretrained\(", text)
    ]
    assert callers == ["opd_cache/models.py"]
