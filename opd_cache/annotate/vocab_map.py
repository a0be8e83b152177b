"""What each token of a tokenizer spells, and the vocabulary map between a student's and a teacher's tokenizers.

Cross-tokenizer annotate (docs/cross-tokenizer.md) needs two facts about tokens:

* the bytes each id spells (`TokenBytes`), to cut the student's sampled tokens and the teacher's tokens at the
  same text offsets. A token's string is not its text: byte-level BPE writes bytes as printable characters
  (GPT-2's table: a space is `Ġ`, a newline `Ċ`), SentencePiece writes a space as `▁` and an unknown byte
  as `<0x0A>`. The table follows the tokenizer's own decoder (read from its tokenizer.json), step by step;
  a decoder it cannot follow is refused by name rather than guessed.
* which teacher id and which student id spell the same bytes (`VocabularyMap`), so the teacher's top-k can be
  written in student ids. Special tokens spell no text; they correspond by role (eos to eos, bos to bos,
  pad to pad) or by identical content (`<|im_end|>` in both).

The map is built once per (student, teacher) pair; its fingerprint (both tokenizers' fingerprints and the
map's contents) goes into the teacher's record in the run manifest, so every reader can tell which map a part
was written with.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from dataclasses import dataclass

import numpy as np
from transformers import PreTrainedTokenizerBase

from opd_cache.tokenizer import tokenizer_fingerprint

# Bumped when the rules below change what the map holds (the fingerprint covers it).
VOCAB_MAP_VERSION = 1
# SentencePiece's byte-fallback tokens: one byte each.
BYTE_FALLBACK_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
# Special tokens that correspond by their role even when their text differs ('<eos>' and '<|endoftext|>').
SPECIAL_ROLES = ("eos_token", "bos_token", "pad_token")
# Decoders that only concatenate, rewrite or strip a token's own text: a token's bytes are well defined.
_SUPPORTED_DECODERS = ("ByteLevel", "ByteFallback", "Fuse", "Metaspace", "Replace", "Strip")


def tokenizer_name(tokenizer: PreTrainedTokenizerBase) -> str:
    return getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__


def require_fast(tokenizer: PreTrainedTokenizerBase, name: str | None = None):
    """The tokenizer's Rust backend (offset mappings, its decoder's definition), or a one-line error naming it."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not getattr(tokenizer, "is_fast", False):
        raise ValueError(
            f"tokenizer {name or tokenizer_name(tokenizer)} ({type(tokenizer).__name__}) has no offset mapping "
            "support: cross-tokenizer alignment needs a fast tokenizer (a folder with tokenizer.json)"
        )
    return backend


@functools.cache
def byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level table, inverted: the printable character that stands for each byte -> the byte.

    Printable Latin-1 bytes stand for themselves; the other 68 (controls, space, soft hyphen...) are shifted to
    U+0100 and up, in byte order (so a space is 'Ġ' U+0120 and a newline 'Ċ' U+010A).
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(b): b for b in printable}
    shifted = (b for b in range(256) if b not in set(printable))
    table.update({chr(256 + n): b for n, b in enumerate(shifted)})
    return table


@dataclass(frozen=True)
class TokenBytes:
    """What every id of one tokenizer spells.

    `spelled[i]` is the bytes token i stands for in running text (None for special tokens, which spell no
    text, and for ids the tokenizer does not define). `decode_strip` is how many leading spaces the tokenizer's
    `decode` drops at the start of a call (SentencePiece decoders drop the space of a first `▁word`), and
    `phantom_prefix` what its encoder prepends to a text that does not start with a space (SentencePiece's
    prefix space, byte-level BPE's add_prefix_space): both are needed to check a round trip exactly.
    """

    name: str
    spelled: tuple[bytes | None, ...]
    special_ids: frozenset[int]
    byte_fallback_ids: frozenset[int]
    decode_strip: int
    phantom_prefix: bytes

    def __len__(self) -> int:
        return len(self.spelled)

    def spell(self, ids) -> list[bytes | None]:
        spelled = self.spelled
        return [spelled[i] if 0 <= i < len(spelled) else None for i in map(int, ids)]


def _decoder_steps(decoder: dict | None) -> list[dict]:
    if decoder is None:
        return []
    if decoder.get("type") == "Sequence":
        return [step for inner in decoder.get("decoders", []) for step in _decoder_steps(inner)]
    return [decoder]


