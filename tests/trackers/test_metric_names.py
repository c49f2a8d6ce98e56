"""docs/metrics.md is generated from the metric registry, and every metric a run logs is in the registry.

Three nets catch a metric added without its entry in `rollflow/trackers/metric_names.py`:

* the code: every metric-shaped key (`word/word`, f-strings included) written into or read from a dict
  anywhere in rollflow/, and every `metrics["name"] = ...` of the algorithms (prefixed later by the workers);
* the algorithm registries: every policy loss, advantage estimator and train-inference correction is called,
  and its metrics, prefixed as the workers prefix them, must be documented;
* a real run: the keys of a short RLVR quickstart's `metrics.jsonl` (the only net that sees keys built at run
  time from names, such as the backend's `loss`, `grad_norm`, ...).
"""

from __future__ import annotations

import ast
import difflib
import re
from pathlib import Path

import pytest
import torch

from rollflow.algorithms import (
    ADVANTAGE_ESTIMATORS,
    AGENTIC_ADVANTAGES,
    POLICY_LOSSES,
    AdvantageInputs,
    PolicyLossInputs,
    train_infer_correction,
)
from rollflow.algorithms.agentic import AgenticAdvantageInputs
from rollflow.trackers.metric_names import (
    METRICS,
    REGENERATE,
    SECONDS,
    documented_metric,
    main,
    render_metrics_reference,
    undocumented,
)

ROOT = Path(__file__).resolve().parents[2]
METRICS_DOC = ROOT / "docs" / "metrics.md"
HOLE = "*"  # what an f-string's `{...}` becomes in a scanned key
KEY_SHAPE = re.compile(r"[\w.:*]+(/[\w.:*]+)+")
# Metric-shaped keys of the code that no run logs: documenting them would mislead.
NOT_LOGGED = {
    "initial_eval/accuracy": "the final metrics a pipeline returns (its step-0 eval), not a logged record",
    "initial_eval/success": "the final metrics a pipeline returns (its step-0 eval), not a logged record",
}


def test_committed_metrics_doc_is_the_rendered_reference():
    rendered = render_metrics_reference()
    committed = METRICS_DOC.read_bytes().decode("utf-8")
    lines = difflib.unified_diff(committed.splitlines(), rendered.splitlines(), "docs/metrics.md", "rendered",
                                 lineterm="")
    diff = "\n".join(list(lines)[:40])
    assert rendered.encode("utf-8") == METRICS_DOC.read_bytes(), (
        f"docs/metrics.md is not what the metric registry renders; run `{REGENERATE}` and commit it.\n{diff}")


def test_main_writes_the_file_or_prints_it(tmp_path, capsys):
    target = tmp_path / "metrics.md"
    assert main([str(target)]) == 0
    assert target.read_bytes() == render_metrics_reference().encode("utf-8")
    assert main([]) == 0
    assert capsys.readouterr().out == render_metrics_reference()
    assert main(["a", "b"]) == 2


def test_each_entry_is_named_once_with_a_unit_and_a_meaning():
    names = [metric.name for metric in METRICS]
    assert len(names) == len(set(names))
    assert all(metric.unit.strip() and metric.meaning.strip().endswith(".") for metric in METRICS)


def test_keys_match_their_entry_and_placeholders_stop_at_a_slash():
    assert documented_metric("reward/mean").name == "reward/mean"  # its entry comes before reward/<domain>
    assert documented_metric("reward/math").name == "reward/<domain>"
    assert documented_metric("eval/math/accuracy").name == "eval/<domain>/accuracy"
    assert documented_metric("rollout/reward/my_pkg.rewards:score").name == "rollout/reward/<function>"
    assert documented_metric("rollout/reward/llm_judge/parse_failed").name == \
        "rollout/reward/<function>/<entry>"
    assert documented_metric("memory/actor_train_rss_mb_after_offload").name == \
        "memory/<role>_rss_mb_after_<action>"
    assert documented_metric("time/old_logprobs_offload_onload").name == "time/<phase>_offload_onload"
    assert undocumented(["reward/mean", "made/up", "eval/a/b/accuracy", "made/up"]) == \
        ["eval/a/b/accuracy", "made/up"]


def metric_keys_in_code() -> dict[str, list[str]]:
    """Metric-shaped keys of rollflow/ (`*` for an f-string's holes) -> where they are (`path:line`).

    A key is a string or f-string of the form `a/b[/c...]` used as a dict display's or comprehension's key or
    as a subscript (`metrics["sync/version"] = ...`, `final["eval/accuracy"]`). In rollflow/algorithms, whose
    metrics the workers prefix (`actor/`, `advantage/`), `metrics["name"] = ...` counts as `*/name`.
    """
    found: dict[str, list[str]] = {}
    for path in sorted((ROOT / "rollflow").rglob("*.py")):
        in_algorithms = path.relative_to(ROOT).parts[1] == "algorithms"
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Dict):
                candidates = [key for key in node.keys if key is not None]
            elif isinstance(node, ast.DictComp):
                candidates = [node.key]
            elif isinstance(node, ast.Subscript):
                candidates = [node.slice]
            else:
                continue
            for candidate in candidates:
                key = _text(candidate)
                if key and in_algorithms and "/" not in key and _is_metrics_store(node):
                    key = f"{HOLE}/{key}"
                if key and KEY_SHAPE.fullmatch(key) and re.search(r"[a-z]", key):  # `*/*` names nothing
                    found.setdefault(key, []).append(f"{path.relative_to(ROOT)}:{candidate.lineno}")
    return found


