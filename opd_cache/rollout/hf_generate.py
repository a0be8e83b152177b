"""Student sampling with Hugging Face transformers: the embedded default engine of `opd rollout`.

Every generation engine has the same small interface:

    engine.generate(prompt_token_ids, SampleRequest(sampling, n, student_topk=0, seed=None)) -> list[Response]
    engine.load_policy(path)          # reload the weights in place for a new policy version

`generate` returns `len(prompt_token_ids) * n` responses, prompt-major
(response `i * n + j` is sample `j` of prompt `i`).

Why not `model.generate`? We need, per sampled token, the log-prob under the
distribution it was *actually* drawn from (after temperature, top-k, top-p),
and optionally the student's top-k ids. `model.generate(output_scores=True)`
keeps a `[batch, vocab]` tensor per step for the whole generation: memory that
grows with length × vocabulary. This loop keeps only what it records — one
token id, one float and `student_topk` ids per row and step.

The loop: left-pad the batch of prompts, run one prefill forward with
`attention_mask` and `position_ids` (computing logits for the last position
only), then feed one token per step through the KV cache. A row is finished
after EOS (the EOS token is part of the response: the teacher must score it)
or when a stop string appears in its tail; finished rows keep being fed a pad
token (cheaper than reshaping the cache) until every row is done.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Sequence

import numpy as np
import torch

from opd_cache.engine import (
    FINISH_LENGTH,
    FINISH_STOP,
    EngineInfo,
    Response,
    SampleRequest,
    hf_engine_info,
    resolve_device,
    torch_dtype,
)


# ---------------------------------------------------------------- the sampling distribution
def sampling_logprobs(
    logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, vocab_limit: int | None = None
) -> torch.Tensor:
    """Log-probs `[B, V]` (float32) of the distribution we sample from: logits / temperature,
    then top-k, then top-p (the order of transformers and vLLM), renormalised.

    Filtered tokens get -inf. `vocab_limit` masks ids the tokenizer does not have
    (padded embedding rows), so they can never be sampled.
    """
    logits = logits.float()
    if vocab_limit is not None and vocab_limit < logits.shape[-1]:
        logits = logits.clone()
        logits[:, vocab_limit:] = float("-inf")
    if temperature != 1.0:
        logits = logits / temperature
    if top_k and top_k < logits.shape[-1]:
        kth_largest = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    if top_p < 1.0:
        # Drop the least likely tokens whose total mass is at most 1 - top_p, keeping at least one.
        sorted_logits, order = torch.sort(logits, dim=-1)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = cumulative <= 1.0 - top_p
        drop_sorted[:, -1] = False
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return torch.log_softmax(logits, dim=-1)


def sample_from_logprobs(logprobs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row: argmax of p / E with E ~ Exp(1) is an exact draw from p (no host sync)."""
    exponential = torch.empty_like(logprobs).exponential_(generator=generator)
    return (logprobs.exp() / exponential).argmax(dim=-1)


# ---------------------------------------------------------------- helpers
def resolve_attn_implementation(requested: str, device: torch.device, dtype: torch.dtype) -> str:
    """`auto` picks flash_attention_2 when flash-attn is installed and usable (CUDA, 16-bit), else sdpa."""
    flash_ok = device.type == "cuda" and dtype in (torch.float16, torch.bfloat16)
    if requested == "auto":
        if flash_ok:
            try:
                import flash_attn  # noqa: F401

                return "flash_attention_2"
            except ImportError:
                pass
        return "sdpa"
    if requested == "flash_attention_2":
        try:
            import flash_attn  # noqa: F401
        except ImportError:
            raise ValueError(
                "attn_implementation flash_attention_2: flash-attn is not installed "
                "(pip install 'opd-cache[gpu]'), use sdpa or auto"
            ) from None
        if not flash_ok:
            raise ValueError(
                f"attn_implementation flash_attention_2 needs a CUDA device and dtype bfloat16 or "
                f"float16, got {device.type} / {str(dtype).removeprefix('torch.')}"
            )
    return requested


def _cache_kwarg_name(model) -> str:
    # transformers 5.x renamed `past_key_values=` to `cache=` (the old name is deprecated, then removed).
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _new_cache(model):
    from transformers import DynamicCache

    try:
        return DynamicCache(config=model.config)  # knows sliding-window layers (less memory)
    except TypeError:  # older transformers
        return DynamicCache()


