"""Token-exact rendering of multi-turn episodes: each observation turn is rendered once, as the tokens that
follow the model's last turn, so the history is never re-tokenized and the tokens trained on are exactly the
tokens the engine saw and sampled.

The pieces come from the tokenizer's own chat template, found by rendering a two-turn conversation with
placeholder contents and cutting it where the contents sit:

    [system] <user prefix> OBS <user suffix> <generation prompt>  MODEL TOKENS  <end of turn> <user prefix> ...

`end of turn` is what the template writes after an assistant message (`<eos>`, `<|im_end|>\\n`). The engine
stops on the end-of-turn token, so a turn the model ended itself already holds that token and only what
follows it (a newline, say) is added; a turn cut by the length limit gets the whole end of turn.
"""

from __future__ import annotations

from dataclasses import dataclass

from rollflow.errors import ConfigError

_USER, _REPLY = "\x01USER\x01", "\x01REPLY\x01"  # placeholders no real content contains


@dataclass(frozen=True)
class TemplatePieces:
    """The texts a chat template puts around an observation and after a reply."""

    first_prefix: str  # [system] + what precedes the first user message
    user_prefix: str  # what precedes a later user message (after the end of turn)
    user_suffix: str  # what follows a user message, generation prompt included
    end_of_turn: str  # what follows an assistant message


def template_pieces(tokenizer, system_prompt: str | None = None) -> TemplatePieces:
    """Cut the tokenizer's chat template into the pieces a multi-turn episode is rendered with.

    A tokenizer without a chat template renders `OBS\\n` as a user turn and ends the model's turn with its EOS
    token and a newline.

    Raises:
        ConfigError: the template does not render a user / assistant / user conversation in order.
    """
    if getattr(tokenizer, "chat_template", None) is None:
        eos = tokenizer.eos_token or ""
        return TemplatePieces(f"{system_prompt}\n" if system_prompt else "", "", "\n", f"{eos}\n")
    system = [{"role": "system", "content": system_prompt}] if system_prompt else []

    def render(messages: list[dict], generation_prompt: bool) -> str:
        return tokenizer.apply_chat_template(system + messages, tokenize=False,
                                             add_generation_prompt=generation_prompt)

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


class TurnEncoder:
    """Renders episodes turn by turn, as token ids.

    Args:
        tokenizer: the policy's tokenizer.
        system_prompt: a system message before the first observation, or None.
    """

    def __init__(self, tokenizer, system_prompt: str | None = None):
        self.tokenizer = tokenizer
        self.pieces = template_pieces(tokenizer, system_prompt)
        self.end_of_turn_ids = self.encode(self.pieces.end_of_turn)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def first_prompt(self, observation: str) -> list[int]:
        """The episode's prompt: [system], the first observation as a user turn, the generation prompt."""
        pieces = self.pieces
        return self.encode(pieces.first_prefix + observation + pieces.user_suffix)

    def observation_turn(self, observation: str, model_ids: list[int]) -> list[int]:
        """The tokens after the model's turn `model_ids`: the rest of its end of turn, the observation as a
        user turn and the generation prompt (none of it trained on)."""
        closing = self.end_of_turn_ids
        if closing and model_ids and model_ids[-1] == closing[0]:
            closing = closing[1:]  # the model ended its turn itself: its stop token is the first one
        return closing + self.encode(self.pieces.user_prefix + observation + self.pieces.user_suffix)

    def step_prompt(self, history: list[tuple[str, str]], observation: str) -> list[int]:
        """A step-wise sample's prompt: the earlier (observation, reply) turns kept, then `observation`."""
        pieces = self.pieces
        text = pieces.first_prefix
        for index, (seen, reply) in enumerate(history):
            text += ("" if index == 0 else pieces.user_prefix) + seen + pieces.user_suffix + reply
            text += pieces.end_of_turn
        text += (pieces.user_prefix if history else "") + observation + pieces.user_suffix
        return self.encode(text)
