"""Reward functions: did a response get the answer right?

Two parsers, following GSM8K's `#### <answer>` convention:

- strict: the number right after the *last* `####` (commas stripped). A
  response that computes the right number but writes it in another format
  scores 0. This is the accuracy that distillation from a teacher that uses
  the format should raise.
- lenient: the last number anywhere in the text. When the optional
  `math-verify` package is installed (`pip install opd-cache[math]`), a
  response whose last number is wrong still counts if math-verify finds it
  equivalent to the ground truth (e.g. `\\boxed{85}` followed by other text).

Reward functions are looked up by the prompt's `data_source` (verl's routing
key); unknown sources use the GSM8K-style `score`.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from decimal import Decimal, InvalidOperation

# A number: optional minus, digits with optional thousands commas, optional decimals.
_NUMBER = r"-?\d[\d,]*(?:\.\d+)?"
_NUMBER_RE = re.compile(_NUMBER)
# Right after "####": optional spaces and a dollar sign, then the number.
_AFTER_MARKER_RE = re.compile(r"\s*\$?\s*(" + _NUMBER + ")")


def _clean_number(text: str) -> str:
    return text.replace(",", "")


def strict_answer(text: str) -> str | None:
    """The number right after the last `####` in `text` (commas removed), or None."""
    position = text.rfind("####")
    if position < 0:
        return None
    match = _AFTER_MARKER_RE.match(text, position + 4)
    return _clean_number(match.group(1)) if match else None


def lenient_answer(text: str) -> str | None:
    """The last number in `text` (commas removed), or None."""
    numbers = _NUMBER_RE.findall(text)
    return _clean_number(numbers[-1]) if numbers else None


def answers_equal(answer: str | None, ground_truth: str) -> bool:
    """Numeric equality when both parse as numbers ("85" == "85.0"), else exact string equality."""
    if answer is None:
        return False
    truth = _clean_number(ground_truth.strip())
    try:
        return Decimal(answer) == Decimal(truth)
    except InvalidOperation:
        return answer.strip() == truth


def _math_verify_equal(text: str, ground_truth: str) -> bool:
    try:
        from math_verify import parse, verify
    except ImportError:
        return False
    # math-verify's timeouts use SIGALRM, which only the main thread may set.
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    try:
        return bool(
            verify(
                parse(ground_truth, parsing_timeout=timeout),
                parse(text, parsing_timeout=timeout),
                timeout_seconds=timeout,
            )
        )
    except Exception:  # a response math-verify cannot parse is simply not equivalent
        return False


def score(text: str, ground_truth: str) -> dict[str, int]:
    """GSM8K-style scoring of one response: {"strict": 0 or 1, "lenient": 0 or 1}."""
    if ground_truth is None:
        raise ValueError("score: ground_truth is None (the prompt dataset has no answer for this row)")
    strict = answers_equal(strict_answer(text), ground_truth)
    lenient = strict or answers_equal(lenient_answer(text), ground_truth) or _math_verify_equal(text, ground_truth)
    return {"strict": int(strict), "lenient": int(lenient)}


# ---------------------------------------------------------------- registry by data_source
RewardFn = Callable[[str, str], dict[str, int]]

DEFAULT_REWARD: RewardFn = score
_REWARDS: dict[str, RewardFn] = {}


def register_reward(data_source: str, fn: RewardFn) -> None:
    """Use `fn(text, ground_truth) -> dict` for prompts whose data_source is `data_source`."""
    _REWARDS[data_source] = fn


def get_reward_fn(data_source: str | None) -> RewardFn:
    """The reward function for a data_source; unknown or missing sources get `score`."""
    return _REWARDS.get(data_source, DEFAULT_REWARD) if data_source is not None else DEFAULT_REWARD


def compute_score(data_source: str | None, text: str, ground_truth: str) -> dict[str, int]:
    return get_reward_fn(data_source)(text, ground_truth)


for _name in ("arithmetic", "openai/gsm8k", "gsm8k"):
    register_reward(_name, score)
