"""What the docs name exists: balanced code fences, links and anchors that resolve, and every make target, CLI
subcommand and flag, BATCH_* variable, HTTP route and repository path they name, checked against the code.

Each problem is reported as `doc:line: the claim: why`, all at once.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import re
import subprocess
import sys
import tempfile
import unicodedata
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

from batch_dagster import settings

REPO = Path(__file__).resolve().parents[2]
DOCS = sorted([REPO / "README.md", REPO / "deploy" / "README.md", *(REPO / "docs").rglob("*.md")])
PACKAGE_DIRS = {p.name for p in (REPO / "batch_dagster").iterdir() if p.is_dir() and not p.name.startswith("_")}
TOP_DIRS = {"batch_dagster", "bench", "tests", "tools", "deploy", "docs", ".ci"}

# Named in the docs on purpose although the code has no such thing, each with the reason.
NOT_OURS = {
    "BATCH_ID": "a shell variable of the curl examples ($BATCH_ID)",
    "POST /v1/webhook_endpoints/{}": "OpenAI's update, named as not implemented here",
}

FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})(.*)$")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
CODE_SPAN = re.compile(r"(`+)(.+?)(?<!`)\1(?!`)", re.S)
VARIABLE = re.compile(r"(?<![\w$])\$?\{?(BATCH_[A-Z0-9_]*[A-Z0-9])\b")
ROUTE = re.compile(r"\b(GET|POST|DELETE|PUT|PATCH)\s+(/[\w/{}.\-]*)")
API_URL = re.compile(r"(?:\$BASE|https?://127\.0\.0\.1:8000)(/v1/[\w/{}.\-$]*)")
PATH = re.compile(r"(?<![\w$/.@:-])((?:\.ci|[a-z_]+)/[\w./<>{}*$-]*)")
# A command at the start of a shell command: after nothing, a separator, or environment assignments.
COMMAND_START = re.compile(r"(?:^|[;|&(]|\$\()\s*(?:[A-Z_][A-Z0-9_]*=\S*\s+)*$")
SEPARATORS = re.compile(r"\s(?:#|\||;|&&|&|>|\\$)|[)`]")


@dataclass(frozen=True)
class Code:
    """A piece of code in a doc: a fenced line or an inline code span, and the line it starts on."""

    doc: str
    line: int
    text: str


@dataclass(frozen=True)
class Doc:
    path: Path
    lines: list[str]
    fenced: frozenset[int]  # 0-based numbers of the lines inside fences (the fence lines included)

    @property
    def name(self) -> str:
        return str(self.path.relative_to(REPO) if self.path.is_relative_to(REPO) else self.path)

    def prose(self) -> Iterator[tuple[int, str]]:
        """Paragraphs outside fences, each with the 1-based number of its first line."""
        start, block = None, []
        for i, text in enumerate(self.lines):
            if i in self.fenced or not text.strip():
                if block:
                    yield start, "\n".join(block)
                start, block = None, []
                continue
            start = i + 1 if start is None else start
            block.append(text)
        if block:
            yield start, "\n".join(block)

    def code(self) -> Iterator[Code]:
        for i in sorted(self.fenced):
            if not FENCE.match(self.lines[i]):
                yield Code(self.name, i + 1, self.lines[i])
        for start, text in self.prose():
            for m in CODE_SPAN.finditer(text):
                yield Code(self.name, start + text.count("\n", 0, m.start()), m.group(2).replace("\n", " "))

    def text_lines(self) -> Iterator[tuple[int, str]]:
        """Every line, fenced or not, with its 1-based number."""
        return ((i + 1, line) for i, line in enumerate(self.lines))


def fences(lines: list[str]) -> tuple[frozenset[int], list[str]]:
    """The fenced lines, and the problems: a fence opened inside another, or never closed."""
    inside, problems, opened = set(), [], None
    for i, text in enumerate(lines):
        m = FENCE.match(text)
        if opened is None:
            if m:
                opened = (i, m.group(1))
                inside.add(i)
            continue
        inside.add(i)
        if m and m.group(1)[0] == opened[1][0] and len(m.group(1)) >= len(opened[1]):
            if m.group(2).strip():  # an info string: this opens a block, so the one above was never closed
                problems.append(f"{i + 1}: the code fence opened at line {opened[0] + 1} is not closed before "
                                f"this one opens ({text.strip()!r})")
                opened = (i, m.group(1))  # read on from here as its author meant, not one fence out of step
                continue
            opened = None
    if opened is not None:
        problems.append(f"{opened[0] + 1}: this code fence is never closed")
    return frozenset(inside), problems


@cache
def load(path: Path) -> tuple[Doc, tuple[str, ...]]:
    lines = path.read_text(encoding="utf-8").splitlines()
    fenced, problems = fences(lines)
    return Doc(path, lines, fenced), tuple(problems)


def slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it: inline markup dropped, lower case, punctuation removed, spaces to -."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = re.sub(r"<[^>]+>", "", text).lower()
    kept = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LNM")
    return kept.replace(" ", "-")


@cache
def anchors(path: Path) -> frozenset[str]:
    doc, _ = load(path)
    seen: dict[str, int] = {}
    out = set()
    for i, text in enumerate(doc.lines):
        m = HEADING.match(text)
        if m is None or i in doc.fenced:
            continue
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return frozenset(out)


def problems_of(check) -> list[str]:
    out = []
    for path in DOCS:
        doc, _ = load(path)
        out += [f"{doc.name}:{p}" for p in check(doc)]
    return out


def report(problems: list[str]) -> None:
    assert not problems, f"{len(problems)} claim(s) in the docs do not hold:\n  " + "\n  ".join(problems)


# The things the docs may name, taken from the code.


@cache
def make_targets() -> frozenset[str]:
    targets = set()
    for line in (REPO / "Makefile").read_text().splitlines():
        m = re.match(r"^([\w.-][\w. -]*?)\s*:(?!=)", line)
        if m and not line.startswith("\t"):
            targets.update(t for t in m.group(1).split() if not t.startswith("."))
    return frozenset(targets)


def options(parser: argparse.ArgumentParser) -> frozenset[str]:
    """A parser's flags, and those of its own subcommands (`keys create --admin`)."""
    nested = [options(p) for a in parser._actions if isinstance(a, argparse._SubParsersAction)
              for p in a.choices.values()]
    return frozenset(parser._option_string_actions).union(*nested)


