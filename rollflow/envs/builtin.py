"""Imports the built-in envs so they register in `rollflow.envs.base.ENVS`."""

from rollflow.envs import countdown, frozenlake, guess_number, prompts, sokoban  # noqa: F401
