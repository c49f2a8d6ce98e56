"""`algorithm.old_logprobs: exact` (rollflow.workers.old_logprobs): each trained token's old logprob is a forward
pass of the weights of the version that sampled it, also inside one partially rolled-out response whose
tokens span versions; checked against the checkpoint of each version loaded by transformers alone."""

from __future__ import annotations

import pytest
import torch

from rollflow.backends.base import TrainerSettings
from rollflow.backends.torch_backend import TorchBackend
from rollflow.config import AlgorithmConfig
from rollflow.data.sample import Sample, collate
from rollflow.errors import RollflowError
from rollflow.workers.actor_loss import ActorLoss
from rollflow.workers.old_logprobs import VersionSnapshots, exact_old_logprobs
from tests.conftest import policy_batch

TEMPERATURE = 0.7
# (prompt, response, the version that sampled each response token; -1: an env token, not trained)
ROWS = [
    ([3, 21, 5], [30, 31, 32, 33], [0, 0, 1, 2]),  # partial rollout: begun by version 0, continued by 1 and 2
    ([3, 22, 5, 7], [34, 35, 36], [1, 1, 1]),  # one step stale
    ([3, 23], [37, 38], [2, 2]),  # the current version's
    ([3, 24, 5], [39, 40, 41, 42], [1, -1, -1, 2]),  # a turn, an env reply, the next turn
]


def _logprobs_from_disk(model_dir, prompt: list[int], response: list[int]) -> torch.Tensor:
    """[n] logprobs of `response` after `prompt` under the checkpoint in `model_dir`, one unpadded sequence."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + response])).logits[0]  # [L, V]
    logprobs = torch.log_softmax(logits[len(prompt) - 1:-1] / TEMPERATURE, dim=-1)  # [n, V]
    return logprobs.gather(-1, torch.tensor(response).unsqueeze(-1)).squeeze(-1)  # [n]


@pytest.fixture(scope="module")
def trained(random_model_dir, tmp_path_factory):
    """A trainer at version 2 with the snapshots of versions 0-2, and each version's checkpoint on disk."""
    out = tmp_path_factory.mktemp("versions")
    torch.manual_seed(0)
    backend = TorchBackend(TrainerSettings(random_model_dir, lr=3e-2, micro_batch_size=8))
    loss = ActorLoss(AlgorithmConfig(), temperature=TEMPERATURE)
    snapshots = VersionSnapshots(keep=3)
    for version in range(3):
        snapshots.take(version, backend.model)
        backend.save(out / f"v{version}")
        if version < 2:
            backend.train_step(policy_batch(), loss)
    return backend, snapshots, out


def test_each_tokens_old_logprob_is_its_sampling_versions_forward_pass(trained):
    backend, snapshots, out = trained
    samples = [Sample(prompt_ids=prompt, response_ids=response, policy_versions=versions,
                      loss_mask=[int(v >= 0) for v in versions], group_id=i)
               for i, (prompt, response, versions) in enumerate(ROWS)]
    batch = collate(samples, pad_token_id=0)
    current_before = backend.forward_logprobs(batch, TEMPERATURE)
    old, metrics = exact_old_logprobs(backend, snapshots, batch, version=2, temperature=TEMPERATURE)
    # each version's checkpoint, loaded by a trainer of its own, on the same batch: 1e-6
    loaded = {version: TorchBackend(TrainerSettings(str(out / f"v{version}"), trainable=False)).forward_logprobs(
        batch, TEMPERATURE) for version in range(3)}  # [B, T] each
    by_version = {}  # and transformers alone, one unpadded sequence at a time (padding moves the last digits)
    for row, (prompt, response, versions) in enumerate(ROWS):
        for version in set(versions) - {-1}:
            by_version[row, version] = _logprobs_from_disk(out / f"v{version}", prompt, response)
        for column, version in enumerate(versions):
            if version >= 0:
                assert old[row, column].item() == pytest.approx(loaded[version][row, column].item(), abs=1e-6), \
                    (row, column, version)
                assert old[row, column].item() == pytest.approx(by_version[row, version][column].item(), abs=2e-5)
    # the versions differ where it matters (else any version's forward would pass)
    assert (by_version[0, 0] - by_version[0, 2]).abs().max() > 1e-3
    # the trainer's own weights are back: the current forward pass is unchanged
    assert torch.equal(backend.forward_logprobs(batch, TEMPERATURE), current_before)
    trained_tokens = sum(v >= 0 for _, _, versions in ROWS for v in versions)  # 11
    stale = sum(0 <= v < 2 for _, _, versions in ROWS for v in versions)  # 7
    assert metrics == {"actor/stale_token_frac": pytest.approx(stale / trained_tokens)}

    # the loss: its PPO ratio is the staleness term (the current weights over the sampling version's)
    from rollflow.algorithms.aggregation import loss_normalizer
    from rollflow.backends.logprobs import model_logits

    batch.extras["old_logprobs"] = old
    batch.extras["advantages"] = torch.ones_like(old) * batch.response_mask
    loss = ActorLoss(AlgorithmConfig(old_logprobs="exact"), temperature=TEMPERATURE)
    with torch.no_grad():
        _, loss_metrics = loss(model_logits(backend.model, batch), batch, loss_normalizer(batch.response_mask))
    mask = batch.response_mask > 0
    log_ratio = (current_before - old)[mask]
    assert loss_metrics["actor/staleness_log_ratio_abs_mean"] == pytest.approx(float(log_ratio.abs().mean()),
                                                                                 rel=1e-4)
    assert loss_metrics["actor/staleness_log_ratio_abs_mean"] > 1e-3
    assert loss_metrics["actor/staleness_ratio_mean"] == pytest.approx(float(log_ratio.exp().mean()), rel=1e-4)
    assert loss_metrics["actor/ratio_mean"] == pytest.approx(loss_metrics["actor/staleness_ratio_mean"], rel=1e-4)