def _pad(rows: Sequence[Sequence[int]], pad_id: int, device, *, left: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`[B, L]` input ids and attention mask of `rows` padded to the longest, on the left or the right."""
    width = max(len(r) for r in rows)
    ids = np.full((len(rows), width), pad_id, dtype=np.int64)
    mask = np.zeros((len(rows), width), dtype=np.int64)
    for i, tokens in enumerate(rows):
        if len(tokens):
            cols = slice(width - len(tokens), width) if left else slice(0, len(tokens))
            ids[i, cols] = tokens
            mask[i, cols] = 1
    return torch.from_numpy(ids).to(device), torch.from_numpy(mask).to(device)


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """`[B, L]` input ids and attention mask of left-padded prompts (generation continues on the right)."""
    return _pad(prompts, pad_id, device, left=True)


def right_pad(rows: Sequence[Sequence[int]], device, pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """`[B, L]` input ids and attention mask of right-padded sequences, for a teacher-forced forward."""
    return _pad(rows, pad_id, device, left=False)


def _stop_string_window(stop: Sequence[str]) -> int:
    # Every token stands for at least one byte of text, so a stop string of b bytes ends within the last b
    # tokens; decoding only that tail keeps the check O(1) per step.
    return max(len(s.encode("utf-8")) for s in stop) + 1


# ---------------------------------------------------------------- the engine
class HFGenerator:
    """Batched sampling with the KV cache on CPU or GPU."""

    def __init__(
        self,
        model_path: str | os.PathLike,
        *,
        tokenizer=None,
        device: str = "auto",
        dtype: str = "float32",
        attn_implementation: str = "sdpa",
        eos_token_ids: Sequence[int] = (),
        pad_token_id: int | None = None,
        vocab_limit: int | None = None,
        seed: int = 0,
        trust_remote_code: bool = False,
    ):
        from opd_cache.models import load_causal_lm

        self.device = resolve_device(device)
        self.dtype = torch_dtype(dtype)
        self.attn_implementation = resolve_attn_implementation(attn_implementation, self.device, self.dtype)
        self.model = load_causal_lm(
            model_path,
            dtype=self.dtype,
            attn_implementation=self.attn_implementation,
            trust_remote_code=trust_remote_code,
        ).to(self.device)
        self.tokenizer = tokenizer  # only needed to decode tails for stop strings
        eos = list(eos_token_ids)
        if not eos:
            config_eos = getattr(self.model.generation_config, "eos_token_id", None)
            eos = config_eos if isinstance(config_eos, list) else [config_eos] if config_eos is not None else []
        if not eos:
            raise ValueError(f"model {model_path}: no EOS token id (give the tokenizer an eos_token)")
        self.eos_ids = torch.tensor(sorted(set(int(e) for e in eos)), device=self.device)
        self.pad_id = int(pad_token_id if pad_token_id is not None else eos[0])
        self.vocab_limit = vocab_limit
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self._cache_kwarg = _cache_kwarg_name(self.model)
        self._keep_last_logits = "logits_to_keep" in inspect.signature(self.model.forward).parameters

    @property
    def info(self) -> EngineInfo:
        return hf_engine_info(self.model)

    # ------------------------------------------------------------ weights
    def load_policy(self, path: str | os.PathLike) -> None:
        """Copy a published checkpoint's safetensors weights into the loaded model (no second model in memory)."""
        from safetensors.torch import load_file

        path = os.fspath(path)
        files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
        if not files:
            raise ValueError(f"policy {path}: no *.safetensors weights in the folder")
        state = {}
        for name in files:
            state.update(load_file(os.path.join(path, name), device=str(self.device)))
        current = self.model.state_dict()
        unexpected = sorted(set(state) - set(current))
        if unexpected:
            raise ValueError(
                f"policy {path}: weights {unexpected[:3]} do not exist in the loaded model (a different architecture?)"
            )
        for key, tensor in state.items():
            if tensor.shape != current[key].shape:
                raise ValueError(
                    f"policy {path}: {key} has shape {tuple(tensor.shape)}, the loaded model has "
                    f"{tuple(current[key].shape)}"
                )
        # Tied weights (e.g. lm_head = embed_tokens) are saved once; they share storage with a loaded tensor.
        loaded_storage = {current[k].data_ptr() for k in state}
        missing = [k for k in current if k not in state and current[k].data_ptr() not in loaded_storage]
        if missing:
            raise ValueError(f"policy {path}: weights {missing[:3]} are missing from the checkpoint")
        with torch.no_grad():
            self.model.load_state_dict(state, strict=False)

    # ------------------------------------------------------------ sampling
    @torch.inference_mode()
    def generate(self, prompt_token_ids: Sequence[Sequence[int]], request: SampleRequest) -> list[Response]:
        if not prompt_token_ids:
            return []
        for i, prompt in enumerate(prompt_token_ids):
            if len(prompt) == 0:
                raise ValueError(f"prompt {i} is empty: every prompt needs at least one token")
        n, sampling, student_topk, seed = request.n, request.sampling, request.student_topk, request.seed
        generator = self.generator if seed is None else torch.Generator(device=self.device).manual_seed(seed)
        prompts = [list(p) for p in prompt_token_ids for _ in range(n)]  # n samples: repeat each prompt
        batch = len(prompts)
        max_new = sampling.max_new_tokens
        stop = list(sampling.stop)
        if stop and self.tokenizer is None:
            raise ValueError("stop strings need the engine's tokenizer")

        input_ids, prompt_mask = left_pad(prompts, self.pad_id, self.device)
        # Positions count real tokens only, so a left-padded prompt is seen exactly as an unpadded one.
        position_ids = (prompt_mask.cumsum(-1) - 1).clamp(min=0)
        next_position = prompt_mask.sum(-1, keepdim=True)  # [B, 1]
        attention_mask = torch.ones(batch, input_ids.shape[1] + max_new, dtype=prompt_mask.dtype, device=self.device)
        attention_mask[:, : input_ids.shape[1]] = prompt_mask
        cache = _new_cache(self.model)

        tokens = torch.full((batch, max_new), self.pad_id, dtype=torch.long, device=self.device)
        logprobs = torch.zeros(batch, max_new, dtype=torch.float32, device=self.device)
        topk_ids = None
        if student_topk:
            topk_ids = torch.zeros(batch, max_new, student_topk, dtype=torch.int32, device=self.device)
        lengths = torch.zeros(batch, dtype=torch.long, device=self.device)
        finished = torch.zeros(batch, dtype=torch.bool, device=self.device)
        stopped = torch.zeros(batch, dtype=torch.bool, device=self.device)  # by EOS or stop string
        window = _stop_string_window(stop) if stop else 0

        step_input, step_positions = input_ids, position_ids
        for step in range(max_new):
            kwargs = {self._cache_kwarg: cache, "use_cache": True}
            if self._keep_last_logits:
                kwargs["logits_to_keep"] = 1  # never materialise [B, L, V] logits for the prompt
            out = self.model(
                input_ids=step_input,
                attention_mask=attention_mask[:, : input_ids.shape[1] + step],
                position_ids=step_positions,
                **kwargs,
            )
            logits = out.logits[:, -1, :]
            step_logprobs = sampling_logprobs(
                logits, sampling.temperature, sampling.top_k, sampling.top_p, self.vocab_limit
            )
            sampled = sample_from_logprobs(step_logprobs, generator)

            active = ~finished
            tokens[:, step] = torch.where(active, sampled, self.pad_id)
            logprobs[:, step] = step_logprobs.gather(-1, sampled[:, None]).squeeze(-1)
            if topk_ids is not None:
                topk_ids[:, step] = torch.topk(logits.float(), student_topk, dim=-1).indices.to(torch.int32)
            lengths += active.long()
            hit_eos = active & torch.isin(sampled, self.eos_ids)
            stopped |= hit_eos
            finished |= hit_eos
            if stop:
                hit_stop = self._stop_string_hits(tokens, step, finished, stop, window)
                stopped |= hit_stop
                finished |= hit_stop
            if bool(finished.all()):
                break
            step_input = tokens[:, step : step + 1]
            step_positions = next_position + step

        return self._responses(tokens, logprobs, topk_ids, lengths, stopped)

    def _stop_string_hits(
        self, tokens: torch.Tensor, step: int, finished: torch.Tensor, stop: list[str], window: int
    ) -> torch.Tensor:
        hits = torch.zeros_like(finished)
        active_rows = (~finished).nonzero().flatten().tolist()
        if not active_rows:
            return hits
        tails = tokens[active_rows, max(0, step + 1 - window) : step + 1].tolist()
        for row, tail in zip(active_rows, tails):
            text = self.tokenizer.decode(tail, skip_special_tokens=False)
            if any(s in text for s in stop):
                hits[row] = True
        return hits

    @staticmethod
    def _responses(tokens, logprobs, topk_ids, lengths, stopped) -> list[Response]:
        tokens = tokens.to(torch.int32).cpu().numpy()
        logprobs = logprobs.cpu().numpy()
        topk = topk_ids.cpu().numpy() if topk_ids is not None else None
        lengths = lengths.cpu().numpy()
        stopped = stopped.cpu().numpy()
        return [
            Response(
                token_ids=tokens[row, :length].copy(),
                logprobs=logprobs[row, :length].copy(),
                finish_reason=FINISH_STOP if stopped[row] else FINISH_LENGTH,
                topk_ids=topk[row, :length].copy() if topk is not None else None,
            )
            for row, length in enumerate(lengths)
        ]
