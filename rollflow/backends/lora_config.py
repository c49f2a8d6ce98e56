"""The LoRA section of a trainer role's config (`rollflow.backends.lora` trains it); imports no torch."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class LoraConfig(BaseModel):
    """Train LoRA adapters (PEFT) instead of all weights; the base model stays frozen.

    The `roles.actor_train.lora` config section; defined with the backends, which read it, so they need
    nothing from the config package; in a module of its own, so the config loads without torch.
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    rank: int = Field(default=8, gt=0, description="Rank of the adapter update `B A`.")
    alpha: float = Field(
        default=16.0, gt=0,
        description="Scale of the update: an adapted layer computes `W x + (alpha / rank) B A x`.")
    dropout: float = Field(
        default=0.0, ge=0, lt=1, description="Dropout on the adapter input (in training only).")
    target_modules: list[str] | str = Field(
        default="all-linear",
        description="PEFT module names (e.g. `[q_proj, v_proj]`), or `all-linear`: every linear layer but "
                    "the LM head.")
