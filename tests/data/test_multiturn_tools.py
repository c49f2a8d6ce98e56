"""Tool turns rendered token by token (`TurnEncoder` with tools) are exactly the tokens of the whole
conversation rendered by `apply_chat_template(..., tools=...)`: the bundled tiny model's template and Qwen2.5's
(tests/data/qwen2_5_chat_template.jinja, on the character tokenizer, so every character is a token and any
difference shows)."""

from pathlib import Path

import pytest

from rollflow.data.char_tokenizer import build_ascii_tokenizer
from rollflow.data.multiturn import TurnEncoder, tool_turn_pieces
from rollflow.errors import ConfigError

QWEN_TEMPLATE = (Path(__file__).parent / "qwen2_5_chat_template.jinja").read_text()
CALCULATOR = {"type": "function", "function": {"name": "calculator", "description": "Evaluate an expression.",
                                               "parameters": {"type": "object", "properties": {
                                                   "expression": {"type": "string"}}, "required": ["expression"]}}}
SEARCH = {"type": "function", "function": {"name": "search", "description": "Search the corpus.", "parameters": {
    "type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "347*29"}}\n</tool_call>'


def _tokenizer(template: str):
    tokenizer = build_ascii_tokenizer(model_max_length=8192)
    if template == "qwen2.5":
        tokenizer.chat_template = QWEN_TEMPLATE
    return tokenizer


def _reference(tokenizer, messages, tools, generation_prompt=False):
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=generation_prompt)
    return tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("template", ["tiny", "qwen2.5"])
@pytest.mark.parametrize("results", [["10063"], ["10063", "error: unknown tool 'x'; the tools: calculator"]])
@pytest.mark.parametrize("system_prompt", [None, "Use the tools."])
@pytest.mark.parametrize("model_stops", [True, False])
def test_tool_turns_are_the_tokens_of_the_whole_conversation(template, results, system_prompt, model_stops):
    tokenizer = _tokenizer(template)
    tools = [CALCULATOR, SEARCH]
    encoder = TurnEncoder(tokenizer, system_prompt, tools)
    stop = encoder.end_of_turn_ids[:1] if model_stops else []  # the engine stops on the first end-of-turn token
    first = encoder.encode(CALL) + stop  # a turn the model ended itself, or one cut by the length limit
    second = encoder.encode("10063") + stop
    ids = encoder.first_prompt("347*29") + first + encoder.next_turn(results, first) + second
    ids += encoder.end_of_turn_ids[len(stop):]
    system = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages = [*system, {"role": "user", "content": "347*29"}, {"role": "assistant", "content": CALL},
                *({"role": "tool", "content": result} for result in results), {"role": "assistant", "content": "10063"}]
    assert ids == _reference(tokenizer, messages, tools)
    # the first prompt holds the template's own tool block
    assert encoder.first_prompt("347*29") == _reference(tokenizer, messages[: len(system) + 1], tools, True)


@pytest.mark.parametrize("template", ["tiny", "qwen2.5"])
def test_a_user_observation_after_a_tool_turn_renders_as_a_user_turn(template):
    tokenizer = _tokenizer(template)
    encoder = TurnEncoder(tokenizer, None, [CALCULATOR])
    ids = encoder.first_prompt("go") + encoder.encode(CALL)
    ids += encoder.next_turn(["7"], encoder.encode(CALL)) + encoder.encode("left")
    ids += encoder.next_turn("a wall", encoder.encode("left")) + encoder.encode("done") + encoder.end_of_turn_ids
    messages = [{"role": "user", "content": "go"}, {"role": "assistant", "content": CALL},
                {"role": "tool", "content": "7"}, {"role": "assistant", "content": "left"},
                {"role": "user", "content": "a wall"}, {"role": "assistant", "content": "done"}]
    assert ids == _reference(tokenizer, messages, [CALCULATOR])


@pytest.mark.parametrize("template", ["tiny", "qwen2.5"])
def test_step_prompts_render_kept_tool_turns_as_the_template_does(template):
    tokenizer = _tokenizer(template)
    encoder = TurnEncoder(tokenizer, None, [CALCULATOR])
    prompt = encoder.step_prompt([("347*29", CALL)], ["10063"])
    messages = [{"role": "user", "content": "347*29"}, {"role": "assistant", "content": CALL},
                {"role": "tool", "content": "10063"}]
    assert prompt == _reference(tokenizer, messages, [CALCULATOR], True)
    # a kept history that starts at tool results: they read as the first (user) observation
    assert encoder.step_prompt([], ["10063", "7"]) == encoder.first_prompt("10063\n7")


def test_a_template_without_a_tool_role_is_one_config_error():
    tokenizer = build_ascii_tokenizer()
    tokenizer.chat_template = ("{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tool role') }}"
                               "{% endif %}{{ m['role'] + ':' + m['content'] + '\\n' }}{% endfor %}"
                               "{% if add_generation_prompt %}assistant:{% endif %}")
    with pytest.raises(ConfigError, match="cannot render tool turns \\(no tool role\\)"):
        tool_turn_pieces(tokenizer, 1)
    assert TurnEncoder(tokenizer).first_prompt("x")  # without tools the template serves as before