@dataclass
class _DecoderPlan:
    """A decoder, reduced to what a single token's bytes depend on."""

    replacements: list[tuple[str, str]]  # (string, replacement), applied in order
    byte_fallback: bool
    byte_level: bool
    decode_strip: int


def _decoder_plan(backend, name: str) -> _DecoderPlan:
    spec = json.loads(backend.to_str())
    decoder = spec.get("decoder")
    if decoder is None:
        raise ValueError(
            f"tokenizer {name} has no decoder: its decode joins tokens with spaces, so what a token spells in "
            "running text is not defined; cross-tokenizer alignment needs a decoder"
        )
    plan = _DecoderPlan(replacements=[], byte_fallback=False, byte_level=False, decode_strip=0)
    fused = False
    for step in _decoder_steps(decoder):
        kind = step.get("type")
        if kind not in _SUPPORTED_DECODERS:
            raise ValueError(
                f"tokenizer {name}: decoder {kind!r} is not supported by cross-tokenizer alignment (it cannot "
                f"say what one token spells); supported: {', '.join(_SUPPORTED_DECODERS)}"
            )
        if kind == "Replace":
            pattern = step.get("pattern", {})
            if "String" not in pattern:
                raise ValueError(f"tokenizer {name}: a Replace decoder with a regex pattern is not supported")
            plan.replacements.append((pattern["String"], step.get("content", "")))
        elif kind == "Metaspace":
            plan.replacements.append((step.get("replacement", "▁"), " "))
            prepends = step.get("prepend_scheme", "always" if step.get("add_prefix_space", True) else "never")
            plan.decode_strip = max(plan.decode_strip, 1 if prepends != "never" else 0)
        elif kind == "ByteFallback":
            plan.byte_fallback = True
        elif kind == "ByteLevel":
            plan.byte_level = True
        elif kind == "Fuse":
            fused = True
        elif kind == "Strip":
            # After Fuse it strips the start of the whole decoded text; before, every token: not supported.
            if not fused or step.get("content") != " " or step.get("stop", 0):
                raise ValueError(f"tokenizer {name}: a Strip decoder other than Llama's leading-space strip")
            plan.decode_strip = max(plan.decode_strip, int(step.get("start", 0)))
    return plan


def _spell_token(token: str, plan: _DecoderPlan) -> bytes:
    """The bytes one token string stands for, following the decoder's per-token steps."""
    if plan.byte_fallback and (match := BYTE_FALLBACK_TOKEN.fullmatch(token)):
        return bytes([int(match.group(1), 16)])
    if plan.byte_level:
        alphabet = byte_level_alphabet()
        if all(c in alphabet for c in token):
            return bytes(alphabet[c] for c in token)
        return token.encode("utf-8")  # an added token written as plain text (the Rust decoder does the same)
    for old, new in plan.replacements:
        token = token.replace(old, new)
    return token.encode("utf-8")


def _special_ids(tokenizer: PreTrainedTokenizerBase, backend) -> frozenset[int]:
    ids = set(tokenizer.all_special_ids)
    ids.update(i for i, added in backend.get_added_tokens_decoder().items() if added.special)
    return frozenset(ids)


def _phantom_prefix(backend, spelled: tuple[bytes | None, ...]) -> bytes:
    """What the encoder prepends to a text without a leading space, found by encoding a probe."""
    for probe in ("a", "x", "0", "."):
        ids = backend.encode(probe, add_special_tokens=False).ids
        pieces = [spelled[i] if i < len(spelled) else None for i in ids]
        if not ids or any(p is None for p in pieces):
            continue
        text = b"".join(pieces)
        if text.endswith(probe.encode()):
            return text[: len(text) - len(probe)]
    return b""


def token_bytes(tokenizer: PreTrainedTokenizerBase, name: str | None = None) -> TokenBytes:
    """The `TokenBytes` of a fast tokenizer (raises a one-line ValueError for one it cannot follow)."""
    name = name or tokenizer_name(tokenizer)
    backend = require_fast(tokenizer, name)
    plan = _decoder_plan(backend, name)
    special = _special_ids(tokenizer, backend)
    size = len(tokenizer)
    spelled: list[bytes | None] = [None] * size
    byte_fallback = set()
    for i in range(size):
        token = backend.id_to_token(i)
        if token is None or i in special:
            continue
        spelled[i] = _spell_token(token, plan)
        if plan.byte_fallback and BYTE_FALLBACK_TOKEN.fullmatch(token):
            byte_fallback.add(i)
    spelled_tuple = tuple(spelled)
    return TokenBytes(
        name=name,
        spelled=spelled_tuple,
        special_ids=special,
        byte_fallback_ids=frozenset(byte_fallback),
        decode_strip=plan.decode_strip,
        phantom_prefix=_phantom_prefix(backend, spelled_tuple),
    )


