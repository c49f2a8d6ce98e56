"""An RLVR run's prompt sets, loaded, encoded and checked on the driver while its workers start
(`rollflow.workers.roles.RoleLaunch`, which stops them if a check fails), so a bad input is one line, never a
worker's traceback nor a failure at step 11 of 12.

`load_prompt_sets(config, roles)` runs every check, in this order, and returns what the driver needs next:

1. the models: a local directory has weights and a tokenizer, a hub id is cached or the hub answers
   (`rollflow.models.check_model_files`);
2. the response limits against the run's context: the model's, or the engine's when `engine_kwargs` sets a
   shorter one (`run_context_length`, `check_generation_limits`);
3. every row of `data.train` and `data.eval` (or of each domain's `train` and `eval`, `data.domains`),
   encoded up front (`encode_prompts`): a null, empty or non-string prompt, characters the tokenizer cannot
   represent, a prompt longer than `data.max_prompt_tokens` or one that leaves no room for the response in
   the model's context, each named by dataset and 1-based row number; rows with images through the model's
   processor (`vision_processor`): an image that cannot be read, or images for a text-only model, is one
   line naming the row; before that, a `data.image_key` that no row has (`check_image_column`) is one line
   naming the columns there are, and a vision-language model given no image at all is a warning;
4. the columns the rewards declared (`rollflow.rewards.needs_columns`) in every row, a domain's rows against
   its own rewards (`check_reward_columns`);
5. thread counts against the machine's cores (`resource_warnings`, lines to print, not errors).

`build_sampler(config, inputs)` then builds the run's prompt sampler from the checked prompts.
"""

from __future__ import annotations

import os
import unicodedata
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rollflow.data.prompts import (
    DomainSampler,
    EncodedPrompt,
    PromptEncoder,
    PromptSampler,
    Row,
    load_dataset,
)
from rollflow.data.seeds import derive_seed
from rollflow.data.vision import check_image_column, load_vision_processor, resolve_image_paths
from rollflow.engines import ENGINE_CONTEXT_KWARGS
from rollflow.errors import ConfigError, DataError
from rollflow.models import (
    check_model_files,
    is_vision_language,
    load_model_config,
    load_tokenizer,
    resolve_model_path,
)
from rollflow.rewards.registry import required_columns, resolve_reward

if TYPE_CHECKING:
    from rollflow.config import DataConfig, DatasetConfig, RLVRConfig

# Model config attributes that hold the context length, by model family (the first one present counts).
CONTEXT_ATTRIBUTES = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")


@dataclass
class PromptInputs:
    """What `load_prompt_sets` hands the driver: the tokenizer and every prompt, encoded and checked.

    With `data.domains`, `train_prompts` and `eval_prompts` hold every domain's, one domain after the other,
    each row's column `domain` its domain's name, and `train_prompts_by_domain` each domain's train prompts.
    """

    tokenizer: Any
    encoder: PromptEncoder
    train_prompts: list[EncodedPrompt]
    eval_prompts: list[EncodedPrompt]
    warnings: list[str]
    train_prompts_by_domain: dict[str, list[EncodedPrompt]] = field(default_factory=dict)


