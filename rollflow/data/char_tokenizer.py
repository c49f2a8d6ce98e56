"""A character-level tokenizer with a minimal chat template, for tiny models.

Every character is one token, so token counts are easy to reason about in tests and a tiny model needs only
a few hundred embedding rows. It is a regular `transformers` fast tokenizer: it saves with
`save_pretrained` and loads back with `AutoTokenizer.from_pretrained`, so every engine and backend treats
it like any other model's tokenizer.

Loaded from a directory whose `config.json` says `model_type: qwen2`, transformers 5 ignores a saved
pipeline and builds `Qwen2Tokenizer` (regex + ByteLevel pre-tokenizer, ByteLevel decoder, BPE without an
unknown token) from the saved vocabulary. (The bundled model's first tokenizer, a `WordLevel` one, broke that
way: spaces, newlines and unknown characters vanished.)

`build_ascii_tokenizer()` is built to survive that pipeline; the bundled model and every new model
(`rollflow.fresh_model`) use it: a byte-level BPE with no merges, so what we build and what `Qwen2Tokenizer`
rebuilds from the saved files are the same tokenizer. Each of the 97 `ASCII_CHARACTERS` (printable ASCII,
newline, tab) is one token and decodes back exactly, whitespace runs included. Every other character is
encoded as its UTF-8 bytes, one fallback token per byte, and decodes back exactly too: `Qwen2Tokenizer`
always builds its BPE without an unknown token, so a byte missing from the vocabulary would be dropped
silently, and the only way to never lose text is to give every byte a token. `<unk>` keeps id 2 but the
encoder never emits it. Text is NFC-normalized first (as `Qwen2Tokenizer` does), which never changes ASCII;
non-ASCII text that is not in NFC (`e` + combining accent) decodes to its NFC form. Chat format:

    <|system|>Be brief.<|user|>What is 7 * 8?<|assistant|>56<eos>
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast

PAD_TOKEN = "<pad>"
EOS_TOKEN = "<eos>"
UNK_TOKEN = "<unk>"
USER_TOKEN = "<|user|>"
ASSISTANT_TOKEN = "<|assistant|>"
SPECIAL_TOKENS = [PAD_TOKEN, EOS_TOKEN, UNK_TOKEN, USER_TOKEN, ASSISTANT_TOKEN]

SYSTEM_TOKEN = "<|system|>"
ASCII_SPECIAL_TOKENS = [PAD_TOKEN, EOS_TOKEN, UNK_TOKEN, USER_TOKEN, ASSISTANT_TOKEN, SYSTEM_TOKEN]
# Printable ASCII in code-point order (space first, `~` last), then newline and tab: ids 6..102.
ASCII_CHARACTERS = "".join(chr(code) for code in range(32, 127)) + "\n\t"

ASCII_CHAT_TEMPLATE = (
    # tools (apply_chat_template(..., tools=[...])): one short system line naming each tool and its parameters,
    # `tools: calculator(expression)`, after the system message's text when there is one (the tiny model's
    # context is 256 tokens: no JSON schemas)
    "{% if tools %}"
    "{{ '<|system|>' }}"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\\n' }}{% endif %}"
    "{{ 'tools:' }}"
    "{% for tool in tools %}"
    "{% set fn = tool['function'] if tool['function'] is defined else tool %}"
    "{{ ' ' + fn['name'] + '(' + (fn['parameters']['properties'] | list | join(', ')) + ')' }}"
    "{% endfor %}"
    "{{ '\\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' and loop.first %}"
    "{% if not tools %}{{ '<|system|>' + message['content'] }}{% endif %}"
    "{% elif message['role'] == 'user' %}"
    "{{ '<|user|>' + message['content'] }}"
    "{% elif message['role'] == 'assistant' %}"
    "{{ '<|assistant|>' + message['content'] }}"
    # structured tool calls (OpenAI / transformers format) are written as the model writes them, Qwen-style
    "{% if message['tool_calls'] is defined and message['tool_calls'] %}"
    "{% for call in message['tool_calls'] %}"
    "{% set call = call['function'] if call['function'] is defined else call %}"
    "{{ '<tool_call>\\n{\"name\": \"' + call['name'] + '\", \"arguments\": ' }}"
    "{{ call['arguments'] if call['arguments'] is string else call['arguments'] | tojson }}"
    "{{ '}\\n</tool_call>' }}"
    "{% endfor %}"
    "{% endif %}"
    "{{ '<eos>' }}"
    "{% elif message['role'] == 'tool' %}"
    # a tool result is a user turn, consecutive results in one turn (as Qwen's template does)
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{ '<|user|>' }}{% endif %}"
    "{{ '<tool_response>' + message['content'] + '</tool_response>' }}"
    "{% else %}"
    "{{ raise_exception('the ascii tokenizer chat template supports a system message (first only), user, '"
    " 'assistant and tool roles, got ' + message['role'] + ' at position ' + loop.index0|string) }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def byte_level_alphabet() -> dict[int, str]:
    """GPT-2's `bytes_to_unicode`: the printable character that stands for each byte in a byte-level vocabulary.

    Bytes that are printable and not whitespace stand for themselves (`a` is `a`); the others are shifted
    past 255 (space is `Ġ`, newline `Ċ`, tab `ĉ`). `tokenizers`' ByteLevel pre-tokenizer and decoder use
    this same table.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {byte: chr(byte) for byte in printable}
    shifted = (byte for byte in range(256) if byte not in table)
    for offset, byte in enumerate(shifted):
        table[byte] = chr(256 + offset)
    return dict(sorted(table.items()))


