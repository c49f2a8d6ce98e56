"""Rows of full conversations as training `Sample`s, and an endless shuffled batch iterator.

`ConversationEncoder` turns a chat row (`messages`) or a prompt / response row into one `Sample` whose
`prompt_ids` are what an engine would be handed and whose `response_ids` are every later token, with
`loss_mask` 1 exactly on the assistant's tokens (its content and the end-of-turn tokens the template
appends), so a model learns to answer and to stop, never to predict prompts or user turns. The samples then
take the one training path every pipeline takes:

    samples = [ConversationEncoder(tokenizer).encode(row) for row in rows]
    batches = shuffled_batches(samples, batch_size=128, seed=0)
    metrics = backend.train_step(collate(next(batches), tokenizer.pad_token_id), OBJECTIVES["nll"]())
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from typing import Any, TypeVar

from rollflow.data.sample import Sample
from rollflow.data.vision import (
    VisionInputs,
    VisionProcessor,
    described_images,
    encodable_images,
    image_messages,
)
from rollflow.errors import DataError

Item = TypeVar("Item")


def chat_prompt_text(tokenizer, prompt: str) -> str:
    """The chat-formatted text a model sees before answering `prompt` (a single user turn).

    Args:
        tokenizer: a transformers tokenizer with a chat template.
        prompt: the user message content.

    Returns:
        The rendered template with the generation prompt.
    """
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
    )


def chat_prompt_ids(tokenizer, prompt: str) -> list[int]:
    """The token ids of `chat_prompt_text(tokenizer, prompt)`: what an engine is handed to answer `prompt`,
    and the `prompt_ids` of an SFT sample.

    Args:
        tokenizer: a transformers tokenizer with a chat template.
        prompt: the user message content.

    Returns:
        Token ids, no special tokens added beyond the template's own.
    """
    return tokenizer.encode(chat_prompt_text(tokenizer, prompt), add_special_tokens=False)


class ConversationEncoder:
    """Rows of full conversations as training `Sample`s: the prompt part is what an engine would be handed,
    the response part every later token, `loss_mask` 1 exactly on the assistant's tokens.

    A row is either a chat (`messages_key`: a list of `{role, content}` turns, system / user / assistant /
    tool, in any number; an assistant turn may carry structured `tool_calls`) or a prompt and a response
    (`prompt_key`, `response_key`). A row's `tools` column (JSON-schema tool specs) goes to the chat template as
    `tools=`, as the agentic rollout renders a tool-use env's first prompt. With a chat template, each turn is
    rendered and tokenized once per prefix of the conversation: the tokens a turn adds are the difference
    between the conversation up to it and up to the turn before, so the assistant's tokens are its content and
    the end-of-turn tokens the template appends after it, never the header (`<|assistant|>`) the generation
    prompt already holds. Every prefix must tokenize to a token prefix of the next (else the mask would be
    ill-defined, a `DataError`). Without a template: prompt text, response text, EOS.

    Args:
        tokenizer: a transformers tokenizer.
        messages_key, prompt_key, response_key: the row's columns.
        apply_chat_template: use the tokenizer's chat template when it has one.
        max_tokens: the longest conversation, in tokens; longer is a `DataError`.
        processor: a vision-language model's `VisionProcessor`: a row's images (`image_key` column) go into
            its first user turn (where it says `<image>`, else before its text) and `Sample.vision`; None: a
            text-only model, whose rows with images are a `DataError`.
        image_key: the row column holding the images.
    """

    def __init__(self, tokenizer, messages_key: str = "messages", prompt_key: str = "prompt",
                 response_key: str = "response", apply_chat_template: bool = True, max_tokens: int = 512,
                 processor: VisionProcessor | None = None, image_key: str = "images"):
        self.tokenizer = tokenizer
        self.processor, self.image_key = processor, image_key
        self.messages_key, self.prompt_key, self.response_key = messages_key, prompt_key, response_key
        self.use_template = apply_chat_template and getattr(tokenizer, "chat_template", None) is not None
        self.max_tokens = max_tokens

    def encode(self, row: dict[str, Any], response: Any = None) -> Sample:
        """The sample of `row`, or of its prompt with `response` instead of its own (DPO's chosen / rejected).

        Args:
            row: a chat row or a prompt / response row.
            response: the response to encode instead of the row's own; None: the row's own.

        Returns:
            The `Sample`: `prompt_ids` up to the first assistant token, `loss_mask` 1 on the assistant's tokens.

        Raises:
            DataError: a missing / malformed column, a template that does not extend its own prefixes, no
                assistant token to train on, or more than `max_tokens` tokens.
        """
        messages, vision = self.conversation(row, response), None
        if row.get(self.image_key):
            messages, vision = self._with_images(row, messages)
        ids, mask = self._tokens(messages, _tools(row), vision)
        if len(ids) > self.max_tokens:
            raise DataError(f"the conversation has {len(ids)} tokens, over data.max_tokens={self.max_tokens}")
        first = mask.index(1) if 1 in mask else len(mask)
        if first == len(mask):
            raise DataError("the conversation has no assistant tokens to train on")
        if first == 0:
            raise DataError("the conversation starts with an assistant turn; it needs a prompt before it")
        return Sample(prompt_ids=ids[:first], response_ids=ids[first:], loss_mask=mask[first:],
                      prompt_text=self.tokenizer.decode(ids[:first]), row=described_images(dict(row), self.image_key),
                      vision=vision)

    def _with_images(self, row: dict[str, Any], messages: list[dict]) -> tuple[list[dict], VisionInputs]:
        """The conversation with the row's images in its first user turn (where it says `<image>`, else before
        its text), and the images processed.

        Raises:
            DataError: a text-only model, an unreadable image, no user turn, markers that do not match.
        """
        images = encodable_images(row, self.image_key, self.processor, self.use_template)
        first_user = next((i for i, message in enumerate(messages) if message["role"] == "user"), None)
        if first_user is None:
            raise DataError("the row has images but no user turn to hold them")
        content = image_messages(messages[first_user]["content"], len(images))[0]["content"]
        messages = [*messages[:first_user], {**messages[first_user], "content": content}, *messages[first_user + 1:]]
        return messages, self.processor.process(images)

    def has_blank_response(self, row: dict[str, Any], response: Any = None) -> bool:
        """Whether the row trains on nothing but the end-of-turn tokens: its response (a chat row: every
        assistant turn) is empty, or whitespace that the chat template or the tokenizer turns into no token
        (the trained tokens are those of an empty response). Whitespace that does become tokens is a response.

        Args:
            row: a row `encode` accepts.
            response: as for `encode`.

        Returns:
            True when the response adds no trained token.
        """
        messages = self.conversation(row, response)
        if response is None and self.messages_key in row:  # a chat: every assistant turn
            answers = [i for i, message in enumerate(messages) if message["role"] == "assistant"]
        else:  # the response is the last turn (earlier assistant turns of a prompt are context)
            answers = [len(messages) - 1]
        contents = [messages[i]["content"] for i in answers]
        if any(content.strip() for content in contents):
            return False
        if not any(contents):
            return True
        blanked = [{**message, "content": ""} if i in answers else message for i, message in enumerate(messages)]
        return _trained(*self._tokens(messages, _tools(row))) == _trained(*self._tokens(blanked, _tools(row)))

    def conversation(self, row: dict[str, Any], response: Any = None) -> list[dict[str, str]]:
        """The row's turns as `{role, content}`: its chat, or its prompt (a string or turns) then the response.

        Args:
            row: a chat row or a prompt / response row.
            response: the response to use instead of the row's own (DPO's chosen / rejected); None: the row's.

        Returns:
            The turns, the response (if not a chat row) last.

        Raises:
            DataError: a missing or malformed column.
        """
        if response is None and self.messages_key in row:
            return _messages(row[self.messages_key], self.messages_key)
        prompt = row.get(self.prompt_key)
        column = self.response_key if response is None else "response"  # a DPO chosen / rejected is given
        response = row.get(self.response_key) if response is None else response
        if not isinstance(response, str):
            raise DataError(f"no {self.messages_key!r} column and the response (column {column!r}) is "
                            f"{'missing' if response is None else type(response).__name__}, not a string")
        if isinstance(prompt, list):
            return _messages(prompt, self.prompt_key) + [{"role": "assistant", "content": response}]
        if isinstance(prompt, str):
            return [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
        raise DataError(f"the prompt (column {self.prompt_key!r}) must be a string or chat turns, not "
                        f"{type(prompt).__name__}")

    def _tokens(self, messages: list[dict[str, str]], tools: list[dict] | None = None,
                vision: VisionInputs | None = None) -> tuple[list[int], list[int]]:
        """Token ids of the whole conversation and a 0/1 mask, 1 on the assistant's tokens; each image's
        placeholder expanded by `vision`'s grids."""
        tokenizer = self.tokenizer
        if not self.use_template:
            if [m["role"] for m in messages] != ["user", "assistant"]:
                raise DataError("chat rows need a chat template (data.apply_chat_template is false or the "
                                "tokenizer has none); give prompt / response columns")
            prompt = tokenizer.encode(messages[0]["content"], add_special_tokens=False)
            answer = tokenizer.encode(messages[1]["content"], add_special_tokens=False) + [tokenizer.eos_token_id]
            return prompt + answer, [0] * len(prompt) + [1] * len(answer)
        ids: list[int] = []
        mask: list[int] = []
        for index, message in enumerate(messages):
            if message["role"] == "assistant":  # its header belongs to the prompt, as at generation time
                ids, mask = self._extend(ids, mask, messages[:index], 0, True, tools, vision)
            ids, mask = self._extend(ids, mask, messages[: index + 1], int(message["role"] == "assistant"), False,
                                     tools, vision)
        return ids, mask

    def _extend(self, ids: list[int], mask: list[int], messages: list[dict[str, str]], value: int,
                generation_prompt: bool = False, tools: list[dict] | None = None,
                vision: VisionInputs | None = None) -> tuple[list[int], list[int]]:
        if not messages:
            return ids, mask
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt,
                                                      tokenize=False, **({"tools": tools} if tools else {}))
        except Exception as err:  # jinja or the template's own raise_exception
            raise DataError(f"the chat template cannot render the row ({_first_line(err)})") from None
        if vision is not None:
            text = self.processor.expand(text, vision)
        longer = self.tokenizer.encode(text, add_special_tokens=False)
        if longer[: len(ids)] != ids:
            raise DataError("the chat template does not render a conversation as a token prefix of its "
                            "continuation, so the loss mask is ill-defined; use prompt / response rows with "
                            "data.apply_chat_template: false")
        return longer, mask + [value] * (len(longer) - len(ids))


