"""The `retrieval` tool: BM25 search (`bm25s`) over a local corpus.

A corpus is a `.jsonl` file, one document per line with a `text` field (and optional `title` and `id`), or
a `.txt` file with one document per line. Its index is built once per file per process (the first time a
tool over it is made) and shared by every later tool over the same file, on any thread; a file changed
on disk is indexed again.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass
from typing import Any

from rollflow.errors import ConfigError
from rollflow.tools.base import (
    TOOLS,
    ToolError,
    check_arguments,
    function_schema,
    on_close_shared,
    positive_int,
)

STOPWORDS = "en"
CORPUS_EXTENSIONS = (".jsonl", ".txt")


@dataclass(frozen=True)
class Document:
    """One document of a corpus."""

    text: str
    title: str = ""
    id: str = ""


@dataclass
class CorpusIndex:
    """A corpus and its BM25 index (`bm25s.BM25`), read-only once built."""

    documents: list[Document]
    bm25: Any

    def search(self, query: str, top_k: int) -> list[tuple[Document, float]]:
        """The (document, score) pairs of the `top_k` best matches with a score above 0, best first."""
        import bm25s

        tokens = bm25s.tokenize([query], stopwords=STOPWORDS, show_progress=False)
        if not tokens.ids[0]:  # only stopwords, or nothing
            return []
        k = min(top_k, len(self.documents))
        ids, scores = self.bm25.retrieve(tokens, k=k, show_progress=False)
        return [(self.documents[int(i)], float(s)) for i, s in zip(ids[0], scores[0]) if s > 0]


_indexes: dict[tuple[str, int, int], CorpusIndex] = {}
_indexes_lock = threading.Lock()


def corpus_index(path: str) -> CorpusIndex:
    """The index of the corpus at `path`, built on first use and cached for the process.

    Args:
        path: a `.jsonl` or `.txt` corpus, relative to the working directory or absolute.

    Returns:
        The shared index.

    Raises:
        ConfigError: the file is missing, unreadable, empty or malformed (one line naming it).
    """
    real = os.path.realpath(path)
    try:
        stat = os.stat(real)
    except OSError:
        raise _missing(path) from None
    key = (real, stat.st_mtime_ns, stat.st_size)
    with _indexes_lock:  # one build per corpus, even when many episodes start at once
        index = _indexes.get(key)
        if index is None:
            for old in [k for k in _indexes if k[0] == real]:
                del _indexes[old]  # the file changed on disk
            index = _indexes[key] = _build_index(real, read_corpus(path))
        return index


def read_corpus(path: str) -> list[Document]:
    """The documents of a `.jsonl` (a `text` field, optional `title` / `id`) or `.txt` (one per line) file.

    Raises:
        ConfigError: an unknown extension, an unreadable file, a malformed line, or no documents.
    """
    extension = _extension(path)
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"retrieval corpus {path!r} cannot be read: {error}") from None
    documents = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if extension == ".txt":
            documents.append(Document(line.strip()))
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            raise ConfigError(f"retrieval corpus {path}:{number}: not JSON ({error.msg})") from None
        if not isinstance(row, dict) or not isinstance(row.get("text"), str):
            raise ConfigError(f"retrieval corpus {path}:{number}: expected an object with a string 'text' field")
        documents.append(Document(row["text"], str(row.get("title") or ""), str(row.get("id") or "")))
    if not documents:
        raise ConfigError(f"retrieval corpus {path!r} holds no documents")
    return documents


def _extension(path: str) -> str:
    extension = os.path.splitext(path)[1].lower()
    if extension not in CORPUS_EXTENSIONS:
        raise ConfigError(f"retrieval corpus {path!r}: expected a .jsonl or .txt file")
    return extension


def _missing(path: str) -> ConfigError:
    where = "" if os.path.isabs(path) else f" (relative to the working directory {os.getcwd()})"
    return ConfigError(f"retrieval corpus {path!r} does not exist{where}")


def _build_index(path: str, documents: list[Document]) -> CorpusIndex:
    import bm25s

    texts = [f"{doc.title}\n{doc.text}" if doc.title else doc.text for doc in documents]
    bm25 = bm25s.BM25()
    bm25.index(bm25s.tokenize(texts, stopwords=STOPWORDS, show_progress=False), show_progress=False)
    return CorpusIndex(documents, bm25)


def clear_indexes() -> None:
    """Drop every cached index (the next tool over a corpus builds its index again)."""
    with _indexes_lock:
        _indexes.clear()


on_close_shared(clear_indexes)


class Retrieval:
    """The `retrieval` tool. Argument: `query` (string).

    Args:
        corpus: the corpus file (see the module's docstring).
        top_k: how many documents an answer lists at most.
        max_chars: each document's text is cut to this many characters.
    """

    name = "retrieval"

    def __init__(self, corpus: str, top_k: int = 3, max_chars: int = 300):
        check_retrieval_options(corpus, top_k, max_chars)
        self.top_k, self.max_chars = top_k, max_chars
        self.index = corpus_index(corpus)

    def schema(self) -> dict[str, Any]:
        query = {"type": "string", "description": "keywords to search for"}
        return function_schema(self.name, "Search the documents.", {"query": query}, ["query"])

    def call(self, arguments: dict[str, Any]) -> str:
        """Search for `arguments["query"]`.

        Returns:
            The best documents, numbered, one per line ("1. Title: text"), or "no results".
        """
        check_arguments(self.schema(), arguments)
        query = arguments["query"].strip()
        if not query:
            raise ToolError("query is empty")
        found = self.index.search(query, self.top_k)
        if not found:
            return "no results"
        return "\n".join(f"{rank}. {self._render(doc)}" for rank, (doc, _) in enumerate(found, 1))

    def _render(self, doc: Document) -> str:
        text = " ".join(doc.text.split())
        if len(text) > self.max_chars:
            text = text[: self.max_chars].rstrip() + "..."
        return f"{' '.join(doc.title.split())}: {text}" if doc.title else text

    def close(self) -> None:
        """Nothing to release (the index is shared)."""


def check_retrieval_options(corpus: str, top_k: int = 3, max_chars: int = 300) -> None:
    """Check a `retrieval` spec's options without reading or indexing the corpus (`check_tools`, at config
    load): a .jsonl or .txt file that exists, and positive numbers."""
    if not isinstance(corpus, str) or not corpus:
        raise ConfigError(f"tool 'retrieval': option 'corpus' must be a file path, got {corpus!r}")
    positive_int("retrieval", "top_k", top_k)
    positive_int("retrieval", "max_chars", max_chars)
    _extension(corpus)
    if not os.path.isfile(corpus):
        raise _missing(corpus)


@TOOLS.register("retrieval")
def make_retrieval(corpus: str, top_k: int = 3, max_chars: int = 300) -> Retrieval:
    """The `retrieval` tool (options: see `Retrieval`)."""
    return Retrieval(corpus, top_k, max_chars)


make_retrieval.check_options = check_retrieval_options  # what `check_tools` runs instead of indexing the corpus
