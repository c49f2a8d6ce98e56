"""Reward registry and `resolve_reward`: names, dotted paths, options, one-line errors."""

from __future__ import annotations

import sys
import textwrap

import pytest

from rollflow.registry import UnknownNameError
from rollflow.rewards import REWARD_FUNCTIONS, RewardLoadError, exact_match, math_answer, resolve_reward


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """A user package `user_rewards_pkg.scores` on sys.path, removed afterwards."""
    package = tmp_path / "user_rewards_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "scores.py").write_text(
        textwrap.dedent(
            """
            NOT_CALLABLE = 3

            def score(completion, *, bonus=0.0, **row):
                return len(completion) + bonus

            class Holder:
                @staticmethod
                def nested(completion, **row):
                    return 1.0

            from dataclasses import dataclass
            from rollflow.rewards import ModelReward

            @dataclass(frozen=True, kw_only=True)
            class VerifierOptions:
                threshold: float = 0.5

                def __post_init__(self):
                    if not 0 <= self.threshold <= 1:
                        raise ValueError(f"threshold must be in [0, 1], got {self.threshold}")

            class Verifier:
                def __init__(self, options, device="cpu"):
                    self.options, self.device = options, device

                async def score_group(self, completions, rows):
                    return [float(len(c) > self.options.threshold) for c in completions]

            verifier = ModelReward("user_rewards_pkg.scores:Verifier", VerifierOptions)
            """
        )
    )
    (package / "broken.py").write_text("import module_that_does_not_exist_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "user_rewards_pkg"
    for name in [n for n in sys.modules if n.startswith("user_rewards_pkg")]:
        del sys.modules[name]


def test_builtin_names_are_registered():
    assert {"math_answer", "exact_match", "boxed_format", "length_penalty"} <= set(REWARD_FUNCTIONS.names())
    assert resolve_reward("math_answer") is math_answer
    assert resolve_reward(" exact_match ") is exact_match


def test_registry_get_unknown_lists_valid_names():
    with pytest.raises(UnknownNameError, match="Did you mean 'math_answer'.*exact_match"):
        REWARD_FUNCTIONS.get("math_anwser")


def test_dotted_paths_colon_and_dot(user_module):
    assert resolve_reward("user_rewards_pkg.scores:score")("abc") == 3
    assert resolve_reward("user_rewards_pkg.scores.score")("abcd") == 4
    assert resolve_reward("user_rewards_pkg.scores:Holder.nested")("x") == 1.0


def test_options_are_bound_and_checked(user_module):
    fn = resolve_reward("user_rewards_pkg.scores:score", {"bonus": 0.5})
    assert fn("ab", answer="unused") == 2.5
    with pytest.raises(RewardLoadError, match="does not take option.*bogus.*its options: bonus"):
        resolve_reward("user_rewards_pkg.scores:score", {"bogus": 1})
    assert resolve_reward("math_answer", {"timeout_s": 1.0}).keywords == {"timeout_s": 1.0}


@pytest.mark.parametrize(
    ("spec", "pattern"),
    [
        (
            "user_rewards_pkg.missing_module:score",
            r"cannot import module 'user_rewards_pkg.missing_module' \(ModuleNotFoundError",
        ),
        (
            "user_rewards_pkg.broken:score",
            r"cannot import module 'user_rewards_pkg.broken' \(ModuleNotFoundError: No module named 'module_that_does_not_exist_xyz'",
        ),
        ("user_rewards_pkg.scores:nope", r"module 'user_rewards_pkg.scores' has no attribute 'nope'"),
        ("user_rewards_pkg.scores:NOT_CALLABLE", r"is a int, not a callable"),
        ("math_anwser", r"unknown reward function 'math_anwser'. Did you mean 'math_answer'\?.*dotted path"),
        (":score", r"not a path of the form"),
        ("", r"non-empty string"),
    ],
)
def test_load_errors_are_one_line(user_module, spec, pattern):
    with pytest.raises(RewardLoadError, match=pattern) as info:
        resolve_reward(spec)
    assert "\n" not in str(info.value)
    assert isinstance(info.value, ValueError)


def test_user_model_reward_by_dotted_path(user_module):
    import asyncio

    from rollflow.rewards import ModelReward

    reward = resolve_reward("user_rewards_pkg.scores:verifier", {"threshold": 1.0})
    assert isinstance(reward, ModelReward) and reward.options.threshold == 1.0
    scorer = reward.build(device="cpu")  # what the reward worker does
    assert asyncio.run(scorer.score_group(["a", "ab"], [{}, {}])) == [0.0, 1.0]
    with pytest.raises(RewardLoadError, match=r"^reward 'user_rewards_pkg.scores:verifier': threshold must be in"):
        resolve_reward("user_rewards_pkg.scores:verifier", {"threshold": 2.0})
    with pytest.raises(RewardLoadError, match="does not take option.*margin.*its options: threshold"):
        resolve_reward("user_rewards_pkg.scores:verifier", {"margin": 1})
    with pytest.raises(RuntimeError, match="needs bound options"):
        ModelReward("user_rewards_pkg.scores:Verifier", object).build()