@cache
def cli() -> dict[str, frozenset[str]]:
    """The `batch-dagster` subcommands and the flags of each."""
    from batch_dagster.cli import build_parser

    parser = build_parser(settings.Settings.from_env())
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {name: options(p) for name, p in sub.choices.items()}


@cache
def serve_flags() -> frozenset[str]:
    from batch_dagster.serve.__main__ import build_parser

    return options(build_parser(settings.Settings.from_env()))


ROUTES = """
import json
from batch_dagster.api.app import create_app
from batch_dagster.settings import Settings
print(json.dumps([[sorted(getattr(r, "methods", None) or ()), r.path] for r in create_app(Settings.from_env()).routes]))
"""


@cache
def routes() -> frozenset[str]:
    """`METHOD /path` of every route of the API app, path parameters as {}; built in a process of its own (in a
    folder of its own, for the store it creates), so that this tier loads no framework."""
    with tempfile.TemporaryDirectory() as tmp:
        env = {k: v for k, v in os.environ.items() if not k.startswith("BATCH_")} | {"BATCH_DATA_DIR": tmp}
        out = subprocess.run([sys.executable, "-c", ROUTES], capture_output=True, text=True, cwd=tmp, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return frozenset(f"{method} {normal_path(path)}" for methods, path in json.loads(out.stdout.splitlines()[-1])
                     for method in methods)


def normal_path(path: str) -> str:
    return re.sub(r"\{[^}]*\}|\$[A-Z_]+", "{}", path.split("?")[0]).rstrip("/.") or "/"


@cache
def ignored() -> tuple[str, ...]:
    """The .gitignore patterns: paths that are written by running things, not kept in the repository."""
    return tuple(p.strip() for p in (REPO / ".gitignore").read_text().splitlines()
                 if p.strip() and not p.startswith(("#", "!")))


def repo_path_problem(path: str, here: Path = REPO) -> str | None:
    """Why `path`, named in a doc in the folder `here`, is not in the repository; None when it is, or when it is
    not a repository path (a pattern, a file the code writes, another program's path)."""
    if any(c in path for c in "<>{}*$") or "NNN" in path:
        return None
    path = path.rstrip(".,:;")
    if any(fnmatch.fnmatch(path, p) or path.startswith(p.rstrip("/") + "/") for p in ignored()):
        return None
    first = path.split("/")[0]
    candidates = ([REPO / path] if first in TOP_DIRS else []) + ([REPO / "batch_dagster" / path]
                                                                  if first in PACKAGE_DIRS else [])
    if here != REPO and (here / first).exists():  # deploy/README.md's helm/dagster-values.yaml
        candidates.append(here / path)
    if not candidates or any(c.exists() for c in candidates):
        return None
    return "no such file or folder in the repository"


def commands(code: Code, name: str) -> Iterator[list[str]]:
    """The words of each command `name` (a program, or `python -m module`) in a piece of code, up to its end."""
    for m in re.finditer(rf"(?<![\w/.-])(?:\.venv/bin/)?{re.escape(name)}(?![\w.-])", code.text):
        if name in ("make", "batch-dagster") and not COMMAND_START.search(code.text[: m.start()]):
            continue
        rest = code.text[m.end():]
        end = SEPARATORS.search(rest)
        yield (rest[: end.start()] if end else rest).split()


def flags(words: list[str]) -> list[str]:
    return [w.strip("[]").split("=")[0] for w in words if w.strip("[]").startswith("--")]



# The checks: each yields `line: claim: why` for one doc.


def check_links(doc: Doc) -> Iterator[str]:
    """Every relative link's file exists, and its #anchor is a heading there (GitHub's anchors)."""
    for start, text in doc.prose():
        for m in LINK.finditer(CODE_SPAN.sub(lambda s: " " * len(s.group(0)), text)):
            target, line = m.group(1), start + text.count("\n", 0, m.start())
            if re.match(r"^[a-z][a-z+.-]*:", target):  # http:, https:, mailto:
                continue
            file, _, anchor = target.partition("#")
            dest = (doc.path.parent / file).resolve() if file else doc.path
            if not dest.exists():
                yield f"{line}: link ({target}): no such file"
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                yield f"{line}: link ({target}): no heading of {dest.name} has the anchor #{anchor}"


def check_make(doc: Doc) -> Iterator[str]:
    """Every `make TARGET` is a target of the Makefile; `make serve ARGS=...` passes flags serve has."""
    for code in doc.code():
        for words in commands(code, "make"):
            targets = [w for w in words if not re.match(r"^[A-Z_][A-Z0-9_]*=", w) and not w.startswith("-")]
            for target in targets[:1] + [t for t in targets[1:] if t in make_targets()]:
                if target not in make_targets():
                    yield f"{code.line}: `make {target}`: the Makefile has no target {target!r}"
            if targets[:1] == ["serve"]:
                for flag in flags([w.partition("=")[2] for w in words if w.startswith("ARGS=")]):
                    if flag not in serve_flags():
                        yield f"{code.line}: `make serve ARGS={flag}`: python -m batch_dagster.serve has no {flag}"


def check_cli(doc: Doc) -> Iterator[str]:
    """Every `batch-dagster SUBCOMMAND --flag` and `python -m batch_dagster.serve --flag` exists."""
    for code in doc.code():
        for words in commands(code, "batch-dagster"):
            if not words or not re.match(r"^[a-z][\w-]*$", words[0]):
                continue
            sub = words[0]
            if sub not in cli():
                yield (f"{code.line}: `batch-dagster {sub}`: the CLI has no subcommand {sub!r} "
                       f"(it has {', '.join(sorted(cli()))})")
                continue
            for flag in flags(words[1:]):
                if flag not in cli()[sub]:
                    yield f"{code.line}: `batch-dagster {sub} {flag}`: {sub} has no option {flag}"
        for words in commands(code, "batch_dagster.serve"):
            for flag in flags(words):
                if flag not in serve_flags():
                    yield f"{code.line}: `python -m batch_dagster.serve {flag}`: serve has no option {flag}"


def check_modules(doc: Doc) -> Iterator[str]:
    """Every `python -m` module of this repository that the docs run exists."""
    for code in doc.code():
        for m in re.finditer(r"-m\s+((?:batch_dagster|bench|tools)(?:\.\w+)*)", code.text):
            module = REPO / m.group(1).replace(".", "/")
            if not (module.with_suffix(".py").exists() or (module / "__main__.py").exists()):
                yield f"{code.line}: `python -m {m.group(1)}`: no such module to run"


@cache
def source_text(*folders: str) -> str:
    return "".join(p.read_text(encoding="utf-8") for f in folders for p in sorted((REPO / f).rglob("*.py")))


def check_variables(doc: Doc) -> Iterator[str]:
    """Every BATCH_* variable is a setting (the tests' BATCH_TEST_* are read by the tests); every BENCH_* and
    SCALE_* is read by a benchmark."""
    documented = {v.name for v in settings.VARIABLES}
    for number, line in doc.text_lines():
        for name in VARIABLE.findall(line):
            if name in documented or name in NOT_OURS:
                continue
            if name.startswith("BATCH_TEST_") and name in source_text("tests"):
                continue
            yield f"{number}: {name}: not a setting (batch_dagster/settings.py VARIABLES)"
        for name in re.findall(r"\b((?:BENCH|SCALE)_[A-Z0-9_]*[A-Z0-9])\b", line):
            if name not in source_text("bench"):
                yield f"{number}: {name}: no benchmark reads it (bench/)"


def check_routes(doc: Doc) -> Iterator[str]:
    """Every `METHOD /v1/...` is a route of the API app; so is every path of $BASE/v1/... and :8000/v1/... URLs."""
    for number, line in doc.text_lines():
        for method, path in ROUTE.findall(line):
            claim = f"{method} {normal_path(path)}"
            if path.startswith("/v1") and claim not in routes() and claim not in NOT_OURS:
                yield f"{number}: `{method} {path}`: the API has no such route"
        for path in API_URL.findall(line):
            if not any(r.endswith(" " + normal_path(path)) for r in routes()):
                yield f"{number}: {path}: the API has no such route"


def check_paths(doc: Doc) -> Iterator[str]:
    """Every repository path named (batch_dagster/..., tests/..., or a package folder such as engine/...) exists."""
    for number, line in doc.text_lines():
        for m in PATH.finditer(re.sub(r"[a-z]+://\S+", "", line)):
            if problem := repo_path_problem(m.group(1), doc.path.parent):
                yield f"{number}: {m.group(1)}: {problem}"


CHECKS = [check_links, check_make, check_cli, check_modules, check_variables, check_routes, check_paths]


def test_code_fences_are_balanced():
    report([f"{load(path)[0].name}:{p}" for path in DOCS for p in load(path)[1]])


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__.removeprefix("check_"))
def test_what_the_docs_name_exists(check):
    report(problems_of(check))


