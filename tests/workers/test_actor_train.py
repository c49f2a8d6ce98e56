"""actor_train trains the objective the pipeline hands it: the RL policy loss is one registered objective,
supervised NLL another, through the same backend.train_step."""

import pytest

from rollflow.cluster.placement import WorkerPlacement
from rollflow.config import load_config
from rollflow.data.sample import Sample, collate
from rollflow.registry import UnknownNameError
from rollflow.workers.actor_loss import ActorLoss
from rollflow.workers.actor_train import ActorTrainWorker
from rollflow.workers.objectives import NLLLoss
from rollflow.workers.specs import trainer_spec

PLACEMENT = WorkerPlacement("actor_train", 0, (), None, (), threads=1)


def _worker(model_dir, objective):
    config = load_config(None, [f"model.path={model_dir}", "train.lr=1e-2", "rollout.groups_per_step=8"])
    return ActorTrainWorker(PLACEMENT, trainer_spec(config, "actor_train", objective))


def test_the_objective_is_chosen_by_name(random_model_dir):
    assert isinstance(_worker(random_model_dir, "policy_gradient").loss, ActorLoss)
    assert isinstance(_worker(random_model_dir, "nll").loss, NLLLoss)
    with pytest.raises(UnknownNameError, match="unknown training objective 'nl'. Did you mean 'nll'"):
        _worker(random_model_dir, "nl")


def test_a_worker_handed_the_nll_objective_fits_its_responses(random_model_dir):
    worker = _worker(random_model_dir, "nll")
    worker.init_backend("127.0.0.1", 0, world_size=1)  # the torch backend: one process, no rendezvous
    samples = [Sample([3, 20, 5], [21, 22, 1]), Sample([3, 23, 5], [24, 1])]  # prompt | answer + eos
    losses = [worker.train(collate(samples, pad_token_id=0))["sft/nll"] for _ in range(5)]
    assert worker.version == 5  # every call is one optimizer step
    assert losses[-1] < 0.5 * losses[0]  # lr 1e-2 on two sequences: the model memorizes them