def _messages(value: Any, column: str) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise DataError(f"column {column!r} must be a non-empty list of {{role, content}} turns")
    for turn in value:
        if not (isinstance(turn, dict) and turn.get("role") in ("system", "user", "assistant", "tool")
                and isinstance(turn.get("content"), str)):
            raise DataError(f"column {column!r}: each turn is {{role: system | user | assistant | tool, content: "
                            f"string}}, got {turn!r:.80}")
        if "tool_calls" in turn and not (turn["role"] == "assistant" and isinstance(turn["tool_calls"], list)):
            raise DataError(f"column {column!r}: tool_calls must be a list on an assistant turn, got {turn!r:.80}")
    return [{key: turn[key] for key in ("role", "content", "tool_calls") if key in turn} for turn in value]


def _tools(row: dict[str, Any]) -> list[dict] | None:
    """The row's `tools` column (JSON-schema tool specs), or None.

    Raises:
        DataError: the column is not a list of objects.
    """
    tools = row.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(isinstance(tool, dict) for tool in tools):
        raise DataError(f"column 'tools' must be a list of JSON-schema tool specs (objects), got {tools!r:.80}")
    return tools or None


def _trained(ids: list[int], mask: list[int]) -> list[int]:
    """The token ids a loss is taken on."""
    return [token for token, value in zip(ids, mask, strict=True) if value]


def _first_line(err: BaseException) -> str:
    text = str(err).strip() or type(err).__name__
    return text.splitlines()[0]




def shuffled_batches(items: Sequence[Item], batch_size: int, seed: int,
                     shuffle: bool = True) -> Iterator[list[Item]]:
    """Endless full batches: each epoch visits every item once in a seed-determined order.

    One `random.Random(seed)` reshuffles the same index list at the start of every epoch. A last partial
    batch of an epoch is dropped, so every batch has exactly `batch_size` items.

    Args:
        items: what to batch (samples, rows).
        batch_size: items per batch, in 1..len(items).
        seed: the shuffle seed.
        shuffle: False keeps the items' order every epoch.

    Returns:
        An endless iterator of `batch_size`-item lists. Raises `ValueError` (on the first `next`) for a
        batch size outside 1..len(items).
    """
    if not 0 < batch_size <= len(items):
        raise ValueError(f"batch_size must be in 1..{len(items)} (the number of items), got {batch_size}")
    rng = random.Random(seed)
    order = list(range(len(items)))
    while True:
        if shuffle:
            rng.shuffle(order)
        for start in range(0, len(order) - batch_size + 1, batch_size):
            yield [items[index] for index in order[start : start + batch_size]]
