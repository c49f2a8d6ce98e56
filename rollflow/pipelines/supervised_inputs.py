"""Checks a supervised run's inputs (SFT, DPO, distillation) on the driver while its workers start, and
encodes every row once: a bad row is one line naming its dataset and row, never a worker's traceback.

`check_supervised_inputs(config)` runs, in order: the model (and the reference or teacher) files; for a
teacher, that its vocabulary is the student's; every train and eval row encoded by
`rollflow.data.supervised.ConversationEncoder` (a DPO row twice: chosen and rejected) with characters the
tokenizer cannot represent, rows over `data.max_tokens` and the model's context named; and for the greedy
eval, the eval rows' prompts and the columns the rewards need.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rollflow.data.prompts import EncodedPrompt, PromptEncoder, Row, load_dataset
from rollflow.data.sample import Sample
from rollflow.data.supervised import ConversationEncoder
from rollflow.errors import ConfigError, DataError
from rollflow.models import check_model_files, load_model_config, load_tokenizer
from rollflow.pipelines.preflight import (
    check_represented,
    check_reward_columns,
    context_length,
    dataset_source,
    encode_prompts,
    resource_warnings,
    reward_columns,
)

# What a training item is: one sample (SFT, distillation) or a (chosen, rejected) pair (DPO).
Item = Sample | tuple[Sample, Sample]


@dataclass
class SupervisedInputs:
    """What `check_supervised_inputs` hands the driver.

    Attributes:
        tokenizer: the model's tokenizer.
        train, eval: every row encoded: a `Sample`, or for DPO a (chosen, rejected) pair.
        eval_prompts: the eval rows' prompts for the greedy eval (empty unless `eval.greedy_accuracy`).
        warnings: resource warnings to print.
    """

    tokenizer: Any
    train: list[Item]
    eval: list[Item]
    eval_prompts: list[EncodedPrompt]
    warnings: list[str]


def check_supervised_inputs(config, roles: Sequence[str]) -> SupervisedInputs:
    """Every check of this module (see its docstring).

    Args:
        config: an `SFTConfig`, `DPOConfig` or `DistillConfig`.
        roles: the roles the run starts, for the resource warnings.

    Raises:
        ModelLoadError, ConfigError, DataError: one line each.
    """
    model, data = config.model, config.data
    check_model_files(model.path)
    reference_path = config.roles.reference.model_path if "reference" in roles else None
    if reference_path is not None:
        check_model_files(reference_path)
    tokenizer = load_tokenizer(model.path, model.trust_remote_code)
    if config.pipeline == "distill":
        check_same_vocabulary(tokenizer, load_tokenizer(reference_path, model.trust_remote_code), reference_path)
    context = context_length(load_model_config(model.path, model.trust_remote_code))
    encoder = ConversationEncoder(tokenizer, data.messages_key, data.prompt_key, data.response_key,
                                  data.apply_chat_template, min(data.max_tokens, context or data.max_tokens))
    encoded: dict[str, list[Item]] = {"train": [], "eval": []}
    eval_rows: list[Row] = []
    for key, dataset in (("data.train", data.train), ("data.eval", data.eval)):
        if dataset is None:
            continue
        source = dataset_source(key, dataset)
        rows = load_dataset(dataset, data.prompt_key, data.answer_key, required=())
        encoded[key.removeprefix("data.")] = [encode_row(encoder, row, f"{source} row {number}", config)
                                             for number, row in enumerate(rows, start=1)]
        if key == "data.eval":
            eval_rows = rows
    eval_prompts: list[EncodedPrompt] = []
    if config.eval.greedy_accuracy:
        source = dataset_source("data.eval", data.eval)
        prompt_rows = [greedy_prompt_row(row, data) for row in eval_rows]
        check_reward_columns(prompt_rows, source, reward_columns(config), data.answer_key)
        prompts = PromptEncoder(tokenizer, data.prompt_key, data.apply_chat_template, data.max_tokens)
        eval_prompts = encode_prompts(prompts, prompt_rows, source, max_new_tokens=config.eval.max_new_tokens,
                                      context_length=context, max_new_tokens_key="eval.max_new_tokens")
    if len(encoded["train"]) < config.train.batch_size:
        raise DataError(f"{dataset_source('data.train', data.train)} has {len(encoded['train'])} rows, fewer than "
                        f"train.batch_size={config.train.batch_size}; lower the batch size or add rows")
    return SupervisedInputs(tokenizer, encoded["train"], encoded["eval"], eval_prompts,
                            resource_warnings(config, roles))


def encode_row(encoder: ConversationEncoder, row: Row, where: str, config) -> Item:
    """One row as the pipeline trains on it; `DataError` naming `where` for a bad row, or for characters the
    tokenizer drops or cannot represent (`check_represented`, the check RLVR prompts get)."""
    data = config.data
    try:
        if config.pipeline == "dpo":
            for column in (data.chosen_key, data.rejected_key):
                if not isinstance(row.get(column), str):
                    present = ", ".join(sorted(row)) or "none"
                    raise DataError(f"a preference row needs a string {column!r} column (its columns: {present})")
            responses = [row[data.chosen_key], row[data.rejected_key]]
        else:
            responses = [None]  # the row's own
        samples = [encoder.encode(row, response) for response in responses]
    except DataError as err:
        raise DataError(f"{where}: {err}") from None
    for sample, response in zip(samples, responses, strict=True):
        check_represented(encoder.tokenizer, contents(row, data, response), sample.prompt_ids + sample.response_ids,
                          where, what="the row")
    return tuple(samples) if config.pipeline == "dpo" else samples[0]


def contents(row: Row, data, response: str | None = None) -> str:
    """The text of a row the tokens must carry: its turns' contents, or its prompt and response (`response`
    instead of its own, as for DPO's chosen / rejected)."""
    messages = row.get(data.messages_key)
    if response is None and isinstance(messages, list):
        return "\n".join(turn.get("content", "") for turn in messages if isinstance(turn, dict))
    prompt = row.get(data.prompt_key)
    prompt = "\n".join(turn.get("content", "") for turn in prompt) if isinstance(prompt, list) else str(prompt)
    return prompt + "\n" + (row.get(data.response_key) if response is None else response)


def greedy_prompt_row(row: Row, data) -> Row:
    """The row the greedy eval decodes: a prompt / response row as it is; a chat row's turns before its last
    assistant turn as the prompt."""
    messages = row.get(data.messages_key)
    if data.prompt_key in row or not isinstance(messages, list):
        return row
    last = max((i for i, turn in enumerate(messages) if isinstance(turn, dict) and turn.get("role") == "assistant"),
               default=len(messages))
    return {**row, data.prompt_key: messages[:last]}


def check_same_vocabulary(student, teacher, teacher_path: str) -> None:
    """A teacher's log-probs are indexed by its token ids: they mean the same tokens only when the two
    tokenizers have the same vocabulary. `ConfigError` otherwise."""
    student_vocab, teacher_vocab = student.get_vocab(), teacher.get_vocab()
    if student_vocab == teacher_vocab:
        return
    differing = sorted(set(student_vocab.items()) ^ set(teacher_vocab.items()), key=lambda item: item[1])
    example = f"e.g. token {differing[0][0]!r}" if differing else ""
    raise ConfigError(f"the teacher {teacher_path!r} and the student have different vocabularies ({len(teacher_vocab)} "
                      f"vs {len(student_vocab)} tokens, {example}); logit distillation needs one tokenizer")
