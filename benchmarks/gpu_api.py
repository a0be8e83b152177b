"""Every opd_cache name the GPU check calls, imported in this one place.

The library is restructured now and then; when a name moves or a signature changes, this is the file to
update, and the check's other modules stay as they are. Imported only by the steps that need the project
(the env and install steps run before its dependencies are installed).
"""

from __future__ import annotations

import importlib

# name -> the module that defines it. Imported on first use, so that a step loads only what it calls (the loss
# step needs neither transformers' models nor the stages; each import of them costs seconds in the dry run).
_NAMES = {
    "HFScorer": "opd_cache.annotate.hf_score",
    "SamplingConfig": "opd_cache.config",
    "load_config": "opd_cache.config",
    "SampleRequest": "opd_cache.engine",
    "LossConfig": "opd_cache.losses",
    "fused_token_losses": "opd_cache.losses",
    "token_losses": "opd_cache.losses",
    "load_causal_lm": "opd_cache.models",
    "save_causal_lm": "opd_cache.models",
    "HFGenerator": "opd_cache.rollout.hf_generate",
    "resolve_attn_implementation": "opd_cache.rollout.hf_generate",
    "right_pad": "opd_cache.rollout.hf_generate",
    "layout": "opd_cache.storage",
    "Store": "opd_cache.storage.store",
    "write_synthetic_store": "opd_cache.testing",
    "load_tokenizer": "opd_cache.tokenizer",
    "tokenizer_fingerprint": "opd_cache.tokenizer",
    "run_train": "opd_cache.train",
    "DistEnv": "opd_cache.train.distributed",
    "PolicyPublisher": "opd_cache.train.publish",
    "Trainer": "opd_cache.train.trainer",
}
__all__ = [*_NAMES, "liger_fused_linear_jsd"]


def __getattr__(name: str):
    if name in _NAMES:
        return getattr(importlib.import_module(_NAMES[name]), name)
    raise AttributeError(f"module 'gpu_api' has no attribute {name!r}")


def check_names() -> list[str]:
    """The names that no longer import from their module (the dry run's imports step reports them)."""
    missing = []
    for name, module in _NAMES.items():
        try:
            getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as e:
            missing.append(f"{module}.{name} ({type(e).__name__})")
    return missing


def liger_fused_linear_jsd(beta: float):
    """Liger-Kernel's fused linear JSD as a callable (student_h, student_w, teacher_h, teacher_w) -> loss, or
    raises ImportError when liger-kernel (or triton) is not installed."""
    try:
        from liger_kernel.transformers.fused_linear_jsd import LigerFusedLinearJSD
    except ImportError:
        raise
    except Exception as e:  # its package __init__ patches transformers models: may break on a new transformers
        raise ImportError(f"liger_kernel.transformers does not import: {type(e).__name__}: {e}") from None
    module = LigerFusedLinearJSD(jsd_beta=beta)
    return lambda sh, sw, th, tw: module(sh, sw, th, tw, None)
