"""Publishing policy versions off the trainer's critical path (issue #14).

`PolicyPublisher.submit(version, objective)` copies the student's weights to
CPU (a clone, in `publish_dtype` when set) and returns; a background thread
writes the HF checkpoint (safetensors, config.json, generation config,
tokenizer files) to a local temporary folder, publishes it with
`Store.publish_policy` (`_CHECKSUMS.json`, then `_COMPLETE`, then LATEST, as
before, so rollout sees a version only once it is complete), then prunes old
versions (opd_cache/storage/retention.py).

At most one publication is in flight: `submit` first waits for the previous
one, so versions appear in order and at most one CPU copy of the weights
exists besides the model. An error of the writer is raised in the trainer's
thread at the next `submit`, `check` or `wait`. The trainer calls `wait` before
it saves a resume state: a state counts the versions up to its own as
published, so they must be complete before it exists (a resumed trainer never
publishes them again otherwise).

Under torchrun (FSDP2) gathering the full state dict is a collective: every
rank takes part in `submit` synchronously, and only rank 0's write runs in the
background.
"""

from __future__ import annotations

import copy
import shutil
import sys
import tempfile
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from opd_cache.storage import layout
from opd_cache.storage.retention import outside_window, prune_policy_versions
from opd_cache.storage.scratch import owned_temp_prefix
from opd_cache.storage.store import Store

PUBLISH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def tied_names(model: torch.nn.Module) -> set[str]:
    """Names of parameters that are the same object as an earlier one (tied weights): saved once."""
    seen, tied = set(), set()
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            tied.add(name)
        seen.add(id(param))
    return tied


class PolicyPublisher:
    def __init__(
        self,
        store: Store,
        model: torch.nn.Module,
        tokenizer,
        *,
        dtype: str | None = None,
        keep_versions: int | None = None,
        rank: int = 0,
        distributed: bool = False,
        background: bool = True,
    ):
        self.store, self.rank, self.distributed = store, rank, distributed
        self.dtype = PUBLISH_DTYPES[dtype] if dtype else None
        self.keep_versions = keep_versions
        self.tied = tied_names(model)
        self.future: Future | None = None
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="opd-publish") if background and rank == 0 else None
        self.template: Path | None = None
        if rank == 0:
            # Everything but the weights is the same for every version: written once, copied per version
            # (the training thread never touches these copies, so the writer needs no lock).
            self.template = Path(tempfile.mkdtemp(prefix=owned_temp_prefix("opd-policy-template-")))
            config = copy.deepcopy(model.config)
            config.dtype = self.dtype or next(model.parameters()).dtype
            config.save_pretrained(self.template)
            if getattr(model, "generation_config", None) is not None and model.can_generate():
                model.generation_config.save_pretrained(self.template)
            tokenizer.save_pretrained(self.template)

    # ------------------------------------------------------------------ the trainer's side
    def submit(self, version: int, objective: torch.nn.Module) -> None:
        """Copy the weights of `objective.model` and publish them as `version` (a collective under torchrun)."""
        self.wait()  # one publication in flight
        state = self._cpu_state(objective)
        if self.rank != 0:
            return
        if self.executor is None:
            self._publish(version, state)
        else:
            self.future = self.executor.submit(self._publish, version, state)

    def check(self) -> None:
        """Raise the writer's error, if the last publication failed."""
        if self.future is not None and self.future.done():
            future, self.future = self.future, None
            future.result()

    def wait(self) -> None:
        """Block until the publication in flight is complete (LATEST written); raise its error."""
        if self.future is not None:
            future, self.future = self.future, None
            future.result()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            if self.executor is not None:
                self.executor.shutdown(wait=True)
            if self.template is not None:
                shutil.rmtree(self.template, ignore_errors=True)

    def _cpu_state(self, objective: torch.nn.Module) -> dict[str, torch.Tensor] | None:
        """The model's weights as CPU tensors the training step cannot change (rank 0; None elsewhere)."""
        if self.distributed:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            full = get_model_state_dict(objective, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            if self.rank != 0:
                return None
            prefix = "model."
            items = ((k[len(prefix) :], v) for k, v in full.items() if k.startswith(prefix))
            copy_needed = False  # the gather made new CPU tensors
        else:
            items = objective.model.state_dict().items()
            copy_needed = True  # the live parameters: the next optimizer step changes them in place
        return {
            name: tensor.detach().to("cpu", dtype=self.dtype or tensor.dtype, copy=copy_needed or _is_view(tensor))
            for name, tensor in items
            if name not in self.tied
        }

    # ------------------------------------------------------------------ the writer's side
    def _publish(self, version: int, state: dict[str, torch.Tensor]) -> None:
        store = self.store
        latest = store.latest_version()
        if latest >= version:  # a resumed trainer re-deriving a version published before the crash
            if not store.is_published(version):
                if self.keep_versions and outside_window(version, latest, self.keep_versions):
                    return  # retention deleted it since, and would delete it again
            else:
                problems = store.verify_folder(layout.policy_dir(version))
                if not problems:
                    return  # published before a crash; the resumed run does not move LATEST back
                # Damaged since (rollout quarantined what failed its checksum): publish these weights again.
                print(f"policy version {version}: {problems[0].reason}; publishing it again", file=sys.stderr)
                store.delete(layout.complete_marker(layout.policy_dir(version)))
        from huggingface_hub import save_torch_state_dict

        # a local store: built in place and renamed into the version (one write of the weights, no copy)
        draft = store.policy_draft(version)
        folder = draft or Path(tempfile.mkdtemp(prefix=owned_temp_prefix("opd-policy-publish-")))
        try:
            shutil.copytree(self.template, folder, dirs_exist_ok=True)
            save_torch_state_dict(state, folder)  # model.safetensors, or shards and their index when large
            del state
            store.publish_policy(version, folder, point_latest=version >= latest, draft=draft is not None)
        finally:
            shutil.rmtree(folder, ignore_errors=True)  # what a failure left (a published draft is gone already)
        if self.keep_versions:
            prune_policy_versions(store, self.keep_versions)


def _is_view(tensor: torch.Tensor) -> bool:
    """A tensor that covers only part of its storage (FSDP2's gathered full tensors can be views of one
    buffer): safetensors refuses to save those, so they are copied."""
    return tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size()