# The checks themselves, on docs that are wrong on purpose.


@pytest.mark.parametrize("text, problems", [
    ("```python\nx\n", ["1: this code fence is never closed"]),
    ("```python\nx\n```bash\ny\n```\n", ["3: the code fence opened at line 1 is not closed before this one opens"]),
    ("```\nx\n```\n````md\n```\n````\n", []),
])
def test_an_unclosed_fence_is_found(text, problems):
    assert [p.split(" (")[0] for p in fences(text.splitlines())[1]] == problems


@pytest.mark.parametrize("heading, anchor", [
    ("Serving with `make serve`", "serving-with-make-serve"),
    ("Drop folders: drop a file, get results beside it", "drop-folders-drop-a-file-get-results-beside-it"),
    ("Against run_batch and the raw engine", "against-run_batch-and-the-raw-engine"),
    ("Queue position and ETA (extension)", "queue-position-and-eta-extension"),
    ("What N GPUs give, on paper", "what-n-gpus-give-on-paper"),
    ("A batch's folder", "a-batchs-folder"),
    ("The [Dagster UI](x.md) — a tour", "the-dagster-ui--a-tour"),
])
def test_anchors_are_made_as_github_makes_them(heading, anchor):
    assert slug(heading) == anchor


WRONG = """# Title

Run `make deploy`, then `batch-dagster serve`, and `batch-dagster run FILE --fast`.
Set `BATCH_NO_SUCH_THING` and `BENCH_NO_SUCH_THING`; call `GET /v1/things`; read `batchfile/nothing.py`.
`make serve ARGS=--no-such-flag`; `python -m batch_dagster.nothing`.
See [the title](#title), [nowhere](#nowhere) and [a file](no-such-file.md).

```bash
kubectl -n batch-dagster rollout status   # not the CLI
BATCH_SHARD_SIZE=10 make demo && batch-dagster validate x.jsonl --json
```
"""


def test_each_check_finds_a_false_claim_with_its_line(tmp_path):
    path = tmp_path / "wrong.md"
    path.write_text(WRONG)
    doc, _ = load(path)
    found = [line for check in CHECKS for line in check(doc)]
    assert [f.split(":")[0] + ":" + f.split(":")[1].strip() for f in found] == [
        "6:link (#nowhere)", "6:link (no-such-file.md)",
        "3:`make deploy`", "5:`make serve ARGS=--no-such-flag`",
        "3:`batch-dagster serve`", "3:`batch-dagster run --fast`",
        "5:`python -m batch_dagster.nothing`",
        "4:BATCH_NO_SUCH_THING", "4:BENCH_NO_SUCH_THING",
        "4:`GET /v1/things`",
        "4:batchfile/nothing.py",
    ], found
