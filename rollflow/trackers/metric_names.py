"""Every metric a run logs (the keys of `metrics.jsonl`, TensorBoard and W&B): its meaning and unit, in one
registry that docs/metrics.md is generated from.

`python -m rollflow.trackers.metric_names docs/metrics.md` rewrites the page; with no argument it goes to
stdout. `tests/trackers/test_metric_names.py` checks that the committed page is what
`render_metrics_reference()` returns, and that every metric key the code writes, every metric of the
registered algorithms and every key of a real run's `metrics.jsonl` is documented here.

A name is a key (`reward/mean`) or a pattern (`eval/<domain>/accuracy`): each `<placeholder>` stands for
any text without a `/` (a domain, a reward function, a role, a phase).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterable
from typing import NamedTuple

from rollflow.registry import generated_doc_main

REGENERATE = "python -m rollflow.trackers.metric_names docs/metrics.md"


class Metric(NamedTuple):
    name: str  # a key, or a pattern with `<placeholder>` parts
    unit: str
    meaning: str


class MetricGroup(NamedTuple):
    title: str
    about: str
    metrics: tuple[Metric, ...]


# Words for the unit column.
FRACTION = "fraction"  # in [0, 1]
SECONDS = "s"
COUNT = "count"
REWARD = "reward"
NATS = "nats"

# What `rollout_metrics` writes under rollout/ (training samples) and eval/ (greedy samples); `{what}`
# names them.
_SAMPLE_STATS = (
    ("samples", COUNT, "Number of {what}, failed ones included."),
    ("accuracy", FRACTION, "Fraction of {what} the first (primary) reward function scores 1; a failed one "
                           "counts as wrong."),
    ("response_length", "tokens", "Mean response length of {what}."),
    ("truncated_ratio", FRACTION, "Fraction of {what} cut at the `max_new_tokens` limit."),
    ("failed_ratio", FRACTION, "Fraction of {what} that failed (engine error, reward error or time limit)."),
    ("reward_mean", REWARD, "Mean reward of {what}: the weighted sum of the reward functions, before reward "
                            "shaping."),
)
# What `episode_metrics` writes under rollout/ (training episodes) and eval/ (greedy episodes).
_EPISODE_STATS = (
    ("success", FRACTION, "Fraction of {what} whose env reported success; a failed episode counts as "
                          "unsolved."),
    ("return", REWARD, "Mean return (the sum of the env's rewards) of {what}, failed ones left out."),
    ("turns", COUNT, "Mean model turns of {what}, failed ones left out."),
    ("invalid_action_frac", FRACTION, "Fraction of the turns of {what} whose action the env rejected as "
                                      "invalid."),
    ("truncated_frac", FRACTION, "Fraction of {what} cut short: by the env, at `env.max_turns` or at the "
                                 "context length."),
    ("context_truncated_frac", FRACTION, "Fraction of {what} cut short at the context length (part of "
                                         "`truncated_frac`): their next turn's prompt and `rollout.max_new_tokens` "
                                         "did not fit `rollout.max_context_tokens` (default the model's context)."),
    ("env_seconds_per_turn", SECONDS, "Env time (reset and steps) per model turn of {what}."),
    ("prefix_reused_frac", FRACTION, "Share of the prompt tokens of the model turns of {what} that the engine's "
                                     "prefix cache already held (vllm; hf with `prefix_cache_tokens`)."),
    ("tool_calls_per_episode", COUNT, "Tool calls per episode of {what}, failed episodes left out; a malformed "
                                      "call counts (tool-use envs: `tool_use`, countdown)."),
    ("tool_error_frac", FRACTION, "Fraction of the tool calls of {what} that failed: malformed (unreadable, an "
                                  "unknown tool, arguments the schema refuses, past `max_calls`) or an error of "
                                  "the tool (a time-out, a program that raised)."),
    ("tool_seconds_per_call", SECONDS, "Time a tool call of {what} took, in the env (tool-use envs)."),
    ("env_retries", COUNT, "Env calls of {what} that a server failed (killed, too slow, garbage) and a fresh "
                           "session on a server redid (`env.id: http://...`), failed episodes included."),
)


def _stats(prefix: str, stats: tuple[tuple[str, str, str], ...], what: str) -> tuple[Metric, ...]:
    return tuple(Metric(f"{prefix}/{name}", unit, meaning.format(what=what)) for name, unit, meaning in stats)


METRIC_GROUPS: tuple[MetricGroup, ...] = (
    MetricGroup(
        "The record",
        "Every line of `metrics.jsonl` is one step's record.",
        (
            Metric("step", "step",
                   "The step the record belongs to: 0 is the eval before any training (a resumed run has "
                   "no step 0 of its own), then 1 .. `train.steps`."),
            Metric("time/unix", SECONDS,
                   "When the record was written (the end of the step): seconds since 1970-01-01 UTC, to the "
                   "millisecond. Only in `metrics.jsonl`: TensorBoard and W&B stamp each point themselves. "
                   "Differs run to run, like every `time/` metric."),
        ),
    ),
    MetricGroup(
        "Training reward",
        "RLVR: the rewards of the step's sampled training responses (at `rollout.temperature`), before "
        "reward shaping.",
        (
            Metric("reward/mean", REWARD,
                   "Mean reward over the step's samples (= `rollout/reward_mean`): the weighted sum of the "
                   "reward functions."),
            Metric("reward/std", REWARD, "Standard deviation (population) of the step's sample rewards."),
            Metric("reward/<domain>", REWARD,
                   "Mean reward of domain `<domain>`'s samples (`data.domains` runs, or a dataset with a "
                   "`domain` column)."),
        ),
    ),
    MetricGroup(
        "Rollout: training samples (RLVR)",
        "The step's sampled responses, as the rollout core handed them to the trainer, with the samples "
        "of the groups it dropped since the last step (filtered, failed).",
        (
            *_stats("rollout", _SAMPLE_STATS, "the step's training samples"),
            Metric("rollout/reward/<function>", REWARD,
                   "Mean unweighted score of reward function `<function>` (as named in "
                   "`reward.functions`; one given by file path by its file name, `score.py:score` for "
                   "`rewards/score.py:score`), over the samples of the domains that use it."),
            Metric("rollout/reward/<function>/<entry>", "as the entry",
                   "An extra entry of a reward function that returns a dict (e.g. "
                   "`llm_judge/parse_failed`), logged only, unweighted."),
            Metric("rollout/<domain>/samples", COUNT, "Samples of domain `<domain>`."),
            Metric("rollout/<domain>/accuracy", FRACTION,
                   "`rollout/accuracy` over domain `<domain>`'s samples."),
            Metric("rollout/<domain>/reward_mean", REWARD, "Mean reward of domain `<domain>`'s samples."),
            Metric("rollout/tokens_per_second", "tokens/s",
                   "Tokens generated since the previous step's batch was handed out, per second of wall "
                   "time."),
            Metric("rollout/groups/consumed", COUNT,
                   "Groups (a prompt's samples, an env seed's episodes) handed to the trainer since the last "
                   "step."),
            Metric("rollout/groups/filtered", COUNT,
                   "Prompt groups the difficulty mask dropped since the last step "
                   "(`algorithm.difficulty_mask`)."),
            Metric("rollout/groups/failed", COUNT,
                   "Groups dropped since the last step because they failed: every sample of a prompt group, "
                   "or too many episodes of an env group for `rollout.group_size` to finish."),
            Metric("rollout/groups/aborted", COUNT,
                   "Groups cut by over-provisioning since the last step (`rollout.overprovision`); their "
                   "keys wait for a long round."),
            Metric("rollout/groups/stale", COUNT,
                   "Groups dropped as older than `rollout.max_staleness` policy versions since the last "
                   "step (`rollout.staleness_control: drop`; always 0 with `admission`)."),
            Metric("rollout/stale_dropped", COUNT,
                   "The same count under the name the async reports use: groups dropped for staleness since "
                   "the last step."),
            Metric("rollout/trained_response_len_mean", "tokens",
                   "Mean response length of the samples this step trains on."),
            Metric("rollout/mixed_version_frac", FRACTION,
                   "Fraction of the samples this step trains on that more than one policy version sampled: new "
                   "weights reached them mid-response (partial rollout; each token's version is in "
                   "`Sample.policy_versions`)."),
            Metric("rollout/generated_response_len_mean", "tokens",
                   "Mean response length of the samples that finished generating since the last step, whether "
                   "they train now, later, or are dropped: beside the trained mean, it shows whether dropping "
                   "favours a length."),
            Metric("rollout/groups/queued", COUNT,
                   "Groups waiting to send their first request when the step's batch was handed out."),
            Metric("rollout/groups/generating", COUNT,
                   "Groups being played when the batch was handed out (asynchronous runs play ahead)."),
            Metric("rollout/groups/scoring", COUNT,
                   "Prompt groups waiting for their rewards when the batch was handed out."),
            Metric("rollout/groups/ready", COUNT,
                   "Finished groups left for later steps when the batch was handed out."),
            Metric("rollout/refill_groups", COUNT,
                   "Groups started this step to replace dropped ones (at most `rollout.max_refill_groups`)."),
            Metric("rollout/refill_bound_hit", "0 or 1",
                   "1 when the refill bound was reached and the step trains on fewer groups."),
            Metric("rollout/wasted_tokens", "tokens",
                   "Tokens generated for groups that were aborted or went stale."),
            Metric("rollout/long_round", "0 or 1",
                   "1 when this step was a long round of the prompts that over-provisioning aborted (tail "
                   "batching)."),
            Metric("rollout/long_queue", COUNT, "Aborted prompts waiting for a long round."),
            Metric("rollout/tail_wait_seconds", SECONDS,
                   "How long the step waited for the last tenth of its batch's groups once the other nine tenths "
                   "were ready (counted from when the driver asked for the batch): the long tail's cost, which "
                   "`rollflow diagnose` reads."),
            Metric("rollout/resubmitted_samples", COUNT,
                   "Unfinished samples sent again after a weight update (`rollout.partial_rollout: "
                   "resubmit`)."),
            Metric("difficulty_mask/kept_samples", COUNT,
                   "Usable samples of the step's batch with `algorithm.difficulty_mask` on: the mask keeps "
                   "a group whose mean reward is strictly inside its bounds."),
            Metric("difficulty_mask/kept_group_frac", FRACTION,
                   "consumed / (consumed + filtered) prompt groups since the last step: the fraction the "
                   "difficulty mask kept."),
            Metric("staleness/mean", "versions",
                   "Mean over the usable samples of (trainer's policy version - the version of the "
                   "sample's oldest token); 0 in synchronous runs."),
            Metric("staleness/max", "versions", "The largest such staleness."),
            Metric("staleness/frac_<k>", FRACTION,
                   "Fraction of usable samples whose staleness is `<k>` versions, for k = 0 .. "
                   "min(`rollout.max_staleness`, 8) (`staleness/max` covers the rest)."),
            Metric("train/usable_samples", COUNT,
                   "Samples trained on: not failed, aborted or filtered, with at least one response token."),
        ),
    ),
    MetricGroup(
        "Rollout: training episodes (agentic)",
        "The step's sampled multi-turn episodes.",
        (
            *_stats("rollout", _EPISODE_STATS, "the step's training episodes"),
            Metric("rollout/groups", COUNT, "Env groups (episodes of one env seed) trained on this step."),
            Metric("rollout/failed", COUNT,
                   "Episodes that failed (env error, time limit) since the last step."),
            Metric("rollout/aborted", COUNT,
                   "Spare episodes cancelled once their group had enough finishers "
                   "(`rollout.group_redundancy`) since the last step."),
            Metric("train/samples", COUNT,
                   "Training rows built from the step's episodes (one per episode, or per turn with "
                   "`rollout.samples: step`)."),
        ),
    ),
    MetricGroup(
        "Held-out eval",
        "Greedy decoding (temperature 0) of `data.eval` (RLVR, and SFT / DPO / distillation with "
        "`eval.greedy_accuracy`) or of the `eval.episodes` env seeds (agentic), at step 0, every "
        "`eval.every_steps` and at the last step.",
        (
            *_stats("eval", _SAMPLE_STATS, "the held-out samples (one greedy sample per eval prompt)"),
            Metric("eval/reward/<function>", REWARD,
                   "Mean unweighted score of reward function `<function>` on the held-out prompts."),
            Metric("eval/reward/<function>/<entry>", "as the entry",
                   "An extra entry of a reward function that returns a dict, on the held-out prompts."),
            Metric("eval/<domain>/samples", COUNT, "Held-out prompts of domain `<domain>`."),
            Metric("eval/<domain>/accuracy", FRACTION, "`eval/accuracy` over domain `<domain>`'s prompts."),
            Metric("eval/<domain>/reward_mean", REWARD,
                   "Mean reward over domain `<domain>`'s held-out prompts."),
            Metric("eval/<column>=<value>/samples", COUNT,
                   "Held-out prompts whose dataset column `<column>` (one of `eval.group_by`) holds `<value>` "
                   "(`null` for a null, a `/` in the value written `_`)."),
            Metric("eval/<column>=<value>/accuracy", FRACTION,
                   "`eval/accuracy` over the held-out prompts whose column `<column>` holds `<value>`."),
            *_stats("eval", _EPISODE_STATS, "the held-out episodes"),
            Metric("eval/episodes_failed", COUNT, "Held-out episodes that failed (env error, time limit)."),
            Metric("eval/loss", NATS,
                   "SFT and distillation: the model's negative log-likelihood of the eval rows' responses, "
                   "per response token."),
            Metric("eval/dpo/rewards_chosen", NATS,
                   "DPO: mean implicit reward beta * (log pi - log pi_ref) of the eval pairs' chosen "
                   "responses."),
            Metric("eval/dpo/rewards_rejected", NATS, "DPO: the same for the rejected responses."),
            Metric("eval/dpo/reward_margin", NATS,
                   "DPO: mean chosen minus rejected implicit reward over the eval pairs."),
            Metric("eval/dpo/reward_accuracy", FRACTION,
                   "DPO: fraction of eval pairs whose chosen response has the strictly larger implicit "
                   "reward."),
        ),
    ),
    MetricGroup(
        "Validation and the best checkpoint",
        "SFT, DPO and distillation with a validation split (`data.validation` or `data.validation_fraction`): "
        "the eval metrics on it, at the same steps as `eval/`. `train.best_checkpoint_metric` chooses on them, "
        "never on `eval/` (the test set). The `best/` keys are not logged per step: the run returns them and "
        "prints them in its last line.",
        (
            Metric("val/loss", NATS, "`eval/loss` on the validation rows."),
            *_stats("val", _SAMPLE_STATS, "the validation samples (one greedy sample per validation row, with "
                                          "`eval.greedy_accuracy`)"),
            Metric("val/reward/<function>", REWARD,
                   "Mean unweighted score of reward function `<function>` on the validation rows."),
            Metric("val/dpo/rewards_chosen", NATS, "`eval/dpo/rewards_chosen` on the validation pairs."),
            Metric("val/dpo/rewards_rejected", NATS, "`eval/dpo/rewards_rejected` on the validation pairs."),
            Metric("val/dpo/reward_margin", NATS, "`eval/dpo/reward_margin` on the validation pairs."),
            Metric("val/dpo/reward_accuracy", FRACTION, "`eval/dpo/reward_accuracy` on the validation pairs."),
            Metric("epoch", "epochs", "Passes over the training rows so far, as `train.epochs` counts them: steps / "
                   "full batches per pass (rows // `train.batch_size`; a last partial batch of a pass is dropped)."),
            Metric("best/step", "step", "The step of the best validation eval (`checkpoints/best/`)."),
            Metric("best/val/loss", NATS, "`val/loss` at that step, with `train.best_checkpoint_metric: val/loss`."),
            Metric("best/val/accuracy", FRACTION,
                   "`val/accuracy` at that step, with `train.best_checkpoint_metric: val/accuracy`."),
            Metric("best/eval/<metric>", "as the metric",
                   "An `eval/` metric (the test set) of the best checkpoint, e.g. `best/eval/accuracy`; evaluated "
                   "after the last step, the best weights loaded back, when the best is not the last step."),
        ),
    ),
    MetricGroup(
        "Optimizer",
        "The trainer's update (every pipeline). With `train.optimizer_steps_per_step` > 1, the mean over "
        "the step's optimizer steps.",
        (
            Metric("loss", "as the objective",
                   "The loss the trainer minimized, over the batch's micro-batches: the RL policy loss (+ "
                   "KL and entropy terms), the SFT NLL, the distillation loss; for DPO a surrogate with "
                   "the right gradient (the real loss is `dpo/loss`)."),
            Metric("grad_norm", "norm", "Global gradient norm before clipping (`train.max_grad_norm`)."),
            Metric("lr", "learning rate",
                   "The learning rate of the next optimizer step (after the scheduler)."),
            Metric("skipped_steps", COUNT,
                   "Optimizer steps dropped for a non-finite loss or gradient norm (`train.on_nonfinite: "
                   "skip_step`)."),
        ),
    ),
    MetricGroup(
        "Policy loss (RL)",
        "From the policy loss and its correction, averaged over the trained tokens. The ratio is pi / "
        "pi_old per token: 1 when the step takes one optimizer step (pi_old is then the current policy).",
        (
            Metric("actor/ratio_mean", "ratio", "Mean token ratio pi / pi_old."),
            Metric("actor/ratio_max", "ratio", "Largest token ratio."),
            Metric("actor/ratio_min", "ratio", "Smallest token ratio."),
            Metric("actor/approx_kl", NATS,
                   "Mean of 0.5 * log(ratio)^2: how far the update moved the policy (k2)."),
            Metric("actor/policy_kl", NATS, "Mean of -log(ratio): KL(pi_old || pi) estimate (k1)."),
            Metric("actor/clip_frac", FRACTION,
                   "Fraction of tokens whose loss the clip changed (ppo; cispo: clipped weights; raft_pp); "
                   "gspo: of sequences, ipa_chunk: of turns."),
            Metric("actor/clip_frac_high", FRACTION,
                   "Fraction of tokens whose ratio is above the upper clip bound (ppo, tis)."),
            Metric("actor/clip_frac_low", FRACTION,
                   "Fraction of tokens whose ratio is below the lower clip bound (ppo, tis)."),
            Metric("actor/dual_clip_frac", FRACTION,
                   "ppo with `dual_clip`: fraction of tokens the dual clip bounds."),
            Metric("actor/behaviour_weight_mean", "weight",
                   "ppo with `decoupled`: mean behaviour weight pi_old / pi_rollout (capped)."),
            Metric("actor/behaviour_weight_clip_frac", FRACTION,
                   "ppo with `decoupled`: fraction of tokens whose behaviour weight hit "
                   "`behaviour_weight_cap`."),
            Metric("actor/masked_frac", FRACTION,
                   "cispo with `unified_mask`: fraction of tokens masked out."),
            Metric("actor/seq_ratio_mean", "ratio", "gspo: mean sequence-level, length-normalized ratio."),
            Metric("actor/turn_ratio_mean", "ratio", "ipa_chunk: mean turn-level ratio."),
            Metric("actor/penalty_mean", NATS,
                   "kimi15: mean squared log-ratio penalty tau / 2 * log(ratio)^2."),
            Metric("actor/positive_frac", FRACTION, "topr: fraction of samples with a positive reward."),
            Metric("actor/negative_clip_frac", FRACTION,
                   "topr: fraction of negative samples' tokens whose ratio is above 1 (truncated)."),
            Metric("actor/kept_frac", FRACTION, "raft_pp: fraction of samples kept (positive reward)."),
            Metric("actor/train_infer_ratio_mean", "ratio",
                   "`algorithm.train_infer_correction`: mean token ratio pi_old (trainer) / pi_rollout "
                   "(engine)."),
            Metric("actor/train_infer_log_ratio_abs_mean", NATS,
                   "`algorithm.train_infer_correction`: mean |log pi_old - log pi_rollout| per token (with "
                   "`algorithm.old_logprobs: exact` the train-inference discrepancy alone, same version)."),
            Metric("actor/stale_token_frac", FRACTION,
                   "`algorithm.old_logprobs: exact`: fraction of trained tokens sampled by an older version than "
                   "the trainer's at the start of the step."),
            Metric("actor/staleness_ratio_mean", "ratio",
                   "`algorithm.old_logprobs: exact`: mean token ratio pi_theta / pi_old (the sampling version's "
                   "weights), the staleness term the PPO clip bounds; over the step's mini-batches (with one, "
                   "the default, the staleness at the start of the step)."),
            Metric("actor/staleness_log_ratio_abs_mean", NATS,
                   "`algorithm.old_logprobs: exact`: mean |log pi_theta - log pi_old| per trained token, as "
                   "`actor/staleness_ratio_mean`."),
            Metric("actor/is_weight_mean", "weight", "Truncated importance-sampling weights: their mean."),
            Metric("actor/is_weight_clip_frac", FRACTION,
                   "Fraction of truncated importance-sampling weights cut at `upper_bound`."),
            Metric("actor/mis_kept_frac", FRACTION,
                   "Masked importance sampling: fraction of trained tokens kept (ratio inside [low, high])."),
            Metric("actor/kl", NATS,
                   "KL to the reference model per token (`algorithm.kl_estimator`), when "
                   "`algorithm.kl_loss_coef` > 0."),
            Metric("actor/entropy", NATS,
                   "Mean token entropy of the policy, when `algorithm.entropy_coef` != 0."),
        ),
    ),
    MetricGroup(
        "Advantages and reward shaping (RL)",
        "From the advantage estimator (`algorithm.advantage`) and the reward shaping before it.",
        (
            Metric("advantage/advantages_mean", "advantage",
                   "Mean advantage over the trained tokens (agentic: over the rows)."),
            Metric("advantage/advantages_max", "advantage", "Largest advantage."),
            Metric("advantage/advantages_min", "advantage", "Smallest advantage."),
            Metric("advantage/returns_mean", "return",
                   "Mean return over the trained tokens (the critic's target with gae)."),
            Metric("advantage/zero_std_group_frac", FRACTION,
                   "grpo, dr_grpo, starpo: fraction of groups whose rewards are all equal (no learning "
                   "signal)."),
            Metric("advantage/reverse_kl_mean", NATS,
                   "opd: mean per-token reverse KL from the student to the teacher."),
            Metric("advantage/anchor_group_nontrivial_frac", FRACTION,
                   "gigpo: fraction of steps whose anchor-state group holds more than one step."),
            Metric("advantage/anchor_group_size_mean", COUNT, "gigpo: mean size of the anchor-state groups."),
            Metric("advantage/clip_frac", FRACTION,
                   "Fraction of tokens whose advantage `algorithm.advantage_clip` cut."),
            Metric("reward_shaping/overlong_filtered_frac", FRACTION,
                   "`algorithm.overlong_filter`: fraction of samples masked out for being truncated."),
            Metric("reward_shaping/overlong_penalty_mean", REWARD,
                   "`algorithm.overlong_buffer`: mean overlong penalty added to the rewards."),
            Metric("reward_shaping/reward_mean", REWARD,
                   "Mean reward after penalties, normalization and clipping, when any of them changed it."),
            Metric("kl_reward/kl", NATS,
                   "`algorithm.kl_reward_coef` > 0: mean per-token KL of the policy to the reference, "
                   "folded into the rewards."),
            Metric("kl_reward/coef", "coefficient",
                   "The KL-in-reward coefficient beta used this step (adaptive with "
                   "`algorithm.kl_reward_controller: adaptive`)."),
        ),
    ),
    MetricGroup(
        "Critic (RL with gae)",
        "The value model's update.",
        (
            Metric("critic/value_loss", "value^2", "Mean (clipped) value loss per trained token."),
            Metric("critic/values_mean", "value", "Mean predicted value per trained token."),
            Metric("critic/returns_mean", "return", "Mean return (the value target) per trained token."),
            Metric("critic/value_clip_frac", FRACTION,
                   "Fraction of tokens whose value moved more than `algorithm.value_clip`."),
            Metric("critic/loss", "value^2", "The critic's loss, as `loss` for the actor."),
            Metric("critic/grad_norm", "norm", "The critic's gradient norm before clipping."),
            Metric("critic/lr", "learning rate", "The critic's learning rate (`train.critic_lr`)."),
            Metric("critic/skipped_steps", COUNT,
                   "Critic optimizer steps dropped for a non-finite loss or gradient norm."),
        ),
    ),
    MetricGroup(
        "Supervised objectives",
        "SFT, DPO and distillation, over the step's batch.",
        (
            Metric("sft/nll", NATS, "SFT: negative log-likelihood of the response tokens, per token."),
            Metric("dpo/loss", NATS, "DPO: the preference loss (`dpo.loss`), mean over the batch's pairs."),
            Metric("dpo/rewards_chosen", NATS,
                   "DPO: mean implicit reward beta * (log pi - log pi_ref) of the chosen responses."),
            Metric("dpo/rewards_rejected", NATS, "DPO: the same for the rejected responses."),
            Metric("dpo/reward_margin", NATS, "DPO: mean chosen minus rejected implicit reward."),
            Metric("dpo/reward_accuracy", FRACTION,
                   "DPO: fraction of pairs whose chosen response has the strictly larger implicit reward."),
            Metric("distill/kd", NATS,
                   "Distillation: the divergence to the teacher over its top-k tokens "
                   "(`distill.divergence`), per trained token."),
            Metric("distill/ce", NATS,
                   "Distillation: the student's negative log-likelihood of the data's response tokens, per "
                   "token."),
        ),
    ),
    MetricGroup(
        "Checks",
        "Is the trainer training the model the engines sample from?",
        (
            Metric("check/logprob_max_abs_diff", NATS,
                   "The first step a process runs (RLVR): the largest |trainer - engine| log-prob of the "
                   "same tokens (`checks.logprob_parity_samples`); past `checks.logprob_parity_tolerance` "
                   "the run stops."),
            Metric("check/train_infer_logprob_max_gap", NATS,
                   "The largest |pi_old - pi_rollout| token log-prob of the step's batch, when pi_old is "
                   "computed (several optimizer steps, KL in the reward, opd): the train-inference "
                   "mismatch."),
        ),
    ),
    MetricGroup(
        "Weight sync",
        "The trainer's weights sent to the engines after each update (`cluster.weight_sync_transport`).",
        (
            Metric("sync/version", "version",
                   "The policy version the engines hold after the sync (one per update)."),
            Metric("sync/seconds", SECONDS, "Wall time of the sync, export to the last engine's load."),
            Metric("sync/bytes", "bytes", "Bytes of weights sent."),
            Metric("sync/buckets", COUNT,
                   "Buckets the weights were sent in (`cluster.weight_sync_bucket_mb`)."),
            Metric("sync/fetch_seconds_max", SECONDS,
                   "The slowest engine worker's time to receive the weights (0 with a hybrid engine: "
                   "nothing travels)."),
        ),
    ),
    MetricGroup(
        "Simulated cluster",
        "Runs on simulated GPUs (`cluster.device: sim`, [simulation.md](simulation.md)).",
        (
            Metric("sim/train_tokens", "tokens",
                   "Simulated tokens of one optimizer step's batch (its tokens times `cluster.sim.token_scale`): "
                   "what the `sim` backend's step costs."),
        ),
    ),
    MetricGroup(
        "Time",
        "Wall time of the step's phases.",
        (
            Metric("time/step", SECONDS, "The whole step: rollout, training, sync, eval and logging."),
            Metric("time/rollout", SECONDS,
                   "Waiting for the step's samples or episodes (asynchronous runs: what was not yet "
                   "generated when the trainer asked)."),
            Metric("time/reward", SECONDS, "Scoring samples on the driver (RLVR)."),
            Metric("time/reward_wait", SECONDS,
                   "Waiting for rewards with nothing left generating: what model rewards add to the step "
                   "(RLVR)."),
            Metric("time/train", SECONDS, "The actor's update in the trainer, all optimizer steps."),
            Metric("time/critic_train", SECONDS, "The critic's update (gae)."),
            Metric("time/reference", SECONDS, "The reference model's logprobs of the batch (KL to a reference)."),
            Metric("time/old_logprobs", SECONDS,
                   "The trainer's logprobs of the batch before the update (`algorithm.old_logprobs: exact`: one "
                   "forward pass per policy version that sampled its tokens)."),
            Metric("time/<phase>_offload_onload", SECONDS,
                   "Moving roles off and onto their devices to enter phase `<phase>` (colocated roles "
                   "time-share devices: rollout, reference, old_logprobs, values, critic_train, "
                   "actor_train, train, weight_sync, checkpoint)."),
        ),
    ),
    MetricGroup(
        "Colocation",
        "Roles whose devices overlap take turns: each phase offloads the roles it does not need and "
        "onloads the ones it does. `<role>` is actor_train, actor_infer, reference, critic, reward or env, "
        "`<action>` offload or onload.",
        (
            Metric("offload/<role>_seconds", SECONDS,
                   "Time the role's slowest worker took to offload, summed over the step."),
            Metric("onload/<role>_seconds", SECONDS,
                   "Time the role's slowest worker took to onload, summed over the step."),
            Metric("memory/<role>_rss_mb_after_<action>", "MiB",
                   "Host memory (RSS) of the role's workers, summed, after its last `<action>` of the step."),
            Metric("memory/<role>_device_mb_after_<action>", "MiB",
                   "Accelerator memory torch holds in the role's workers, summed, after its last "
                   "`<action>` of the step (0 on CPU)."),
        ),
    ),
)


METRICS: tuple[Metric, ...] = tuple(metric for group in METRIC_GROUPS for metric in group.metrics)


def name_pattern(name: str) -> re.Pattern[str]:
    """The regex of a registry name: literal text, each `<placeholder>` any text without a `/`."""
    parts = re.split(r"<[^<>/]+>", name)
    return re.compile("[^/]+".join(re.escape(part) for part in parts))


_PATTERNS = [(metric, name_pattern(metric.name)) for metric in METRICS]


def documented_metric(key: str) -> Metric | None:
    """The registry entry a logged key falls under (the first that matches), None when none does."""
    return next((metric for metric, pattern in _PATTERNS if pattern.fullmatch(key)), None)


def undocumented(keys: Iterable[str]) -> list[str]:
    """The keys (sorted, once each) that no registry entry documents."""
    return sorted({key for key in keys if documented_metric(key) is None})


INTRODUCTION = f"""\
# Metrics reference

