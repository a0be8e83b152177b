"""Teacher scoring with Hugging Face transformers: top-k log-probs for every response token.

`HFScorer.score(prompts, responses, k, support_ids=None)` runs one
teacher-forced forward pass over prompt + response and returns, for every
response position t, the teacher's distribution that predicts `response[t]`:

    position:   p0  p1  p2 | r0  r1  r2
    hidden at:          ^^   ^^  ^^        (position prompt_len + t - 1 predicts r_t)

so the last response token is never fed (nothing is predicted after it).

How it stays fast and small:
- Rows are sorted by length and packed into batches whose *padded* size
  (rows x longest row) fits `max_tokens_per_batch`, so there is little padding.
- Only the model body runs over the whole batch. The output layer runs on the
  response positions alone, `head_chunk_tokens` positions at a time, and each
  chunk's float32 `[chunk, vocab]` logits are reduced (log-softmax, top-k,
  gathers) before the next chunk: `[batch, seq, vocab]` in float32 never exists.
- Everything is returned as flat `[total_response_tokens, k]` numpy arrays in
  input row order, ready for `schema.annotated_table`.

Log-probs are always those of the raw distribution (temperature 1), over the
first `vocab_limit` ids (the tokenizer's ids: rows of an embedding padded
beyond the tokenizer are never trained and are left out of the softmax, so a
teacher and a student with different padding agree on the support).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from opd_cache.engine import EngineInfo, RowArrays, TeacherScores, hf_engine_info, resolve_device, torch_dtype

# Elements of one float32 [chunk, vocab] logits block (256 MiB); sets the default chunk of positions.
HEAD_CHUNK_ELEMENTS = 1 << 26


def plan_batches(lengths: np.ndarray, max_tokens_per_batch: int) -> list[np.ndarray]:
    """Group row indices into batches whose padded size (rows x longest row) fits the budget.

    Rows are taken longest first, so each batch's first row is its longest and
    neighbours have similar lengths (little padding); the biggest batch comes
    first, so an out-of-memory error shows up at once. A row longer than the
    budget gets a batch of its own.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    order = np.argsort(-lengths, kind="stable")
    batches, start = [], 0
    while start < len(order):
        longest = int(lengths[order[start]])
        rows = max(1, max_tokens_per_batch // max(longest, 1))
        batches.append(order[start : start + rows])
        start += rows
    return batches


class HFScorer:
    """Scores (prompt, response) token sequences with a causal LM from transformers."""

    def __init__(
        self,
        model,
        *,
        max_tokens_per_batch: int = 16384,
        head_chunk_tokens: int | None = None,
        padding_side: str = "right",
        vocab_limit: int | None = None,
        name: str = "teacher",
    ):
        if padding_side not in ("right", "left"):
            raise ValueError(f"padding_side {padding_side!r}: expected 'right' or 'left'")
        self.model = model.eval()
        self.name = name
        self.decoder = model.get_decoder()
        self.head = model.get_output_embeddings()
        if self.decoder is None or self.head is None:
            raise ValueError(
                f"teacher {name}: the model exposes no decoder body / output layer "
                f"(get_decoder() / get_output_embeddings()); the hf scorer needs both"
            )
        self.device = next(model.parameters()).device
        self.embedding_size = int(self.head.weight.shape[0])
        self.vocab_limit = min(vocab_limit or self.embedding_size, self.embedding_size)
        self.max_tokens_per_batch = max_tokens_per_batch
        self.head_chunk_tokens = head_chunk_tokens or max(16, HEAD_CHUNK_ELEMENTS // self.vocab_limit)
        self.padding_side = padding_side
        # Gemma-2/3 squash their logits; applied here exactly as the model's own forward does.
        self.softcap = getattr(model.config, "final_logit_softcapping", None)
        self.max_positions = getattr(model.config, "max_position_embeddings", None)
        self._check_head_matches_model()

    @classmethod
    def load(
        cls,
        path: str,
        *,
        model_dtype: str = "float32",
        device: str = "auto",
        attn_implementation: str = "sdpa",
        trust_remote_code: bool = False,
        **kwargs,
    ) -> HFScorer:
        from opd_cache.models import load_causal_lm

        model = load_causal_lm(
            path,
            dtype=torch_dtype(model_dtype),
            attn_implementation=attn_implementation,
            trust_remote_code=trust_remote_code,
        )
        return cls(model.to(resolve_device(device)), name=str(path), **kwargs)

    @property
    def info(self) -> EngineInfo:
        return hf_engine_info(self.model)

    # ------------------------------------------------------------------ scoring
    @torch.inference_mode()
    def score(
        self, prompts: RowArrays, responses: RowArrays, k: int, support_ids: RowArrays | None = None
    ) -> TeacherScores:
        """Top-k ids/log-probs and the sampled token's log-prob at every response position.

        `prompts[i]` / `responses[i]` are 1-D token id arrays; `support_ids[i]`
        (optional) is `[len(responses[i]), k_s]`: extra ids per position whose
        log-probs are gathered too (the student's top-k, for union support).
        """
        if not 1 <= k <= self.vocab_limit:
            raise ValueError(
                f"top-k {k} must be between 1 and the vocabulary size of teacher {self.name} "
                f"({self.vocab_limit} tokens)"
            )
        prompt_lens = np.array([len(p) for p in prompts], dtype=np.int64)
        lengths = np.array([len(r) for r in responses], dtype=np.int64)
        if len(prompt_lens) and prompt_lens.min() == 0:
            raise ValueError(f"row {int(np.argmin(prompt_lens))} has an empty prompt: nothing predicts its first token")
        support_k = _support_width(support_ids, lengths) if support_ids is not None else None
        out = TeacherScores.zeros(lengths, k, support_k)
        row_offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=row_offsets[1:])

        # The last response token is never fed: no position after it is scored.
        fed_lens = prompt_lens + lengths - 1
        scored = np.nonzero(lengths > 0)[0]  # rows with an empty response produce no positions
        for batch in plan_batches(fed_lens[scored], self.max_tokens_per_batch):
            rows = scored[batch]
            self._score_batch(rows, prompts, responses, support_ids, prompt_lens, lengths, k, out, row_offsets)
        return out

    def _score_batch(self, rows, prompts, responses, support_ids, prompt_lens, lengths, k, out, row_offsets):
        fed = [np.concatenate([prompts[i], responses[i][:-1]]) for i in rows]
        fed_lens = prompt_lens[rows] + lengths[rows] - 1
        width = int(fed_lens.max())
        if self.max_positions is not None and width > self.max_positions:
            raise ValueError(
                f"teacher {self.name}: a sequence of {width} tokens (prompt + response) exceeds the "
                f"model's max_position_embeddings {self.max_positions}"
            )

        # Padded inputs. Right padding needs no attention mask: with causal attention a real token never
        # sees the padding after it, and leaving the mask out keeps SDPA on its fused causal kernel.
        input_ids = np.zeros((len(rows), width), dtype=np.int64)
        pad_before = width - fed_lens if self.padding_side == "left" else np.zeros_like(fed_lens)
        row_of = np.repeat(np.arange(len(rows)), fed_lens)
        col_of = np.arange(int(fed_lens.sum())) - np.repeat(np.cumsum(fed_lens) - fed_lens, fed_lens)
        input_ids[row_of, col_of + np.repeat(pad_before, fed_lens)] = np.concatenate(fed)
        inputs = {"input_ids": torch.from_numpy(input_ids).to(self.device)}
        if self.padding_side == "left":
            mask = np.zeros_like(input_ids)
            mask[row_of, col_of + np.repeat(pad_before, fed_lens)] = 1
            positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
            inputs["attention_mask"] = torch.from_numpy(mask).to(self.device)
            inputs["position_ids"] = torch.from_numpy(positions).to(self.device)
        hidden = self.decoder(**inputs, use_cache=False).last_hidden_state  # [B, width, H]

        # Response position t of row b is predicted by the hidden state at prompt_len + t - 1.
        resp_lens = lengths[rows]
        t_in_row = np.arange(int(resp_lens.sum())) - np.repeat(np.cumsum(resp_lens) - resp_lens, resp_lens)
        b_idx = np.repeat(np.arange(len(rows)), resp_lens)
        pos_idx = np.repeat(pad_before + prompt_lens[rows] - 1, resp_lens) + t_in_row
        h = hidden[torch.from_numpy(b_idx).to(self.device), torch.from_numpy(pos_idx).to(self.device)]  # [T_b, H]
        targets = torch.from_numpy(np.concatenate([responses[i] for i in rows]).astype(np.int64)).to(self.device)
        support = None
        if support_ids is not None:
            support = torch.from_numpy(np.concatenate([np.asarray(support_ids[i], dtype=np.int64) for i in rows])).to(
                self.device
            )

        ids, lps, tok, sup = self._head_topk(h, targets, support, k)
        dest = np.repeat(row_offsets[rows], resp_lens) + t_in_row  # where each position goes in the output
        out.topk_ids[dest] = ids
        out.topk_logprobs[dest] = lps
        out.token_logprob[dest] = tok
        if sup is not None:
            out.support_logprobs[dest] = sup

    def _head_topk(self, h: torch.Tensor, targets: torch.Tensor, support: torch.Tensor | None, k: int):
        """Output layer + float32 log-softmax + top-k, a chunk of positions at a time."""
        ids, lps, tok, sup = [], [], [], []
        for start in range(0, h.shape[0], self.head_chunk_tokens):
            stop = start + self.head_chunk_tokens
            logprobs = self._logprobs(h[start:stop])  # [chunk, V] float32
            top = torch.topk(logprobs, k, dim=-1, sorted=True)
            ids.append(top.indices)
            lps.append(top.values)
            tok.append(logprobs.gather(1, targets[start:stop, None])[:, 0])
            if support is not None:
                sup.append(logprobs.gather(1, support[start:stop]))
            del logprobs
        # one device -> host copy per batch
        ids = torch.cat(ids).to(torch.int32).cpu().numpy()
        lps = torch.cat(lps).cpu().numpy()
        tok = torch.cat(tok).cpu().numpy()
        sup = torch.cat(sup).cpu().numpy() if support is not None else None
        return ids, lps, tok, sup

    def _logprobs(self, h: torch.Tensor) -> torch.Tensor:
        logits = self.head(h)[:, : self.vocab_limit].float()
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return torch.log_softmax(logits, dim=-1)

    @torch.inference_mode()
    def _check_head_matches_model(self) -> None:
        """Refuse models whose logits are not `head(decoder(x))` (+ softcapping): we would score them wrongly."""
        probe = torch.arange(min(8, self.vocab_limit), device=self.device)[None]
        expected = torch.log_softmax(
            self.model(input_ids=probe, use_cache=False).logits[0, :, : self.vocab_limit].float(), -1
        )
        got = self._logprobs(self.decoder(input_ids=probe, use_cache=False).last_hidden_state[0])
        tolerance = 1e-4 if self.head.weight.dtype == torch.float32 else 5e-2
        if not torch.allclose(got, expected, atol=tolerance, rtol=tolerance):
            raise ValueError(
                f"teacher {self.name}: its logits are not the output layer applied to the decoder's hidden states "
                f"(max difference {float((got - expected).abs().max()):.3g}); the hf scorer does not support "
                f"this architecture"
            )


def _support_width(support_ids: Sequence[np.ndarray], lengths: np.ndarray) -> int:
    """k_s of `support_ids`: each row must be a `[response_len, k_s]` array with one k_s for all rows."""
    widths = set()
    for i, s in enumerate(support_ids):
        shape = np.shape(s)
        if len(shape) != 2 or shape[0] != lengths[i]:
            raise ValueError(f"support_ids row {i}: shape {shape}, expected ({lengths[i]}, k_s)")
        widths.add(shape[1])
    if len(widths) > 1:
        raise ValueError(f"support_ids: rows have different widths {sorted(widths)}")
    return widths.pop() if widths else 0