def ascii_vocabulary() -> dict[str, int]:
    """The ASCII tokenizer's vocabulary, token -> id.

    Ids 0-5 are `ASCII_SPECIAL_TOKENS` (`<pad>`, `<eos>`, `<unk>`, `<|user|>`, `<|assistant|>`,
    `<|system|>`); 6-102 the `ASCII_CHARACTERS` in that order; 103-261 the other 159 bytes (the UTF-8 bytes
    of any non-ASCII character, and ASCII control characters such as `\r`) in byte order. Tokens are
    spelled byte-level (`byte_level_alphabet`): id 6, the space, is `Ġ`.
    """
    alphabet = byte_level_alphabet()
    character_bytes = [ord(character) for character in ASCII_CHARACTERS]
    fallback_bytes = [byte for byte in range(256) if byte not in set(character_bytes)]
    tokens = ASCII_SPECIAL_TOKENS + [alphabet[byte] for byte in character_bytes + fallback_bytes]
    return {token: index for index, token in enumerate(tokens)}


def build_ascii_tokenizer(model_max_length: int = 256) -> PreTrainedTokenizerFast:
    """Build the character-level ASCII tokenizer for new models (see the module docstring).

    It round-trips exactly (`decode(encode(text)) == text`) used directly and after `save_pretrained` next to
    a qwen2 `config.json` and `AutoTokenizer.from_pretrained`, which loads it as `Qwen2Tokenizer`; both
    encode every text to the same ids.

    Args:
        model_max_length: the longest input, in tokens, the tokenizer reports (the model's context).

    Returns:
        A fast tokenizer with 262 tokens (`ascii_vocabulary`): `pad_token="<pad>"` (id 0),
        `eos_token="<eos>"` (id 1), `unk_token="<unk>"` (id 2), the `<|user|>` / `<|assistant|>` /
        `<|system|>` chat markers, left padding, no clean-up of spaces on decode, and a chat template that
        renders an optional first system message as `<|system|>{content}`, a user turn as
        `<|user|>{content}`, an assistant turn as `<|assistant|>{content}<eos>` and the generation prompt as
        `<|assistant|>`; any other role raises.
    """
    # No merges: every byte stays its own token. The same model, normalizer and byte-level mapping that
    # `Qwen2Tokenizer` rebuilds on load (its regex split only groups bytes, which cannot change tokens
    # that are never merged), so a loaded tokenizer encodes exactly as this one does.
    backend = Tokenizer(models.BPE(vocab=ascii_vocabulary(), merges=[], unk_token=UNK_TOKEN))
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(ASCII_SPECIAL_TOKENS)

    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        extra_special_tokens=[USER_TOKEN, ASSISTANT_TOKEN, SYSTEM_TOKEN],
        padding_side="left",
        clean_up_tokenization_spaces=False,
        chat_template=ASCII_CHAT_TEMPLATE,
        model_max_length=model_max_length,
    )


# A user or tool message's content may be a list of parts (`{"type": "image"}`, `{"type": "text", "text": ...}`),
# as vision-language chat formats give images: an image part is Qwen2-VL's placeholder run.
_RENDER_CONTENT = (
    "{% macro render(content) %}{% if content is string %}{{ content }}{% else %}{% for part in content %}"
    "{% if part['type'] == 'image' %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}{% endmacro %}"
)
ASCII_VL_CHAT_TEMPLATE = _RENDER_CONTENT + ASCII_CHAT_TEMPLATE.replace(
    "{{ '<|user|>' + message['content'] }}", "{{ '<|user|>' + render(message['content']) }}").replace(
    "{{ '<tool_response>' + message['content'] + '</tool_response>' }}",
    "{{ '<tool_response>' + render(message['content']) + '</tool_response>' }}")


def build_ascii_vl_tokenizer(model_max_length: int = 256) -> PreTrainedTokenizerFast:
    """`build_ascii_tokenizer` plus the four vision tokens of Qwen2-VL (`<|vision_start|>`, `<|vision_end|>`,
    `<|image_pad|>`, `<|video_pad|>`: ids 262-265) and a chat template whose user and tool messages may hold
    image parts (`ASCII_VL_CHAT_TEMPLATE`)."""
    from tokenizers import AddedToken

    tokenizer = build_ascii_tokenizer(model_max_length)
    tokenizer.add_tokens([AddedToken(token, special=True, normalized=False) for token in VL_SPECIAL_TOKENS],
                         special_tokens=True)
    tokenizer.chat_template = ASCII_VL_CHAT_TEMPLATE
    return tokenizer


VL_SPECIAL_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
