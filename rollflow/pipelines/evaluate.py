"""`rollflow eval`: greedy decoding of a model on an eval dataset, scored with the config's rewards.

It starts its workers the way every pipeline does (`rollflow.workers.roles.running_roles`): the
`actor_infer` role, and the `reward` role when a reward needs a model. Each eval writes a directory of its
own, `output.dir/name` (`rollflow eval` names it after the model: `rollflow.cli.eval_directory_name`),
prepared as a training run's is (`prepare_run_dir`): an earlier eval there is moved aside to `NAME.1`, never
appended to.
"""

from __future__ import annotations

import collections
import sys
from pathlib import Path

from rollflow.cluster.runtime import pinned_threads
from rollflow.config import DataConfig, DatasetConfig, RLVRConfig
from rollflow.data.prompts import EncodedPrompt
from rollflow.data.tables import JSON_SUFFIXES, PARQUET_SUFFIXES
from rollflow.engines import check_engine_installed
from rollflow.engines.base import SamplingParams
from rollflow.errors import ConfigError
from rollflow.inputs.prompt_sets import load_prompt_sets
from rollflow.pipelines.phases import check_group_by, eval_group_metrics, prompt_rollout
from rollflow.pipelines.run_directory import check_run_dir_writable, prepare_run_dir
from rollflow.rewards import model_rewards
from rollflow.rollout.filters import check_some_succeeded, failure_warning
from rollflow.rollout.metrics import rollout_metrics
from rollflow.trackers.durable_files import append_records
from rollflow.trackers.samples import write_samples
from rollflow.workers.roles import running_roles


@pinned_threads(1)
def run_eval(config: RLVRConfig, manage_ray: bool = True) -> dict[str, float]:
    """Greedy accuracy and reward of `config.model` on `config.data.eval` (or every domain's `eval`, each also
    as `eval/NAME/accuracy`, and per `eval.group_by` value as `eval/C=V/accuracy`).

    Writes `config.run_dir` once the samples are decoded: the resolved `config.yaml`, the metrics
    as one `metrics.jsonl` record (step 0) and every decoded sample in `eval_samples.jsonl`. A directory
    holding an earlier eval is moved aside first (`prepare_run_dir`), which is printed.

    Raises:
        ConfigError: no eval dataset, an unwritable output directory, an eval row without a `group_by` column.
        StepFailedError: every sample failed (a reward that always raises); their errors are written first.
    """
    data = config.data
    if data.eval is None and not any(domain.eval for domain in (data.domains or {}).values()):
        raise ConfigError("no eval dataset: set data.eval, or a domain's eval (or pass --data FILE.jsonl)")
    check_engine_installed(config.roles.actor_infer.engine)
    check_run_dir_writable(config)  # where the samples go, before anything starts
    rewards = model_rewards(config.reward)
    roles = ["actor_infer", "reward"] if rewards else ["actor_infer"]
    inputs = load_prompt_sets(config, roles, train=False)
    tokenizer, prompts = inputs.tokenizer, inputs.eval_prompts
    check_group_by(prompts, config.eval.group_by)
    for warning in inputs.warnings:
        print(f"rollflow: warning: {warning}", file=sys.stderr, flush=True)
    print(describe_eval_set(data, prompts), flush=True)  # before the workers start: what the numbers will be of
    with running_roles(config, roles, manage_ray=manage_ray) as groups:
        greedy = SamplingParams(config.eval.max_new_tokens or config.rollout.max_new_tokens, temperature=0.0)
        core = prompt_rollout(config, groups, tokenizer, sampling=greedy)
        try:
            samples = core.evaluate(prompts, core.program)
        finally:
            core.close()
    # prepared once there is something to write: an eval that fails leaves an earlier one where it was
    prepared = prepare_run_dir(config)
    if prepared.note:  # an earlier eval moved aside (the note's `resume=true` advice is for training runs)
        print(prepared.note.partition(" (resume=true")[0], flush=True)
    write_samples(config.run_dir / "eval_samples.jsonl", 0, samples, len(samples), columns=config.eval.group_by)
    check_some_succeeded(samples, "eval")  # an accuracy of 0 from a reward that always raises would mean nothing
    warning = failure_warning(samples, "eval")
    if warning:
        print(f"rollflow: warning: {warning} (each failed sample's error is in eval_samples.jsonl; failed samples "
              "count as wrong)", file=sys.stderr, flush=True)
    metrics = {**rollout_metrics(samples, prefix="eval"), **eval_group_metrics(samples, config.eval.group_by)}
    append_records(config.run_dir / "metrics.jsonl", [{"step": 0, **metrics}])
    return metrics


def describe_eval_set(data: DataConfig, prompts: list[EncodedPrompt]) -> str:
    """One line naming what is evaluated and how many rows: `evaluating 500 rows of add2 (eval split)`, or
    with `data.domains`, `evaluating 220 rows: 20 of add2 (eval split) [domain add2], 200 of ...`."""
    if data.domains is None:
        return f"evaluating {len(prompts)} rows of {_dataset_name(data.eval, 'data.eval')}"
    counts = collections.Counter(prompt.row.get("domain") for prompt in prompts)
    parts = [f"{counts[name]} of {_dataset_name(domain.eval, f'data.domains.{name}.eval')} [domain {name}]"
             for name, domain in data.domains.items() if domain.eval is not None]
    return f"evaluating {len(prompts)} rows: {', '.join(parts)}"


def _dataset_name(dataset: DatasetConfig, key: str) -> str:
    """`add2 (eval split)`, `my.jsonl`, `owner/name (test split)`, and the limit when there is one:
    `add2 (eval split; data.eval.limit=200)`."""
    details = [] if dataset.path is not None and _single_file(dataset.path) else [f"{dataset.split} split"]
    if dataset.limit is not None:
        details.append(f"{key}.limit={dataset.limit}")
    name = dataset.task if dataset.task is not None else dataset.path
    return f"{name} ({'; '.join(details)})" if details else name


def _single_file(path: str) -> bool:
    """A JSONL or parquet file, which has no splits (`rollflow.data.tables.read_rows` ignores `split`)."""
    return Path(path).suffix.lower() in (*JSON_SUFFIXES, *PARQUET_SUFFIXES)
