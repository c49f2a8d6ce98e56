"""The pipelines and `PIPELINES`: what `rollflow train` dispatches through.

One driver frame (`rollflow.pipelines.loop.run_pipeline`) runs every pipeline; a pipeline is a step object
(`loop.PipelineStep`: `RLVRStep`, `AgenticStep`, `SFTStep` / `DPOStep` / `DistillStep`) and a run function
that hands it to the frame. Each entry names the pipeline's config model (`rollflow.config.PIPELINE_CONFIGS`
holds the same one), the roles a run of it needs (a function of its config) and its run function (imported on
first use, so the CLI stays light). A new pipeline is one config model, one step class with its run function,
and one entry here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rollflow.config import PIPELINE_CONFIGS, RunConfigBase
from rollflow.registry import Registry, import_object


@dataclass(frozen=True)
class Pipeline:
    """One pipeline.

    Attributes:
        config: its run config model (a `RunConfigBase` with `pipeline: Literal[<name>]`).
        roles: `"module:function"`, `config -> [role, ...]`: the roles a run starts, in start order.
        run: `"module:function"`, `run(config, manage_ray=True) -> final metrics`.
    """

    config: type[RunConfigBase]
    roles: str
    run: str

    def roles_of(self, config: RunConfigBase) -> list[str]:
        return import_object(self.roles)(config)

    def runner(self) -> Callable[..., dict[str, Any]]:
        return import_object(self.run)


PIPELINES: Registry[Pipeline] = Registry("pipeline")
PIPELINES.register("rlvr")(Pipeline(PIPELINE_CONFIGS["rlvr"], "rollflow.pipelines.rlvr:rlvr_roles",
                                    "rollflow.pipelines.rlvr:run_rlvr"))
for _name in ("sft", "dpo", "distill"):  # one driver, three objectives (rollflow.pipelines.supervised)
    PIPELINES.register(_name)(Pipeline(PIPELINE_CONFIGS[_name], "rollflow.pipelines.supervised:supervised_roles",
                                       "rollflow.pipelines.supervised:run_supervised"))
PIPELINES.register("agentic")(Pipeline(PIPELINE_CONFIGS["agentic"], "rollflow.pipelines.agentic:agentic_roles",
                                       "rollflow.pipelines.agentic:run_agentic"))
