"""The shape of the code: a pure core, imports one way, one owner of the batch folder and of configuration."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from batch_dagster import settings

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "batch_dagster"
FRAMEWORKS = ("dagster", "dagster_aws", "vllm", "torch", "fastapi", "starlette", "uvicorn", "sqlalchemy", "alembic")


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        if "migrations" in path.parts:
            continue
        parts = path.relative_to(REPO).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def _imports(name: str, path: Path) -> set[str]:
    """Every module `name` imports, at module level or inside functions (relative imports resolved)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            out.add(base)
            out.update(f"{base}.{alias.name}" for alias in node.names)
    return out


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: {m for m in _imports(name, path) if m in modules and m != name} for name, path in modules.items()}


def test_the_core_imports_no_framework():
    for name, path in _modules().items():
        if name.startswith("batch_dagster.batchfile"):
            used = {m.split(".")[0] for m in _imports(name, path)}
            assert not used & set(FRAMEWORKS), f"{name} imports {used & set(FRAMEWORKS)}"
            assert not {m for m in _imports(name, path) if m.startswith("batch_dagster.")
                        and not m.startswith("batch_dagster.batchfile")}, name


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles of `edges`: each strongly connected component of more than one module, sorted."""
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in edges:
        if v not in index:
            visit(v)
    return cycles


def test_imports_go_one_way_no_cycle_anywhere():
    # A package's __init__ that imports its submodules counts as an import like any other: a module that imports
    # the package back (or imports what does, inside a function too) closes a loop Python runs through.
    assert _cycles(_graph()) == []


def test_a_packages_init_edges_to_its_own_modules_are_kept():
    # Dropping them hid the loop of issue 28: definitions -> defs/definitions -> defs/sensors/__init__ ->
    # sensors/api_batches -> runner -> (inside a function) definitions.
    assert "batch_dagster.defs.sensors.api_batches" in _graph()["batch_dagster.defs.sensors"]


def test_the_database_and_the_api_do_not_use_the_dagster_side():
    for name, targets in _graph().items():
        if name.startswith(("batch_dagster.db", "batch_dagster.api", "batch_dagster.features")):
            assert not {t for t in targets if t.startswith("batch_dagster.defs")}, name


def test_the_store_and_the_engine_are_below_the_features():
    """Layers: core <- engine, storage, db <- features <- api, defs: the store and the engine use no feature."""
    for name, targets in _graph().items():
        if name.startswith(("batch_dagster.db", "batch_dagster.engine", "batch_dagster.storage")):
            assert not {t for t in targets if t.startswith("batch_dagster.features")}, name


def test_the_features_serve_both_sides_and_import_neither():
    """A feature's module is reached by the API and by the Dagster side: it imports no FastAPI, Dagster or vLLM."""
    for name, path in _modules().items():
        if name.startswith("batch_dagster.features"):
            used = {m.split(".")[0] for m in _imports(name, path)}
            assert not used & {"dagster", "dagster_aws", "vllm", "torch", "fastapi", "starlette", "uvicorn"}, name
            assert not {m for m in _imports(name, path) if m.startswith("batch_dagster.api")}, name


DAGSTER = ("dagster", "dagster_aws", "dagster_k8s", "dagster_postgres", "dagster_graphql", "dagster_webserver")
# The CLI's run command (and the demo, which is one run) runs a batch through Dagster from Python; the components
# module is the name a project's defs.yaml gives the table batch component (its code is in defs/table/).
RUN_COMMANDS = ("batch_dagster.cli", "batch_dagster.demo.run", "batch_dagster.definitions", "batch_dagster.components")


def test_only_the_dagster_package_imports_dagster():
    modules, graph = _modules(), _graph()
    direct = {name for name, path in modules.items() if {m.split(".")[0] for m in _imports(name, path)} & set(DAGSTER)}
    assert {name for name in direct if not name.startswith("batch_dagster.defs")} == set()
    reaching, changed = set(direct), True
    while changed:  # every module that imports Dagster through a chain of imports, inside functions too
        grown = reaching | {name for name, targets in graph.items() if targets & reaching}
        changed, reaching = grown != reaching, grown
    outside = {name for name in reaching if not name.startswith("batch_dagster.defs")}
    assert outside == set(RUN_COMMANDS)


