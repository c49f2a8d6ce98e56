"""Hardware profiles and length distributions of the simulated cluster (`rollflow.sim.profiles`)."""

from __future__ import annotations

import json
import random
import statistics

import pytest

from rollflow.errors import ConfigError
from rollflow.sim.profiles import PROFILES, SimSettings, length_distribution


def test_the_default_profile_costs_what_its_sources_say():
    h800 = PROFILES.get("h800-7b")
    # a 7B bf16 weight sync: 15.2 GB at 50 GB/s = 0.304 s, plus 1 s of gather / reshard
    assert h800.sync_seconds() == pytest.approx(1.304)
    # 256 rows of 1,000 KV tokens each: 8 ms + 2.3e-8 * 256,000 = 13.9 ms a step
    assert h800.decode_seconds(1, 256_000, 256) == pytest.approx(0.013888)
    h200 = PROFILES.get("h200-7b")
    assert h200.decode_seconds(1, 256_000, 256) < h800.decode_seconds(1, 256_000, 256)
    assert h200.train_gpu_s_per_token == h800.train_gpu_s_per_token  # the same compute


def test_lognormal_lengths_have_the_median_and_the_tail_asked_for():
    rng = random.Random(0)
    distribution = length_distribution({"median": 200, "tail_ratio": 10})
    draws = sorted(distribution.draw(rng) for _ in range(20_000))
    median, p99 = statistics.median(draws), draws[int(0.99 * len(draws))]
    assert median == pytest.approx(200, rel=0.05) and p99 / median == pytest.approx(10, rel=0.1)
    assert {length_distribution({"kind": "fixed", "median": 37}).draw(rng) for _ in range(10)} == {37}


def test_replayed_lengths_come_from_a_runs_samples(tmp_path):
    path = tmp_path / "samples.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [{"response": "abc"}, {"response_tokens": 9, "response": "x"},
                                                      {"response": ""}]))
    distribution = length_distribution({"replay": str(path)})
    assert sorted(set(distribution.values)) == [3, 9]  # an empty response is no length
    assert {distribution.draw(random.Random(s)) for s in range(50)} == {3, 9}


@pytest.mark.parametrize("spec, message", [
    ({"kind": "pareto"}, "unknown kind 'pareto'"),
    ({"median": 0}, "median must be > 0"),
    ({"tail_ratio": 0.5}, "tail_ratio >= 1"),
    ({"mean": 3}, r"unknown keys \['mean'\]"),
    ({"replay": "/nonexistent/samples.jsonl"}, "cannot read /nonexistent/samples.jsonl"),
])
def test_a_bad_length_distribution_is_one_line(spec, message):
    with pytest.raises(ConfigError, match=message):
        length_distribution(spec)


def test_overrides_replace_profile_fields_and_unknown_ones_are_named():
    settings = SimSettings(overrides={"max_running": 8})
    assert settings.hardware().max_running == 8 and settings.wall(20.0) == 1.0  # time_scale 20
    with pytest.raises(ConfigError, match=r"unknown fields \['max_runing'\]"):
        SimSettings(overrides={"max_runing": 8}).hardware()
    with pytest.raises(ConfigError, match="unknown simulation profile 'h900'"):
        SimSettings(profile="h900").hardware()
