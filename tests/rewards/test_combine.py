"""`combine_rewards`: weighted totals, dict rewards, validation."""

from __future__ import annotations

import math

import pytest

from rollflow.rewards import combine_rewards


def _constant(value):
    return lambda completion, **row: value


def test_weighted_sum_of_floats():
    combined = combine_rewards([("answer", _constant(1.0), 1.0), ("format", _constant(0.5), 0.2)])
    total, parts = combined("text", answer="1")
    # 1.0 * 1.0 + 0.2 * 0.5 = 1.1
    assert math.isclose(total, 1.1)
    assert parts == {"answer": 1.0, "format": 0.5}  # unweighted


def test_dict_reward_without_reward_key_sums_entries():
    rules = _constant({"word_count": 1.0, "json": 0.0, "ending": 1.0})
    total, parts = combine_rewards([("rules", rules, 0.5)])("text")
    # value = 1 + 0 + 1 = 2; total = 0.5 * 2 = 1.0
    assert total == 1.0
    assert parts == {"rules": 2.0, "rules/word_count": 1.0, "rules/json": 0.0, "rules/ending": 1.0}


def test_dict_reward_with_reward_key_logs_the_rest():
    fn = _constant({"reward": 0.25, "passed": 1.0, "total": 4.0})
    total, parts = combine_rewards([("code", fn, 2.0), ("bonus", _constant(True), -1.0)])("text")
    # 2.0 * 0.25 + (-1.0) * 1.0 = -0.5
    assert total == -0.5
    assert parts == {"code": 0.25, "code/passed": 1.0, "code/total": 4.0, "bonus": 1.0}


def test_row_is_passed_through():
    seen = {}

    def spy(completion, **row):
        seen.update(row, completion=completion)
        return 0.0

    combine_rewards([("spy", spy, 1.0)])("c", prompt="p", answer="a", domain="math")
    assert seen == {"completion": "c", "prompt": "p", "answer": "a", "domain": "math"}


@pytest.mark.parametrize(
    ("rewards", "error", "pattern"),
    [
        ([], ValueError, "at least one"),
        ([("a", _constant(1.0), 1.0), ("a", _constant(1.0), 1.0)], ValueError, "repeated: a"),
        ([("a/b", _constant(1.0), 1.0)], ValueError, "must not contain '/'"),
        ([("a", 3, 1.0)], TypeError, "not callable"),
        ([("a", _constant(1.0), float("nan"))], ValueError, "non-finite weight"),
    ],
)
def test_bad_specs(rewards, error, pattern):
    with pytest.raises(error, match=pattern):
        combine_rewards(rewards)


@pytest.mark.parametrize(
    ("value", "error", "pattern"),
    [
        (None, TypeError, "reward 'r' returned NoneType"),
        ("1.0", TypeError, "returned str"),
        (float("nan"), ValueError, "returned nan, expected a finite number"),
        (float("-inf"), ValueError, "returned -inf, expected a finite number"),
        ({"x": "bad"}, TypeError, "entry 'x' returned str"),
    ],
)
def test_bad_values(value, error, pattern):
    with pytest.raises(error, match=pattern):
        combine_rewards([("r", _constant(value), 1.0)])("text")


def test_reward_exception_propagates():
    def boom(completion, **row):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        combine_rewards([("r", boom, 1.0)])("text")


class FakeGroupReward:
    """A `GroupReward` scored in-process: `submit` computes the values, `wait` hands them back."""

    def __init__(self, score, log: list | None = None, fail_wait: Exception | None = None):
        self.score, self.log, self.fail_wait = score, log if log is not None else [], fail_wait
        self.groups: list[int] = []
        self.closed = False

    def submit(self, completions, rows):
        self.log.append("submit")
        self.groups.append(len(completions))
        return [self.score(c, r) for c, r in zip(completions, rows)]

    def wait(self, future):
        if self.fail_wait is not None:
            raise self.fail_wait
        return future

    def close(self):
        self.closed = True


def test_group_reward_mixes_with_plain_rewards_in_config_order():
    judge = FakeGroupReward(lambda c, r: {"reward": len(c) / 10, "parse_failed": 0.0})
    combined = combine_rewards([("answer", lambda c, **row: float(c == row["answer"]), 1.0),
                                ("judge", judge, 0.5)])
    outcomes = combined.score_group(["4", "456"], [{"answer": "4"}] * 2)
    assert judge.groups == [2]  # the whole group in one call
    # sample 0: 1.0 * 1 + 0.5 * 0.1 = 1.05; sample 1: 1.0 * 0 + 0.5 * 0.3 = 0.15
    assert [total for total, _ in outcomes] == pytest.approx([1.05, 0.15])
    assert list(outcomes[0][1]) == ["answer", "judge/parse_failed", "judge"]
    assert outcomes[1][1] == {"answer": 0.0, "judge": pytest.approx(0.3), "judge/parse_failed": 0.0}
    total, parts = combined("4", answer="4")  # the per-sample call still works
    assert total == pytest.approx(1.05) and parts["judge"] == pytest.approx(0.1)


