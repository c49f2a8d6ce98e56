"""Typed run configuration: one pydantic schema per pipeline, YAML file + `a.b=c` overrides, validated on load.

Unknown keys are errors that name the key and suggest the nearest valid one. Batch sizes carry their unit
in the name and each quantity is set once; indivisible combinations are rejected with a message that says
which numbers to change. `sections` holds what every pipeline shares, `rlvr` the RLVR pipeline's sections,
`loading` the loader and the `RunConfig` union over pipelines.
"""

from rollflow.config.loading import (
    DEFAULT_PIPELINE,
    PIPELINE_CONFIGS,
    RunConfig,
    apply_overrides,
    build_config,
    config_model,
    dump_config,
    load_config,
)
from rollflow.config.rlvr import (
    AlgorithmConfig,
    RewardConfig,
    RewardFunctionConfig,
    RLVRConfig,
    RolloutConfig,
    TrainInferCorrectionConfig,
)
from rollflow.config.sections import (
    BUNDLED_MODEL,
    ActorInferConfig,
    ActorTrainConfig,
    ChecksConfig,
    ClusterConfig,
    DataConfig,
    DatasetConfig,
    DomainConfig,
    EvalConfig,
    LoraConfig,
    ModelConfig,
    OutputConfig,
    ReferenceConfig,
    RoleConfig,
    RolesConfig,
    RunConfigBase,
    TrainConfig,
    TrainerRoleConfig,
)

__all__ = [
    "BUNDLED_MODEL",
    "DEFAULT_PIPELINE",
    "PIPELINE_CONFIGS",
    "ActorInferConfig",
    "ActorTrainConfig",
    "AlgorithmConfig",
    "ChecksConfig",
    "ClusterConfig",
    "DataConfig",
    "DatasetConfig",
    "DomainConfig",
    "EvalConfig",
    "LoraConfig",
    "ModelConfig",
    "OutputConfig",
    "RLVRConfig",
    "ReferenceConfig",
    "RewardConfig",
    "RewardFunctionConfig",
    "RoleConfig",
    "RolesConfig",
    "RolloutConfig",
    "RunConfig",
    "RunConfigBase",
    "TrainConfig",
    "TrainInferCorrectionConfig",
    "TrainerRoleConfig",
    "apply_overrides",
    "build_config",
    "config_model",
    "dump_config",
    "load_config",
]
