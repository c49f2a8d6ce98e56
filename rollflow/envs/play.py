"""Play an env without a model: from the terminal (`rollflow env play ENV_ID`), or with a random or scripted
expert policy (to test env code, and as baselines).

A policy is a callable `policy(observation) -> action text`.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Callable
from typing import Any

from rollflow.envs.base import Env
from rollflow.envs.make import make_env
from rollflow.envs.serve_cli import add_serve_parser
from rollflow.errors import ConfigError, RollflowError

Policy = Callable[[str], str]
EXIT_USER_ERROR = 2


def random_policy(env: Any, rng: random.Random) -> Policy:
    """A policy writing the env's uniformly random actions.

    Args:
        env: an env with `random_action(rng)`: a built-in, or a GEM env (`gem:<id>`, GEM's random action).
        rng: the random source of the actions.

    Returns:
        observation -> action text.
    """
    _require(env, "random_action")
    return lambda observation: env.random_action(rng)


def expert_policy(env: Any) -> Policy:
    """A policy writing the env's scripted expert actions.

    Args:
        env: a built-in env (it has `expert_action`).

    Returns:
        observation -> action text.
    """
    _require(env, "expert_action")
    return lambda observation: env.expert_action()


def human_policy(prompt: str = "> ") -> Policy:
    """A policy reading each action from standard input (EOFError when it ends)."""
    return lambda observation: input(prompt)


def _require(env: Any, method: str) -> None:
    if not callable(getattr(env, method, None)):
        raise ConfigError(f"{type(env).__name__} has no {method}(); the built-in envs have scripted policies, "
                          "GEM envs a random one")


def play_help(env: Any) -> str | None:
    """The env's help for a person playing it (its `play_help()`: the legend of its symbols and the moves it
    accepts), or None when it has none (a GEM or user env)."""
    help_of = getattr(env, "play_help", None)
    return help_of() if callable(help_of) else None


def run_episode(
    env: Env, policy: Policy, seed: int | None, max_steps: int = 100, echo: Callable[[str], None] | None = None,
    help_text: str | None = None,
) -> dict[str, Any]:
    """Play one episode.

    Args:
        env: the env.
        policy: observation -> action text.
        seed: the episode's seed.
        max_steps: stop after this many steps even if the env has not ended the episode.
        echo: called with a line of text for each observation, action and reward (None: silent). The reward
            line of the last step says why the episode ended (`info["outcome"]`, when the env gives one:
            `reward: 0 (fell into a hole)`); then `terminated` or `truncated`.
        help_text: echoed before the first observation and after each invalid action (`play_help`).

    Returns:
        {"return": sum of rewards, "steps": steps taken, "success": info["success"] of the last step (False
        when absent), "invalid": steps with `info["invalid_action"]`}.
    """
    say = echo or (lambda line: None)
    observation, info = env.reset(seed)
    total, steps, invalid, success = 0.0, 0, 0, bool(info.get("success", False))
    if help_text:
        say(help_text)
    say(observation)
    for steps in range(1, max_steps + 1):  # noqa: B007  (steps is the count after the loop)
        action = policy(observation)
        say(f"action: {action}")
        observation, reward, terminated, truncated, info = env.step(action)
        total += reward
        invalid += bool(info.get("invalid_action", False))
        success = bool(info.get("success", False))
        ended = terminated or truncated
        notes = ["invalid action"] if info.get("invalid_action") else []
        if ended and info.get("outcome"):
            notes.append(str(info["outcome"]))
        say(observation)
        say(f"reward: {reward:g}" + (f" ({'; '.join(notes)})" if notes else ""))
        if ended:
            say("terminated" if terminated else "truncated")
            break
        if info.get("invalid_action") and help_text:
            say(help_text)
    else:
        say(f"stopped after {max_steps} steps (--max-steps); the episode had not ended")
    return {"return": total, "steps": steps, "success": success, "invalid": invalid}


def add_play_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add `env play` (and `env serve`, `rollflow.envs.serve_cli`) to the `rollflow` command line.

    Args:
        subparsers: the result of `parser.add_subparsers(...)`.

    Returns:
        The `env` parser.
    """
    env = subparsers.add_parser("env", help="environments: play one in the terminal or with a scripted policy, "
                                            "or serve one over HTTP")
    commands = env.add_subparsers(dest="env_command", required=True)
    play = commands.add_parser("play", help="play an env (human from stdin, or a random / expert policy)")
    play.add_argument("env_id", help="frozenlake, sokoban, guess_number, countdown, gem:<id>, gym:<id>, pkg.mod:fn")
    play.add_argument("--seed", type=int, default=0, help="episode seed (default 0)")
    play.add_argument("--policy", choices=("human", "random", "expert"), default="human",
                      help="who acts: you (stdin), random actions, or the scripted expert (default human)")
    play.add_argument("--env-kwargs", default="{}", help='env keyword arguments as JSON, e.g. \'{"size": 5}\'')
    play.add_argument("--max-steps", type=int, default=100, help="stop after this many steps (default 100)")
    play.set_defaults(handler=play_main)
    add_serve_parser(commands)  # `rollflow env serve ENV_ID`
    return env


def play_main(args: argparse.Namespace) -> int:
    """Run `rollflow env play`.

    Args:
        args: the parsed arguments of `add_play_parser`'s `play`.

    Returns:
        The exit status: 0 (the episode ended, or stdin did), 2 for a user error (printed as one line).
    """
    try:
        env_kwargs = json.loads(args.env_kwargs)
        if not isinstance(env_kwargs, dict):
            raise ConfigError(f"--env-kwargs must be a JSON object, got {args.env_kwargs!r}")
        env = make_env(args.env_id, **env_kwargs)
        if args.policy == "human":
            policy = human_policy()
        elif args.policy == "random":
            policy = random_policy(env, random.Random(args.seed))
        else:
            policy = expert_policy(env)
    except json.JSONDecodeError as err:
        print(f"rollflow: error: --env-kwargs is not valid JSON ({err})", file=sys.stderr)
        return EXIT_USER_ERROR
    except (RollflowError, TypeError) as err:  # TypeError: an env keyword argument it does not take
        print(f"rollflow: error: {err}", file=sys.stderr)
        return EXIT_USER_ERROR
    # a person needs the legend and the moves; a scripted policy's output stays the episode alone
    help_text = play_help(env) if args.policy == "human" else None
    try:
        result = run_episode(env, policy, args.seed, args.max_steps, echo=print, help_text=help_text)
    except EOFError:
        print("\nend of input")
        return 0
    except RollflowError as err:  # found at the first action: a GEM env without a random action
        print(f"rollflow: error: {err}", file=sys.stderr)
        return EXIT_USER_ERROR
    print(f"return: {result['return']:g}  steps: {result['steps']}  success: {result['success']}  "
          f"invalid actions: {result['invalid']}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m rollflow.envs.play ENV_ID [...]`: `rollflow env play` without the rest of the CLI."""
    parser = argparse.ArgumentParser(prog="rollflow")
    add_play_parser(parser.add_subparsers(dest="command", required=True))
    return play_main(parser.parse_args(["env", "play", *(sys.argv[1:] if argv is None else argv)]))


if __name__ == "__main__":
    sys.exit(main())
