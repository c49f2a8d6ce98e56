"""`cluster.sim`: the settings of a simulated cluster (`cluster.device: sim`), where the `sim` engine and the
`sim` training backend replace the model math with a hardware profile's costs (docs/simulation.md), and the
checks that a run is simulated all through or not at all."""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator

from rollflow.config.values import Strict
from rollflow.sim.profiles import DEFAULT_PROFILE, PROFILES, SimSettings


class SimConfig(Strict):
    profile: str = Field(
        default=DEFAULT_PROFILE,
        description="The hardware profile of a simulated GPU (its decode, prefill, training, sync and offload "
                    "costs): `h800-7b` or `h200-7b`; see [simulation.md](simulation.md).")
    time_scale: float = Field(
        default=20.0, gt=0,
        description="Simulated seconds per wall-clock second: 60 runs a simulated hour in a minute.")
    token_scale: int = Field(
        default=16, ge=1,
        description="Simulated tokens per token a sample carries: costs count simulated tokens, the driver "
                    "moves 1/token_scale of them.")
    overrides: dict[str, Any] = Field(
        default={},
        description="Profile fields replaced, e.g. `{max_running: 128, sync_fixed_s: 2.0}`.")

    @field_validator("profile")
    @classmethod
    def _known_profile(cls, name: str) -> str:
        if name not in PROFILES:
            raise ValueError(PROFILES.unknown_message(name))
        return name

    def settings(self, gpus: int = 1) -> SimSettings:
        """The engines' and trainers' `SimSettings`, for a worker of `gpus` simulated GPUs."""
        return SimSettings(self.profile, self.time_scale, self.token_scale, dict(self.overrides), gpus)


def check_simulated(config: Any) -> None:
    """A simulated cluster runs the `sim` engine and the `sim` actor backend, on `cluster.num_devices`
    simulated GPUs; the `sim` engine and backend run nowhere else.

    Raises:
        ValueError: one line naming the key to change.
    """
    cluster, roles = config.cluster, config.roles
    if cluster.device != "sim":
        if roles.actor_infer.engine == "sim" or roles.actor_train.backend == "sim":
            raise ValueError("the sim engine and backend simulate GPUs: set cluster.device: sim (and "
                             "cluster.num_devices), see docs/simulation.md")
        return
    if cluster.num_devices is None:
        raise ValueError("cluster.device sim needs cluster.num_devices: the simulated GPUs of the cluster")
    if roles.actor_infer.engine != "sim":
        raise ValueError(f"cluster.device sim simulates the engines: set roles.actor_infer.engine: sim "
                         f"(it is {roles.actor_infer.engine})")
    if roles.actor_train.backend != "sim":
        raise ValueError(f"cluster.device sim simulates the trainer: set roles.actor_train.backend: sim "
                         f"(it is {roles.actor_train.backend})")
    cluster.sim.settings().hardware()  # unknown override fields fail here, before anything starts
