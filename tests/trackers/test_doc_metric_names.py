"""Every metric name the docs, the README and the config's field descriptions quote is one the registry
(`rollflow/trackers/metric_names.py`) documents, so a renamed metric cannot leave a stale name behind: the
registry is the one list, and docs/metrics.md and docs/config.md are generated from it and the schema."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from rollflow.trackers.metric_names import METRICS, documented_metric, name_pattern

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
PREFIXES = sorted({metric.name.split("/")[0] for metric in METRICS if "/" in metric.name})
QUOTED = re.compile(r"`((?:" + "|".join(map(re.escape, PREFIXES)) + r")/[A-Za-z0-9_<>=./*-]+)`")


def quoted_metric_names(text: str) -> set[str]:
    return set(QUOTED.findall(text))


def is_documented(name: str) -> bool:
    """A key the registry matches; a pattern (`eval/<domain>/accuracy`, `rollout/groups/<state>`; a `*` or
    `...` is a placeholder too) that a registry name fits or that fits a registry name; or a prefix
    (`eval/dpo/`) that some registry name starts with."""
    if name.endswith("/"):
        return any(metric.name.startswith(name) for metric in METRICS)
    name = name.replace("...", "*")
    if "<" not in name and "*" not in name:
        return documented_metric(name) is not None
    doc = name_pattern(name.replace("*", "<any>"))
    filled = re.sub(r"<[^<>/]+>", "x", name.replace("*", "<any>"))
    return documented_metric(filled) is not None or any(
        doc.fullmatch(re.sub(r"<[^<>/]+>", "x", metric.name)) for metric in METRICS)


@pytest.mark.parametrize("page", PAGES, ids=lambda path: path.name)
def test_every_metric_a_page_quotes_is_in_the_registry(page):
    names = quoted_metric_names(page.read_text())
    unknown = sorted(name for name in names if not is_documented(name))
    assert not unknown, (f"{page.relative_to(ROOT)} quotes metrics the registry does not have: {unknown}; rename "
                         "them to what the run writes (docs/metrics.md), or add them to metric_names.py")


def test_the_check_catches_a_stale_name():
    assert quoted_metric_names("dropped (`rollout/trajectories/failed`) and `eval/accuracy`") == {
        "rollout/trajectories/failed", "eval/accuracy"}
    assert not is_documented("rollout/trajectories/failed")
    assert is_documented("eval/accuracy") and is_documented("eval/<domain>/accuracy")
    assert is_documented("rollout/groups/<state>") and is_documented("eval/dpo/")
    assert not is_documented("rollout/trajectories/<state>") and not is_documented("evals/")
