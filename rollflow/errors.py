"""Errors a user can cause. The CLI prints them as one line and exits non-zero (no traceback)."""


class RollflowError(Exception):
    """Base for errors caused by user input or a run's state, not by a bug in rollflow."""


class ConfigError(RollflowError):
    """The config file or an override is wrong."""


class DataError(RollflowError):
    """A dataset is missing, unreadable, or lacks a required column."""


class ModelLoadError(RollflowError):
    """A model or tokenizer could not be loaded from the given path or hub id."""


class WeightSyncError(RollflowError):
    """Weights that reached an inference engine differ from the ones the trainer sent."""


class ParityError(RollflowError):
    """Trainer and inference engine disagree on the logprobs of the same tokens."""
