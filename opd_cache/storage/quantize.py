"""The quantizers of the `packed` codec (opd_cache/storage/codec.py): top-k log-probs, the top-k mass, the sampled token.

Top-k log-probs are coded by their gap below the row's maximum, g_j = max - lp_j >= 0,
on a log scale so that the entries that carry the mass (small gaps) get the
finest steps: code_j = round(254 * log1p(g_j / c) / L) with L = log1p(max_j g_j / c)
over the finite entries rounded up onto a grid of 256 levels (steps of RANGE_STEP; rows spanning more than
1e6 nats keep their exact L), and code 255 means -inf (p_j = 0). On the grid, the
reader turns (level, code) into a gap with one table lookup instead of an expm1 and an exp per entry; parts
written before the grid (exact L) decode with the same arithmetic, the slow way.
c, the gap scale, trades the two losses: small c favours forward KL, which weighs entries by the
teacher's p; large c, uniform steps, favours reverse KL, which weighs them by the
student's q. Codec version 3 uses c = GAP_SCALE = 1 nat (its codes compress ~0.5 byte/token better at
k = 8 on a trained teacher, whose entries after the first sit in a narrow band far below it); versions 1
and 2 used c = LEGACY_GAP_SCALE = 4 and still decode with it (benchmarks/bench_codec.py measures both).
Decoding inverts the code and then shifts the whole row so that its log-sum-exp equals the
row's log top-k mass: the teacher's tail mass 1 - sum_j p_j, which the losses' tail bucket uses, is
therefore the stored mass, not a sum of rounded terms.

The mass (version 3): logit(m) = log m - log(1 - m) of the top-k mass m, as an int16 in steps of
MASS_STEP = 2**-8 (|logit| < 128; -32768: m = 0, 32767: m = 1, no tail). Half a step on the logit moves
log m by at most (1 - m) * 2**-9 * e**(2**-9) and the log tail log(1 - m) by at most m * 2**-9 * e**(2**-9),
so a peaked row's top entries and a flat row's tail both keep their precision. Versions 1 and 2 kept
log m as an exact float32 (4 bytes a token, a third of the 12 the size target allows at k = 8).

The sampled token's log-prob (version 3): -lp as a uint16 in steps of TOKEN_STEP = 2**-9 nats, so within
2**-10 nats (65535: -inf; finite values below -(65534 * TOKEN_STEP) = -127.996 are stored as that bound,
p < 1e-55). Versions 1 and 2 kept it as an exact float32.

Bound (tests/test_codec.py checks it for every entry): a gap decodes within
delta(g) = (c + g) * (exp(L / 508) - 1) (half a code step on the log scale),
and the renormalising shift is a weighted mean of those errors, at most
C = exp(delta(0)) * sum_i exp(-g_i + delta(g_i)) * delta(g_i), plus the mass's error above. So every
log-prob is within delta(g_j) + C + mass error. For a row spanning 30 nats with c = 1, L <= log1p(30) + 0.054
and delta(g) <= 0.0069 (1 + g).
"""

from __future__ import annotations

import functools
import math

import numpy as np

_NEG_INF_CODE = 255
_MAX_CODE = 254
GAP_SCALE = 1.0  # c of codec version 3, in nats: steps are ~uniform for gaps << c and ~relative for gaps >> c
LEGACY_GAP_SCALE = 4.0  # c of codec versions 1 and 2
MAX_GRID_GAP = 1e6  # rows spanning up to this many nats get a range on the lookup grid (below)
RANGE_LEVELS = 256
TABLE_CHUNK = 1024  # positions per step of the decoders (a chunk's arrays stay in cache)


def range_step(gap_scale: float = GAP_SCALE) -> float:
    """The grid of row ranges L: 0.054 for c = 1, 0.049 for c = 4 (RANGE_LEVELS steps up to MAX_GRID_GAP)."""
    return math.log1p(MAX_GRID_GAP / gap_scale) / (RANGE_LEVELS - 1)


