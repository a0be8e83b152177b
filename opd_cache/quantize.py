"""The 8-bit log-prob quantizer of the `packed` codec (opd_cache/codec.py): codes relative to the row's maximum.

Log-probs are coded by their gap below the row's maximum, g_j = max - lp_j >= 0,
on a log scale so that the entries that carry the mass (small gaps) get the
finest steps: code_j = round(254 * log1p(g_j / c) / L) with L = log1p(max_j g_j / c)
over the finite entries rounded up onto a grid of 256 levels (steps of 0.049; rows spanning more than
1e6 nats keep their exact L), c = GAP_SCALE = 4 nats, and code 255 means -inf (p_j = 0). On the grid, the
reader turns (level, code) into a gap with one table lookup instead of an expm1 and an exp per entry; parts
written before the grid (exact L) decode with the same arithmetic, the slow way.
(c trades the two losses: small c favours forward KL, which weighs entries by the
teacher's p; large c, uniform steps, favours reverse KL, which weighs them by the
student's q; benchmarks/bench_codec.py measures both.) Decoding inverts
the code and then shifts the whole row so that its log-sum-exp equals the stored
`log_mass`: the teacher's tail mass 1 - sum_j p_j, which the losses' tail
bucket uses, is therefore exact (to float32), not a sum of rounded terms.

Bound (tests/test_codec.py checks it for every entry): a gap decodes within
delta(g) = (c + g) * (exp(L / 508) - 1) (half a code step on the log scale),
and the renormalising shift is a weighted mean of those errors, at most
C = exp(delta(0)) * sum_i exp(-g_i + delta(g_i)) * delta(g_i). So every log-prob
is within delta(g_j) + C. For a row spanning 30 nats, L <= log1p(7.5) + 0.049 and delta(g) <= 0.0043 (4 + g).
"""

from __future__ import annotations

import math

import numpy as np

_NEG_INF_CODE = 255
_MAX_CODE = 254
GAP_SCALE = 4.0  # c, in nats: steps are ~uniform for gaps << c and ~relative for gaps >> c
MAX_GRID_GAP = 1e6  # rows spanning up to this many nats get a range on the lookup grid (below)
RANGE_LEVELS = 256
TABLE_CHUNK = 1024  # positions per step of the decoders (a chunk's arrays stay in cache)
RANGE_STEP = math.log1p(MAX_GRID_GAP / GAP_SCALE) / (RANGE_LEVELS - 1)  # 0.049: the grid of row ranges L


def _row_ranges(max_gaps: np.ndarray) -> np.ndarray:
    """Each row's quantization range L >= log1p(max gap / c), rounded up onto the grid of RANGE_STEP when it fits.

    On the grid, a decoder turns (L, code) into a gap with one lookup in a [RANGE_LEVELS, 256] table instead of an
    expm1 per entry; rounding L up widens a row's code step by at most RANGE_STEP / L (1 % for a row spanning
    30 nats, L = 2.14). A row spanning more than MAX_GRID_GAP nats keeps its exact L and decodes the slow way.
    """
    exact = np.log1p(max_gaps / GAP_SCALE)
    level = np.ceil(exact / RANGE_STEP - 1e-9)
    return np.where(level < RANGE_LEVELS, level * RANGE_STEP, exact)


