"""Prompt datasets: loading rows (built-in synthetic tasks or any source `rollflow.data.tables.read_rows`
reads: JSONL, parquet, a `datasets` directory, a hub dataset), encoding prompts, and sampling them.

A row is a dict with a `prompt` column (the user message), an optional `answer`, and any other columns;
the whole row is passed to reward functions. Pipelines whose rows have no prompt column (SFT `messages`,
DPO `prompt` / `chosen` / `rejected`) name their own columns through `load_rows(required=...)`.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from rollflow.data.arithmetic import ARITHMETIC_TASKS, arithmetic_splits
from rollflow.data.seeds import derive_seed
from rollflow.data.tables import read_rows
from rollflow.data.vision import (
    VisionInputs,
    VisionProcessor,
    described_images,
    encodable_images,
    image_messages,
    vision_from_state,
    vision_state,
)
from rollflow.data.visual_tasks import VISUAL_TASKS, visual_task_splits
from rollflow.errors import DataError

Row = dict[str, Any]


def load_rows(task: str | None = None, path: str | None = None, split: str = "train",
              limit: int | None = None, prompt_key: str = "prompt", answer_key: str = "answer", *,
              subset: str | None = None, required: Sequence[str] | None = None) -> list[Row]:
    """Load dataset rows from a built-in `task` (its `split`) or from `path` (see `read_rows`).

    A built-in task's split is fixed (the same held-out rows for every run, whatever its seed). When
    `answer_key` is not "answer", its column is also exposed as `answer` (what rewards read).

    Args:
        task: a built-in synthetic task (`add2`, `sum3`); set this or `path`.
        path: a JSONL / parquet file, a `datasets` directory or a hub dataset name (`read_rows`).
        split: the task's `train` / `eval` rows, or a `datasets` dataset's split; ignored for a file.
        limit: keep only the first `limit` rows; `None`: all.
        prompt_key: the prompt column, the one required column by default.
        answer_key: the answer column, aliased as `answer`.
        subset: a hub dataset's configuration name.
        required: the columns every row must have; `None`: `(prompt_key,)`, `()`: none.

    Returns:
        The rows, in order.

    Raises:
        DataError: unknown task, anything `read_rows` refuses (missing / unreadable / non-UTF-8 file, bad
            JSON line, ...), a required column missing from a row, no rows.
    """
    if task is not None:
        if task in VISUAL_TASKS:
            train, held_out = visual_task_splits(task)
        elif task in ARITHMETIC_TASKS:
            train, held_out = arithmetic_splits(task, seed=0)  # the split is fixed, independent of the run seed
        else:
            raise DataError(ARITHMETIC_TASKS.unknown_message(task).rstrip(".")
                            + f" (or a visual task: {', '.join(VISUAL_TASKS.names())})")
        rows = [dict(r) for r in (train if split == "train" else held_out)]
        source = f"task {task!r}"
    elif path is not None:
        rows = read_rows(path, split, subset)
        source = str(path)
    else:
        raise DataError("a dataset needs a `task` or a `path`")
    if limit is not None:
        rows = rows[:limit]
    if not rows:
        raise DataError(f"dataset {source} has no rows")
    columns = (prompt_key,) if required is None else tuple(required)
    for number, row in enumerate(rows, start=1):
        missing = [column for column in columns if column not in row]
        if missing:
            raise DataError(f"dataset {source} has no {missing[0]!r} column (row {number} lacks it; "
                            f"columns: {', '.join(sorted(row)) or 'none'})")
    if answer_key != "answer":
        rows = [{**row, "answer": row[answer_key]} if answer_key in row else row for row in rows]
    return rows


def load_dataset(dataset, prompt_key: str = "prompt", answer_key: str = "answer",
                 required: Sequence[str] | None = None) -> list[Row]:
    """Rows of one configured dataset (a `data.train` / `data.eval` section: `task`, `path`, `split`,
    `subset`, `limit`), with the config's column names; `required` as in `load_rows`."""
    return load_rows(dataset.task, dataset.path, dataset.split, dataset.limit, prompt_key, answer_key,
                     subset=dataset.subset, required=required)


