"""Where `opd demo` finds its config, prompts and models: a checkout, or the installed package.

In a checkout they are the repository's own files (`examples/arithmetic_cpu/config.yaml`, `data/...`). A
wheel carries copies of the same files in the same layout under `opd_cache/demo_data/`: `setup.py` copies
`DEMO_FILES` there at build time (with `copy_demo_files`). The demo config's relative paths
(`data/models/student`) resolve against whichever root holds them, so one config serves both.

`opd demo --engine vllm` also needs models vLLM's CPU attention accepts: head size 32 or more, and the demo
models have 4 heads of 16. `widen_attention_heads` writes a copy of a model whose heads are zero-padded to a
wider size and computes the same function (the RoPE frequencies are kept by placing each old dimension pair on
the new pair of the same frequency), so the vLLM demo distills the same student from the same teacher.

Standard library only at import time: `setup.py` loads this file by path, before the package is installed.
"""

from __future__ import annotations

import math
import os
import shutil
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]  # the checkout, when this file is in one
PACKAGED = Path(__file__).resolve().parents[1] / "demo_data"  # the copies a wheel carries (opd_cache/demo_data/)
DEMO_CONFIG = "examples/arithmetic_cpu/config.yaml"
# What the demo reads, relative to the root that holds it (the models' README.md comes along with them).
DEMO_MODELS = ("data/models/student", "data/models/teacher")
# the demo's models only: data/models/ also holds the cross-tokenizer example's student_bpe (docs/cross-tokenizer.md)
DEMO_FILES = (
    DEMO_CONFIG,
    "data/arithmetic/train.parquet",
    "data/arithmetic/test.parquet",
    "data/models/README.md",
    *DEMO_MODELS,
)
VLLM_CPU_MIN_HEAD_DIM = 32  # vLLM's CPU attention supports head sizes 32, 64, 80, ...


def demo_root() -> Path:
    """The folder that holds the demo's files: the checkout if this module runs from one, else the package's
    copies; ValueError when neither has the config."""
    for root in (REPO, PACKAGED):
        if (root / DEMO_CONFIG).is_file():
            return root
    raise ValueError(
        f"the demo's files are missing: neither {REPO / DEMO_CONFIG} (a checkout) nor {PACKAGED / DEMO_CONFIG} "
        f"(an installed package) exists; reinstall opd-cache (pip install --force-reinstall opd-cache)"
    )


def is_checkout(root: Path) -> bool:
    return root == REPO


def copy_demo_files(repo: Path, target: Path) -> None:
    """Copy DEMO_FILES from a checkout `repo` into `target` (a package's `demo_data/`), in the same layout."""
    for name in DEMO_FILES:
        source, dest = Path(repo) / name, Path(target) / name
        dest.parent.mkdir(parents=True, exist_ok=True)
        if source.is_dir():
            shutil.copytree(source, dest, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(source, dest)


def head_dim_of(model_path: str | os.PathLike) -> int:
    import json

    config = json.loads((Path(model_path) / "config.json").read_text())
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


def widen_attention_heads(source: str | os.PathLike, target: str | os.PathLike, head_dim: int) -> None:
    """Write to `target` the model at `source` (Llama-style, float32) with every attention head zero-padded
    from its head size d to `head_dim` (a multiple of d), computing the same logits.

    - RoPE rotates dimension i with i + d/2 at frequency theta^(-2i/d). With r = head_dim / d, old dimension i
      goes to r*i and old i + d/2 to r*i + head_dim/2: a pair of the same frequency, theta^(-2ri/head_dim).
    - The other query/key dimensions are zero, so q·k is unchanged; queries are scaled by sqrt(head_dim / d)
      to keep the softmax's 1/sqrt(d). Values take the same positions; the output projection reads them there.
    - The padded weights start at zero and their gradients are zero (each is multiplied by another zero), so
      training leaves them at zero: the widened student learns as the original does, up to that query scale.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from opd_cache.models import load_causal_lm, save_causal_lm
    from opd_cache.tokenizer import load_tokenizer

    model = load_causal_lm(source)
    config = model.config
    old = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if head_dim % old or head_dim < old:
        raise ValueError(f"model {source}: head size {old} cannot be padded to {head_dim} (not a multiple)")
    ratio = head_dim // old
    index = torch.tensor([ratio * i for i in range(old // 2)] + [head_dim // 2 + ratio * i for i in range(old // 2)])

    def pad_rows(weight: torch.Tensor, heads: int, scale: float = 1.0) -> torch.Tensor:
        """[heads*old, ...] -> [heads*head_dim, ...], each head's rows at `index`."""
        wide = weight.new_zeros((heads, head_dim) + weight.shape[1:])
        wide[:, index] = weight.reshape((heads, old) + weight.shape[1:]) * scale
        return wide.reshape((heads * head_dim,) + weight.shape[1:])

    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    state = {}
    for name, tensor in model.state_dict().items():
        if ".self_attn.q_proj." in name:
            tensor = pad_rows(tensor, heads, scale=math.sqrt(ratio))
        elif ".self_attn.k_proj." in name or ".self_attn.v_proj." in name:
            tensor = pad_rows(tensor, kv_heads)
        elif ".self_attn.o_proj.weight" in name:
            tensor = pad_rows(tensor.T, heads).T.contiguous()
        state[name] = tensor
    wide_config = AutoConfig.for_model(**{**config.to_dict(), "head_dim": head_dim})
    wide = AutoModelForCausalLM.from_config(wide_config, dtype=torch.float32, attn_implementation="sdpa")
    wide.load_state_dict(state, strict=True)
    wide.tie_weights()
    save_causal_lm(wide.eval(), load_tokenizer(source), target)


def vllm_demo_models(models: dict[str, str], out: Path) -> dict[str, str]:
    """For each model in `models` (name -> path) whose head size is below vLLM CPU's minimum, a widened copy
    written to `out/name` (a second or so each); the others as they are."""
    result = {}
    for name, path in models.items():
        if head_dim_of(path) >= VLLM_CPU_MIN_HEAD_DIM:
            result[name] = path
        else:
            shutil.rmtree(Path(out) / name, ignore_errors=True)
            widen_attention_heads(path, Path(out) / name, VLLM_CPU_MIN_HEAD_DIM)
            result[name] = str(Path(out) / name)
    return result
