"""Is this teacher compatible with the run? Checked before any of its weights load.

Teacher and student must map every id to the same token: the teacher's tokenizer fingerprint must be the run's
(run.json), its vocabulary the run's size, and its embedding at least as large as its tokenizer. When the
fingerprints differ and the student's tokenizer can be loaded here, the message names the first differing token.
"""

from __future__ import annotations

import os

from opd_cache.storage import layout
from opd_cache.storage.store import RunManifest, Store
from opd_cache.tokenizer import check_compatible, load_tokenizer, tokenizer_fingerprint

CROSS_TOKENIZER_HINT = "opd annotate --cross-tokenizer aligns a teacher of another tokenizer: docs/cross-tokenizer.md"


def student_tokenizer(store: Store, run: RunManifest):
    """The run's tokenizer, when it can be loaded here (the student folder, or a published policy)."""
    candidates = []
    if run.student and os.path.isdir(run.student):
        candidates.append(run.student)
    if store.local_dir(layout.POLICY) is not None:  # a local store: published policies, read in place
        candidates += [str(store.local_dir(layout.policy_dir(v))) for v in reversed(store.policy_versions())]
    for path in candidates:
        try:
            return load_tokenizer(path)
        except (OSError, ValueError):
            continue
    return None


def embedding_size_of(model_path: str, trust_remote_code: bool) -> int | None:
    """The teacher's output size from its config.json (no weights are loaded)."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError):
        return None
    return getattr(config.get_text_config(), "vocab_size", None)


def check_teacher_tokenizer(
    store: Store, run: RunManifest, teacher_tok, teacher: str, embedding_size: int | None
) -> None:
    """Teacher and student must map every id to the same token; raise naming both models and the difference."""
    student = run.student or "student"
    expected = run.tokenizer_fingerprint
    got = tokenizer_fingerprint(teacher_tok)
    # the fingerprint hashes the vocabulary and the special tokens: when it matches, loading the student's
    # tokenizer to compare them token by token would only repeat that work
    student_tok = student_tokenizer(store, run) if got != expected else None
    if student_tok is not None:
        # names the first differing token; also refuses tokenizer ids beyond the teacher's embedding
        check_compatible(student_tok, teacher_tok, embedding_size, student_name=student, teacher_name=teacher)
    if expected and got != expected:
        raise ValueError(
            f"teacher {teacher} and student {student} tokenizers differ: the teacher's fingerprint is "
            f"{got}, the run's (run.json) is {expected} ({CROSS_TOKENIZER_HINT})"
        )
    if run.vocab_size is not None and len(teacher_tok) != run.vocab_size:
        raise ValueError(
            f"teacher {teacher}: its tokenizer has {len(teacher_tok)} tokens, the run's has "
            f"{run.vocab_size} (run.json vocab_size)"
        )
    if embedding_size is not None and embedding_size < len(teacher_tok):
        raise ValueError(
            f"teacher {teacher}: the tokenizer has {len(teacher_tok)} tokens but the model's embedding "
            f"has only {embedding_size} rows (ids >= {embedding_size} cannot be scored)"
        )
