"""The retrieval tool: BM25 over a local corpus, ranked answers, top_k and max_chars, one index per file."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from rollflow.errors import ConfigError
from rollflow.tools import ToolError, close_shared_tools, make_tools
from rollflow.tools import retrieval as retrieval_module

DOCUMENTS = [
    {"id": "fr", "title": "France", "text": "Paris is the capital of France, on the river Seine."},
    {"id": "de", "title": "Germany", "text": "Berlin is the capital of Germany."},
    {"id": "cat", "title": "Cats", "text": "Cats sleep for most of the day and purr when content."},
    {"id": "sea", "title": "Oceans", "text": "The Pacific is the largest ocean on Earth."},
]


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps(doc) + "\n" for doc in DOCUMENTS))
    yield str(path)
    close_shared_tools()


def search(corpus: str, query: str, **options) -> str:
    return make_tools([{"name": "retrieval", "corpus": corpus, **options}])[0].call({"query": query})


def test_the_right_document_ranks_first(corpus):
    lines = search(corpus, "What is the capital of France?").splitlines()
    assert lines[0] == "1. France: Paris is the capital of France, on the river Seine."
    assert lines[1].startswith("2. Germany: Berlin")  # shares "capital" only
    assert len(lines) == 2  # the others share no word with the query
    assert search(corpus, "why do cats purr") == "1. Cats: Cats sleep for most of the day and purr when content."


def test_top_k_and_max_chars(corpus):
    assert search(corpus, "capital France", top_k=1) == "1. France: Paris is the capital of France, on the river Seine."
    assert search(corpus, "capital France", top_k=1, max_chars=12) == "1. France: Paris is the..."


def test_no_match_and_an_empty_query(corpus):
    assert search(corpus, "zebra quantum") == "no results"
    assert search(corpus, "the of and") == "no results"  # stopwords only
    with pytest.raises(ToolError, match="query is empty"):
        search(corpus, "   ")


def test_a_txt_corpus_is_one_document_per_line(tmp_path):
    path = tmp_path / "lines.txt"
    path.write_text("apples are red\n\nbananas are yellow\n")
    assert search(str(path), "yellow bananas") == "1. bananas are yellow"
    close_shared_tools()


def test_the_index_is_built_once_per_corpus_and_shared(corpus, monkeypatch):
    builds = []
    build = retrieval_module._build_index
    monkeypatch.setattr(retrieval_module, "_build_index", lambda *a: builds.append(a[0]) or build(*a))
    first = make_tools([{"name": "retrieval", "corpus": corpus}])[0]
    second = make_tools([{"name": "retrieval", "corpus": corpus, "top_k": 1}])[0]
    assert second.index is first.index and len(builds) == 1
    second.close()  # a tool's close leaves the shared index alone
    assert make_tools([{"name": "retrieval", "corpus": corpus}])[0].index is first.index
    close_shared_tools()
    assert make_tools([{"name": "retrieval", "corpus": corpus}])[0].index is not first.index
    assert len(builds) == 2


def test_episodes_on_many_threads_build_one_index(corpus):
    with ThreadPoolExecutor(8) as pool:
        tools = list(pool.map(lambda _: make_tools([{"name": "retrieval", "corpus": corpus}])[0], range(16)))
    assert len({id(tool.index) for tool in tools}) == 1


def test_a_changed_corpus_is_indexed_again(corpus):
    before = make_tools([{"name": "retrieval", "corpus": corpus}])[0]
    with open(corpus, "a") as f:
        f.write(json.dumps({"text": "Rome is the capital of Italy."}) + "\n")
    after = make_tools([{"name": "retrieval", "corpus": corpus}])[0]
    assert after.index is not before.index and len(after.index.documents) == 5


def test_a_relative_corpus_is_found_in_the_working_directory(corpus, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert search("docs.jsonl", "ocean").startswith("1. Oceans:")


@pytest.mark.parametrize(("content", "name", "message"), [
    (None, "missing.jsonl", r"retrieval corpus '.*missing\.jsonl' does not exist"),
    ("{}\n", "docs.csv", r"expected a \.jsonl or \.txt file"),
    ('{"text": "ok"}\nnot json\n', "docs.jsonl", r"docs\.jsonl:2: not JSON"),
    ('{"title": "no text"}\n', "docs.jsonl", r"docs\.jsonl:1: expected an object with a string 'text' field"),
    ("\n\n", "docs.jsonl", "holds no documents"),
])
def test_a_bad_corpus_fails_at_make_time(tmp_path, content, name, message):
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError, match=message) as error:
        make_tools([{"name": "retrieval", "corpus": str(path)}])
    assert "\n" not in str(error.value)
