"""Exact old logprobs for asynchronous training: the trainer's logprobs of each token under the weights of the
policy version that sampled it (`algorithm.old_logprobs: exact`).

With staleness, a step trains tokens sampled by older versions (up to `rollout.max_staleness` behind; with
partial rollout one response may mix versions). Their total importance ratio pi_theta / pi_engine(v) is two
different things (the "missing old-logit problem" of the asynchronous off-policy correction paper in the seeds):

    pi_theta / pi_engine(v) = [pi_train(v) / pi_engine(v)]   the train-inference discrepancy, same version v
                            * [pi_theta / pi_train(v)]        the staleness, version v -> the current policy

`algorithm.old_logprobs: current` (the default) takes the trainer's logprobs under the weights at the start
of the step as "old": the discrepancy correction (`train_infer_correction`, TIS / MIS) then sees the staleness
too, and the PPO clip none of it (its ratio starts at 1). `exact` keeps the two apart: the trainer keeps the
trainable weights of the last `max_staleness + 1` versions on the host (`VersionSnapshots`) and computes each
token's old logprob with its own version's weights (`exact_old_logprobs`): TIS / MIS see only the discrepancy,
the PPO clip bounds the staleness, and each has its metric (`actor/train_infer_*`, `actor/staleness_*`).

The cost: one copy of the trainable weights per kept version in host memory (LoRA: the adapters only), a copy
of them after each update, and a forward pass over the batch before the update (a row whose tokens span
versions is run once per version) where `current` with one optimizer step per RL step runs none.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Iterator

import torch

from rollflow.data.sample import Batch
from rollflow.errors import RollflowError


class VersionSnapshots:
    """The trainable parameters of the last `keep` policy versions, on CPU, by version.

    Args:
        keep: how many versions are kept (the newest; `rollout.max_staleness + 1`).
    """

    def __init__(self, keep: int):
        if keep < 1:
            raise ValueError(f"keep must be at least 1, got {keep}")
        self.keep = keep
        self.versions: OrderedDict[int, dict[str, torch.Tensor]] = OrderedDict()

    def take(self, version: int, model: torch.nn.Module) -> None:
        """Keep `model`'s trainable parameters as `version`'s; the oldest beyond `keep` are dropped."""
        self.versions[version] = {name: parameter.detach().to("cpu", copy=True)
                                  for name, parameter in _trainable(model)}
        while len(self.versions) > self.keep:
            self.versions.popitem(last=False)

    def clear(self) -> None:
        self.versions.clear()

    @contextlib.contextmanager
    def weights_of(self, version: int, model: torch.nn.Module) -> Iterator[None]:
        """Within the block `model` computes with `version`'s weights; its own come back after, untouched.

        Raises:
            RollflowError: `version` is not kept (older than the staleness bound allows, or from before a
                resume).
        """
        if version not in self.versions:
            raise RollflowError(
                f"algorithm.old_logprobs=exact: no weights of policy version {version} (kept: "
                f"{sorted(self.versions)}); a token older than rollout.max_staleness versions reached the trainer")
        snapshot = self.versions[version]
        own = {}
        try:
            for name, parameter in _trainable(model):
                own[name] = parameter.data
                parameter.data = snapshot[name].to(parameter.device)
            yield
        finally:
            for name, parameter in _trainable(model):
                if name in own:
                    parameter.data = own[name]


def _trainable(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """The parameters an update changes (every one of a model trained in full; LoRA's adapters)."""
    return ((name, parameter) for name, parameter in model.named_parameters() if parameter.requires_grad)


def exact_old_logprobs(backend, snapshots: VersionSnapshots, batch: Batch, version: int,
                       temperature: float) -> tuple[torch.Tensor, dict[str, float]]:
    """Each response token's logprob under the weights of the version that sampled it (`batch.policy_versions`):
    one forward pass per version present, over the rows holding its tokens.

    Args:
        backend: the trainer's backend (`forward_logprobs`, `model`): its weights are version `version`.
        snapshots: the kept versions (`version`'s need not be among them: the backend holds it).
        version: the trainer's current version.

    Returns:
        old logprobs [B, T] (0 where padded or on tokens no policy sampled), and `actor/stale_token_frac`: the
        share of trained tokens sampled by an older version. (The staleness term's own metrics come from the
        loss, which sees the current logprobs: `ActorLoss`.)
    """
    mask = batch.response_mask > 0  # [B, T]
    versions = batch.policy_versions  # [B, T]
    sampled = mask & (versions >= 0)  # env / tool tokens carry -1
    ahead = versions[sampled] > version
    if ahead.any():
        raise RollflowError(f"a token of policy version {int(versions[sampled][ahead].max())} reached a trainer at "
                            f"version {version}")
    old = torch.zeros(versions.shape)  # [B, T]
    for sampler in sorted(set(versions[sampled].tolist())):
        tokens = sampled & (versions == sampler)  # [B, T]
        rows = tokens.any(dim=1).nonzero().flatten()  # [b]
        weights = contextlib.nullcontext() if sampler == version else snapshots.weights_of(sampler, backend.model)
        with weights:
            logprobs = backend.forward_logprobs(batch.select(rows), temperature)  # [b, T]
        old[rows] = torch.where(tokens[rows], logprobs, old[rows])
    trained = max(int(mask.sum()), 1)
    return old, {"actor/stale_token_frac": float((sampled & (versions != version)).sum()) / trained}
