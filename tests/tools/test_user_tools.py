"""A tool of the user's own, named by dotted path `module:factory` (as env ids and rewards are), and
`check_tools`: tool specs checked at config load without making anything."""

from __future__ import annotations

import re
import sys

import pytest

from rollflow.errors import ConfigError
from rollflow.registry import UnknownNameError
from rollflow.tools import TOOLS, check_tools, make_tools

USER_TOOLS = '''
MADE = []


class WordCount:
    name = "word_count"

    def __init__(self, max_words: int = 100):
        MADE.append(self)
        self.max_words = max_words

    def schema(self):
        return {"type": "function", "function": {"name": "word_count", "description": "Count the words.",
                                                 "parameters": {"type": "object",
                                                                "properties": {"text": {"type": "string"}},
                                                                "required": ["text"]}}}

    def call(self, arguments):
        return str(min(len(arguments["text"].split()), self.max_words))

    def close(self):
        pass


class NoCall:
    name = "no_call"

    def schema(self):
        return {}


def both():
    return [WordCount(), WordCount()]


def not_a_tool():
    return 42


class BadSchema(WordCount):
    def schema(self):
        return {"type": "function", "function": {"name": "another_name"}}


LIMIT = 3
'''


@pytest.fixture
def module(tmp_path, monkeypatch, request):
    """A user's tool module in a directory on sys.path, under a name of this test's own."""
    name = f"user_tools_{request.node.name.split('[')[0][-40:]}"
    (tmp_path / f"{name}.py").write_text(USER_TOOLS)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def test_a_class_by_dotted_path_is_a_tool_with_its_options(module):
    [tool] = make_tools([{"name": f"{module}:WordCount", "max_words": 2}])
    assert tool.name == "word_count" and tool.call({"text": "one two three"}) == "2"
    assert make_tools([f"{module}:WordCount"])[0].call({"text": "one two three"}) == "3"


def test_check_tools_checks_a_user_tool_without_making_it(module):
    check_tools([f"{module}:WordCount", {"name": f"{module}:WordCount", "max_words": 5}, f"{module}:both"])
    assert sys.modules[module].MADE == []


@pytest.mark.parametrize(("spec", "message"), [
    ("no_such_tools_module:Tool", r"tool 'no_such_tools_module:Tool': cannot import module 'no_such_tools_module' "
                                  r"\(ModuleNotFoundError: .*; looked on sys.path and in the working directory"),
    ("MODULE:Missing", r"tool 'MODULE:Missing': module 'MODULE' has no attribute 'Missing'"),
    ("MODULE:LIMIT", r"tool 'MODULE:LIMIT': 'LIMIT' is not callable"),
    ({"name": "MODULE:WordCount", "max_wrods": 2}, r"tool 'MODULE:WordCount': unknown option 'max_wrods'\. Did "
                                                   r"you mean 'max_words'\?"),
    ("MODULE:NoCall", r"tool 'MODULE:NoCall' (makes|made) a NoCall without call, close; a tool has a `name`"),
])
def test_a_bad_user_tool_is_one_line_at_check_and_at_make(module, spec, message):
    spec = spec.replace("MODULE", module) if isinstance(spec, str) else {**spec, "name": spec["name"].replace(
        "MODULE", module)}
    message = message.replace("MODULE", module)
    for check in (check_tools, make_tools):
        with pytest.raises(ConfigError, match=message) as error:
            check([spec])
        assert "\n" not in str(error.value)


@pytest.mark.parametrize(("factory", "message"), [
    ("not_a_tool", r"tool 'MODULE:not_a_tool' made a int without name, schema, call, close; a tool has"),
    ("BadSchema", r"tool 'MODULE:BadSchema' made tool 'word_count' whose schema\(\) is not \{'type': 'function', "
                  r"'function': \{'name': 'word_count'"),
])
def test_what_a_user_factory_makes_is_checked_when_it_is_made(module, factory, message):
    check_tools([f"{module}:{factory}"])  # a function is not called at config load; its result is checked at make
    with pytest.raises(ConfigError, match=message.replace("MODULE", module)):
        make_tools([f"{module}:{factory}"])


def test_an_unknown_name_says_a_dotted_path_is_valid_too():
    valid = re.escape(f"Valid: {', '.join(TOOLS.names())}; or a tool of your own as 'module:factory'")
    with pytest.raises(UnknownNameError,
                       match=rf"unknown tool 'calculater'\. Did you mean 'calculator'\? {valid}"):
        check_tools(["calculater"])


@pytest.mark.parametrize(("specs", "message"), [
    ([], "tools must be a non-empty list of tool specs"),
    ("calculator", "tools must be a non-empty list of tool specs"),
    ([{"name": "calculator", "max_length": 0}], "option 'max_length' must be an integer above 0"),
    ([{"name": "retrieval", "corpus": "no/such/corpus.jsonl"}], "retrieval corpus 'no/such/corpus.jsonl' does not "
                                                                "exist"),
    ([{"name": "retrieval", "corpus": "docs.jsonl", "top_k": 0}], "option 'top_k' must be an integer above 0"),
])
def test_check_tools_refuses_bad_built_in_options(specs, message):
    with pytest.raises(ConfigError, match=message):
        check_tools(specs)


def test_check_tools_does_not_index_a_corpus(tmp_path, monkeypatch):
    from rollflow.tools import retrieval

    corpus = tmp_path / "docs.jsonl"
    corpus.write_text('{"text": "Paris is the capital of France."}\n')
    monkeypatch.setattr(retrieval, "_build_index", lambda *args: pytest.fail("check_tools built an index"))
    check_tools([{"name": "retrieval", "corpus": str(corpus), "top_k": 2}])
