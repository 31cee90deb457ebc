"""The text an evaluation scores: a UTF-8 file, or a default that needs no download.

The default is the English reference prose that CPython ships with its standard library for `help()`
(`pydoc_data.topics`: the language reference's sections on statements, expressions, data model, ...,
about 465,000 characters in Python 3.11). Its digest goes in every report, since it changes with the
Python version."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

DEFAULT_CORPUS_NAME = "pydoc_data.topics"


@dataclass(frozen=True)
class Corpus:
    name: str
    text: str

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()


def load_corpus(path: str | None) -> Corpus:
    """The file at `path` (UTF-8), or the default corpus; raises ValueError for unreadable or empty text."""
    if path is None:
        from pydoc_data.topics import topics

        return Corpus(DEFAULT_CORPUS_NAME, "\n\n".join(topics[key] for key in sorted(topics)))
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read corpus {path!r}: {exc}") from exc
    if not text.strip():
        raise ValueError(f"corpus {path!r} is empty")
    return Corpus(Path(path).name, text)
