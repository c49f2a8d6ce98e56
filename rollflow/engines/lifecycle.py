"""`EngineLifecycle`: the policy version and the asleep / weights-resident / closed state every engine keeps.

An engine holds one (composition, not a base class) and asks it before generating; the engine still does
the library-specific work of sleeping and waking, handed to `sleep` / `wake` as a function, while this
class makes both idempotent and keeps the state in one place.
"""

from __future__ import annotations

from collections.abc import Callable

ASLEEP_MESSAGE = "engine is asleep; call wake() before generate()"
CLOSED_MESSAGE = "engine is closed; build a new engine to use it again"


class EngineLifecycle:
    """Version and sleep state of one engine.

    Attributes:
        version: policy version of the loaded weights (0 until the first `update_weights`).
        asleep: between `sleep()` and `wake()`; `generate` is refused.
        weights_resident: False while asleep with the weights released from the accelerator; a weight load
            while asleep brings them back first and sets it True.
        closed: after the engine's `close()`; nothing is served any more.
    """

    def __init__(self) -> None:
        self.version = 0
        self.asleep = False
        self.weights_resident = True
        self.closed = False

    def check_can_generate(self) -> None:
        """Raise RuntimeError when the engine is closed or asleep (the guard at the top of `generate`)."""
        self.check_open()
        if self.asleep:
            raise RuntimeError(ASLEEP_MESSAGE)

    def check_open(self) -> None:
        """Raise RuntimeError when the engine is closed."""
        if self.closed:
            raise RuntimeError(CLOSED_MESSAGE)

    def sleep(self, release: Callable[[], None], weights_released: bool) -> None:
        """Put the engine to sleep with `release()`, unless it already sleeps.

        Args:
            release: frees the engine's memory (the library call); the state changes only if it returns.
            weights_released: whether `release` took the weights off the accelerator.
        """
        self.check_open()
        if self.asleep:
            return
        release()
        self.asleep, self.weights_resident = True, not weights_released

    def wake(self, resume: Callable[[], None]) -> None:
        """Wake the engine with `resume()`, unless it is awake (see `tags_to_resume`)."""
        self.check_open()
        if not self.asleep:
            return
        resume()
        self.asleep, self.weights_resident = False, True

    def tags_to_resume(self) -> list[str] | None:
        """What `wake` must bring back, in the tags vLLM's `wake_up` and SGLang's `resume_memory_occupation`
        share: None (everything) when the weights were released, else only the KV cache (a weight load
        while asleep already brought the weights back)."""
        return None if not self.weights_resident else ["kv_cache"]

    def close(self) -> bool:
        """Mark the engine closed. Returns whether it was open (so an engine's `close()` runs once)."""
        was_open = not self.closed
        self.closed = True
        return was_open
