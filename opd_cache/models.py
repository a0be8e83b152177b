"""Building, loading and saving causal language models (transformers, safetensors only).

`build_tiny_model` makes the small Llama / Qwen2 models of the CPU demo and the
tests from a config alone (nothing is downloaded). `load_causal_lm` and
`save_causal_lm` are the only way stages read and write checkpoints, so every
checkpoint in a store is a plain Hugging Face folder: safetensors weights,
config.json and the tokenizer files.
"""

from __future__ import annotations

import contextlib
import os

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedModel, PreTrainedTokenizerBase, Qwen2Config
from transformers.utils import logging as hf_logging

_CONFIGS = {"llama": LlamaConfig, "qwen2": Qwen2Config}


@contextlib.contextmanager
def _quiet_progress_bars():
    # transformers 5 draws a progress bar for every shard read or written; stages have their own display.
    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def build_tiny_model(
    arch: str = "llama",
    vocab_size: int = 128,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    intermediate_size: int = 256,
    tie_word_embeddings: bool = True,
    seed: int = 0,
    max_position_embeddings: int = 512,
    pad_token_id: int | None = None,
    eos_token_id: int | None = None,
    bos_token_id: int | None = None,
) -> PreTrainedModel:
    """A randomly initialised float32 causal LM; the same arguments give the same weights.

    The caller's global RNG state is left untouched.
    """
    if arch not in _CONFIGS:
        raise ValueError(f"arch {arch!r} is not supported: use one of {sorted(_CONFIGS)}")
    config = _CONFIGS[arch](
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        intermediate_size=intermediate_size,
        tie_word_embeddings=tie_word_embeddings,
        max_position_embeddings=max_position_embeddings,
        pad_token_id=pad_token_id,
        eos_token_id=eos_token_id,
        bos_token_id=bos_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    return model.eval()


def looks_local(path: str) -> bool:
    """Whether a model given as `path` is meant as a folder on this machine rather than a hub repo id.

    A hub id is `name` or `org/name`. A path is local when it is absolute, starts with `./`, `../` or `~`,
    has more than one `/` (no repo id does), or when its parent folder exists (`runs/demo/policy/v9`).
    """
    if "://" in path:
        return False  # a URI: the stage that reads it says what is wrong
    if os.path.isabs(path) or path.startswith(("./", "../", "~")) or path in (".", "..") or path.count("/") > 1:
        return True
    parent = os.path.dirname(path)
    return bool(parent) and os.path.isdir(parent)


def check_model_path(path: str | os.PathLike | None, flag: str) -> None:
    """One clear error for a local model folder that is not there, before anything loads.

    Without it a missing folder reaches the hub client, which answers with its repo-id naming rule.
    A hub id (`Qwen/Qwen3-0.6B`) passes: downloading it is the loader's business.
    """
    if path is None:
        return
    path = os.fspath(path)
    if not looks_local(path):
        return
    if not os.path.exists(path):  # `~` is not expanded: the loaders do not expand it either
        raise ValueError(f"{flag}: model folder {path} does not exist")
    if not os.path.isdir(path):
        raise ValueError(f"{flag}: model folder {path} is a file, not a folder")


def load_causal_lm(
    path: str | os.PathLike,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str = "sdpa",
    trust_remote_code: bool = False,
) -> PreTrainedModel:
    """Load a causal LM from a folder (or hub id) holding safetensors weights, in eval mode.

    Pickle checkpoints (`pytorch_model.bin`) are refused: loading one can run
    arbitrary code, and every checkpoint this package writes is safetensors.
    """
    path = os.fspath(path)
    if os.path.isdir(path) and not any(name.endswith(".safetensors") for name in os.listdir(path)):
        raise ValueError(f"model {path}: no *.safetensors weights in the folder (pickle checkpoints are not loaded)")
    from safetensors import SafetensorError

    try:
        with _quiet_progress_bars():
            model = AutoModelForCausalLM.from_pretrained(
                path,
                dtype=dtype,
                attn_implementation=attn_implementation,
                trust_remote_code=trust_remote_code,
                use_safetensors=True,
            )
    except (SafetensorError, OSError) as e:  # truncated/corrupt weights, unreadable or missing files
        raise ValueError(f"model {path}: cannot be loaded ({' '.join(str(e).split())})") from None
    except ValueError as e:
        if "trust_remote_code" in str(e) and not trust_remote_code:
            # config.json names custom code (auto_map) for a model type transformers does not know
            raise ValueError(
                f"model {path}: its config.json needs custom Python code from the model folder, which "
                f"runs only with trust_remote_code (e.g. --set annotate.trust_remote_code=true); "
                f"enable it only for a model you trust"
            ) from None
        raise
    return model.eval()


def save_causal_lm(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None, out_dir: str | os.PathLike
) -> None:
    """Write a loadable checkpoint folder: safetensors weights, config.json, tokenizer files.

    This writes into `out_dir` in place; publishing it atomically (write
    elsewhere, then rename) is the store's job.
    """
    out_dir = os.fspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    with _quiet_progress_bars():
        model.save_pretrained(out_dir)
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)
