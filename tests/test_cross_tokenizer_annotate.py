"""`opd annotate` with a teacher of another tokenizer: opt-in, the teacher's record, a contradicting worker, and
the targets of a real part (issue #27; docs/cross-tokenizer.md)."""

from __future__ import annotations

import numpy as np
import pytest

from opd_cache.annotate import Annotator
from opd_cache.annotate.cross_tokenizer import render_prompt
from opd_cache.config import load_config
from opd_cache.storage import layout
from opd_cache.storage.manifest import StoreError
from opd_cache.storage.schema import ANNOTATED, TARGET_FLAGS, flat_values, read_shard, rollout_table
from opd_cache.target_flags import EXCLUDED, GROUP_END, TOPK_VALID
from opd_cache.testing import write_rollout_shard
from opd_cache.tokenizer import load_tokenizer, tokenizer_fingerprint
from tests.conftest import REPO

STUDENT = REPO / "data/models/student_bpe"
TEACHER = REPO / "data/models/teacher"


@pytest.fixture
def bpe_store(local_store):
    """A store whose run is the BPE student's, with one rollout shard of its texts (one row it cannot spell)."""
    tok = load_tokenizer(STUDENT)
    run = local_store.manifest.ensure(
        student=str(STUDENT), tokenizer_fingerprint=tokenizer_fingerprint(tok), vocab_size=len(tok)
    )
    prompt = render_prompt(tok, [{"role": "user", "content": "What is 66 + 80?"}])
    texts = [" #### 146", " ans= 146", " ans= 147"]
    responses = [tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for t in texts]
    responses.append([tok.convert_tokens_to_ids("Ã")])  # half a UTF-8 character: the teacher cannot spell it
    n = len(responses)
    table = rollout_table(
        sample_ids=[f"s{i}" for i in range(n)],
        prompt_index=np.zeros(n),
        sample_index=np.arange(n),
        prompt_ids=[prompt] * n,
        response_ids=responses,
        behavior_logprobs=[np.full(len(r), -0.5) for r in responses],
        policy_version=0,
        finish_reason=["stop"] * n,
    )
    write_rollout_shard(local_store, run.model_dump(), "v000000-w00-000000", table)
    return local_store, responses


def annotate_config(store, **annotate):
    return load_config(
        overrides={"store.uri": store.uri, "annotate.teacher": str(TEACHER), "annotate.top_k": 4, **annotate}
    )


def test_a_teacher_of_another_tokenizer_is_refused_without_the_flag(bpe_store):
    store, _ = bpe_store
    with pytest.raises(ValueError, match="tokenizers differ"):
        Annotator(annotate_config(store), store, progress=False)
    assert not store.manifest.teachers()


def test_cross_tokenizer_annotation_writes_student_targets_and_records_the_map(bpe_store):
    store, responses = bpe_store
    annotator = Annotator(
        annotate_config(store, **{"annotate.cross_tokenizer": True, "annotate.codec": "packed"}), store, progress=False
    )
    stats = annotator.run()
    assert stats.annotated == ["v000000-w00-000000"]
    (record,) = store.manifest.teachers()
    student, teacher = load_tokenizer(STUDENT), load_tokenizer(TEACHER)
    assert (record.tokenizer_fingerprint, record.vocab_size) == (tokenizer_fingerprint(student), len(student))
    assert record.teacher_tokenizer_fingerprint == tokenizer_fingerprint(teacher)
    assert record.vocab_map_fingerprint == annotator.cross.aligner.vocab_map.fingerprint
    assert record.cross_tokenizer_topk == "one_to_one"

    part, meta = read_shard(store, layout.annotated_path("v000000-w00-000000", "teacher"), kind=ANNOTATED)
    assert meta.codec == "packed"
    flags = flat_values(part[TARGET_FLAGS])
    lengths = [len(r) for r in responses]
    rows = np.split(flags, np.cumsum(lengths)[:-1])
    assert (rows[3] == EXCLUDED).all() and not (np.concatenate(rows[:3]) & EXCLUDED).any()
    # " #### 146<eos>": groups Ġ | #### | Ġ | 1 | 4 | 6 | <eos>: every position ends a group; all but '####'
    # (four teacher characters) are one to one
    np.testing.assert_array_equal(rows[0] & GROUP_END, [GROUP_END] * 7)
    np.testing.assert_array_equal(rows[0] & TOPK_VALID, [TOPK_VALID, 0] + [TOPK_VALID] * 5)
    assert flat_values(part["teacher_topk_ids"]).max() < len(student)
    # a group's log-prob at its end: the '####' group is what the teacher writes, 'ans' is not
    token_lp = np.split(flat_values(part["teacher_token_logprob"]), np.cumsum(lengths)[:-1])
    assert token_lp[0][1] > -1.0 > token_lp[1][1]

    # a second worker of this teacher with another top-k rule would write other targets: refused
    with pytest.raises(StoreError, match="cross_tokenizer_topk"):
        Annotator(
            annotate_config(
                store, **{"annotate.cross_tokenizer": True, "annotate.cross_tokenizer_topk": "group_start"}
            ),
            store,
            progress=False,
        )
