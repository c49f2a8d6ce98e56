"""Guess the number: find a secret integer in a range from "higher" / "lower" answers."""

from __future__ import annotations

import random
from typing import Any

from rollflow.envs.actions import parse_first_integer
from rollflow.envs.base import ENVS, StepResult
from rollflow.errors import ConfigError

INSTRUCTIONS = """\
The first observation is the range, e.g. "guess 1-20". Reply with a number (the first integer in the reply
counts). The answer is "higher" (the secret is larger), "lower" (smaller) or "correct" (reward 1, the episode
ends). A reply without an integer, or with one outside the range, is invalid: a penalty, and the range again."""

HIGHER, LOWER, CORRECT = "higher", "lower", "correct"


@ENVS.register("guess_number")
class GuessNumber:
    """Guess a secret integer drawn from the reset seed.

    Args:
        low: smallest possible secret.
        high: largest possible secret.
        max_turns: guesses (valid or not) before the episode is truncated.
        invalid_penalty: the reward of a step without a guess in the range.
    """

    def __init__(self, low: int = 1, high: int = 20, max_turns: int = 6, invalid_penalty: float = -0.1):
        if low > high:
            raise ConfigError(f"guess_number: low ({low}) must be <= high ({high})")
        self.low, self.high = low, high
        self.max_turns = max_turns
        self.invalid_penalty = invalid_penalty
        self.secret = low
        self.bounds = (low, high)  # what the answers so far allow; the expert guesses the middle
        self.turns = 0
        self.done = False
        self.observation = ""

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        """Draw the secret.

        Args:
            seed: the episode; None draws one.

        Returns:
            (observation, info).
        """
        rng = random.Random(random.randrange(2**31) if seed is None else seed)
        self.secret = rng.randint(self.low, self.high)
        self.bounds = (self.low, self.high)
        self.turns, self.done = 0, False
        self.observation = f"guess {self.low}-{self.high}"
        return self.observation, {"success": False, "anchor": self._anchor()}

    def step(self, action: str) -> StepResult:
        """Take the model's guess.

        Args:
            action: what the model wrote; its first integer is the guess.

        Returns:
            (observation, reward, terminated, truncated, info); the observation is "higher", "lower",
            "correct", or the range again after an invalid reply.
        """
        guess = parse_first_integer(action)
        invalid = guess is None or not self.low <= guess <= self.high
        if self.done:
            return self._result(0.0, invalid)
        self.turns += 1
        if invalid:
            return self._result(self.invalid_penalty, True, f"guess {self.low}-{self.high}")
        low, high = self.bounds
        if guess < self.secret:
            self.bounds = (max(low, guess + 1), high)
            return self._result(0.0, False, HIGHER)
        if guess > self.secret:
            self.bounds = (low, min(high, guess - 1))
            return self._result(0.0, False, LOWER)
        self.done = True
        return self._result(1.0, False, CORRECT)

    def _result(self, reward: float, invalid: bool, observation: str | None = None) -> StepResult:
        self.observation = observation or self.observation
        info = {"success": self.done, "invalid_action": invalid, "anchor": self._anchor()}
        truncated = not self.done and self.turns >= self.max_turns
        if self.done or truncated:
            info["outcome"] = f"guessed the number, {self.secret}" if self.done else \
                f"out of turns: all {self.max_turns} guesses used; the number was {self.secret}"
        return self.observation, reward, self.done, truncated, info

    def play_help(self) -> str:
        """The moves, for a person playing (`rollflow env play`)."""
        return (f"moves: a number from {self.low} to {self.high}; the answer is {HIGHER} (the secret number is "
                f"larger), {LOWER} (smaller) or {CORRECT}; {self.max_turns} guesses")

    def _anchor(self) -> str:
        """The state is the range the answers so far allow (the observation alone does not name it)."""
        return f"{self.bounds[0]}-{self.bounds[1]}"

    def expert_action(self) -> str:
        """Binary search: the middle of the range the answers so far allow."""
        return str((self.bounds[0] + self.bounds[1]) // 2)

    def random_action(self, rng: random.Random) -> str:
        """A uniformly random number of the range."""
        return str(rng.randint(self.low, self.high))
