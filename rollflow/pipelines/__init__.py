"""The pipelines: what `rollflow train` dispatches through `PIPELINES` (`rollflow.config.PIPELINES`).

One driver frame (`rollflow.pipelines.loop.run_pipeline`) runs every pipeline; a pipeline is a step object
(`loop.PipelineStep`): `RLVRStep` and `AgenticStep`, both the shared RL step (`rl_step.RLStep`), and
`SFTStep` / `DPOStep` / `DistillStep`. A new pipeline is one config model, one step class and one entry in
`PIPELINES`.
"""

from __future__ import annotations

from rollflow.config.loading import PIPELINES, Pipeline, RunConfigBase

__all__ = ["PIPELINES", "Pipeline", "run"]


def run(config: RunConfigBase, manage_ray: bool = True) -> dict[str, float]:
    """Run `config` through its pipeline's step in the driver frame (`loop.run_pipeline`). Returns the final
    metrics (the first eval's under `initial_`).

    Args:
        config: a run config (`rollflow.config.load_config`).
        manage_ray: start Ray (per `config.cluster`) and shut it down at the end. False runs in the caller's
            Ray session and leaves it up.
    """
    from rollflow.pipelines.loop import run_pipeline  # torch and the workers: only once a run starts

    return run_pipeline(PIPELINES.get(config.pipeline).step_class()(config), manage_ray)