def test_group_rewards_are_submitted_before_plain_rewards_run():
    log: list[str] = []

    def plain(completion, **row):
        log.append("plain")
        return 0.0

    combined = combine_rewards([("plain", plain, 1.0), ("judge", FakeGroupReward(lambda c, r: 1.0, log), 1.0)])
    pending = combined.submit_group(["a", "b"], [{}, {}])
    assert log == ["submit", "plain", "plain"]
    assert len(pending.futures) == 1
    assert pending.finish([[1.0, 0.0]]) == [(1.0, {"plain": 0.0, "judge": 1.0}),
                                            (0.0, {"plain": 0.0, "judge": 0.0})]


def test_failures_fail_only_their_samples():
    from rollflow.rewards import RewardScoreError, ScoreError

    def plain(completion, **row):
        if completion == "boom":
            raise RuntimeError("plain broke")
        return 1.0

    judge = FakeGroupReward(lambda c, r: ScoreError("judge timed out") if c == "slow" else 0.5)
    outcomes = combine_rewards([("plain", plain, 1.0), ("judge", judge, 1.0)]).score_group(
        ["ok", "boom", "slow"], [{}] * 3)
    assert outcomes[0] == (1.5, {"plain": 1.0, "judge": 0.5})
    assert isinstance(outcomes[1], RuntimeError) and str(outcomes[1]) == "plain broke"
    assert isinstance(outcomes[2], RewardScoreError) and str(outcomes[2]) == "reward 'judge': judge timed out"


def test_a_failed_group_call_fails_every_sample_and_close_releases():
    judge = FakeGroupReward(lambda c, r: 1.0, fail_wait=ConnectionError("worker died"))
    combined = combine_rewards([("plain", _constant(1.0), 1.0), ("judge", judge, 1.0)])
    outcomes = combined.score_group(["a", "b"], [{}, {}])
    assert all(isinstance(o, ConnectionError) and str(o) == "worker died" for o in outcomes)
    with pytest.raises(ValueError, match="returned 1 values for 2 samples"):
        combined.submit_group(["a", "b"], [{}, {}]).finish([[1.0]])
    combined.close()
    assert judge.closed


def test_unbuilt_model_reward_is_rejected_with_a_hint():
    from rollflow.rewards import resolve_reward

    with pytest.raises(TypeError, match="not callable.*build_reward_fn"):
        combine_rewards([("judge", resolve_reward("llm_judge", {"model_path": "tiny"}), 1.0)])


def test_domain_rewards_score_each_group_with_its_domains_functions():
    from rollflow.rewards import DomainRewards

    default = combine_rewards([("answer", lambda completion, **row: float(completion == row["answer"]), 1.0)])
    own = combine_rewards([("answer", lambda completion, **row: float(completion == row["answer"]), 1.0),
                           ("short", lambda completion, **row: -0.1 * len(completion), 0.5)])
    rewards = DomainRewards({"sum3": own}, default)
    add2 = {"prompt": "12+30", "answer": "42", "domain": "add2"}  # no functions of its own: the default's
    sum3 = {"prompt": "1+2+3", "answer": "6", "domain": "sum3"}
    assert rewards.score_group(["42", "43"], [add2, add2]) == [(1.0, {"answer": 1.0}), (0.0, {"answer": 0.0})]
    # sum3: 1.0 * 1 + 0.5 * (-0.1 * 1) = 0.95; 1.0 * 0 + 0.5 * (-0.1 * 2) = -0.1
    (total, parts), (total_wrong, _) = rewards.score_group(["6", "60"], [sum3, sum3])
    assert total == pytest.approx(0.95) and parts == {"answer": 1.0, "short": pytest.approx(-0.1)}
    assert total_wrong == pytest.approx(-0.1)
    pending = rewards.submit_group(["6"], [sum3])  # what the rollout core calls
    assert pending.futures == [] and pending.finish([])[0][0] == pytest.approx(0.95)
    assert rewards("6", **sum3)[0] == pytest.approx(0.95)
    assert rewards("42", prompt="12+30", answer="42") == (1.0, {"answer": 1.0})  # no domain column: default
    assert rewards.names == ["answer", "short"]
    with pytest.raises(ValueError, match="one domain, got add2, sum3"):
        rewards.submit_group(["6", "42"], [sum3, add2])
    rewards.close()
