"""Guess the number: seeded secrets, answers, the integer parser, the binary-search expert."""

from __future__ import annotations

import random

import pytest

from rollflow.envs.actions import parse_first_integer
from rollflow.envs.guess_number import GuessNumber
from rollflow.envs.play import expert_policy, random_policy, run_episode
from rollflow.errors import ConfigError


@pytest.mark.parametrize(("text", "expected"), [
    ("12", 12), ("I guess 7.", 7), ("\\boxed{15}", 15), ("-3", -3), ("3 or 4", 3),
    ("", None), ("hello", None), ("\x00junk", None), ("9" * 19, None), ("9" * 5000, None),
])
def test_parse_first_integer(text, expected):
    assert parse_first_integer(text) == expected


def test_answers_and_success():
    env = GuessNumber()
    observation, info = env.reset(0)
    assert observation == "guess 1-20" and info["success"] is False
    secret = env.secret
    assert 1 <= secret <= 20
    if secret > 1:
        assert env.step(f"{secret - 1}")[:4] == ("higher", 0.0, False, False)
    if secret < 20:
        assert env.step(f"maybe {secret + 1}?")[:4] == ("lower", 0.0, False, False)
    observation, reward, terminated, truncated, info = env.step(str(secret))
    assert (observation, reward, terminated, truncated, info["success"]) == ("correct", 1.0, True, False, True)


def test_seeds_fix_the_secret():
    env = GuessNumber(low=1, high=1000)
    secrets = []
    for seed in range(10):
        env.reset(seed)
        secrets.append(env.secret)
    env.reset(3)
    assert env.secret == secrets[3]
    assert len(set(secrets)) > 5


@pytest.mark.parametrize("junk", ["", "hello", "\x00junk", "0", "21"])
def test_invalid_action_penalty_and_state_unchanged(junk):
    env = GuessNumber(invalid_penalty=-0.2)
    env.reset(1)
    env.step("10")  # narrows the bounds
    bounds = env.bounds
    observation, reward, terminated, truncated, info = env.step(junk)
    assert (observation, reward, terminated, truncated) == ("guess 1-20", -0.2, False, False)
    assert info["invalid_action"] is True and env.bounds == bounds


def test_truncation_at_max_turns():
    env = GuessNumber(max_turns=2)
    env.reset(0)
    wrong = "1" if env.secret != 1 else "2"
    assert env.step(wrong)[3] is False
    _, _, terminated, truncated, info = env.step(wrong)
    assert (terminated, truncated, info["success"]) == (False, True, False)


def test_expert_is_binary_search():
    env = GuessNumber(low=1, high=20)
    env.reset(0)
    env.secret = 14  # 10 -> higher, bounds 11-20 -> 15 -> lower, bounds 11-14 -> 12 -> higher, 13-14 -> 13, 14
    guesses = []
    for _ in range(5):
        guesses.append(env.expert_action())
        if env.step(guesses[-1])[2]:
            break
    assert guesses == ["10", "15", "12", "13", "14"]


def test_expert_solves_every_seed_and_random_does_not():
    env = GuessNumber()  # 1-20 in 6 guesses: binary search needs at most 5 (2^5 = 32 > 20)
    expert = [run_episode(env, expert_policy(env), seed) for seed in range(100)]
    assert all(result["success"] and result["steps"] <= 5 for result in expert)
    rng = random.Random(0)
    randoms = [run_episode(env, random_policy(env, rng), seed) for seed in range(100)]
    # Random guesses with replacement: P(hit in 6) = 1 - (19/20)^6 ~ 0.26.
    assert sum(result["success"] for result in randoms) < 45


def test_anchor_names_the_remaining_range():
    env = GuessNumber()
    env.reset(0)
    env.secret = 14
    assert env.step("10")[4]["anchor"] == "11-20"


def test_bad_config():
    with pytest.raises(ConfigError):
        GuessNumber(low=5, high=4)
