"""Token-exact rendering of multi-turn episodes: each observation turn is rendered once, as the tokens that
follow the model's last turn, so the history is never re-tokenized and the tokens trained on are exactly the
tokens the engine saw and sampled.

The pieces come from the tokenizer's own chat template, found by rendering a two-turn conversation with
placeholder contents and cutting it where the contents sit:

    [system] <user prefix> OBS <user suffix> <generation prompt>  MODEL TOKENS  <end of turn> <user prefix> ...

`end of turn` is what the template writes after an assistant message (`<eos>`, `<|im_end|>\\n`). The engine
stops on the end-of-turn token, so a turn the model ended itself already holds that token and only what
follows it (a newline, say) is added; a turn cut by the length limit gets the whole end of turn.

Tool use: with `tools` (JSON-schema function specs), every rendering passes `tools=` to the template, so the
first prompt holds the template's own tool block (Qwen: the `# Tools` system message with the schemas). A turn
answered by tool results renders them as `tool` role messages (`tool_turn`), cut from the template the same
way: `[user, assistant, tool, ..., tool]` with placeholder contents, the text between the reply and the end
(Qwen: `<|im_start|>user\n<tool_response>\n...\n</tool_response><|im_end|>\n<|im_start|>assistant\n`).

Image observations (a vision-language policy, `processor`): an observation turn's images go where its text says
`<image>` (else before the text), as the template renders an image part (Qwen2-VL:
`<|vision_start|><|image_pad|><|vision_end|>`), each placeholder expanded to the image's tokens by the
processor; the turn's `VisionInputs` (`vision`) join the episode's in order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from rollflow.errors import ConfigError, DataError

if TYPE_CHECKING:
    from rollflow.data.vision import VisionInputs, VisionProcessor

_USER, _REPLY = "\x01USER\x01", "\x01REPLY\x01"  # placeholders no real content contains
_TOOL = "\x01TOOL{}\x01"  # the k-th tool result's placeholder


@dataclass(frozen=True)
class TemplatePieces:
    """The texts a chat template puts around an observation and after a reply."""

    first_prefix: str  # [system] + what precedes the first user message
    user_prefix: str  # what precedes a later user message (after the end of turn)
    user_suffix: str  # what follows a user message, generation prompt included
    end_of_turn: str  # what follows an assistant message


def template_pieces(tokenizer, system_prompt: str | None = None, tools: list[dict] | None = None) -> TemplatePieces:
    """Cut the tokenizer's chat template into the pieces a multi-turn episode is rendered with.

    A tokenizer without a chat template renders `OBS\\n` as a user turn and ends the model's turn with its EOS
    token and a newline.

    Args:
        tokenizer: the policy's tokenizer.
        system_prompt: a system message before the first observation, or None.
        tools: the tools' JSON-schema specs, passed to the template as `tools=` (None: no tools).

    Raises:
        ConfigError: the template does not render a user / assistant / user conversation in order.
    """
    if getattr(tokenizer, "chat_template", None) is None:
        eos = tokenizer.eos_token or ""
        return TemplatePieces(f"{system_prompt}\n" if system_prompt else "", "", "\n", f"{eos}\n")
    render = _renderer(tokenizer, system_prompt, tools)

    one = render([{"role": "user", "content": _USER}], True)
    two = render([{"role": "user", "content": _USER}, {"role": "assistant", "content": _REPLY},
                  {"role": "user", "content": _USER}], True)
    if one.count(_USER) != 1 or two.count(_USER) != 2 or two.count(_REPLY) != 1 \
            or two.index(_REPLY) < two.index(_USER):
        raise ConfigError("the tokenizer's chat template does not render user / assistant / user turns in order; "
                          "multi-turn episodes need one that does")
    first_prefix, user_suffix = one.split(_USER)
    between = two.split(_REPLY)[1].split(_USER)[0]  # end of turn + next user prefix
    # The end of turn is what the template adds after a reply when nothing follows it.
    closed = render([{"role": "user", "content": _USER}, {"role": "assistant", "content": _REPLY}], False)
    end_of_turn = closed.split(_REPLY, 1)[1]
    if not between.startswith(end_of_turn):
        end_of_turn = ""  # a template that ends turns differently when another follows: all of it is prefix
    return TemplatePieces(first_prefix, between[len(end_of_turn):], user_suffix, end_of_turn)


def tool_turn_pieces(tokenizer, count: int, system_prompt: str | None = None,
                     tools: list[dict] | None = None) -> list[str]:
    """The texts a chat template puts around `count` tool results that answer a model turn.

    Returns:
        `count + 1` texts: before the first result (after the reply's end of turn), between results, and after
        the last (the generation prompt included); a tokenizer without a chat template: each result on a
        line of its own, as a user turn.

    Raises:
        ConfigError: the template cannot render `tool` messages after an assistant turn, in order.
    """
    if getattr(tokenizer, "chat_template", None) is None:
        return ["", *(["\n"] * count)]
    render = _renderer(tokenizer, system_prompt, tools)
    results = [{"role": "tool", "content": _TOOL.format(k)} for k in range(count)]
    try:
        text = render([{"role": "user", "content": _USER}, {"role": "assistant", "content": _REPLY}, *results],
                      True)
    except Exception as err:  # noqa: BLE001  (jinja, or the template's own raise_exception)
        raise ConfigError(f"the tokenizer's chat template cannot render tool turns ({_first_line(err)}); tool "
                          "use needs a template with a tool role") from None
    after_reply = text.split(_REPLY, 1)[1] if text.count(_REPLY) == 1 else ""
    end_of_turn = template_pieces(tokenizer, system_prompt, tools).end_of_turn
    pieces, rest = [], after_reply[len(end_of_turn):] if after_reply.startswith(end_of_turn) else ""
    for k in range(count):
        if rest.count(_TOOL.format(k)) != 1:
            raise ConfigError("the tokenizer's chat template does not render tool results after the model's turn, "
                              "in order; tool use needs one that does")
        piece, rest = rest.split(_TOOL.format(k))
        pieces.append(piece)
    return [*pieces, rest]


def _renderer(tokenizer, system_prompt: str | None, tools: list[dict] | None):
    """`render(messages, generation_prompt) -> text` with the system message and tools of an episode."""
    system = [{"role": "system", "content": system_prompt}] if system_prompt else []
    extra = {"tools": tools} if tools else {}

    def render(messages: list[dict], generation_prompt: bool) -> str:
        return tokenizer.apply_chat_template(system + messages, tokenize=False,
                                             add_generation_prompt=generation_prompt, **extra)

    return render


def _first_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return lines[0] if lines else type(err).__name__


class TurnEncoder:
    """Renders episodes turn by turn, as token ids.

    Args:
        tokenizer: the policy's tokenizer.
        system_prompt: a system message before the first observation, or None.
        tools: the env's tools (JSON-schema specs) for the template's tool block, or None.
        processor: a vision-language policy's `VisionProcessor`, for image observations; None: text only.
    """

    def __init__(self, tokenizer, system_prompt: str | None = None, tools: list[dict] | None = None,
                 processor: VisionProcessor | None = None):
        self.tokenizer = tokenizer
        self.processor = processor
        self.system_prompt, self.tools = system_prompt, tools or None
        self.pieces = template_pieces(tokenizer, system_prompt, self.tools)
        self.end_of_turn_ids = self.encode(self.pieces.end_of_turn)
        self._tool_pieces: dict[int, list[str]] = {}

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def holds_image_token(self, token_ids: list[int]) -> bool:
        """Whether the model's `token_ids` hold the image-pad token (a vision-language policy): a trajectory
        cannot go on after them, since every engine's next prefill would read that token as an image's."""
        return self.processor is not None and self.processor.image_token_id in token_ids

    def vision(self, images: list) -> VisionInputs | None:
        """An observation's images (PIL images, PNG bytes, paths) processed for the policy; None without images.

        Raises:
            DataError: the policy is text-only, or an image cannot be read (one line each).
        """
        if not images:
            return None
        if self.processor is None:
            raise DataError(f"the env's observation has {len(images)} image(s), but the model is text-only: use a "
                            "vision-language model (Qwen2-VL's family) or the env's text observations")
        from rollflow.data.vision import read_image

        return self.processor.process([read_image(image) for image in images])

    def first_prompt(self, observation: str, vision: VisionInputs | None = None) -> list[int]:
        """The episode's prompt: [system], the first observation (with its images, `vision`) as a user turn,
        the generation prompt."""
        pieces = self.pieces
        return self._user_turn(pieces.first_prefix, observation, vision)

    def observation_turn(self, observation: str, model_ids: list[int], vision: VisionInputs | None = None
                         ) -> list[int]:
        """The tokens after the model's turn `model_ids`: the rest of its end of turn, the observation (with
        its images, `vision`) as a user turn and the generation prompt (none of it trained on)."""
        return self._closing(model_ids) + self._user_turn(self.pieces.user_prefix, observation, vision)

    def _user_turn(self, prefix: str, observation: str, vision: VisionInputs | None) -> list[int]:
        if vision is None:
            return self.encode(prefix + observation + self.pieces.user_suffix)
        from rollflow.data.vision import place_images

        placed = place_images(observation, vision.num_images)
        return self.encode(self.processor.expand(prefix + placed + self.pieces.user_suffix, vision))

    def tool_turn(self, results: list[str], model_ids: list[int]) -> list[int]:
        """The tokens after the model's turn `model_ids` when tools answer it: the rest of its end of turn, each
        result as a `tool` message (as the template renders consecutive ones) and the generation prompt."""
        return self._closing(model_ids) + self.encode(self._tool_text(results))

    def next_turn(self, seen: str | list[str], model_ids: list[int], vision: VisionInputs | None = None
                  ) -> list[int]:
        """`tool_turn` when the env answered with tool results (a list: `info["tool_results"]`), else
        `observation_turn` of the observation text (and its images, `vision`)."""
        if isinstance(seen, list):
            if vision is not None:
                raise DataError("an env answered with tool results and images at once; images come with an "
                                "observation")
            return self.tool_turn(seen, model_ids)
        return self.observation_turn(seen, model_ids, vision)

    def _closing(self, model_ids: list[int]) -> list[int]:
        closing = self.end_of_turn_ids
        if closing and model_ids and model_ids[-1] == closing[0]:
            closing = closing[1:]  # the model ended its turn itself: its stop token is the first one
        return closing

    def _tool_text(self, results: list[str]) -> str:
        count = len(results)
        if count not in self._tool_pieces:
            self._tool_pieces[count] = tool_turn_pieces(self.tokenizer, count, self.system_prompt, self.tools)
        pieces = self._tool_pieces[count]
        return "".join(piece + result for piece, result in zip(pieces, results)) + pieces[-1]

    def step_prompt(self, history: list[tuple[str | list[str], str]], observation: str | list[str],
                    visions: list[VisionInputs | None] | None = None) -> list[int]:
        """A step-wise sample's prompt: the earlier (observation, reply) turns kept, then `observation`.

        An observation is text (a user turn) or a list of tool results (tool turns after the reply before it);
        tool results with no reply before them in the prompt (the kept history starts there) are a user turn
        of their lines. `visions`: the images of each observation of the prompt (the history's, then
        `observation`'s; None: none), placed in their turns; the prompt's images are `join_vision(visions)`.
        """
        pieces = self.pieces
        visions = visions or [None] * (len(history) + 1)
        text = pieces.first_prefix
        for index, ((seen, reply), vision) in enumerate(zip(history, visions)):
            text += self._observation_text(seen, index == 0, vision) + reply + pieces.end_of_turn
        text += self._observation_text(observation, not history, visions[-1])
        from rollflow.data.vision import join_vision

        joined = join_vision(visions)
        return self.encode(text if joined is None else self.processor.expand(text, joined))

    def _observation_text(self, seen: str | list[str], first: bool, vision: VisionInputs | None = None) -> str:
        if isinstance(seen, list):
            if not first:
                return self._tool_text(seen)
            seen = "\n".join(seen)
        if vision is not None:
            from rollflow.data.vision import place_images

            seen = place_images(seen, vision.num_images)
        return ("" if first else self.pieces.user_prefix) + seen + self.pieces.user_suffix
