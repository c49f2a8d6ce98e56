"""The rollout settings every pipeline that samples shares, under one vocabulary: a step trains on
`groups_per_step` groups of `group_size` samples (a prompt's completions, or an env seed's episodes), and the
rollout core's policy (refills, staleness, over-provisioning, rounds) is set by the same keys in RLVR and
agentic configs. Old names are read for one release, with a warning (`RENAMED`)."""

from __future__ import annotations

import sys
from typing import Any, Literal

from pydantic import Field, model_validator

from rollflow.config.sections import Strict

# old key -> new key, in `rollout:`; read with a deprecation line until the next release
RENAMED = {"prompts_per_step": "groups_per_step", "samples_per_prompt": "group_size",
           "max_refill_prompts": "max_refill_groups"}


def renamed(data: Any, section: str, renames: dict[str, str], defaults: dict[str, Any]) -> Any:
    """`data` with the old keys of `section` under their new names, each announced on stderr once per load.

    Args:
        defaults: the new keys' defaults (an override of a section the config file lacks starts from them: a
            new key at its default is not a conflict).

    Raises:
        ValueError: a key given under both names (the new one not at its default).
    """
    if not isinstance(data, dict) or not renames.keys() & data.keys():
        return data
    data = dict(data)
    for old, new in renames.items():
        if old not in data:
            continue
        if new in data and data[new] != defaults.get(new):
            raise ValueError(f"{section}.{old} is the old name of {section}.{new}, and both are set; keep "
                             f"{section}.{new}")
        print(f"rollflow: warning: {section}.{old} is now {section}.{new}; the old name is read until the next "
              "release", file=sys.stderr, flush=True)
        data[new] = data.pop(old)
    return data


class SamplingFields(Strict):
    """How one response (or one turn) is sampled."""

    max_new_tokens: int = Field(
        default=8, gt=0,
        description="Response length limit (of one turn, in agentic runs), in tokens; a response that hits it is "
                    "`truncated`.")
    temperature: float = Field(
        default=1.0, gt=0,
        description="Sampling temperature; the trainer computes its logprobs at the same temperature.")
    top_p: float = Field(
        default=1.0, gt=0, le=1,
        description="Nucleus sampling: sample from the most likely tokens that hold this much probability; "
                    "1: off.")
    top_k: int = Field(default=0, ge=0, description="Sample from the k most likely tokens; 0: off.")


class GroupFlowFields(Strict):
    """The groups a step trains on and the rollout core's policy for them ([async.md](async.md))."""

    groups_per_step: int = Field(
        default=16, gt=0,
        description="Groups a step trains on: prompts (RLVR) or env seeds (agentic).")
    group_size: int = Field(
        default=8, gt=0,
        description="Samples per group: completions of one prompt (the GRPO group), or episodes of one env seed.")
    max_refill_groups: int | None = Field(
        default=None, ge=0,
        description="Dynamic sampling (DAPO): a group dropped (by `algorithm.difficulty_mask`, because it "
                    "failed, or as stale) is replaced by a new one, at most this many per step; then the step "
                    "trains on what it has (`rollout/refill_bound_hit`). `null`: `groups_per_step`; 0: no refills "
                    "(the batch shrinks).")
    max_staleness: int = Field(
        default=0, ge=0,
        description="Asynchronous training (ROLL Flash): the engines keep generating (envs keep playing) while "
                    "the trainer trains, at most this many policy versions ahead (`staleness_control` says how "
                    "the bound is kept). 0: synchronous steps; a bound above `train.steps` acts as "
                    "`train.steps`. Needs `actor_infer` on devices disjoint from the trainer's "
                    "(`device_mapping`); RLVR turns on `algorithm.train_infer_correction` unless set.")
    staleness_control: Literal["admission", "drop"] = Field(
        default="admission",
        description="How asynchronous training keeps `max_staleness`: `admission` bounds it where a group is "
                    "drawn, and steps take their groups in the order they were drawn: a slow group holds its step "
                    "back while later groups keep generating, no finished group is dropped and no response length "
                    "is favoured. `drop` hands out the first groups to finish and drops a group whose oldest token "
                    "is older than the bound (`rollout/stale_dropped`): faster when responses have a long tail, but "
                    "the long ones are dropped, which biases training towards short answers (docs/async.md).")
    partial_rollout: Literal["continue", "resubmit"] = Field(
        default="continue",
        description="Asynchronous mode, when new weights reach the engines mid-generation: `continue` (the "
                    "running samples go on with the new weights from the next token; each token records its "
                    "version) or `resubmit` (abort them and send each unfinished sample again as prompt + its "
                    "tokens so far, kept with their logprobs and versions: for engines that cannot swap weights "
                    "under a running request).")
    overprovision: float = Field(
        default=1.0, ge=1.0,
        description="Tail batching (RollPacker): a synchronous step launches ceil(overprovision x "
                    "groups_per_step) groups, trains on the first `groups_per_step` that finish and cuts the rest "
                    "(their requests are aborted); they wait for a long round. 1: off.")
    long_round_every: int = Field(
        default=0, ge=0,
        description="With `overprovision > 1`: every N-th step plays the cut groups to the end (a long round); "
                    "0: a long round once `groups_per_step` cut groups wait.")
    deterministic: bool = Field(
        default=True,
        description="Reproducible rollouts: each sample draws from its own generator keyed by (seed, step, group, "
                    "sample), and a step's requests go out in rounds: each engine worker gets its share as one "
                    "batch in a fixed order (agentic: every turn of the step's episodes), so batch composition (and "
                    "so every float) does not depend on timing. Two runs with the same seed and config then log "
                    "the same metrics. `false` sends each request to the least-loaded worker as it frees up "
                    "(faster with engine workers of uneven speed, or envs of uneven latency). Asynchronous "
                    "(`max_staleness > 0`) and over-provisioned (`overprovision > 1`) rollouts depend on timing by "
                    "nature: their seeds stay fixed, their batches do not.")

    @model_validator(mode="before")
    @classmethod
    def _old_names(cls, data: Any) -> Any:
        defaults = {new: cls.model_fields[new].default for new in RENAMED.values()}
        return renamed(data, "rollout", RENAMED, defaults)

    @property
    def refill_bound(self) -> int:
        return self.groups_per_step if self.max_refill_groups is None else self.max_refill_groups