def quantize_logprobs(logprobs: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`[N, k]` log-probs -> (codes `[N, k]` uint8, log_mass `[N]` float32, log_range `[N]` float32)."""
    lp = np.asarray(logprobs, dtype=np.float64)
    n, k = lp.shape
    finite = np.isfinite(lp)
    row_max = np.max(np.where(finite, lp, -np.inf), axis=1, initial=-np.inf) if k else np.full(n, -np.inf)
    has_any = np.isfinite(row_max)
    safe_max = np.where(has_any, row_max, 0.0)
    gaps = np.where(finite, safe_max[:, None] - lp, 0.0)
    # L as stored (float32), so the codes are computed with exactly the step the decoder will use
    log_range = _row_ranges(np.max(gaps, axis=1, initial=0.0)).astype(np.float32).astype(np.float64)
    scale = np.where(log_range > 0, _MAX_CODE / np.where(log_range > 0, log_range, 1.0), 0.0)
    codes = np.minimum(np.rint(np.log1p(gaps / GAP_SCALE) * scale[:, None]), _MAX_CODE).astype(np.uint8)
    codes[~finite] = _NEG_INF_CODE
    with np.errstate(divide="ignore"):
        shifted = np.where(finite, lp - safe_max[:, None], -np.inf)
        log_mass = np.where(has_any, safe_max + np.log(np.sum(np.exp(shifted), axis=1)), -np.inf)
    return codes, log_mass.astype(np.float32), log_range.astype(np.float32)


def _gap_tables() -> tuple[np.ndarray, np.ndarray]:
    """gap[level, code] = c * expm1(code * level * RANGE_STEP / 254) and exp(-gap), for every grid level.

    Code 255 (-inf) has gap inf; exp(-gap) is 0 at code 0 as well, so a row's sum of it is the mass outside its
    maximum (what the log-sum-exp below needs). float32, 256 KiB each: they stay in cache.
    """
    levels = np.arange(RANGE_LEVELS, dtype=np.float64)[:, None] * RANGE_STEP
    codes = np.arange(256, dtype=np.float64)[None, :]
    gaps = GAP_SCALE * np.expm1(codes * levels / _MAX_CODE)
    gaps[:, _NEG_INF_CODE] = np.inf
    exp_neg = np.exp(-gaps)
    exp_neg[:, 0] = 0.0
    return gaps.astype(np.float32), exp_neg.astype(np.float32)


_GAPS, _EXP_NEG_GAPS = _gap_tables()
# both as one table of (gap, exp(-gap)) pairs, so the decoder gathers each entry's two values in one lookup
_GAP_PAIRS = np.stack([_GAPS.ravel(), _EXP_NEG_GAPS.ravel()], axis=1).view(np.complex64).ravel()


def dequantize_logprobs(codes: np.ndarray, log_mass: np.ndarray, log_range: np.ndarray) -> np.ndarray:
    """Inverse of `quantize_logprobs` (within the module's bound): `[N, k]` float32 whose log-sum-exp is log_mass.

    Rows whose range lies on the grid (every row `quantize_logprobs` writes, unless it spans more than
    MAX_GRID_GAP nats) decode by table lookup; others, and parts written before the grid, compute the same
    values with expm1/exp.
    """
    codes = np.asarray(codes)
    log_range = np.asarray(log_range, dtype=np.float32)
    log_mass = np.asarray(log_mass, dtype=np.float32)
    level, on_grid = grid_levels(log_range)
    if on_grid.all():
        return _dequantize_by_table(codes, log_mass, level)
    out = np.empty(codes.shape, dtype=np.float32)
    out[on_grid] = _dequantize_by_table(codes[on_grid], log_mass[on_grid], level[on_grid])
    off = ~on_grid
    out[off] = _dequantize_exact(codes[off], log_mass[off], log_range[off])
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


def _dequantize_by_table(codes: np.ndarray, log_mass: np.ndarray, level: np.ndarray) -> np.ndarray:
    out = np.empty(codes.shape, dtype=np.float32)
    level_base = level.astype(np.uint16) << np.uint16(8)
    # TABLE_CHUNK positions at a time, so the [chunk, k] index and gathered values stay in cache
    for start in range(0, len(codes), TABLE_CHUNK):
        rows = slice(start, start + TABLE_CHUNK)
        dequantize_chunk(codes[rows], log_mass[rows], level_base[rows], out[rows])
    return out


def dequantize_chunk(codes: np.ndarray, log_mass: np.ndarray, level_base: np.ndarray, out: np.ndarray) -> None:
    """Decode `[rows, k]` codes into `out` by one lookup per entry; level_base: each row's grid level << 8, uint16."""
    # [rows, k] uint16 (level, code) indices: take() widens them to intp itself, faster than building intp here
    index = level_base[:, None] | codes
    pairs = _GAP_PAIRS.take(index)
    at_max = (codes == 0).sum(axis=1, dtype=np.int32).astype(np.float32)
    rest = pairs.imag.sum(axis=1, dtype=np.float32)
    np.negative(pairs.real, out=out)
    out += _shift_to_mass(at_max, rest, log_mass)[:, None]


def _dequantize_exact(codes: np.ndarray, log_mass: np.ndarray, log_range: np.ndarray) -> np.ndarray:
    finite = codes != _NEG_INF_CODE
    # float32 arithmetic (numpy's vectorised exp/log): its rounding, ~1e-7 relative, is far below a code step
    step = (log_range / np.float32(_MAX_CODE))[:, None]
    gaps = np.float32(GAP_SCALE) * np.expm1(codes.astype(np.float32) * step)
    rel = np.where(finite, -gaps, np.float32(-np.inf))  # 0 at the row max
    at_max = (codes == 0).sum(axis=1).astype(np.float32)
    rest = np.sum(np.where(finite & (codes != 0), np.exp(rel), np.float32(0)), axis=1)
    out = rel + _shift_to_mass(at_max, rest, log_mass)[:, None]
    return out.astype(np.float32, copy=False)


def logprob_bound(logprobs: np.ndarray) -> np.ndarray:
    """The per-entry bound of the module docstring, `[N, k]` (inf where the entry is -inf)."""
    lp = np.asarray(logprobs, dtype=np.float64)
    finite = np.isfinite(lp)
    row_max = np.max(np.where(finite, lp, -np.inf), axis=1)
    gaps = np.where(finite, row_max[:, None] - lp, np.inf)
    log_range = _row_ranges(np.max(np.where(finite, gaps, 0.0), axis=1)).astype(np.float32).astype(np.float64)
    unit = np.expm1(log_range / (2 * _MAX_CODE))[:, None]
    delta = (GAP_SCALE + gaps) * unit
    with np.errstate(invalid="ignore"):
        shift = np.exp(GAP_SCALE * unit[:, 0]) * np.sum(np.where(finite, np.exp(-gaps + delta) * delta, 0.0), axis=1)
    return np.where(finite, delta + shift[:, None], np.inf)


def grid_levels(log_range: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(each row's grid level, whether its range lies on the grid) for stored float32 ranges L."""
    log_range = np.asarray(log_range, dtype=np.float32)
    level = np.rint(log_range / np.float32(RANGE_STEP))
    on_grid = (np.abs(log_range - (level * RANGE_STEP).astype(np.float32)) <= 1e-6 * np.maximum(log_range, 1)) & (
        level < RANGE_LEVELS
    )
    return level.astype(np.int32), on_grid
