"""The warm worker: what the idle worker of a Ray the command line started early imports before the run asks
for it (`rollflow.cluster.prestart.prestart_ray`, `warm_up`).

`rollflow train` starts Ray's head in a process of its own before it loads its config; that head's raylet
also starts one idle Python worker. While the driver imports its own modules and checks its inputs, this
worker imports what a trainer or engine worker's constructor would (torch, the worker classes, the model's
transformers modeling code, ~4 s of CPU on a small machine) on the other core; the run's first actor then
lands on it with all that done. Every worker of that Ray runs `setup_worker` (Ray's worker setup hook); the
others only get `lean_process`.
"""

from __future__ import annotations

import os
import time

from rollflow.cluster.ray_environment import is_warm_worker, lean_process
from rollflow.spans import record

SETUP_HOOK = "rollflow.workers.warm.setup_worker"  # what `prestart_ray(warm_up=...)` names
MODEL_VARIABLE = "ROLLFLOW_WARM_MODEL"  # the model whose modeling code the warm worker imports


def setup_worker() -> None:
    """Ray's setup hook in each worker of a prestarted Ray: `lean_process`, then, in the warm worker only,
    `warm_up` of the model `ROLLFLOW_WARM_MODEL` names (the config's default model when it is not set)."""
    lean_process()
    if is_warm_worker():
        started = time.time()
        warm_up(os.environ.get(MODEL_VARIABLE))
        record("warm up", started, time.time())  # in the lane of the actor that takes this worker over


def warm_up(model_path: str | None) -> None:
    """Import the worker classes (torch, transformers, the hf engine) and, for a bundled model or a local
    directory, its modeling code. Best effort: whatever fails here is left for the actor to report. Nothing is
    built and no thread pool is started (the actor pins its threads when it starts)."""
    try:
        import rollflow.engines.hf  # noqa: F401 -- torch, transformers
        import rollflow.workers.hybrid  # noqa: F401 -- actor_train, rollout
        from rollflow.backends import backend_class
        from rollflow.config.sections import BUNDLED_MODEL
        from rollflow.models import preload_model_code, resolve_model_path

        backend_class("torch")
        model_path = model_path or BUNDLED_MODEL
        if os.path.isdir(resolve_model_path(model_path)):  # a hub id could mean a download: left to the actor
            preload_model_code(model_path)
    except Exception:  # noqa: BLE001,S110 -- a warm-up, not a check
        pass
