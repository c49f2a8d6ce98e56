"""Errors a user or a failing run can cause. The CLI prints them as one line and exits non-zero (no
traceback)."""


class RollflowError(Exception):
    """Base for errors caused by user input or a run's state, not by a bug in rollflow.

    `exit_code` is the CLI's exit status for it: 2 for a user error (the default), 1 for a run that failed
    while running (a worker died, training diverged), 0 for a request with nothing to do (`RunFinished`: a
    resume of a run that already reached `train.steps`).
    """

    exit_code = 2


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


class EngineError(RollflowError):
    """An inference engine failed while generating (e.g. the model's outputs became NaN); every request it
    held fails with this error and the engine serves later requests."""

    exit_code = 1


class NonFiniteError(RollflowError):
    """A loss, gradient norm or the weights became non-finite (NaN / inf) during training; the bad update
    never reached the engines.

    `weights_updated` says whether the optimizer step had already changed the trainer's weights (they are
    non-finite) or was refused before it (they are the last good ones).
    """

    exit_code = 1

    def __init__(self, message: str, weights_updated: bool = False):
        super().__init__(message)
        self.weights_updated = weights_updated


class StalledError(RollflowError):
    """A worker call made no progress for `cluster.watchdog_s` seconds."""

    exit_code = 1


class WorkerDiedError(RollflowError):
    """A worker process died (killed, out of memory, crashed) while the driver waited on it; `details` holds
    what Ray knows of the death (exit type, signal, node), for a file in the run directory."""

    exit_code = 1

    def __init__(self, message: str, details: str = ""):
        super().__init__(message)
        self.details = details


class WorkerError(RollflowError):
    """A worker raised an exception that is not a RollflowError (a bug, or a torch / library error).

    The message is one line (role, worker, method, `Type: first line`); `details` holds the worker's full
    traceback text, for a file in the run directory.
    """

    exit_code = 1

    def __init__(self, message: str, details: str = ""):
        super().__init__(message)
        self.details = details


class StepFailedError(RollflowError):
    """Every sample of a step failed (a reward that raises, times out or returns no number for every row;
    an env that raises, hangs or returns what the protocol forbids in every episode): the run stops, naming
    the first sample's error, instead of training on nothing. `details` holds every distinct error with its
    count and the first traceback, for `error.log`."""

    details_label = "every error"

    def __init__(self, message: str, details: str = ""):
        super().__init__(message)
        self.details = details


class RunDirUnwritableError(RollflowError):
    """A file of the run directory could not be written any more (its permissions changed, its file system was
    remounted read-only) while the run ran (exit status 1). Before a run starts, an unwritable `output.dir` is
    a `ConfigError`."""

    exit_code = 1


class DiskFullError(RollflowError):
    """The disk (or the user's quota) filled up while the run wrote a file of its run directory: a fault of the
    run, not of its input (exit status 1)."""

    exit_code = 1
