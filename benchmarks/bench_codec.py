"""The `packed` annotation codec vs float16/float32 parts: bytes per token, loss error, encode/decode speed.

    python benchmarks/bench_codec.py            # 400 demo prompts x 4 samples, k in {8, 32, 64}
    python benchmarks/bench_codec.py --quick    # a smoke run

Annotations are a *trained* teacher's: the shipped demo teacher (data/models/teacher)
scoring the demo student's own samples (data/models/student, temperature 1, --samples
per prompt) on the held-out data/arithmetic prompts; the distribution is peaked
(median top-1 p > 0.9), which is the hard case for quantized log-probs.

(a) Bytes per response token of one annotated part as stored (Arrow IPC
    stream, every column and the framing, as `write_shard` writes it), for
    float32 / float16 / packed x none / zstd. The demo vocabulary has 99 ids
    (7-bit ids, a 13-byte bitmap); the rows "packed@V" re-pack the same parts
    with random ids drawn within V = 49152 (SmolLM2) and 151936 (Qwen) to show
    the id cost at real vocabularies (random ids barely compress, so this is a
    worst case). Then the packed part's bytes per field (zstd, each alone).

(b) Loss error vs float32: |mean_t loss_packed - mean_t loss_f32| (the
    quantity the trainer's token-mean optimises), its standard error, and the
    mean per-token |difference|, for forward KL (tail bucket), reverse KL, JSD
    and the k3 estimator of the sampled token, with the demo student's logits.

(c) Throughput in tokens/s on the annotations tiled to --tokens positions:
    encode (plain table -> packed table) and decode (packed -> plain columns,
    what `read_shard` adds) of the demo teacher's parts as stored (V = 99) and
    with 18-bit ids (the width of a real vocabulary), next to converting a
    float16 part to the float32 columns the trainer uses, measured in the same
    run. Best of --rounds wall-clock times (3x as many for decoding); the load average is recorded.

Results: tables on stdout and benchmarks/results/bench_codec.json.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from opd_cache.losses import LossConfig, token_losses
from opd_cache.models import load_causal_lm
from opd_cache.storage import codec
from opd_cache.storage.schema import annotated_table, flat_values
from opd_cache.tokenizer import load_tokenizer

RESULTS = ROOT / "benchmarks" / "results" / "bench_codec.json"
K_VALUES = (8, 32, 64)


@torch.inference_mode()
def demo_outputs(num_prompts: int, max_new_tokens: int, seed: int, part_rows: int):
    """(teacher log-probs [T, V], student logits [T, V], the sampled tokens' teacher log-probs [T], the sampled
    tokens [T], response lengths [rows]) on one demo-student sample per prompt, `part_rows` prompts at a time.

    Prompts: the 400 held-out ones (data/arithmetic/test), then training prompts up to num_prompts, every one
    distinct (a prompt sampled twice often repeats its response, which zstd would find and flatter).
    """
    tok = load_tokenizer(str(ROOT / "data/models/student"))
    student = load_causal_lm(ROOT / "data/models/student").eval()
    teacher = load_causal_lm(ROOT / "data/models/teacher").eval()
    prompts = [
        p
        for split in ("test", "train")
        for p in pq.read_table(ROOT / f"data/arithmetic/{split}.parquet")["prompt"].to_pylist()
    ]
    prompts = list({json.dumps(p, sort_keys=True): p for p in prompts}.values())[:num_prompts]
    torch.manual_seed(seed)
    outputs = [
        _demo_sample(tok, student, teacher, prompts[i : i + part_rows], max_new_tokens)
        for i in range(0, len(prompts), part_rows)
    ]
    return (*(torch.cat([o[i] for o in outputs]) for i in range(4)), np.concatenate([o[4] for o in outputs]))


def _demo_sample(tok, student, teacher, prompts: list, max_new_tokens: int):
    texts = tok.apply_chat_template(prompts, add_generation_prompt=True, tokenize=False)
    batch = tok(texts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
    out = student.generate(**batch, do_sample=True, max_new_tokens=max_new_tokens, pad_token_id=tok.pad_token_id)
    prompt_len = batch["input_ids"].shape[1]
    response = out[:, prompt_len:]
    # positions up to and including the first eos are the response; later ones are padding
    eos = (response == tok.eos_token_id).int()
    lengths = torch.where(eos.any(1), eos.argmax(1) + 1, torch.full_like(eos[:, 0], response.shape[1]))
    mask = torch.cat([batch["attention_mask"], torch.ones_like(response)], 1)
    keep = torch.arange(response.shape[1])[None] < lengths[:, None]
    t_lp = torch.log_softmax(teacher(input_ids=out, attention_mask=mask).logits[:, prompt_len - 1 : -1].float(), -1)
    s_logits = student(input_ids=out, attention_mask=mask).logits[:, prompt_len - 1 : -1].float()
    sampled_lp = t_lp.gather(2, response[..., None])[..., 0]
    return t_lp[keep], s_logits[keep], sampled_lp[keep], response[keep], lengths.numpy()


def ipc_bytes(table: pa.Table, compression: str | None) -> int:
    sink = io.BytesIO()
    with pa.ipc.new_stream(sink, table.schema, options=pa.ipc.IpcWriteOptions(compression=compression)) as w:
        w.write_table(table)
    return sink.tell()


def best_seconds(fn, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


DIVERGENCES = ("forward_kl", "reverse_kl", "jsd", "k3")


def loss_errors(student_logits, sampled, ref, got) -> dict:
    """Per divergence, the loss from `got` = (ids, top-k log-probs, sampled token's log-prob) vs from `ref`: each
    with its own ids, since a packed part's rows come back in rank order with ties by id, not necessarily in the
    reference's order."""
    out = {}
    for divergence in DIVERGENCES:
        config = LossConfig(divergence=divergence, tail="bucket")
        ref_loss, got_loss = (
            token_losses(student_logits, ids, lp, config, sampled_ids=sampled, teacher_token_logprobs=token).double()
            for ids, lp, token in (ref, got)
        )
        error = got_loss - ref_loss
        out[divergence] = {
            "mean_loss": ref_loss.mean().item(),
            "mean_error": error.mean().abs().item(),
            "mean_error_stderr": (error.std() / len(error) ** 0.5).item(),
            "per_token_error": error.abs().mean().item(),
        }
    return out


def part_tables(sample_ids, lengths, ids, lp, token_lp, vocab: int, wide_ids: dict) -> dict[str, pa.Table]:
    """One part's tables in every format: float32, float16, packed, and float16/packed with each of `wide_ids`
    ({(label, V): ids within V}) in place of the demo's."""

    def plain(topk_ids, dtype="float32"):
        return annotated_table(
            sample_ids=sample_ids,
            lengths=lengths,
            topk_ids=topk_ids,
            topk_logprobs=lp,
            token_logprob=token_lp,
            logprob_dtype=dtype,
        )

    tables = {
        "float32": plain(ids),
        "float16": plain(ids, "float16"),
        "packed": codec.encode_annotation(plain(ids), vocab)[0],
    }
    for (label, v), wide in wide_ids.items():
        tables[f"packed@{label}"] = codec.encode_annotation(plain(wide), v)[0]
        tables[f"float16@{label}"] = plain(wide, "float16")
    return tables


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=1536, help="distinct prompts: the 400 held-out, then training")
    parser.add_argument("--part-rows", type=int, default=256, help="rows per annotated part (bytes are per part)")
    parser.add_argument("--max-new-tokens", type=int, default=12)
    parser.add_argument("--tokens", type=int, default=200_000, help="positions for the throughput rounds")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.prompts, args.tokens, args.rounds = 64, 20_000, 1
    torch.set_num_threads(1)

    t_lp, s_logits, sampled_lp, sampled, lengths = demo_outputs(
        args.prompts, args.max_new_tokens, args.seed, args.part_rows
    )
    tokens, vocab = t_lp.shape
    top1 = t_lp.exp().max(-1).values
    print(f"demo teacher on {tokens} student tokens (V={vocab}); median top-1 p = {top1.median():.3f}")
    sample_ids = [f"s{i}" for i in range(len(lengths))]
    rng = np.random.default_rng(args.seed)

    storage, columns, errors, speed = [], {}, {}, {}
    load_before = os.getloadavg()
    spread = {v: np.random.default_rng(args.seed).choice(v, size=vocab, replace=False) for v in (49152, 151936)}
    row_ends = np.cumsum(lengths)
    parts = [  # (rows, tokens) of each part, as annotate writes one part per rollout shard
        (
            slice(r, min(r + args.part_rows, len(lengths))),
            slice(int(row_ends[r] - lengths[r]), int(row_ends[min(r + args.part_rows, len(lengths)) - 1])),
        )
        for r in range(0, len(lengths), args.part_rows)
    ]
    for k in K_VALUES:
        top = torch.topk(t_lp, k)
        ids, lp = top.indices.int().numpy(), top.values.numpy()
        # ids at a real vocabulary's width: random (a worst case: they hardly compress), and the demo teacher's
        # own ids spread over it by a fixed injective map (its sets repeat as they do here, at 16 or 18 bits)
        wide_ids = {}
        for v in (49152, 151936):
            wide_ids[f"V={v}", v] = rng.integers(0, v, size=ids.shape)
            wide_ids[f"V={v} spread", v] = spread[v][ids]
        sizes, fields, decoded_parts = {}, {}, []
        for rows, toks in parts:
            tables = part_tables(
                sample_ids[rows],
                lengths[rows],
                ids[toks],
                lp[toks],
                sampled_lp.numpy()[toks],
                vocab,
                {key: w[toks] for key, w in wide_ids.items()},
            )
            for name, table in tables.items():
                for compression in (None, "zstd"):
                    sizes[name, compression] = sizes.get((name, compression), 0) + ipc_bytes(table, compression)
            # each field alone (a flat array, its own small framing); the rest of the part is sample_id, the one
            # list offsets buffer and the schema
            packed = tables["packed"]
            per_token = packed[codec.PACKED].combine_chunks().flatten()
            for f, child in zip(per_token.type, per_token.flatten(), strict=True):
                fields[f.name] = fields.get(f.name, 0) + ipc_bytes(pa.table({f.name: child}), "zstd")
            fields["sample_id"] = fields.get("sample_id", 0) + ipc_bytes(packed.select(["sample_id"]), "zstd")
            decoded_parts.append(codec.decode_annotation(packed, k, codec.id_bits(vocab)))
        columns[k] = {name: size / tokens for name, size in fields.items()}
        storage += [
            {"k": k, "format": name, "compression": compression or "none", "bytes_per_token": size / tokens}
            for (name, compression), size in sizes.items()
        ]

        decoded = pa.concat_tables(decoded_parts)
        ids_t = torch.from_numpy(ids)
        ref = (ids_t, torch.from_numpy(lp), sampled_lp)
        half = (ids_t, torch.from_numpy(lp.astype(np.float16).astype(np.float32)), sampled_lp.half().float())
        got = (
            torch.from_numpy(flat_values(decoded["teacher_topk_ids"]).copy()),
            torch.from_numpy(flat_values(decoded["teacher_topk_logprobs"]).copy()),
            torch.from_numpy(flat_values(decoded["teacher_token_logprob"]).copy()),
        )
        errors[k] = {
            "float16": loss_errors(s_logits, sampled, ref, half),
            "packed": loss_errors(s_logits, sampled, ref, got),
        }

        # throughput on the annotations tiled to --tokens positions (rows of the same lengths)
        reps = max(1, args.tokens // tokens)
        big_lengths = np.tile(lengths, reps)
        big_plain = annotated_table(
            sample_ids=[f"s{i}" for i in range(len(big_lengths))],
            lengths=big_lengths,
            topk_ids=np.tile(ids, (reps, 1)),
            topk_logprobs=np.tile(lp, (reps, 1)),
            token_logprob=np.tile(sampled_lp.numpy(), reps),
        )
        big_f16 = big_plain.cast(tables["float16"].schema)
        big_packed, _ = codec.encode_annotation(big_plain, 151936)  # 18-bit ids: the width of a real vocabulary
        demo_packed, _ = codec.encode_annotation(big_plain, vocab)  # the demo teacher's parts as stored
        n = int(big_lengths.sum())
        f16_to_f32 = best_seconds(lambda: flat_values(big_f16["teacher_topk_logprobs"]).astype(np.float32), args.rounds)
        enc = best_seconds(lambda: codec.encode_annotation(big_plain, 151936), args.rounds)
        # decoding is short (~0.2 s a round): more rounds, so a best time is likelier to meet a quiet moment
        dec = best_seconds(lambda: codec.decode_annotation(big_packed, k, 18), 3 * args.rounds)
        dec_demo = best_seconds(lambda: codec.decode_annotation(demo_packed, k, codec.id_bits(vocab)), 3 * args.rounds)
        speed[k] = {
            "tokens": n,
            "demo_id_layout": demo_packed.schema.names[1],
            "encode_tokens_per_s": n / enc,
            "decode_tokens_per_s": n / dec,
            "decode_demo_tokens_per_s": n / dec_demo,
            "float16_to_float32_tokens_per_s": n / f16_to_f32,
        }

    print("\n(a) bytes per response token (Arrow IPC stream as stored)")
    formats = list(dict.fromkeys(r["format"] for r in storage))
    print(f"{'format':<26}" + "".join(f"{f'k={k} none':>12}{f'k={k} zstd':>12}" for k in K_VALUES))
    for name in formats:
        cells = "".join(
            f"{r['bytes_per_token']:>12.1f}" for k in K_VALUES for r in storage if r["format"] == name and r["k"] == k
        )
        print(f"{name:<26}{cells}")
    zstd = {(r["k"], r["format"]): r["bytes_per_token"] for r in storage if r["compression"] == "zstd"}
    print(
        "packed+zstd / float16+zstd: "
        + ", ".join(
            f"k={k} {at.lstrip('@') or f'V={v}'}: {zstd[k, 'packed' + at] / zstd[k, 'float16' + at]:.2f}"
            for k in K_VALUES
            for v, at in ((vocab, ""), (151936, "@V=151936"), (151936, "@V=151936 spread"))
        )
    )
    print("\npacked+zstd bytes per token by field (each alone, V = 99; the rest is offsets and framing)")
    print(f"{'column':<26}" + "".join(f"{f'k={k}':>9}" for k in K_VALUES))
    for name in dict.fromkeys(n for k in K_VALUES for n in columns[k]):
        print(f"{name:<26}" + "".join(f"{columns[k].get(name, float('nan')):>9.2f}" for k in K_VALUES))
    print(
        "\n(b) loss error vs float32 annotations (nats/token): |mean difference| (± its standard error) / "
        "mean |per-token difference|"
    )
    print(f"{'k':>3} {'format':<8}" + "".join(f"{d:>36}" for d in DIVERGENCES))
    for k in K_VALUES:
        for fmt in ("float16", "packed"):
            e = errors[k][fmt]
            print(
                f"{k:>3} {fmt:<8}"
                + "".join(
                    f"{e[d]['mean_error']:>13.2e} ±{e[d]['mean_error_stderr']:>8.1e}{e[d]['per_token_error']:>13.2e}"
                    for d in DIVERGENCES
                )
            )
    for k in K_VALUES:
        losses = ", ".join(f"{d}={errors[k]['packed'][d]['mean_loss']:.3f}" for d in DIVERGENCES)
        print(f"mean float32 loss at k={k}: {losses}")

    load_after = os.getloadavg()
    print(f"\n(c) throughput, tokens/s (load average {load_before[0]:.2f} before, {load_after[0]:.2f} after)")
    print(f"{'k':>3}{'encode 18b':>12}{'decode 18b':>12}{'decode V=99':>13}{'f16->f32':>12}{'decode 18b/f16->f32':>21}")
    for k in K_VALUES:
        s = speed[k]
        print(
            f"{k:>3}{s['encode_tokens_per_s']:>12.3g}{s['decode_tokens_per_s']:>12.3g}"
            f"{s['decode_demo_tokens_per_s']:>13.3g}{s['float16_to_float32_tokens_per_s']:>12.3g}"
            f"{s['decode_tokens_per_s'] / s['float16_to_float32_tokens_per_s']:>21.3f}"
        )

    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(
        json.dumps(
            {
                "args": vars(args),
                "tokens": tokens,
                "vocab": vocab,
                "median_top1_p": top1.median().item(),
                "storage": storage,
                "packed_zstd_bytes_per_column": {str(k): v for k, v in columns.items()},
                "loss_errors": {str(k): v for k, v in errors.items()},
                "throughput": {str(k): v for k, v in speed.items()},
                "loadavg": {"before": load_before, "after": load_after},
                "codec_version": codec.CODEC_VERSION,
                "machine": {
                    "platform": platform.platform(),
                    "python": platform.python_version(),
                    "torch": torch.__version__,
                    "threads": torch.get_num_threads(),
                },
            },
            indent=2,
        )
    )
    print(f"\nwrote {RESULTS}")


if __name__ == "__main__":
    main()
