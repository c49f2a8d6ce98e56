"""A supervised run's inputs (SFT and distillation conversations, DPO preference pairs), loaded and checked on
the driver while its workers start, every row encoded once: a bad row is one line naming its dataset and row,
never a worker's traceback.

`load_supervised_inputs(config, roles)` runs, in order: the model (and the reference or teacher) files; for a
teacher, that its vocabulary is the student's; every train and eval row encoded by
`rollflow.data.supervised.ConversationEncoder` (a DPO row twice: chosen and rejected) with characters the
tokenizer cannot represent, rows over `data.max_tokens` and the model's context named; degenerate rows,
which train on nothing or teach the model to answer nothing (a DPO pair whose chosen and rejected encode to the
same tokens, an empty or blank response), refused or, with `data.drop_degenerate_rows`, dropped with one
warning a dataset; and for the greedy eval, the eval rows' prompts and the columns the rewards need.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rollflow.data.prompts import EncodedPrompt, PromptEncoder, Row, load_dataset
from rollflow.data.sample import Sample
from rollflow.data.supervised import ConversationEncoder
from rollflow.data.vision import check_image_column, resolve_image_paths
from rollflow.errors import ConfigError, DataError
from rollflow.inputs.prompt_sets import (
    check_represented,
    check_reward_columns,
    context_length,
    dataset_source,
    encode_prompts,
    image_directory,
    resource_warnings,
    reward_columns,
    vision_processor,
)
from rollflow.models import check_model_files, load_model_config, load_tokenizer
from rollflow.registry import Registry

# What a training item is: one sample (SFT, distillation) or a (chosen, rejected) pair (DPO).
Item = Sample | tuple[Sample, Sample]


@dataclass
class SupervisedInputs:
    """What `load_supervised_inputs` hands the driver.

    Attributes:
        tokenizer: the model's tokenizer.
        train, eval: every row encoded: a `Sample`, or for DPO a (chosen, rejected) pair.
        eval_prompts: the eval rows' prompts for the greedy eval (empty unless `eval.greedy_accuracy`).
        warnings: resource warnings to print.
        validation, validation_prompts: the same for the validation split (`data.validation`, or the rows
            `data.validation_fraction` carved from train, which `train` then lacks); empty without one.
    """

    tokenizer: Any
    train: list[Item]
    eval: list[Item]
    eval_prompts: list[EncodedPrompt]
    warnings: list[str]
    validation: list[Item] = field(default_factory=list)
    validation_prompts: list[EncodedPrompt] = field(default_factory=list)


def load_supervised_inputs(config, roles: Sequence[str]) -> SupervisedInputs:
    """Every check of this module (see its docstring), for SFT, distillation and DPO alike: how a row is read
    (one conversation, a preference pair, with a teacher or not) is the pipeline's entry of `ROW_FORMATS`.

    Args:
        config: an `SFTConfig`, `DPOConfig` or `DistillConfig`.
        roles: the roles the run starts, for the resource warnings.

    Returns:
        The tokenizer and every row encoded: train, validation and eval, and the greedy eval's prompts.

    Raises:
        ModelLoadError, ConfigError, DataError: one line each.
    """
    model, data = config.model, config.data
    check_model_files(model.path)
    reference_path = config.roles.reference.model_path if "reference" in roles else None
    if reference_path is not None:
        check_model_files(reference_path)
    tokenizer = load_tokenizer(model.path, model.trust_remote_code)
    if ROW_FORMATS[config.pipeline].teacher:
        check_same_vocabulary(tokenizer, load_tokenizer(reference_path, model.trust_remote_code), reference_path)
    model_config = load_model_config(model.path, model.trust_remote_code)
    context = context_length(model_config)
    processor = vision_processor(model.path, model_config, tokenizer, model.trust_remote_code)
    encoder = ConversationEncoder(tokenizer, data.messages_key, data.prompt_key, data.response_key,
                                  data.apply_chat_template, min(data.max_tokens, context or data.max_tokens),
                                  processor, data.image_key)
    loaded: dict[str, list[Row]] = {}
    for key, dataset in (("data.train", data.train), ("data.validation", data.validation),
                         ("data.eval", data.eval)):
        if dataset is not None:
            rows = load_dataset(dataset, data.prompt_key, data.answer_key, required=())
            loaded[key] = resolve_image_paths(rows, data.image_key, image_directory(dataset))
    sources = {key: dataset_source(key, getattr(data, key.removeprefix("data."))) for key in loaded}
    warnings = check_image_column([(sources[key], rows) for key, rows in loaded.items()], data.image_key,
                                  type(data).model_fields["image_key"].default, processor is not None)
    found: dict[str, EncodedDataset] = {}
    for key, rows in loaded.items():  # encoded once every dataset passed the checks above
        found[key] = encode_dataset(encoder, rows, sources[key], config)
        warnings += [found[key].warning] if found[key].warning else []
    if data.validation_fraction is not None:
        found["data.train"], found["data.validation"] = carve_validation(found["data.train"], data.validation_fraction,
                                                                         config.seed, data.train)
    prompts = PromptEncoder(tokenizer, data.prompt_key, data.apply_chat_template, data.max_tokens, processor,
                            data.image_key)
    greedy = {key: greedy_prompts(prompts, found[key], dataset_source(key, getattr(data, key[5:]) or data.train),
                                  config, context)
              for key in ("data.eval", "data.validation") if config.eval.greedy_accuracy and key in found}
    train = found["data.train"]
    if len(train.items) < config.train.batch_size:
        left = f" left after dropping {train.dropped} degenerate rows" if train.dropped else ""
        carved = " and carving the validation split" if data.validation_fraction is not None else ""
        raise DataError(f"{dataset_source('data.train', data.train)} has {len(train.items)} rows{left}{carved}, "
                        f"fewer than train.batch_size={config.train.batch_size}; lower the batch size or add rows")
    empty = EncodedDataset([], [], 0, None)
    return SupervisedInputs(tokenizer, train.items, found.get("data.eval", empty).items, greedy.get("data.eval", []),
                            warnings + resource_warnings(config, roles),
                            found.get("data.validation", empty).items, greedy.get("data.validation", []))


def carve_validation(train: EncodedDataset, fraction: float, seed: int,
                     source) -> tuple[EncodedDataset, EncodedDataset]:
    """`data.validation_fraction`: a seeded draw of round(fraction × rows) rows (at least 1) out of `train`, kept
    apart as the validation split; both keep the file's order.

    Raises:
        DataError: too few rows to leave any for training.
    """
    count = max(1, round(fraction * len(train.items)))
    if count >= len(train.items):
        raise DataError(f"{dataset_source('data.train', source)} has {len(train.items)} rows: too few to carve "
                        f"data.validation_fraction={fraction} from and still train")
    chosen = set(random.Random(seed).sample(range(len(train.items)), count))
    parts = {True: EncodedDataset([], [], 0, None), False: EncodedDataset([], [], train.dropped, None)}
    for index, (item, row) in enumerate(zip(train.items, train.rows, strict=True)):
        parts[index in chosen].items.append(item)
        parts[index in chosen].rows.append(row)
    return parts[False], parts[True]


def greedy_prompts(encoder: PromptEncoder, dataset: EncodedDataset, source: str, config,
                   context: int | None) -> list[EncodedPrompt]:
    """The greedy eval's prompts of one dataset's rows, with the columns the rewards need checked."""
    data = config.data
    prompt_rows = [greedy_prompt_row(row, data) for row in dataset.rows]
    check_reward_columns(prompt_rows, source, reward_columns(config), data.answer_key)
    return encode_prompts(encoder, prompt_rows, source, max_new_tokens=config.eval.max_new_tokens,
                          context_length=context, max_new_tokens_key="eval.max_new_tokens")


class DegenerateRowError(DataError):
    """A well-formed row that trains on nothing or teaches the model to answer nothing: a DPO pair whose
    chosen and rejected encode to the same tokens (loss constant, gradient 0), an empty or blank response.
    `data.drop_degenerate_rows` drops such rows instead of stopping.

    Attributes:
        reason: what is wrong, without the row's name, e.g. `chosen and rejected are the same text`.
    """

    def __init__(self, where: str, reason: str, consequence: str):
        super().__init__(f"{where}: {reason}; {consequence}")
        self.reason = reason


@dataclass
class EncodedDataset:
    """One dataset's rows as `encode_dataset` keeps them.

    Attributes:
        items: the kept rows encoded, in the file's order.
        rows: the kept rows themselves, in the same order.
        dropped: how many degenerate rows were dropped (`data.drop_degenerate_rows`).
        warning: the one line that says so; None when nothing was dropped.
    """

    items: list[Item]
    rows: list[Row]
    dropped: int
    warning: str | None


def encode_dataset(encoder: ConversationEncoder, rows: Sequence[Row], source: str, config) -> EncodedDataset:
    """Every row of one dataset encoded (`encode_row`). A degenerate row stops the run, or with
    `data.drop_degenerate_rows` is dropped: one warning counts the dropped rows and names the first.

    Args:
        encoder: the run's encoder.
        rows: the dataset's rows.
        source: how messages name the dataset, e.g. `data.train (rows.jsonl)`.
        config: an `SFTConfig`, `DPOConfig` or `DistillConfig`.

    Returns:
        The kept rows, encoded and as read, and the warning.

    Raises:
        DataError: a bad row; a degenerate one unless `data.drop_degenerate_rows`; every row degenerate.
    """
    kept = EncodedDataset([], [], 0, None)
    first = ""
    for number, row in enumerate(rows, start=1):
        try:
            item = encode_row(encoder, row, f"{source} row {number}", config)
        except DegenerateRowError as err:
            if not config.data.drop_degenerate_rows:
                raise
            kept.dropped += 1
            first = first or f"row {number}: {err.reason}"
            continue
        kept.items.append(item)
        kept.rows.append(row)
    if kept.dropped and not kept.items:
        raise DataError(f"{source}: all {kept.dropped} rows are degenerate (first: {first}); "
                        "data.drop_degenerate_rows would leave none")
    if kept.dropped:
        kept.warning = (f"{source}: dropped {kept.dropped} of {len(rows)} degenerate rows, as "
                        f"data.drop_degenerate_rows says (first: {first})")
    return kept


def encode_row(encoder: ConversationEncoder, row: Row, where: str, config) -> Item:
    """One row as the pipeline trains on it.

    Args:
        encoder: the run's encoder.
        row: the row as read.
        where: the dataset and row, for messages, e.g. `data.train (rows.jsonl) row 3`.
        config: an `SFTConfig`, `DPOConfig` or `DistillConfig`.

    Returns:
        A `Sample` (SFT, distillation) or a (chosen, rejected) pair of them (DPO).

    Raises:
        DataError: naming `where`: a bad row, characters the tokenizer drops or cannot represent
            (`check_represented`, the check RLVR prompts get).
        DegenerateRowError: a row that trains on nothing (its row format's `degenerate_reason`).
    """
    data, rows = config.data, ROW_FORMATS[config.pipeline]
    try:
        responses = rows.responses(row, data)
        samples = [encoder.encode(row, response) for response in responses]
    except DataError as err:
        raise DataError(f"{where}: {err}") from None
    for sample, response in zip(samples, responses, strict=True):
        check_represented(encoder.tokenizer, contents(row, data, response), sample.prompt_ids + sample.response_ids,
                          where, what="the row")
    found = rows.degenerate_reason(encoder, row, samples, responses, data)
    if found is not None:
        raise DegenerateRowError(where, *found)
    return rows.item(samples)


class ResponseRows:
    """SFT and distillation rows: one sample each, trained on the row's own response.

    Attributes:
        teacher: a teacher's log-probs come with the rows (distillation): its vocabulary must be the student's.
    """

    def __init__(self, teacher: bool = False):
        self.teacher = teacher

    def responses(self, row: Row, data) -> list[str | None]:
        """The responses a row is encoded with: the row's own."""
        return [None]

    def item(self, samples: list[Sample]) -> Item:
        return samples[0]

    def degenerate_reason(self, encoder: ConversationEncoder, row: Row, samples: Sequence[Sample],
                          responses: Sequence[str | None], data) -> tuple[str, str] | None:
        """Why an encoded row teaches the model to answer nothing: its response is blank, i.e. adds no trained
        token to the end-of-turn tokens (`has_blank_response`): empty, or whitespace the template or tokenizer
        drops (whitespace that becomes tokens is a response).

        Args:
            encoder: the encoder that encoded the row.
            row: the row as read.
            samples: its one sample.
            responses: `[None]` (the row's own).
            data: the config's `data` section.

        Returns:
            None for a good row; else what is wrong and what follows from it (the two halves of the message).
        """
        if not encoder.has_blank_response(row):
            return None
        answer = "training on it teaches the model to answer nothing"
        if data.messages_key in row:  # a chat (the encoder read it as one, so its turns are well formed)
            contents = [turn["content"] for turn in row[data.messages_key] if turn["role"] == "assistant"]
            blank = "empty" if not any(contents) else "empty or only whitespace, which encodes to no token"
            return f"every assistant turn (column {data.messages_key!r}) is {blank}", answer
        return f"the response (column {data.response_key!r}) is {_blank(row[data.response_key])}", answer


class PreferencePairs:
    """DPO rows: a (chosen, rejected) pair of samples each, from the row's chosen and rejected columns."""

    teacher = False

    def responses(self, row: Row, data) -> list[str | None]:
        """The chosen and rejected responses.

        Raises:
            DataError: a column missing or not a string.
        """
        for column in (data.chosen_key, data.rejected_key):
            if not isinstance(row.get(column), str):
                present = ", ".join(sorted(row)) or "none"
                raise DataError(f"a preference row needs a string {column!r} column (its columns: {present})")
        return [row[data.chosen_key], row[data.rejected_key]]

    def item(self, samples: list[Sample]) -> Item:
        return tuple(samples)

    def degenerate_reason(self, encoder: ConversationEncoder, row: Row, samples: Sequence[Sample],
                          responses: Sequence[str | None], data) -> tuple[str, str] | None:
        """Why an encoded pair trains on nothing: a response is blank (`ResponseRows.degenerate_reason`), or
        chosen and rejected are the same tokens: their log-ratios are then equal, the loss constant and its
        gradient 0 (text that differs only where it tokenizes differently, as in whitespace, is a real pair).

        Args:
            encoder: the encoder that encoded the row.
            row: the row as read.
            samples: its chosen and rejected samples.
            responses: the chosen and rejected responses they were encoded with.
            data: the config's `data` section.

        Returns:
            None for a good pair; else what is wrong and what follows from it (the two halves of the message).
        """
        pair = "a pair needs two non-empty responses"
        for name, column, response in (("chosen", data.chosen_key, responses[0]),
                                       ("rejected", data.rejected_key, responses[1])):
            if encoder.has_blank_response(row, response):
                return f"the {name} response (column {column!r}) is {_blank(response)}", pair
        chosen, rejected = samples
        if chosen.prompt_ids + chosen.response_ids == rejected.prompt_ids + rejected.response_ids \
                and chosen.loss_mask == rejected.loss_mask:
            same = ("are the same text" if responses[0] == responses[1] else
                    f"encode to the same tokens ({_shown(responses[0])} and {_shown(responses[1])})")
            return f"chosen and rejected {same}", "a pair must differ (DPO learns nothing from it)"
        return None


# How each supervised pipeline reads its rows.
ROW_FORMATS: Registry[ResponseRows | PreferencePairs] = Registry("supervised pipeline")
ROW_FORMATS.register("sft")(ResponseRows())
ROW_FORMATS.register("distill")(ResponseRows(teacher=True))
ROW_FORMATS.register("dpo")(PreferencePairs())


def _blank(response: str) -> str:
    """How a blank response reads in a message."""
    return "empty" if not response else f"only whitespace ({_shown(response)}), which encodes to no token"


def _shown(text: str, limit: int = 40) -> str:
    """`text` quoted for a message, cut to `limit` characters."""
    return repr(text) if len(text) <= limit else repr(text[:limit]) + "..."


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
