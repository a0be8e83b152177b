"""Write docs/configuration.md from the typed config (opd_cache/config.py): every key, type, default and description.

python scripts/config_reference.py          # rewrite the page
python scripts/config_reference.py --check  # exit 1 if the page is out of date (the test suite runs this)
"""

from __future__ import annotations

import sys
from pathlib import Path

from pydantic import BaseModel

from opd_cache.config import Config

PAGE = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"

HEADER = """# Configuration reference

Generated from `opd_cache/config.py` by `python scripts/config_reference.py`; do not edit by hand.

Every stage reads one YAML file (`--config FILE`) with the sections below, then its own flags, then
`--set section.key=value` overrides (highest priority). Unknown keys and wrong types are refused with a
message naming the key, the value and what was expected. Example: `examples/arithmetic_cpu/config.yaml`.

Every key is also a flag of the commands that read its section, with the meaning below as its help:
a key of the command's own section is spelled without the section, dots and underscores as dashes
(`rollout.flush_rows` is `opd rollout --flush-rows`, `rollout.sampling.top_p` is `--sampling-top-p`), a key
of another section keeps it (`store.s3_endpoint` is `--store-s3-endpoint`, `train.lr` is `opd run --train-lr`),
and a top-level key has no section (`max_staleness` is `--max-staleness` of `opd rollout`, `annotate`, `train`
and `run`). Booleans take `--key/--no-key`; lists, tuples and mappings take a YAML value as `--set` does
(`--betas "[0.9, 0.95]"`). A few short flags are kept as aliases (`--store` for `store.uri`, `--temperature`,
`--top-p`, `--max-new-tokens` for `opd rollout`'s sampling keys, `--sample` for `opd eval --no-greedy`).
`opd <command> --print-config` prints the resolved configuration (defaults, file, flags, `--set`) and exits.
"""


def _type_name(annotation) -> str:
    text = getattr(annotation, "__name__", None) if isinstance(annotation, type) else None
    return text or str(annotation).replace("typing.", "").replace("NoneType", "None")


SYMBOLS = {"ge": "≥", "gt": ">", "le": "≤", "lt": "<"}


def constraint_text(metadata) -> str:
    parts = []
    for item in metadata:
        for attr, symbol in SYMBOLS.items():
            if getattr(item, attr, None) is not None:
                parts.append(f"{symbol} {getattr(item, attr)}")
    return ", ".join(parts)


def section_rows(model: type[BaseModel], prefix: str, *, scalars_only: bool = False) -> list[str]:
    rows = []
    for name, field in model.model_fields.items():
        key = f"{prefix}.{name}" if prefix else name
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            if not scalars_only:
                rows.extend(section_rows(annotation, key))
            continue
        default = field.default
        default_text = "" if default is None else f"`{default!r}`"
        type_text = _type_name(annotation).replace("|", "\\|")
        rows.append(
            f"| `{key}` | `{type_text}` | {default_text} | {constraint_text(field.metadata)} | "
            f"{(field.description or '').replace('|', '/')} |"
        )
    return rows


def render() -> str:
    parts = [HEADER]
    top_level = section_rows(Config, "", scalars_only=True)  # keys outside the sections (max_staleness)
    if top_level:
        parts.append(
            "\n## top level\n\nKeys every stage reads (the per-stage `rollout.max_staleness`, `annotate.max_staleness` "
            "and `train.max_staleness` of earlier releases are refused, naming this one).\n\n"
            "| key | type | default | range | meaning |\n|---|---|---|---|---|"
        )
        parts.append("\n".join(top_level))
    for name, field in Config.model_fields.items():
        model = field.annotation
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            continue
        doc = (model.__doc__ or "").strip().splitlines()[0] if model.__doc__ else ""
        parts.append(f"\n## `{name}`\n\n{doc}\n\n| key | type | default | range | meaning |\n|---|---|---|---|---|")
        parts.append("\n".join(section_rows(model, name)))
    return "\n".join(parts) + "\n"


if __name__ == "__main__":
    text = render()
    if "--check" in sys.argv:
        if not PAGE.exists() or PAGE.read_text() != text:
            print(f"{PAGE} is out of date: run python scripts/config_reference.py")
            sys.exit(1)
        sys.exit(0)
    PAGE.write_text(text)
    print(f"wrote {PAGE}")