@dataclass
class EncodedPrompt:
    """A prompt ready for the engine: its row, rendered text and token ids, and its images as the model's
    processor made them (`vision`; None for a text prompt).

    The row keeps its columns; images held in it as objects (PIL images, bytes) are replaced by a short
    description (`<image 32x32>`), so rows stay JSON (samples.jsonl, checkpoints) while `vision` carries
    the pixels.
    """

    row: Row
    text: str
    token_ids: list[int]
    vision: VisionInputs | None = None

    def state(self) -> dict:
        """The prompt as JSON (a checkpoint's pending groups); `from_state` reads it back."""
        return {"row": self.row, "text": self.text, "token_ids": self.token_ids,
                "vision": None if self.vision is None else vision_state(self.vision)}

    @classmethod
    def from_state(cls, state: dict) -> EncodedPrompt:
        vision = state.get("vision")
        return cls(state["row"], state["text"], state["token_ids"],
                   None if vision is None else vision_from_state(vision))


class PromptEncoder:
    """Renders rows into prompt text (chat template or raw) and token ids.

    Rows with images (their `image_key` column: see `rollflow.data.vision`) are rendered as a user turn
    holding the images and the text, and encoded by the model's `processor`, whose expanded image tokens
    count towards `max_prompt_tokens`.

    Args:
        tokenizer: a transformers tokenizer.
        prompt_key: the row column holding the user message.
        apply_chat_template: wrap the prompt as a user turn (when the tokenizer has a template).
        max_prompt_tokens: longer prompts raise `DataError`.
        processor: the model's `VisionProcessor`; None: a text-only model, whose rows with images raise
            `DataError`.
        image_key: the row column holding the images (relative paths: from the working directory;
            `rollflow.data.vision.resolve_image_paths` makes a dataset's relative to its file).
    """

    def __init__(self, tokenizer, prompt_key: str = "prompt", apply_chat_template: bool = True,
                 max_prompt_tokens: int = 256, processor: VisionProcessor | None = None,
                 image_key: str = "images"):
        self.tokenizer = tokenizer
        self.processor, self.image_key = processor, image_key
        self.prompt_key = prompt_key
        self.use_template = apply_chat_template and getattr(tokenizer, "chat_template", None) is not None
        self.max_prompt_tokens = max_prompt_tokens
        self._frame: tuple[str, str] | None | bool = False  # (before, after) the user text; None: no frame

    def render(self, row: Row) -> str:
        """The row's prompt text: the chat template around it (when used), else the prompt itself.

        A plain-text user message is rendered by the template's frame (`_template_frame`) when the template
        has one and the text is of the kind a template only copies; anything else renders in full.
        """
        prompt = row[self.prompt_key]
        if not self.use_template:
            return str(prompt)
        if isinstance(prompt, str) and _copied_verbatim(prompt) and (frame := self._template_frame()):
            return frame[0] + prompt + frame[1]
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": str(prompt)}]
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    def _template_frame(self) -> tuple[str, str] | None:
        """(before, after) such that the template renders a lone user message `x` as `before + x + after`,
        found by rendering two different probe texts once; None when the template does anything else with
        them (renders them differently, drops or repeats them). Rendering a template costs ~0.1 ms a prompt;
        a dataset of 10,000 prompts is encoded at every start."""
        if self._frame is False:
            self._frame = None
            renders = []
            for probe in _FRAME_PROBES:
                text = self.tokenizer.apply_chat_template([{"role": "user", "content": probe}],
                                                          add_generation_prompt=True, tokenize=False)
                if text.count(probe) != 1:
                    return None
                renders.append(text.partition(probe)[::2])
            if renders[0] == renders[1]:
                self._frame = renders[0]
        return self._frame

    def encode_all(self, rows: Sequence[Row]) -> list[EncodedPrompt]:
        """`encode` of every row, the tokenizer called once for all of them (a fast tokenizer's batch call
        is ~10x cheaper than one call a row). Raises like `encode`, without saying which row: on an error,
        encode row by row to find it."""
        if any(row.get(self.image_key) for row in rows):
            return [self.encode(row) for row in rows]  # the processor encodes one prompt with its images
        texts = [self.render(row) for row in rows]
        all_ids = self.tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
        return [self._checked(row, text, ids) for row, text, ids in zip(rows, texts, all_ids)]

    def encode(self, row: Row) -> EncodedPrompt:
        """The row's prompt, encoded (with its images, when it has some).

        Raises:
            DataError: a row with images for a text-only model, an image that cannot be read, an image
                count the prompt's `<image>` markers disagree with, too many tokens.
        """
        if row.get(self.image_key):
            return self._encode_with_images(row)
        text = self.render(row)
        return self._checked(row, text, self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _encode_with_images(self, row: Row) -> EncodedPrompt:
        images = encodable_images(row, self.image_key, self.processor, self.use_template)
        prompt = row[self.prompt_key]
        if not isinstance(prompt, str):
            raise DataError("a prompt with images must be a string (its images go where it says <image>)")
        text = self.tokenizer.apply_chat_template(image_messages(prompt, len(images)), add_generation_prompt=True,
                                                  tokenize=False)
        ids, vision = self.processor(text, images)
        return self._checked(described_images(row, self.image_key), text, ids, vision)

    def _checked(self, row: Row, text: str, ids: list[int], vision: VisionInputs | None = None) -> EncodedPrompt:
        if len(ids) > self.max_prompt_tokens:
            raise DataError(f"a prompt has {len(ids)} tokens, over data.max_prompt_tokens="
                            f"{self.max_prompt_tokens}: {text[:60]!r}...")
        if not ids:
            raise DataError(f"a prompt encodes to no tokens: {text!r}")
        return EncodedPrompt(row, text, ids, vision)


# Two user texts no template treats specially (no markup, no surrounding whitespace), to find its frame.
_FRAME_PROBES = ("rollflowprobeA1", "rollflowprobeBB22")


def _copied_verbatim(text: str) -> bool:
    """Whether a chat template can be trusted to copy `text` unchanged into its frame: no surrounding
    whitespace (templates may trim) and no markup (templates look for tags like `<think>` or
    `<tool_response>` in messages)."""
    return bool(text) and text == text.strip() and "<" not in text and "{%" not in text


class PromptSampler:
    """Endless batches of rows, reshuffled every epoch; its `state` resumes the exact data position.

    The rows may be anything (dataset rows, or `EncodedPrompt`s encoded up front); the order depends only on
    their number, the seed and the epoch.
    """

    def __init__(self, rows: Sequence[Any], batch_size: int, seed: int = 0, shuffle: bool = True):
        self.rows, self.batch_size, self.seed, self.shuffle = rows, batch_size, seed, shuffle
        self.epoch, self.position = 0, 0
        self._order = self._epoch_order()

    def _epoch_order(self) -> list[int]:
        order = list(range(len(self.rows)))
        if self.shuffle:
            random.Random(derive_seed(self.seed, "data_order", self.epoch)).shuffle(order)
        return order

    def take(self, count: int) -> list[Any]:
        """The next `count` rows, crossing into the next (reshuffled) epoch as needed.

        Any sequence of `take`s hands out the same rows as one `take` of their total: a caller that refills
        a dropped group with `take(1)` continues the same order.
        """
        rows = []
        while len(rows) < count:
            if self.position == len(self._order):
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._epoch_order()
            rows.append(self.rows[self._order[self.position]])
            self.position += 1
        return rows

    def next_batch(self) -> list[Any]:
        """The next step's prompts: `take(batch_size)`."""
        return self.take(self.batch_size)

    def state(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state(self, state: dict[str, int]) -> None:
        """Restore what `state` returned.

        Raises:
            DataError: a multi-domain run's state (the run's `data.domains` changed).
        """
        if "epoch" not in state:
            domains = ", ".join(state.get("domains", {}))
            raise DataError(f"the checkpoint's data position is of the domains {domains}, but this run has one "
                            "dataset: resume with the data.domains it was saved with")
        self.epoch, self.position = state["epoch"], state["position"]
        self._order = self._epoch_order()


class DomainSampler:
    """Prompts of several domains mixed by share; the interface of `PromptSampler` (`take`, `next_batch`,
    `state`, `load_state`, `batch_size`).

    Each domain keeps its own `PromptSampler` (its own epochs and shuffles, seeded per domain). Which domain
    the next prompt comes from is a smooth weighted round-robin over the shares: prompt `n` (counting from 0
    over the whole run) comes from the domain furthest behind its quota, the one with the largest
    `(n + 1) * share - taken`, the first such domain in `samplers`' order on a tie. So after any `n`
    prompts every domain has had `n * share` of them, give or take less than one; when `share * P` is a whole
    number for every domain, every run of `P` consecutive prompts holds exactly `share * P` of each, so each
    `next_batch()` (and each `take(P)`, wherever it starts) does. The schedule depends only on how many
    prompts each domain has given, which is what `state` keeps: resuming continues it exactly.

    Args:
        samplers: domain name -> its sampler.
        shares: domain name -> its share, exact (`fractions.Fraction`) and summing to 1
            (`rollflow.config.DataConfig.domain_shares`): with floats, `0.3 * 10` would not be a whole 3.
        batch_size: prompts per `next_batch()`.
    """

    def __init__(self, samplers: dict[str, PromptSampler], shares: dict[str, Fraction], batch_size: int):
        if set(samplers) != set(shares) or not samplers:
            raise ValueError(f"samplers ({', '.join(samplers)}) and shares ({', '.join(shares)}) must name "
                             "the same domains, at least one")
        if sum(shares.values()) != 1 or min(shares.values()) <= 0:
            raise ValueError(f"shares must be positive and sum to 1, got {shares}")
        self.samplers, self.shares, self.batch_size = samplers, shares, batch_size
        self.taken = dict.fromkeys(samplers, 0)  # prompts each domain has given so far

    def next_domain(self) -> str:
        """The domain the next prompt comes from (without taking it)."""
        after = sum(self.taken.values()) + 1
        behind = {name: after * self.shares[name] - self.taken[name] for name in self.samplers}
        return max(behind, key=behind.__getitem__)  # max keeps the first of equals: ties go to the first

    def take(self, count: int) -> list[Any]:
        """The next `count` prompts of the schedule, each from its domain's sampler."""
        rows = []
        for _ in range(count):
            domain = self.next_domain()
            rows += self.samplers[domain].take(1)
            self.taken[domain] += 1
        return rows

    def next_batch(self) -> list[Any]:
        """The next step's prompts: `take(batch_size)`."""
        return self.take(self.batch_size)

    def state(self) -> dict[str, Any]:
        """Each domain's data position and prompts given (JSON-serializable)."""
        return {"domains": {name: {**sampler.state(), "taken": self.taken[name]}
                            for name, sampler in self.samplers.items()}}

    def load_state(self, state: dict[str, Any]) -> None:
        """Restore what `state` returned.

        Raises:
            DataError: the state holds other domains than this sampler (the run's `data.domains` changed).
        """
        saved = state.get("domains")
        if not isinstance(saved, dict) or set(saved) != set(self.samplers):
            found = ", ".join(saved) if isinstance(saved, dict) else "none (a single-dataset run)"
            raise DataError(f"the checkpoint's data position is of the domains {found}, not of data.domains "
                            f"({', '.join(self.samplers)}): resume with the domains it was saved with")
        for name, sampler in self.samplers.items():
            sampler.load_state(saved[name])
            self.taken[name] = saved[name]["taken"]