@pytest.mark.parametrize("module", ["batch_dagster.api.app", "batch_dagster.cli", "batch_dagster.serve.__main__"])
def test_importing_the_api_the_cli_or_serve_imports_neither_dagster_nor_vllm(module):
    code = (f"import sys, importlib; importlib.import_module({module!r}); "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'dagster', 'vllm', 'torch', 'dagster_aws'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout.strip() == "[]"


FOLDER_NAMES = re.compile(r"""["'/](input\.jsonl|validation\.json|requests\.parquet|manifest\.json|progress\.json|"""
                          r"""merged\.json|output\.jsonl|errors\.jsonl|summary\.json|stop\.json|deadline\.json|"""
                          r"""source\.json|batch\.json|shard-)""")


def test_only_the_folder_contract_spells_a_batch_file_name():
    spelled = []
    for name, path in _modules().items():
        if name == "batch_dagster.batchfile.folder":
            continue
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if FOLDER_NAMES.search(line) and not line.lstrip().startswith("#"):
                spelled.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
    assert spelled == []


def test_only_settings_reads_batch_variables_and_every_one_is_documented():
    documented = {v.name for v in settings.VARIABLES}
    name = re.compile(r"\bBATCH_[A-Z0-9_]*[A-Z0-9](?![A-Z0-9_*])")  # BATCH_S3_* in prose names a family
    named, readers = set(re.findall(name, (REPO / "Makefile").read_text(encoding="utf-8"))), []
    for path in [*PACKAGE.rglob("*.py"), *(REPO / "bench").rglob("*.py")]:
        text = path.read_text(encoding="utf-8")
        strings = [n.value for n in ast.walk(ast.parse(text)) if isinstance(n, ast.Constant) and isinstance(n.value, str)]
        named |= {m for s in strings for m in name.findall(s)}
        if path.name != "settings.py" and re.search(r"(environ|getenv)[^\n]*BATCH_", text):
            readers.append(str(path.relative_to(REPO)))
    assert readers == []
    assert named - documented == set()


def test_the_configuration_docs_are_generated_from_the_settings():
    doc = (REPO / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert settings.BEGIN in doc and settings.END in doc
    assert settings.with_tables(doc) == doc, "run: python -m batch_dagster.settings --update docs/configuration.md"
    for variable in settings.VARIABLES:
        assert f"`{variable.name}`" in doc


def test_settings_defaults_and_overrides(monkeypatch, tmp_path):
    for variable in settings.VARIABLES:
        monkeypatch.delenv(variable.name, raising=False)
    monkeypatch.chdir(tmp_path)
    s = settings.Settings.from_env()
    assert s.data_dir == tmp_path / "data" and s.shard_size == 1000 and s.windows.lengths == {"1h": 3600, "24h": 86_400}
    assert s.database_url == f"sqlite:///{tmp_path / 'data' / 'batch-api.db'}"
    assert s.max_upload_bytes == s.limits.max_bytes and s.outbox_dir == tmp_path / "data" / "outbox"
    monkeypatch.setenv("BATCH_API_KEYS", " sk-a, sk-b ,")
    monkeypatch.setenv("BATCH_MAX_BYTES", "1000")
    s = settings.Settings.from_env()
    assert s.api_keys == ("sk-a", "sk-b") and s.intake_api_key == ""  # no key picked to own dropped files
    assert s.limits.max_bytes == 1000 and s.max_upload_bytes == 1000


def _functions() -> list[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    return [(name, node) for name, path in _modules().items()
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)]


def _parameters(function: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Its parameters, `self` and `cls` not counted."""
    a = function.args
    named = [*a.posonlyargs, *a.args, *a.kwonlyargs]
    return len(named) - (bool(named) and named[0].arg in ("self", "cls")) + (a.vararg is not None) \
        + (a.kwarg is not None)


def test_no_function_takes_more_than_eight_parameters():
    # A value carried whole instead (a BatchRequest, a Shard), not sixteen keywords threaded through.
    wide = [f"{name}.{f.name}: {_parameters(f)}" for name, f in _functions() if _parameters(f) > 8]
    assert wide == []


def test_no_module_name_is_in_three_packages():
    """One meaning per name: a feature's modules are named after it in at most two packages (its rules in features/,
    its Dagster side in defs/), never a slice of the same name in every layer."""
    packages: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        if "migrations" not in path.parts and path.name not in ("__init__.py", "__main__.py"):
            packages.setdefault(path.name, set()).add(str(path.parent.relative_to(REPO)))
    assert {name: sorted(where) for name, where in packages.items() if len(where) >= 3} == {}


# Where a process reads its settings from the environment; everything else is given them.
COMPOSITION_ROOTS = {"batch_dagster/cli.py", "batch_dagster/serve/__main__.py", "batch_dagster/api/__main__.py",
                     "batch_dagster/defs/definitions.py", "batch_dagster/defs/table/component.py"}


def test_settings_are_read_from_the_environment_in_the_composition_roots_only():
    readers = {str(path.relative_to(REPO)) for path in PACKAGE.rglob("*.py")
               if path.name != "settings.py" and "Settings.from_env(" in path.read_text(encoding="utf-8")}
    assert readers == COMPOSITION_ROOTS


def test_the_lifecycles_assets_do_not_import_the_table_component():
    """The table component runs the lifecycle's steps; the lifecycle knows nothing of it."""
    for name, targets in _graph().items():
        if name.startswith("batch_dagster.defs.assets"):
            assert not {t for t in targets if t.startswith("batch_dagster.defs.table")}, name


def test_the_core_keeps_the_batch_request_and_every_way_in_builds_one():
    """A new way in builds a BatchRequest and hands it to the store; no way in threads its fields to the store one by
    one (db/batches.create_batch takes the request whole)."""
    create = next(f for name, f in _functions() if name == "batch_dagster.db.batches" and f.name == "create_batch")
    assert [a.arg for a in create.args.args][:3] == ["session", "storage", "request"] and _parameters(create) <= 6
    builders = {name for name, path in _modules().items() if "BatchRequest(" in path.read_text(encoding="utf-8")}
    assert {"batch_dagster.api.schemas", "batch_dagster.db.batches", "batch_dagster.defs.table.run"} <= builders