def load_prompt_sets(config: RLVRConfig, roles: Sequence[str], train: bool = True) -> PromptInputs:
    """Every check of this module, in the order of the module docstring.

    Args:
        config: the run config.
        roles: the roles the run starts (`rollflow.pipelines.rlvr.rlvr_roles`), for `resource_warnings`.
        train: check and encode `data.train` too (`rollflow eval` reads only `data.eval`).

    Returns:
        The tokenizer, the prompt encoder, every train and eval prompt encoded, and the resource warnings.

    Raises:
        ModelLoadError, ConfigError, DataError: one line each (the CLI prints it and exits with status 2).
    """
    model = config.model
    check_model_files(model.path)
    if config.algorithm.needs_reference and config.roles.reference.model_path is not None:
        check_model_files(config.roles.reference.model_path)
    model_config = load_model_config(model.path, model.trust_remote_code)
    context = run_context_length(config, model_config)
    check_generation_limits(config, context)
    tokenizer = load_tokenizer(model.path, model.trust_remote_code)
    data = config.data
    processor = vision_processor(model.path, model_config, tokenizer, model.trust_remote_code)
    check_no_vision_critic(processor, config.algorithm)
    encoder = PromptEncoder(tokenizer, data.prompt_key, data.apply_chat_template, data.max_prompt_tokens,
                            processor=processor, image_key=data.image_key)
    prompts: dict[str, dict[str | None, list[EncodedPrompt]]] = {"train": {}, "eval": {}}  # by domain
    limits = {"train": ("rollout.max_new_tokens", config.rollout.max_new_tokens),
              "eval": ("eval.max_new_tokens", config.eval.max_new_tokens or config.rollout.max_new_tokens)}
    loaded: list[tuple[str, str | None, str, list[Row]]] = []  # (kind, domain, source, rows)
    for key, kind, domain, dataset in configured_datasets(data):
        if dataset is None or kind == "train" and not train:
            continue
        source = dataset_source(key, dataset)
        rows = load_dataset(dataset, data.prompt_key, data.answer_key)
        rows = resolve_image_paths(rows, data.image_key, image_directory(dataset))
        if domain is not None:
            for row in rows:
                row["domain"] = domain  # picks the domain's rewards and names its metrics
        check_reward_columns(rows, source, reward_columns(config, domain), data.answer_key)
        loaded.append((kind, domain, source, rows))
    warnings = check_image_column([(source, rows) for _, _, source, rows in loaded], data.image_key,
                                  type(data).model_fields["image_key"].default, processor is not None)
    for kind, domain, source, rows in loaded:  # encoded once every dataset passed the checks above
        prompts[kind][domain] = encode_prompts(encoder, rows, source, max_new_tokens=limits[kind][1],
                                               context_length=context, max_new_tokens_key=limits[kind][0],
                                               engine_context_key=engine_context_key(config, context))
    warnings += resource_warnings(config, roles)
    train_prompts, eval_prompts = ([p for part in prompts[kind].values() for p in part]
                                   for kind in ("train", "eval"))
    by_domain = {domain: part for domain, part in prompts["train"].items() if domain is not None}
    return PromptInputs(tokenizer, encoder, train_prompts, eval_prompts, warnings, by_domain)


def vision_processor(path: str, model_config: Any, tokenizer, trust_remote_code: bool = False):
    """The `VisionProcessor` of a vision-language model (`is_vision_language`), None for a text model.

    Raises:
        DataError: the model has no image processor or no vision tokens (one line).
    """
    if not is_vision_language(model_config):
        return None
    return load_vision_processor(resolve_model_path(path), tokenizer, trust_remote_code)


def check_no_vision_critic(processor, algorithm) -> None:
    """ConfigError when a vision-language policy (`processor` not None) would get a critic: a value model
    reads token ids only, so its values would not see the images."""
    if processor is not None and algorithm.needs_critic:
        raise ConfigError(f"algorithm.advantage={algorithm.advantage} needs a critic (a value model), and a "
                          "vision-language model's critic is not supported: its values would not see the images; "
                          "use an advantage without one (grpo, rloo, reinforce_pp)")


def image_directory(dataset: DatasetConfig) -> Path | None:
    """Where a dataset's relative image paths are found: its file's directory (None for a built-in task)."""
    if dataset.path is None:
        return None
    path = Path(dataset.path).expanduser()
    return path.parent if path.is_file() else path if path.is_dir() else None


def configured_datasets(data: DataConfig) -> list[tuple[str, str, str | None, DatasetConfig | None]]:
    """Every dataset of the run as `(config key, "train" | "eval", domain, dataset)`: `data.train` and
    `data.eval` (domain None), or each domain's `train` and `eval` (`data.domains.NAME.train`, ...)."""
    if data.domains is None:
        return [("data.train", "train", None, data.train), ("data.eval", "eval", None, data.eval)]
    return [(f"data.domains.{name}.{kind}", kind, name, getattr(domain, kind))
            for name, domain in data.domains.items() for kind in ("train", "eval")]


def build_sampler(config: RLVRConfig, inputs: PromptInputs) -> PromptSampler | DomainSampler:
    """The run's prompt sampler, `rollout.groups_per_step` prompts a `next_batch()`: a `PromptSampler` over
    the train prompts, or with `data.domains` a `DomainSampler` mixing one `PromptSampler` per domain
    (seeded `derive_seed(seed, "domain", name)`) by the domains' shares."""
    data, batch_size = config.data, config.rollout.groups_per_step
    if data.domains is None:
        return PromptSampler(inputs.train_prompts, batch_size, config.seed, data.shuffle)
    samplers = {name: PromptSampler(inputs.train_prompts_by_domain[name], batch_size,
                                    derive_seed(config.seed, "domain", name), data.shuffle)
                for name in data.domains}
    return DomainSampler(samplers, data.domain_shares(), batch_size)