@dataclass(frozen=True)
class VocabularyMap:
    """Teacher ids -> student ids that spell the same bytes (or are the same special token).

    `teacher_to_student[t]` is the student id of teacher id t, or -1 when the student has no token spelling
    the same bytes. Several teacher ids may map to one student id (a byte-fallback `<0x41>` and `A`); the
    target builder adds their probabilities. `special` maps the student's special ids to the teacher's.
    """

    teacher_to_student: np.ndarray  # [teacher vocabulary] int32, -1 = unmapped
    special: dict[int, int]  # student special id -> teacher special id
    student_fingerprint: str
    teacher_fingerprint: str
    fingerprint: str

    @property
    def num_mapped(self) -> int:
        return int((self.teacher_to_student >= 0).sum())

    def record(self) -> dict:
        """The fields of the teacher's record in the run manifest.

        `tokenizer_fingerprint` stays the student's, as for every teacher: it names the vocabulary of the stored
        targets (student ids), which is what `ManifestFiles.check_teacher` compares with run.json. The teacher's
        own tokenizer and the map are recorded beside it.
        """
        return {
            "tokenizer_fingerprint": self.student_fingerprint,
            "teacher_tokenizer_fingerprint": self.teacher_fingerprint,
            "vocab_map_fingerprint": self.fingerprint,
            "vocab_map_size": self.num_mapped,
        }


def _special_pairs(student, teacher, student_bytes: TokenBytes, teacher_bytes: TokenBytes) -> dict[int, int]:
    """Student special id -> teacher special id: by role first, then by identical content."""
    pairs: dict[int, int] = {}
    for role in SPECIAL_ROLES:
        s_id, t_id = getattr(student, f"{role}_id", None), getattr(teacher, f"{role}_id", None)
        if s_id is not None and t_id is not None and s_id not in pairs:
            pairs[int(s_id)] = int(t_id)
    teacher_by_content = {teacher.convert_ids_to_tokens(i): i for i in sorted(teacher_bytes.special_ids)}
    unk = {student.unk_token_id}
    for s_id in sorted(student_bytes.special_ids - set(pairs) - unk):
        t_id = teacher_by_content.get(student.convert_ids_to_tokens(s_id))
        if t_id is not None and t_id != teacher.unk_token_id:
            pairs[s_id] = t_id
    return pairs


def build_vocabulary_map(
    student: PreTrainedTokenizerBase,
    teacher: PreTrainedTokenizerBase,
    student_bytes: TokenBytes | None = None,
    teacher_bytes: TokenBytes | None = None,
) -> VocabularyMap:
    """The map between two fast tokenizers (pass their `TokenBytes` when already built)."""
    student_bytes = student_bytes or token_bytes(student)
    teacher_bytes = teacher_bytes or token_bytes(teacher)
    # One student id per spelling: a regular token before a byte-fallback token, then the lowest id.
    student_of: dict[bytes, int] = {}
    for s_id in sorted(range(len(student_bytes)), key=lambda i: (i in student_bytes.byte_fallback_ids, i)):
        spelled = student_bytes.spelled[s_id]
        if spelled:  # None (special) and b"" (spells nothing) map to nothing
            student_of.setdefault(spelled, s_id)
    teacher_to_student = np.full(len(teacher_bytes), -1, dtype=np.int32)
    for t_id, spelled in enumerate(teacher_bytes.spelled):
        if spelled:
            teacher_to_student[t_id] = student_of.get(spelled, -1)
    special = _special_pairs(student, teacher, student_bytes, teacher_bytes)
    for s_id, t_id in special.items():
        if 0 <= t_id < len(teacher_to_student):
            teacher_to_student[t_id] = s_id
    student_fp, teacher_fp = tokenizer_fingerprint(student), tokenizer_fingerprint(teacher)
    digest = hashlib.sha256()
    header = {"version": VOCAB_MAP_VERSION, "student": student_fp, "teacher": teacher_fp, "special": special}
    digest.update(json.dumps(header, sort_keys=True).encode())
    digest.update(teacher_to_student.astype("<i4").tobytes())
    return VocabularyMap(
        teacher_to_student=teacher_to_student,
        special=special,
        student_fingerprint=student_fp,
        teacher_fingerprint=teacher_fp,
        fingerprint=digest.hexdigest()[:16],
    )
