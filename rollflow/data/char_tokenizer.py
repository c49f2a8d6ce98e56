"""A character-level tokenizer with a minimal chat template, for the bundled tiny model.

Every character is one token, so token counts are easy to reason about in tests and the tiny model
needs only ~90 embedding rows. It is a regular `transformers` fast tokenizer: it saves with
`save_pretrained` and loads back with `AutoTokenizer.from_pretrained`, so every engine and backend treats
it like any other model's tokenizer.

Chat format (no system role, no whitespace between turns):

    <|user|>23+58<|assistant|>81<eos>
"""

from __future__ import annotations

import string

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

PAD_TOKEN = "<pad>"
EOS_TOKEN = "<eos>"
UNK_TOKEN = "<unk>"
USER_TOKEN = "<|user|>"
ASSISTANT_TOKEN = "<|assistant|>"
SPECIAL_TOKENS = [PAD_TOKEN, EOS_TOKEN, UNK_TOKEN, USER_TOKEN, ASSISTANT_TOKEN]

# Order fixes the token ids: special tokens first (pad = 0, eos = 1), then the characters.
CHARACTERS = (
    string.digits + "+-*/=()., \n" + string.ascii_lowercase + string.ascii_uppercase + "!?:;'\"<>%_^#|"
)

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}"
    "{{ '<|user|>' + message['content'] }}"
    "{% elif message['role'] == 'assistant' %}"
    "{{ '<|assistant|>' + message['content'] + '<eos>' }}"
    "{% else %}"
    "{{ raise_exception('the char tokenizer chat template supports only user and assistant roles, got '"
    " + message['role']) }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """Build the character-level tokenizer used by the bundled tiny model.

    Returns:
        A fast tokenizer with `pad_token="<pad>"` (id 0), `eos_token="<eos>"` (id 1),
        `unk_token="<unk>"`, the `<|user|>` / `<|assistant|>` chat markers, left padding, and a chat
        template that renders a user turn as `<|user|>{content}` and an assistant turn as
        `<|assistant|>{content}<eos>`. Characters outside `CHARACTERS` encode to `<unk>`.
    """
    vocab = {token: index for index, token in enumerate(SPECIAL_TOKENS + list(CHARACTERS))}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    # `[\s\S]` matches any single character, newline included: one pre-token (one token) per character.
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    # Fuse joins tokens with no separator, so decoding never inserts spaces between characters.
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(SPECIAL_TOKENS)

    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        extra_special_tokens=[USER_TOKEN, ASSISTANT_TOKEN],
        padding_side="left",
        clean_up_tokenization_spaces=False,
        chat_template=CHAT_TEMPLATE,
        model_max_length=64,
    )