def dataset_source(key: str, dataset: DatasetConfig) -> str:
    """How messages name a dataset: its config key and its file or task, e.g. `data.train (rows.jsonl)`."""
    return f"{key} ({dataset.path})" if dataset.path is not None else f"{key} (task {dataset.task!r})"


def context_length(model_config: Any) -> int | None:
    """The model's context length, in tokens (`max_position_embeddings` or its family's name for it); None
    when the config states none."""
    for attribute in CONTEXT_ATTRIBUTES:
        value = getattr(model_config, attribute, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def engine_context_length(config: Any) -> tuple[int, str] | None:
    """The inference engine's own cap on prompt + response tokens, when `engine_kwargs` sets one (vLLM's
    `max_model_len`, SGLang's `context_length`): (tokens, its config key); None when not set."""
    role = config.roles.actor_infer
    name = ENGINE_CONTEXT_KWARGS.get(role.engine)
    value = role.engine_kwargs.get(name) if name is not None else None
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value, f"roles.actor_infer.engine_kwargs.{name}"
    return None


def run_context_length(config: Any, model_config: Any) -> int | None:
    """The context the run's prompts and responses must fit: the model's (`context_length`), or the engine's
    when `engine_kwargs` sets a shorter one (`engine_context_length`: past it vLLM cuts a response short,
    silently); None on a simulated cluster, whose engines run no model (their tokens stand for
    `cluster.sim.token_scale` each)."""
    if config.cluster.device == "sim":
        return None
    model, engine = context_length(model_config), engine_context_length(config)
    limits = [n for n in (model, engine[0] if engine is not None else None) if n is not None]
    return min(limits) if limits else None


def engine_context_key(config: Any, context: int | None) -> str | None:
    """The `engine_kwargs` key that sets `context` (`run_context_length`), for messages; None: the model's."""
    engine = engine_context_length(config)
    return engine[1] if engine is not None and engine[0] == context else None


def check_generation_limits(config: RLVRConfig, context: int | None) -> None:
    """A response limit must leave room for a prompt in the run's context (`run_context_length`).

    Raises:
        ConfigError: `rollout.max_new_tokens` or `eval.max_new_tokens` >= the context length.
    """
    if context is None:
        return
    engine_key = engine_context_key(config, context)
    holder, setting = (("the model's context", "max_position_embeddings") if engine_key is None
                       else ("the engine's context", engine_key))
    for key, value in (("rollout.max_new_tokens", config.rollout.max_new_tokens),
                       ("eval.max_new_tokens", config.eval.max_new_tokens)):
        if value is not None and value >= context:
            raise_it = f" or raise {engine_key}" if engine_key else ""
            raise ConfigError(f"{key} is {value}, but {holder} holds {context} tokens ({setting}), prompt "
                              f"included; set it below {context}{raise_it}")


def encode_prompts(encoder: PromptEncoder, rows: Sequence[Row], source: str, *, max_new_tokens: int = 0,
                   context_length: int | None = None, max_new_tokens_key: str = "rollout.max_new_tokens",
                   engine_context_key: str | None = None) -> list[EncodedPrompt]:
    """Encode every row now, checking each prompt, so a bad row stops the run before it starts.

    Args:
        encoder: renders and tokenizes a row's prompt.
        rows: the dataset's rows.
        source: the dataset, as messages name it (`dataset_source`).
        max_new_tokens: the response limit the prompts are generated with.
        context_length: the run's context, in tokens (`run_context_length`); None: not checked.
        max_new_tokens_key: the config key of `max_new_tokens`, for the message.
        engine_context_key: the `engine_kwargs` key that sets `context_length` (`engine_context_key`), for the
            message; None: the model's context.

    Returns:
        One `EncodedPrompt` per row, in order.

    Raises:
        DataError: naming `source` and the 1-based row: a null, empty or non-string prompt; characters the
            tokenizer cannot represent; more tokens than `data.max_prompt_tokens`; prompt + response longer
            than the model's context.
    """
    tokenizer = encoder.tokenizer
    for number, row in enumerate(rows, start=1):
        problem = _prompt_problem(row.get(encoder.prompt_key), encoder.prompt_key, encoder.use_template)
        if problem:
            raise DataError(f"{source} row {number}: {problem}")
    try:
        in_bulk = encoder.encode_all(rows)  # all at once; on any error, row by row below names the row
    except Exception:  # noqa: BLE001 - a chat template raises whatever jinja or the template raises
        in_bulk = None
    encoded = []
    for number, row in enumerate(rows, start=1):
        where = f"{source} row {number}"
        try:
            prompt_ids = in_bulk[number - 1] if in_bulk is not None else encoder.encode(row)
        except DataError as err:
            raise DataError(f"{where}: {err}") from None
        except Exception as err:  # a chat template raises whatever jinja or the template raises
            raise DataError(f"{where}: the chat template cannot render the prompt ({_first_line(err)})") from None
        check_represented(tokenizer, prompt_ids.text, prompt_ids.token_ids, where)
        total = len(prompt_ids.token_ids) + max_new_tokens
        if context_length is not None and total > context_length:
            over = (f"the model's context of {context_length} tokens" if engine_context_key is None else
                    f"the engine's context of {context_length} tokens ({engine_context_key})")
            fixes = (f" or lower {max_new_tokens_key}" if engine_context_key is None else
                     f", lower {max_new_tokens_key} or raise {engine_context_key}")
            raise DataError(
                f"{where}: the prompt has {len(prompt_ids.token_ids)} tokens, and with {max_new_tokens_key} = "
                f"{max_new_tokens} that is {total}, over {over}; keep prompts within "
                f"{context_length - max_new_tokens} tokens{fixes}")
        encoded.append(prompt_ids)
    return encoded


def check_represented(tokenizer, text: str, token_ids: Sequence[int], where: str, what: str = "the prompt") -> None:
    """`DataError` naming `where` when `token_ids` (the encoding of `text`) lost characters of it (a tokenizer
    that drops what it cannot represent) or hold the tokenizer's unknown token.

    Args:
        tokenizer: the tokenizer that encoded `text`.
        text: what was encoded (all of its characters must survive; whitespace and normalization aside).
        token_ids: its token ids.
        where: the dataset and row, for the message.
        what: what `text` is, for the message.
    """
    lost = _unrepresented(text, tokenizer.decode(list(token_ids), skip_special_tokens=False))
    if lost:
        raise DataError(f"{where}: the tokenizer cannot represent {lost} (they would be dropped or turned "
                        "into unknown tokens); remove them from the data or use a model whose tokenizer "
                        "covers them")
    unknown = getattr(tokenizer, "unk_token_id", None)
    if unknown is not None and unknown in token_ids:
        raise DataError(f"{where}: {what} encodes to the tokenizer's unknown token {tokenizer.unk_token!r}: "
                        f"{text[:60]!r}")


def reward_columns(config: RLVRConfig, domain: str | None = None) -> dict[str, tuple[str, ...]]:
    """Per reward of `domain`'s prompts (`reward.domains`, else `reward.functions`), the dataset columns it
    declared (`rollflow.rewards.needs_columns`).

    Args:
        config: the run config.
        domain: a `data.domains` name; None: a single-dataset run's rewards, `reward.functions`.

    Raises:
        RewardLoadError: a reward that does not resolve (one line).
    """
    return {function.name: required_columns(resolve_reward(function.name, function.kwargs))
            for function in config.reward.functions_of(domain)}


def check_reward_columns(rows: Sequence[Row], source: str, columns: Mapping[str, Sequence[str]],
                         answer_key: str = "answer") -> None:
    """Every row has every column a reward needs (null counts as missing, as `require_column` sees it).

    Args:
        rows: the dataset's rows.
        source: the dataset, as messages name it.
        columns: reward name -> the columns it needs (`reward_columns`).
        answer_key: `data.answer_key`, named in the message when `answer` is missing.

    Raises:
        DataError: naming the dataset, the first row without a column, the reward and the row's columns.
    """
    for number, row in enumerate(rows, start=1):
        for reward, needed in columns.items():
            for column in needed:
                if row.get(column) is None:
                    hint = ("" if column != "answer" else f" (data.answer_key is {answer_key!r})"
                            if answer_key != "answer" else "; if the answers are in another column, set "
                            "data.answer_key")
                    present = ", ".join(sorted(row)) or "none"
                    raise DataError(f"{source} row {number}: reward {reward!r} needs the column {column!r}, "
                                    f"which the row lacks (its columns: {present}){hint}")


def resource_warnings(config: RLVRConfig, roles: Sequence[str]) -> list[str]:
    """One line per thread count above this machine's cores: `cluster.num_cpus`, and the busiest role.

    Roles without a `device_mapping` time-share the machine phase by phase, so the largest one counts: a
    role's workers run at once, each with `num_cpus` threads. More threads than cores slow a run several
    times over (64 threads on 2 cores: 3.7x). Nothing is checked when joining a cluster (`cluster.address`):
    its nodes are other machines.

    Args:
        config: the run config.
        roles: the roles the run starts.

    Returns:
        The warnings (empty when the plan fits).
    """
    if config.cluster.address:
        return []
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    warnings = []
    if config.cluster.num_cpus is not None and config.cluster.num_cpus > cores:
        warnings.append(f"cluster.num_cpus is {config.cluster.num_cpus} but this machine has {cores} CPU cores: "
                        f"Ray will start more work than the cores can run; set it to {cores} or less")
    unplaced = [role for role in roles if config.roles.of(role).device_mapping is None]
    threads = {role: config.roles.of(role).num_workers * max(1, int(config.roles.of(role).num_cpus))
               for role in unplaced}
    if threads:
        busiest = max(threads, key=threads.get)
        spec = config.roles.of(busiest)
        if threads[busiest] > cores:
            warnings.append(
                f"roles.{busiest} runs {threads[busiest]} threads ({spec.num_workers} worker(s) x num_cpus "
                f"{spec.num_cpus:g}) on a machine with {cores} CPU cores: oversubscribed threads slow a run "
                f"several times over; lower roles.{busiest}.num_cpus (or num_workers) to fit {cores} cores")
    return warnings


def _prompt_problem(prompt: Any, prompt_key: str, chat: bool) -> str | None:
    """Why `prompt` cannot be a prompt, or None. A list of `{role, content}` messages is a prompt when the
    chat template renders it."""
    if prompt is None:
        return f"the prompt (column {prompt_key!r}) is null"
    if isinstance(prompt, str):
        return None if prompt.strip() else f"the prompt (column {prompt_key!r}) is empty"
    if isinstance(prompt, list):
        if not chat:
            return (f"the prompt (column {prompt_key!r}) is a list of chat messages, but no chat template "
                    "renders it (data.apply_chat_template is false or the tokenizer has no template); give a "
                    "string")
        for message in prompt:
            if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                    and isinstance(message.get("content"), str)):
                return (f"the prompt (column {prompt_key!r}) is a list, but not of chat messages "
                        f"{{role: str, content: str}}: {message!r:.60}")
        if not any(message["content"].strip() for message in prompt):
            return f"the prompt (column {prompt_key!r}) has no message with content"
        return None
    return f"the prompt (column {prompt_key!r}) must be a string, not {type(prompt).__name__}: {prompt!r:.60}"


def _normalized(text: str) -> str:
    """Text as compared for representability: no whitespace (a tokenizer may drop or add spaces), NFKC and
    case-folded (a tokenizer may normalize)."""
    return "".join(unicodedata.normalize("NFKC", text).casefold().split())


def _unrepresented(text: str, decoded: str) -> str:
    """The characters of `text` (a rendered prompt) that `decoded` (its token ids decoded, special tokens
    kept) lacks, quoted, e.g. `'é', 'ü'`; empty when it has them all, up to whitespace and normalization."""
    lost = Counter(_normalized(text)) - Counter(_normalized(decoded))
    if not lost:
        return ""
    kept = Counter(_normalized(decoded))
    named = [character for character in dict.fromkeys(text) if not character.isspace()
             and Counter(_normalized(character)) - kept]  # e.g. 'ﬁ' when no 'f' survived
    return ", ".join(repr(character) for character in (named or sorted(lost)))


def _first_line(err: BaseException) -> str:
    text = str(err).strip() or type(err).__name__
    return text.splitlines()[0]
