"""The `packed` annotation codec vs float16/float32 parts: bytes per token, loss error, encode/decode speed.

    python benchmarks/bench_codec.py            # 256 demo prompts, k in {8, 32, 64}
    python benchmarks/bench_codec.py --quick    # a smoke run

Annotations are a *trained* teacher's: the shipped demo teacher (data/models/teacher)
scoring the demo student's own samples (data/models/student, temperature 1) on
data/arithmetic prompts; the distribution is peaked (median top-1 p > 0.9),
which is the hard case for quantized log-probs.

(a) Bytes per response token of one annotated part as stored (Arrow IPC
    stream, every column and the framing, as `write_shard` writes it), for
    float32 / float16 / packed x none / zstd. The demo vocabulary has 99 ids
    (7-bit ids, a 13-byte bitmap); the rows "packed@V" re-pack the same parts
    with random ids drawn within V = 49152 (SmolLM2) and 151936 (Qwen) to show
    the id cost at real vocabularies (random ids barely compress, so this is a
    worst case). Then the packed part's bytes per column (zstd).

(b) Loss error vs float32: |mean_t loss_packed - mean_t loss_f32| (the
    quantity the trainer's token-mean optimises) and the mean per-token
    |difference|, for forward KL (tail bucket), reverse KL and JSD, with the
    demo student's logits.

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

from opd_cache import codec
from opd_cache.losses import LossConfig, token_losses
from opd_cache.models import load_causal_lm
from opd_cache.schema import annotated_table, flat_values
from opd_cache.tokenizer import load_tokenizer

RESULTS = ROOT / "benchmarks" / "results" / "bench_codec.json"
K_VALUES = (8, 32, 64)


@torch.inference_mode()
def demo_outputs(num_prompts: int, max_new_tokens: int, seed: int):
    """(teacher log-probs [T, V], student logits [T, V], response lengths) on the demo student's samples."""
    tok = load_tokenizer(str(ROOT / "data/models/student"))
    student = load_causal_lm(ROOT / "data/models/student").eval()
    teacher = load_causal_lm(ROOT / "data/models/teacher").eval()
    prompts = pq.read_table(ROOT / "data/arithmetic/test.parquet").column("prompt").to_pylist()[:num_prompts]
    texts = tok.apply_chat_template(prompts, add_generation_prompt=True, tokenize=False)
    batch = tok(texts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
    torch.manual_seed(seed)
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
    return t_lp[keep], s_logits[keep], sampled_lp[keep], lengths.numpy()


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


def loss_errors(student_logits, ref_ids, ref_lp, got_ids, got_lp) -> dict:
    """Per divergence, the loss from (got_ids, got_lp) vs from (ref_ids, ref_lp): each its own ids, since a packed
    part's rows come back in rank order with ties by id, not necessarily in the reference's order."""
    out = {}
    for divergence in ("forward_kl", "reverse_kl", "jsd"):
        config = LossConfig(divergence=divergence, tail="bucket")
        ref = token_losses(student_logits, ref_ids, ref_lp, config).double()
        got = token_losses(student_logits, got_ids, got_lp, config).double()
        out[divergence] = {
            "mean_loss": ref.mean().item(),
            "mean_error": (got.mean() - ref.mean()).abs().item(),
            "per_token_error": (got - ref).abs().mean().item(),
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--max-new-tokens", type=int, default=12)
    parser.add_argument("--tokens", type=int, default=200_000, help="positions for the throughput rounds")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.prompts, args.tokens, args.rounds = 32, 20_000, 1
    torch.set_num_threads(1)

    t_lp, s_logits, sampled_lp, lengths = demo_outputs(args.prompts, args.max_new_tokens, args.seed)
    tokens, vocab = t_lp.shape
    top1 = t_lp.exp().max(-1).values
    print(f"demo teacher on {tokens} student tokens (V={vocab}); median top-1 p = {top1.median():.3f}")
    sample_ids = [f"s{i}" for i in range(len(lengths))]
    rng = np.random.default_rng(args.seed)

    storage, columns, errors, speed = [], {}, {}, {}
    load_before = os.getloadavg()
    for k in K_VALUES:
        top = torch.topk(t_lp, k)
        ids, lp = top.indices.int().numpy(), top.values.numpy()
        plain = {
            dtype: annotated_table(
                sample_ids=sample_ids,
                lengths=lengths,
                topk_ids=ids,
                topk_logprobs=lp,
                token_logprob=sampled_lp.numpy(),
                logprob_dtype=dtype,
            )
            for dtype in ("float32", "float16")
        }
        packed, _ = codec.encode_annotation(plain["float32"], vocab)
        tables = {"float32": plain["float32"], "float16": plain["float16"], "packed": packed}
        for v in (49152, 151936):  # the same parts with ids at a real vocabulary's width
            wide = annotated_table(
                sample_ids=sample_ids,
                lengths=lengths,
                topk_ids=rng.integers(0, v, size=ids.shape),
                topk_logprobs=lp,
                token_logprob=sampled_lp.numpy(),
            )
            tables[f"packed@V={v}"] = codec.encode_annotation(wide, v)[0]
            tables[f"float16@V={v}"] = annotated_table(
                sample_ids=sample_ids,
                lengths=lengths,
                topk_ids=flat_values(wide["teacher_topk_ids"]),
                topk_logprobs=lp,
                token_logprob=sampled_lp.numpy(),
                logprob_dtype="float16",
            )
        columns[k] = {
            name: ipc_bytes(packed.select([name]), "zstd") / tokens for name in packed.schema.names
        }  # each column alone, with its own (small) framing
        for name, table in tables.items():
            for compression in (None, "zstd"):
                storage.append(
                    {
                        "k": k,
                        "format": name,
                        "compression": compression or "none",
                        "bytes_per_token": ipc_bytes(table, compression) / tokens,
                    }
                )

        decoded = codec.decode_annotation(packed, k, codec.id_bits(vocab))
        ids_t = torch.from_numpy(ids)
        errors[k] = {
            "float16": loss_errors(
                s_logits,
                ids_t,
                torch.from_numpy(lp),
                ids_t,
                torch.from_numpy(lp.astype(np.float16).astype(np.float32)),
            ),
            "packed": loss_errors(
                s_logits,
                ids_t,
                torch.from_numpy(lp),
                torch.from_numpy(flat_values(decoded["teacher_topk_ids"]).copy()),
                torch.from_numpy(flat_values(decoded["teacher_topk_logprobs"]).copy()),
            ),
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
        big_f16 = big_plain.cast(plain["float16"].schema)
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
    print(f"{'format':<20}" + "".join(f"{f'k={k} none':>12}{f'k={k} zstd':>12}" for k in K_VALUES))
    for name in formats:
        cells = "".join(
            f"{r['bytes_per_token']:>12.1f}" for k in K_VALUES for r in storage if r["format"] == name and r["k"] == k
        )
        print(f"{name:<20}{cells}")
    zstd = {(r["k"], r["format"]): r["bytes_per_token"] for r in storage if r["compression"] == "zstd"}
    print(
        "packed+zstd / float16+zstd: "
        + ", ".join(
            f"k={k} V={v}: {zstd[k, 'packed' + at] / zstd[k, 'float16' + at]:.2f}"
            for k in K_VALUES
            for v, at in ((vocab, ""), (151936, "@V=151936"))
        )
    )
    print("\npacked+zstd bytes per token by column (each column alone, V = 99)")
    print(f"{'column':<26}" + "".join(f"{f'k={k}':>9}" for k in K_VALUES))
    for name in dict.fromkeys(n for k in K_VALUES for n in columns[k]):
        print(f"{name:<26}" + "".join(f"{columns[k].get(name, float('nan')):>9.2f}" for k in K_VALUES))
    print("\n(b) loss error vs float32 annotations (nats/token): |mean difference| / mean |per-token difference|")
    print(f"{'k':>3} {'format':<8}" + "".join(f"{d:>26}" for d in ("forward_kl", "reverse_kl", "jsd")))
    for k in K_VALUES:
        for fmt in ("float16", "packed"):
            e = errors[k][fmt]
            print(
                f"{k:>3} {fmt:<8}"
                + "".join(
                    f"{e[d]['mean_error']:>13.2e}{e[d]['per_token_error']:>13.2e}"
                    for d in ("forward_kl", "reverse_kl", "jsd")
                )
            )
    print(
        "mean float32 loss: "
        + ", ".join(
            f"{d}={errors[K_VALUES[0]]['packed'][d]['mean_loss']:.3f}" for d in ("forward_kl", "reverse_kl", "jsd")
        )
    )

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