def _text(node: ast.AST) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(part.value if isinstance(part, ast.Constant) else HOLE for part in node.values)
    return None


def _is_metrics_store(node: ast.AST) -> bool:
    return (isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store)
            and isinstance(node.value, ast.Name) and node.value.id == "metrics")


def _documented(key: str) -> bool:
    """A plain key: some entry matches it. A key with holes: it matches some entry's name (a hole stands for
    any text, a placeholder for itself)."""
    if HOLE not in key:
        return documented_metric(key) is not None
    pattern = re.compile(".+".join(re.escape(part) for part in key.split(HOLE)))
    return any(pattern.fullmatch(metric.name) for metric in METRICS)


def test_every_metric_key_in_the_code_is_documented():
    found = metric_keys_in_code()
    # the scan sees literals, f-strings and the algorithms' stores
    assert {"sync/version", "memory/*_rss_mb_after_*", "*/accuracy", "*/clip_frac_high"} <= set(found)
    missing = [f"{key} ({', '.join(where)})" for key, where in found.items()
               if key not in NOT_LOGGED and not _documented(key)]
    assert not missing, ("metric keys without an entry in rollflow/trackers/metric_names.py: "
                         f"{'; '.join(missing)} — add them, then run `{REGENERATE}`")


def test_every_metric_of_the_registered_algorithms_is_documented():
    torch.manual_seed(0)
    rows, width = 4, 3
    mask = torch.ones(rows, width)
    policy = PolicyLossInputs(
        logprobs=torch.randn(rows, width).requires_grad_(), old_logprobs=torch.randn(rows, width),
        advantages=torch.randn(rows, width), mask=mask, rollout_logprobs=torch.randn(rows, width),
        rewards=torch.tensor([1.0, -1.0, 0.5, -0.5]), segment_ids=torch.tensor([[0, 0, 1]] * rows))
    advantage = AdvantageInputs(
        rewards=torch.tensor([1.0, 0.0, 1.0, 0.0]), mask=mask, group_ids=torch.tensor([0, 0, 1, 1]),
        token_rewards=torch.zeros(rows, width), values=torch.zeros(rows, width),
        logprobs=torch.randn(rows, width), teacher_logprobs=torch.randn(rows, width))
    agentic = AgenticAdvantageInputs(
        episode_returns=torch.tensor([1.0, 0.0, 1.0, 0.0]), group_ids=torch.tensor([0, 0, 1, 1]),
        episode_ids=torch.arange(rows), anchor_ids=torch.tensor([0, 0, 1, 1]),
        step_returns=torch.tensor([1.0, 0.0, 1.0, 0.0]))
    # prefixed as rollflow/workers/actor_loss.py, workers/advantages.py and rollout/episode_advantages.py do
    keys = {f"actor/{key}" for name in POLICY_LOSSES.names() for key in POLICY_LOSSES.get(name)(policy)[1]}
    for options in ({}, {"mask_level": "token"}):
        _, _, metrics = train_infer_correction(policy.old_logprobs, policy.rollout_logprobs, mask, **options)
        keys |= {f"actor/{key}" for key in metrics}
    keys |= {f"advantage/{key}" for name in ADVANTAGE_ESTIMATORS.names()
             for key in ADVANTAGE_ESTIMATORS.get(name)(advantage)[2]}
    keys |= {f"advantage/{key}" for name in AGENTIC_ADVANTAGES.names()
             for key in AGENTIC_ADVANTAGES.get(name)(agentic)[1]}
    assert {"actor/clip_frac", "actor/mis_kept_frac", "advantage/zero_std_group_frac"} <= keys
    assert undocumented(keys) == [], f"add them to rollflow/trackers/metric_names.py, then run `{REGENERATE}`"


def test_every_wall_time_says_so_in_its_name():
    """A reading in seconds differs run to run: tests that compare two runs (same seed, kill -9 and resume) leave
    out keys naming `time/` or `seconds`, so a timing named otherwise (`rollout/tail_wait_s` once) breaks them."""
    unnamed = [m.name for m in METRICS if m.unit == SECONDS and "time/" not in m.name and "seconds" not in m.name]
    assert unnamed == []


@pytest.mark.slow
def test_every_key_of_a_quickstart_run_is_documented(tmp_path, ray_session):
    from rollflow.config import load_config
    from rollflow.pipelines.rlvr import run_rlvr
    from rollflow.trackers.durable_files import read_records

    config = load_config(ROOT / "examples" / "quickstart.yaml", [
        f"output.dir={tmp_path}", "name=quick", "output.trackers=[jsonl]", "train.steps=2",
        "rollout.groups_per_step=8", "data.eval.limit=16", "eval.every_steps=1",
        "roles.actor_infer.hybrid=false"])  # an engine worker of its own: it offloads, with memory/ metrics
    run_rlvr(config, manage_ray=False)
    keys = {key for row in read_records(tmp_path / "quick" / "metrics.jsonl") for key in row}
    assert {"reward/mean", "eval/accuracy", "actor/approx_kl", "grad_norm", "time/step", "sync/version",
            "check/logprob_max_abs_diff", "memory/actor_infer_rss_mb_after_offload"} <= keys
    assert undocumented(keys) == [], f"add them to rollflow/trackers/metric_names.py, then run `{REGENERATE}`"