def test_a_version_no_longer_kept_is_a_clear_error(trained):
    backend, _, _ = trained
    kept = VersionSnapshots(keep=2)
    for version in range(3):  # keeps 1 and 2
        kept.take(version, backend.model)
    assert sorted(kept.versions) == [1, 2]
    prompt, response, versions = ROWS[0]  # has version-0 tokens
    batch = collate([Sample(prompt_ids=prompt, response_ids=response, policy_versions=versions)], pad_token_id=0)
    with pytest.raises(RollflowError, match=r"no weights of policy version 0 \(kept: \[1, 2\]\)"):
        exact_old_logprobs(backend, kept, batch, version=2, temperature=TEMPERATURE)
    ahead = collate([Sample(prompt_ids=prompt, response_ids=response, policy_versions=[3, 3, 3, 3])], pad_token_id=0)
    with pytest.raises(RollflowError, match="version 3 reached a trainer at version 2"):
        exact_old_logprobs(backend, kept, ahead, version=2, temperature=TEMPERATURE)


def test_exact_old_logprobs_need_the_torch_backend():
    from rollflow.config import load_config
    from rollflow.errors import ConfigError

    with pytest.raises(ConfigError, match="old_logprobs=exact needs roles.actor_train.backend=torch"):
        load_config(None, ["algorithm.old_logprobs=exact", "roles.actor_train.backend=fsdp2"])


ASYNC_K2 = ["roles.actor_infer.hybrid=false", "roles.actor_train.device_mapping=[0]",
            "roles.actor_infer.device_mapping=[1]", "rollout.max_staleness=2"]


@pytest.mark.parametrize("pipeline", ["rlvr", "agentic"])
def test_a_staleness_bound_of_2_with_current_old_logprobs_is_warned_of_before_the_run(pipeline):
    """K >= 2 with `current` trains tokens two versions old with the clip blind to it (the io-bound bench
    collapsed so): the input check returns a line naming the fix; with `exact`, or at K = 1, none."""
    from rollflow.config import load_config
    from rollflow.pipelines.agentic import AgenticStep
    from rollflow.pipelines.rlvr import RLVRStep

    step_class = {"rlvr": RLVRStep, "agentic": AgenticStep}[pipeline]

    def warnings(*overrides: str) -> list[str]:
        config = load_config(None, [f"pipeline={pipeline}", *ASYNC_K2, *overrides])
        step = step_class(config)
        return [line for line in step.check_inputs(step.roles()) if "old_logprobs" in line]

    (line,) = warnings()
    assert line.startswith("rollout.max_staleness is 2 with algorithm.old_logprobs: current")
    assert line.endswith("set algorithm.old_logprobs: exact")
    assert warnings("algorithm.old_logprobs=exact") == []
    assert warnings("rollout.max_staleness=1") == []
    assert warnings("train.steps=1") == []  # a bound above the run's steps acts as the steps