<!-- Generated from the registry in rollflow/trackers/metric_names.py by `{REGENERATE}`.
Edit the meanings there, not this file. -->

Every metric a run logs, what it means and its unit. A run writes one record per step to
`runs/<name>/metrics.jsonl` (with `output.trackers` `jsonl`), and the same numbers to TensorBoard
(`tensorboard`) and Weights & Biases (`wandb`); the console line shows a few of them. A record holds the
metrics the step produced: which ones depends on the pipeline (`rlvr`, `agentic`, `sft`, `dpo`, `distill`)
and the config (a critic only with `algorithm.advantage: gae`, eval metrics only on eval steps, ...).

A name in `<angle brackets>` stands for a part of the key: `eval/<domain>/accuracy` is
`eval/math/accuracy` for a domain called `math`. Units: `fraction` is in [0, 1], `s` seconds, `nats`
natural-log units of log-probabilities, `MiB` 2^20 bytes, `count` a number of things.
"""


def render_metrics_reference() -> str:
    """The whole docs/metrics.md, generated from `METRIC_GROUPS`.

    Returns:
        Markdown text ending in one newline; the same for the same registry.
    """
    parts = [INTRODUCTION]
    for group in METRIC_GROUPS:
        rows = [f"| `{metric.name}` | {metric.unit} | {_cell(metric.meaning)} |" for metric in group.metrics]
        parts.append(f"## {group.title}\n\n{group.about}\n\n| metric | unit | meaning |\n|---|---|---|\n"
                     + "\n".join(rows) + "\n")
    return "\n".join(parts)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def main(argv: list[str] | None = None) -> int:
    """Write the reference to the path given (e.g. docs/metrics.md), or print it when none is."""
    return generated_doc_main(argv, REGENERATE, render_metrics_reference)


if __name__ == "__main__":
    sys.exit(main())
