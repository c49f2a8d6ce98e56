"""Spans recorded per process and the timeline written from them (`timeline.json`, `timeline.png`)."""

from __future__ import annotations

import asyncio
import inspect
import json

import pytest

from rollflow import spans
from rollflow.trackers.timeline import assign_rows, chrome_trace, typical_step, write_timeline


@pytest.fixture(autouse=True)
def _empty_buffer():
    spans.take()
    yield
    spans.take()
    spans.set_lane(spans.DRIVER_LANE)


class Worker:
    def __init__(self, placement, scale):
        self.scale = scale

    def train(self, x):
        return self.check(x) * self.scale

    def check(self, x):
        return x

    @staticmethod
    def helper(x):
        return x + 1

    async def generate(self, x):
        await asyncio.sleep(0)
        return x


class Placement:
    role, index = "actor_train", 3


def test_traced_worker_records_outer_public_calls_in_its_lane():
    cls = spans.traced(Worker, lambda placement, *_: f"{placement.role} {placement.index}")
    worker = cls(Placement(), 2)
    assert worker.train(5) == 10
    assert cls.helper(1) == 2  # static methods stay static, untraced
    assert inspect.iscoroutinefunction(cls.generate)
    assert asyncio.run(worker.generate(7)) == 7
    taken = asyncio.run(worker.pop_spans())  # an async actor's methods are all coroutines
    assert [(s["lane"], s["name"]) for s in taken] == [
        ("actor_train 3", "start"), ("actor_train 3", "train"), ("actor_train 3", "generate")]
    assert all(s["end"] >= s["start"] for s in taken)
    assert asyncio.run(worker.pop_spans()) == []  # handed over once


def test_a_span_recorded_before_the_process_has_its_lane_lands_in_the_lane_it_gets():
    """A warm worker records its warm-up before an actor takes it over and names its lane."""
    spans.record("warm up", 1.0, 2.0)
    spans.record("elsewhere", 1.0, 2.0, lane="driver")
    cls = spans.traced(Worker, lambda placement, *_: f"{placement.role} {placement.index}")
    cls(Placement(), 2)
    assert [(s["lane"], s["name"]) for s in spans.take()] == [
        ("actor_train 3", "warm up"), ("driver", "elsewhere"), ("actor_train 3", "start")]


def test_a_failing_call_is_still_a_span_and_the_next_call_is_recorded():
    cls = spans.traced(Worker, lambda *_: "w 0")
    worker = cls(None, None)
    with pytest.raises(TypeError):
        worker.train(1)  # None * int
    worker.check(1)
    assert [s["name"] for s in spans.take()] == ["start", "train", "check"]


def _span(lane, name, start, end, **args):
    return {"lane": lane, "name": name, "start": start, "end": end, "args": args}


def test_rows_keep_nested_and_sequential_spans_together_and_split_overlaps():
    lane = [_span("e 0", "a", 0, 10), _span("e 0", "b", 1, 2), _span("e 0", "c", 5, 12), _span("e 0", "d", 11, 13)]
    assert assign_rows(lane) == [0, 0, 1, 0]


def test_chrome_trace_names_lanes_driver_first_and_times_from_the_first_span():
    trace = chrome_trace([_span("actor_train 0", "train", 10.5, 11.0), _span("driver", "step", 10.0, 12.0, step=1),
                          _span("actor_infer 1", "generate", 10.2, 10.4), _span("actor_infer 0", "generate", 10.1, 10.3)])
    names = [e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"]
    assert names == ["driver", "actor_infer 0", "actor_infer 1", "actor_train 0"]
    step = next(e for e in trace["traceEvents"] if e["name"] == "step")
    assert step["ts"] == 0 and step["dur"] == pytest.approx(2e6) and step["args"] == {"step": 1}
    train = next(e for e in trace["traceEvents"] if e["name"] == "train")
    assert train["ts"] == pytest.approx(0.5e6) and train["pid"] == 3


def test_the_pictured_step_is_the_median_of_the_steps_after_the_first():
    steps = [_span("driver", "step", 0, 9, step=1), _span("driver", "step", 9, 10, step=2),
             _span("driver", "step", 10, 13, step=3), _span("driver", "step", 13, 15, step=4)]
    assert typical_step(steps)["args"]["step"] == 4  # durations 1, 3, 2 after the first: median 2
    assert typical_step(steps[:1])["args"]["step"] == 1
    assert typical_step([_span("driver", "eval", 0, 1)]) is None


def test_write_timeline_writes_the_trace_and_a_picture_of_one_step(tmp_path):
    recorded = [_span("driver", "step", 0, 1, step=1), _span("driver", "rollout", 0, 0.4),
                _span("actor_infer 0", "generate_batch", 0.01, 0.39), _span("actor_train 0", "train", 0.5, 0.9)]
    path = write_timeline(tmp_path, recorded)
    assert json.loads(path.read_text())["traceEvents"]
    assert (tmp_path / "timeline.png").stat().st_size > 1000
    assert write_timeline(tmp_path / "none", []) is None
