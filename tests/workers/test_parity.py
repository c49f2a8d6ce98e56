import pytest

from rollflow.data.sample import Sample, collate
from rollflow.errors import ParityError
from rollflow.workers.parity import check_logprob_parity, parity_probe
from tests.conftest import step_samples


def test_parity_check_measures_the_gap_and_stops_on_a_large_one():
    batch = collate(step_samples()[:3], pad_token_id=0)
    close = batch.rollout_logprobs + 1e-4 * batch.response_mask
    assert check_logprob_parity(batch, close, tolerance=1e-2) == pytest.approx(1e-4, rel=1e-3)
    far = batch.rollout_logprobs.clone()
    far[1, 0] -= 0.5  # one token disagrees by 0.5
    with pytest.raises(ParityError, match="differ by up to 0.5"):
        check_logprob_parity(batch, far, tolerance=1e-2)
    padded = batch.rollout_logprobs.clone()
    padded[1, 2] = 9.0  # padding is ignored
    assert check_logprob_parity(batch, padded, tolerance=1e-2) == 0.0




def test_parity_probe_takes_samples_of_every_engine_worker():
    samples = [Sample([1], [2], metadata={"worker": w}) for w in (0, 0, 0, 1, 1, 2)]
    assert parity_probe(samples, 2) == [0, 1, 3, 4, 5]
