"""The generated parts of the docs: a table written between two markers of a document, and the small command that
prints it or writes it into the document (`--markdown`, `--update PATH`)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path


def between(doc: str, begin: str, end: str, text: str) -> str:
    """`doc` with what lies between its `begin` and `end` markers replaced by `text`."""
    head, _, rest = doc.partition(begin)
    _, _, tail = rest.partition(end)
    return f"{head}{begin}\n{text}{end}{tail}"


def main(markdown: Callable[[], str], with_tables: Callable[[str], str], usage: str) -> None:
    """`--markdown`: print the tables; `--update PATH`: write them into the document at PATH."""
    args = sys.argv[1:]
    if args == ["--markdown"]:
        sys.stdout.write(markdown())
    elif len(args) == 2 and args[0] == "--update":
        doc = Path(args[1])
        doc.write_text(with_tables(doc.read_text(encoding="utf-8")), encoding="utf-8")
    else:
        sys.exit(f"usage: {usage}")
