"""Prompt datasets and reward functions (see prompts.py, rewards.py, arithmetic.py)."""

from opd_cache.tasks.prompts import PromptSet, load_prompts
from opd_cache.tasks.rewards import compute_score, get_reward_fn, lenient_answer, register_reward, score, strict_answer

__all__ = [
    "PromptSet",
    "compute_score",
    "get_reward_fn",
    "lenient_answer",
    "load_prompts",
    "register_reward",
    "score",
    "strict_answer",
]