def _row_ranges(max_gaps: np.ndarray, gap_scale: float = GAP_SCALE) -> np.ndarray:
    """Each row's quantization range L >= log1p(max gap / c), rounded up onto the grid of range_step(c) when it fits.

    On the grid, a decoder turns (L, code) into a gap with one lookup in a [RANGE_LEVELS, 256] table instead of an
    expm1 per entry; rounding L up widens a row's code step by at most range_step / L (1.6 % for a row spanning
    30 nats with c = 1, L = 3.43). A row spanning more than MAX_GRID_GAP nats keeps its exact L and decodes the
    slow way.
    """
    step = range_step(gap_scale)
    exact = np.log1p(max_gaps / gap_scale)
    level = np.ceil(exact / step - 1e-9)
    return np.where(level < RANGE_LEVELS, level * step, exact)


def quantize_logprobs(logprobs: np.ndarray, gap_scale: float = GAP_SCALE) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`[N, k]` log-probs -> (codes `[N, k]` uint8, log_mass `[N]` float32, log_range `[N]` float32)."""
    lp = np.asarray(logprobs, dtype=np.float64)
    n, k = lp.shape
    finite = np.isfinite(lp)
    row_max = np.max(np.where(finite, lp, -np.inf), axis=1, initial=-np.inf) if k else np.full(n, -np.inf)
    has_any = np.isfinite(row_max)
    safe_max = np.where(has_any, row_max, 0.0)
    gaps = np.where(finite, safe_max[:, None] - lp, 0.0)
    # L as stored (float32), so the codes are computed with exactly the step the decoder will use
    log_range = _row_ranges(np.max(gaps, axis=1, initial=0.0), gap_scale).astype(np.float32).astype(np.float64)
    scale = np.where(log_range > 0, _MAX_CODE / np.where(log_range > 0, log_range, 1.0), 0.0)
    codes = np.minimum(np.rint(np.log1p(gaps / gap_scale) * scale[:, None]), _MAX_CODE).astype(np.uint8)
    codes[~finite] = _NEG_INF_CODE
    with np.errstate(divide="ignore"):
        shifted = np.where(finite, lp - safe_max[:, None], -np.inf)
        log_mass = np.where(has_any, safe_max + np.log(np.sum(np.exp(shifted), axis=1)), -np.inf)
    return codes, log_mass.astype(np.float32), log_range.astype(np.float32)


@functools.cache
def _gap_pairs(gap_scale: float) -> np.ndarray:
    """(gap, exp(-gap)) for every (grid level, code), as one complex64 table indexed by level << 8 | code.

    gap[level, code] = c * expm1(code * level * range_step / 254). Code 255 (-inf) has gap inf; exp(-gap) is 0
    at code 0 as well, so a row's sum of it is the mass outside its maximum (what the log-sum-exp below needs).
    Pairs, so the decoder gathers each entry's two values in one lookup; 512 KiB: it stays in cache.
    """
    levels = np.arange(RANGE_LEVELS, dtype=np.float64)[:, None] * range_step(gap_scale)
    codes = np.arange(256, dtype=np.float64)[None, :]
    gaps = gap_scale * np.expm1(codes * levels / _MAX_CODE)
    gaps[:, _NEG_INF_CODE] = np.inf
    exp_neg = np.exp(-gaps)
    exp_neg[:, 0] = 0.0
    return (
        np.stack([gaps.astype(np.float32).ravel(), exp_neg.astype(np.float32).ravel()], axis=1)
        .view(np.complex64)
        .ravel()
    )


def dequantize_logprobs(
    codes: np.ndarray, log_mass: np.ndarray, log_range: np.ndarray, gap_scale: float = GAP_SCALE
) -> np.ndarray:
    """Inverse of `quantize_logprobs` (within the module's bound): `[N, k]` float32 whose log-sum-exp is log_mass.

    Rows whose range lies on the grid (every row `quantize_logprobs` writes, unless it spans more than
    MAX_GRID_GAP nats) decode by table lookup; others, and parts written before the grid, compute the same
    values with expm1/exp.
    """
    codes = np.asarray(codes)
    log_range = np.asarray(log_range, dtype=np.float32)
    log_mass = np.asarray(log_mass, dtype=np.float32)
    level, on_grid = grid_levels(log_range, gap_scale)
    if on_grid.all():
        return _dequantize_by_table(codes, log_mass, level, gap_scale)
    out = np.empty(codes.shape, dtype=np.float32)
    out[on_grid] = _dequantize_by_table(codes[on_grid], log_mass[on_grid], level[on_grid], gap_scale)
    off = ~on_grid
    out[off] = _dequantize_exact(codes[off], log_mass[off], log_range[off], gap_scale)
    return out


def _dequantize_by_table(codes: np.ndarray, log_mass: np.ndarray, level: np.ndarray, gap_scale: float) -> np.ndarray:
    out = np.empty(codes.shape, dtype=np.float32)
    level_base = level.astype(np.uint16) << np.uint16(8)
    # TABLE_CHUNK positions at a time, so the [chunk, k] index and gathered values stay in cache
    for start in range(0, len(codes), TABLE_CHUNK):
        rows = slice(start, start + TABLE_CHUNK)
        dequantize_chunk(codes[rows], log_mass[rows], level_base[rows], out[rows], gap_scale)
    return out


def _shift_to_mass(at_max: np.ndarray, rest: np.ndarray, log_mass: np.ndarray) -> np.ndarray:
    """The per-row shift that makes a row's log-sum-exp equal log_mass.

    log-sum-exp as log(n0) + log1p(rest / n0), n0 the entries at the max (code 0, exp(0) = 1 each): for a
    peaked row the rest is ~1e-7 of the max, which 1 + rest would round away in float32, and the tail
    1 - sum p that the losses derive from these values depends on exactly that difference.
    """
    with np.errstate(divide="ignore", invalid="ignore"):
        lse = np.log(at_max) + np.log1p(rest / at_max)
        return np.where(at_max > 0, log_mass - lse, np.float32(0))


def dequantize_chunk(
    codes: np.ndarray, log_mass: np.ndarray, level_base: np.ndarray, out: np.ndarray, gap_scale: float = GAP_SCALE
) -> None:
    """Decode `[rows, k]` codes into `out` by one lookup per entry; level_base: each row's grid level << 8, uint16."""
    # [rows, k] uint16 (level, code) indices: take() widens them to intp itself, faster than building intp here
    index = level_base[:, None] | codes
    pairs = _gap_pairs(gap_scale).take(index)
    at_max = (codes == 0).sum(axis=1, dtype=np.int32).astype(np.float32)
    rest = pairs.imag.sum(axis=1, dtype=np.float32)
    np.negative(pairs.real, out=out)
    out += _shift_to_mass(at_max, rest, log_mass)[:, None]


def _dequantize_exact(
    codes: np.ndarray, log_mass: np.ndarray, log_range: np.ndarray, gap_scale: float = GAP_SCALE
) -> np.ndarray:
    finite = codes != _NEG_INF_CODE
    # float32 arithmetic (numpy's vectorised exp/log): its rounding, ~1e-7 relative, is far below a code step
    step = (log_range / np.float32(_MAX_CODE))[:, None]
    gaps = np.float32(gap_scale) * np.expm1(codes.astype(np.float32) * step)
    rel = np.where(finite, -gaps, np.float32(-np.inf))  # 0 at the row max
    at_max = (codes == 0).sum(axis=1).astype(np.float32)
    rest = np.sum(np.where(finite & (codes != 0), np.exp(rel), np.float32(0)), axis=1)
    out = rel + _shift_to_mass(at_max, rest, log_mass)[:, None]
    return out.astype(np.float32, copy=False)


def logprob_bound(logprobs: np.ndarray, gap_scale: float = GAP_SCALE, mass_quantized: bool = True) -> np.ndarray:
    """The per-entry bound of the module docstring, `[N, k]` (inf where the entry is -inf).

    mass_quantized: the row's mass is stored as `quantize_mass` codes (version 3), not as an exact float32.
    """
    lp = np.asarray(logprobs, dtype=np.float64)
    finite = np.isfinite(lp)
    row_max = np.max(np.where(finite, lp, -np.inf), axis=1)
    gaps = np.where(finite, row_max[:, None] - lp, np.inf)
    log_range = _row_ranges(np.max(np.where(finite, gaps, 0.0), axis=1), gap_scale)
    unit = np.expm1(log_range.astype(np.float32).astype(np.float64) / (2 * _MAX_CODE))[:, None]
    delta = (gap_scale + gaps) * unit
    with np.errstate(invalid="ignore"):
        shift = np.exp(gap_scale * unit[:, 0]) * np.sum(np.where(finite, np.exp(-gaps + delta) * delta, 0.0), axis=1)
    if mass_quantized:
        with np.errstate(divide="ignore", invalid="ignore"):
            log_mass = np.logaddexp.reduce(np.where(finite, lp, -np.inf), axis=1)
        shift = shift + log_mass_bound(log_mass)
    return np.where(finite, delta + shift[:, None], np.inf)


def grid_levels(log_range: np.ndarray, gap_scale: float = GAP_SCALE) -> tuple[np.ndarray, np.ndarray]:
    """(each row's grid level, whether its range lies on the grid) for stored float32 ranges L."""
    log_range = np.asarray(log_range, dtype=np.float32)
    step = range_step(gap_scale)
    level = np.rint(log_range / np.float32(step))
    on_grid = (np.abs(log_range - (level * step).astype(np.float32)) <= 1e-6 * np.maximum(log_range, 1)) & (
        level < RANGE_LEVELS
    )
    return level.astype(np.int32), on_grid


# ---------------------------------------------------------------- the top-k mass (version 3)
MASS_STEP = 2.0**-8  # int16 codes of logit(m): |logit| < 128
_MASS_ZERO, _MASS_ONE = -32768, 32767  # m = 0 (every entry -inf), m = 1 (no tail)


def quantize_mass(log_mass: np.ndarray) -> np.ndarray:
    """`[N]` log top-k masses (float32, <= 0 up to rounding) -> int16 codes of logit(m) in steps of MASS_STEP."""
    lm = np.minimum(np.asarray(log_mass, dtype=np.float64), 0.0)  # a mass rounded above 1 is 1
    with np.errstate(divide="ignore", invalid="ignore"):
        logit = lm - np.log(-np.expm1(lm))  # log m - log(1 - m); +inf at m = 1, -inf at m = 0
        codes = np.clip(np.rint(logit / MASS_STEP), _MASS_ZERO + 1, _MASS_ONE - 1)
    codes = np.where(lm == 0, _MASS_ONE, np.where(np.isneginf(lm), _MASS_ZERO, codes))
    if np.isnan(codes).any():
        raise ValueError("quantize_mass: NaN top-k mass")
    return codes.astype(np.int16)


def dequantize_mass(codes: np.ndarray) -> np.ndarray:
    """Inverse of `quantize_mass`: float32 log m = log sigmoid(code * MASS_STEP) (-inf and 0 at the ends)."""
    codes = np.asarray(codes)
    logit = codes.astype(np.float64) * MASS_STEP
    log_mass = -np.logaddexp(0.0, -logit)
    log_mass = np.where(codes == _MASS_ONE, 0.0, np.where(codes == _MASS_ZERO, -np.inf, log_mass))
    return log_mass.astype(np.float32)


def log_mass_bound(log_mass: np.ndarray) -> np.ndarray:
    """|decoded - true| log m of `quantize_mass`: (1 - m) * h * e**h with h half a step (0 at m = 0 and m = 1)."""
    lm = np.asarray(log_mass, dtype=np.float64)
    half = MASS_STEP / 2
    with np.errstate(invalid="ignore"):
        bound = -np.expm1(lm) * half * math.exp(half)
    return np.where((lm >= 0) | np.isneginf(lm), 0.0, bound)


# ---------------------------------------------------------------- the sampled token's log-prob (version 3)
TOKEN_STEP = 2.0**-9  # uint16 codes of -lp
_TOKEN_NEG_INF = 65535


def quantize_token_logprob(logprob: np.ndarray) -> np.ndarray:
    """`[N]` log-probs -> uint16 codes of -lp in steps of TOKEN_STEP (65535: -inf; below -127.996: that bound)."""
    lp = np.asarray(logprob, dtype=np.float64)
    if np.isnan(lp).any():
        raise ValueError("quantize_token_logprob: NaN log-prob")
    codes = np.clip(np.rint(-lp / TOKEN_STEP), 0, _TOKEN_NEG_INF - 1)
    return np.where(np.isneginf(lp), _TOKEN_NEG_INF, codes).astype(np.uint16)


def dequantize_token_logprob(codes: np.ndarray) -> np.ndarray:
    codes = np.asarray(codes)
    lp = codes.astype(np.float32) * np.float32(-TOKEN_STEP)
    return np.where(codes == _TOKEN_NEG_INF, np.float32(-np.inf), lp).astype(np.float32)
