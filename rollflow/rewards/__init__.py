"""Reward functions: `fn(completion: str, **row) -> float | dict[str, float]`, picked by name or dotted path.

Importing this package registers the built-in rewards in `REWARD_FUNCTIONS`: `math_answer`,
`exact_match`, `boxed_format`, `length_penalty`, `code_tests` and `instruction_rules`, and the model rewards
(`ModelReward`, scored a group at a time in reward workers) `llm_judge`, `http_judge` and `reward_model`.
"""

from rollflow.rewards.code import code_tests
from rollflow.rewards.combine import (
    CombinedReward,
    DomainRewards,
    GroupReward,
    PendingGroup,
    RewardScoreError,
    combine_rewards,
)
from rollflow.rewards.configured import configured_rewards, model_rewards
from rollflow.rewards.judge import HTTPJudgeOptions, LLMJudgeOptions, parse_score, render_judge_prompt
from rollflow.rewards.math import boxed_format, exact_match, length_penalty, math_answer
from rollflow.rewards.registry import (
    REWARD_FUNCTIONS,
    GroupScorer,
    MissingColumnError,
    ModelReward,
    RewardLoadError,
    ScoreError,
    require_column,
    resolve_reward,
)
from rollflow.rewards.reward_model import RewardModelOptions
from rollflow.rewards.rules import INSTRUCTION_RULES, instruction_rules
from rollflow.rewards.sandbox import Sandbox, SandboxLimits, SandboxResult
from rollflow.rewards.sandbox_isolation import detect_isolation

__all__ = [
    "INSTRUCTION_RULES",
    "REWARD_FUNCTIONS",
    "CombinedReward",
    "DomainRewards",
    "GroupReward",
    "GroupScorer",
    "HTTPJudgeOptions",
    "LLMJudgeOptions",
    "MissingColumnError",
    "ModelReward",
    "PendingGroup",
    "RewardLoadError",
    "RewardModelOptions",
    "RewardScoreError",
    "Sandbox",
    "SandboxLimits",
    "SandboxResult",
    "ScoreError",
    "boxed_format",
    "code_tests",
    "combine_rewards",
    "configured_rewards",
    "detect_isolation",
    "exact_match",
    "instruction_rules",
    "length_penalty",
    "math_answer",
    "model_rewards",
    "parse_score",
    "render_judge_prompt",
    "require_column",
    "resolve_reward",
]
