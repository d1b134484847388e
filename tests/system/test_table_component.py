"""The example project (examples/reviews) as a team would run it: `dg check defs` passes, its 200 reviews are
labelled by the real model into typed columns, 10 changed rows are all that run again, and the Dagster UI shows
reviews -> review_labels in the lineage graph.

The labels come from vLLM in the run's own process, as the example's README runs it (its structured outputs through
vLLM's own serving layer), so the JSON schema's columns are filled as a user reads them. The README's commands
themselves, from the wheel into the project's own environment, run in tests/system/test_install.py.
"""

from __future__ import annotations

import importlib
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import dagster as dg
import pandas as pd
import pytest

from tests.helpers import MODEL_CACHE, webserver
from tests.system.test_ui_browser import CHROMIUM, browse

pytestmark = pytest.mark.engine
REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "reviews"
SENTIMENTS, TOPICS = {"positive", "negative", "neutral"}, {"quality", "shipping", "price", "support", "usability"}


def example_env(home: Path, data: Path, csv: Path) -> dict[str, str]:
    return {"DAGSTER_HOME": str(home), "BATCH_DATA_DIR": str(data), "BATCH_MODEL_CACHE": str(MODEL_CACHE),
            "BATCH_ENGINE_MODE": "offline", "REVIEWS_CSV": str(csv)}


def materialize(defs: dg.Definitions, instance: dg.DagsterInstance) -> tuple[pd.DataFrame, dict, float]:
    started = time.perf_counter()
    result = defs.resolve_implicit_global_asset_job_def().execute_in_process(
        instance=instance, asset_selection=[dg.AssetKey("reviews"), dg.AssetKey("review_labels")])
    assert result.success
    event = result.asset_materializations_for_node("review_labels")[0]
    assert all(check.passed for check in result.get_asset_check_evaluations())
    return (result.output_for_node("review_labels"), {k: v.value for k, v in event.metadata.items()},
            time.perf_counter() - started)


@pytest.fixture(scope="module")
def reviews_project(tmp_path_factory):
    """The example's definitions loaded as `dg` loads them, its instance in a tmp DAGSTER_HOME, and its first
    materialization on the real model: yields (definitions, instance, env, labels, metadata)."""
    root = tmp_path_factory.mktemp("reviews-project")
    home, data, csv = root / "dagster_home", root / "data", root / "reviews.csv"
    home.mkdir()
    (home / "dagster.yaml").write_text("nux:\n  enabled: false\ntelemetry:\n  enabled: false\n")
    shutil.copy(EXAMPLE / "src" / "reviews_example" / "data" / "reviews.csv", csv)
    env = example_env(home, data, csv)
    with pytest.MonkeyPatch.context() as monkeypatch:
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        monkeypatch.syspath_prepend(str(EXAMPLE / "src"))
        defs = importlib.import_module("reviews_example.definitions").defs.load_fn()
        with dg.DagsterInstance.from_config(str(home)) as instance:
            labels, meta, took = materialize(defs, instance)
            print(f"first materialization of the 200 reviews: {took:.1f}s")
            yield defs, instance, env, labels, meta


def run_dg(args: list[str], cwd: Path, home: Path) -> str:
    """`dg ARGS` in the project at `cwd`, in this environment; its output (it must succeed)."""
    env = {**os.environ, "DAGSTER_HOME": str(home), "VIRTUAL_ENV": str(Path(sys.executable).parents[1]),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}", "COLUMNS": "200"}
    if (cwd / "src").is_dir():  # a project not installed in this environment: its package from its own folder
        env["PYTHONPATH"] = str(cwd / "src")
    (home / "dagster.yaml").touch()
    out = subprocess.run([str(Path(sys.executable).with_name("dg")), *args], cwd=cwd, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout + out.stderr


def test_dg_check_defs_passes_on_the_example_project_and_on_batch_dagster_itself(tmp_path):
    # The example, with a second table batch `dg scaffold defs` wrote (as a team adds one), and batch-dagster itself.
    # Its sources only: not the environment, instance and data its README's commands leave in a checkout.
    project = shutil.copytree(EXAMPLE, tmp_path / "reviews", ignore=lambda folder, names: [
        n for n in names if n.endswith(".egg-info") or (Path(folder) == EXAMPLE and n in {".venv", ".dagster_home", "data"})])
    run_dg(["scaffold", "defs", "batch_dagster.components.TableBatchComponent", "summaries", "--upstream", "reviews"],
           project, tmp_path)
    scaffolded = (project / "src" / "reviews_example" / "defs" / "summaries" / "defs.yaml").read_text()
    assert "type: batch_dagster.components.TableBatchComponent" in scaffolded and "upstream: reviews" in scaffolded
    for root in (project, REPO):
        said = run_dg(["check", "defs"], root, tmp_path)
        assert "All component YAML validated successfully" in said and "All definitions loaded successfully" in said
    assert "summaries" in run_dg(["list", "defs"], project, tmp_path)
    assert "batch_dagster.components.TableBatchComponent" in run_dg(["list", "components"], project, tmp_path)
    listed = run_dg(["list", "defs", "--json"], REPO, tmp_path)
    assert '"batch_input"' in listed and '"shard_results"' in listed


def test_the_reviews_are_labelled_into_typed_columns_and_only_changed_rows_run_again(reviews_project):
    defs, instance, env, labels, meta = reviews_project
    assert len(labels) == 200 and labels["row"].tolist() == list(range(200))
    assert labels["review_id"].tolist()[:3] == ["r001", "r002", "r003"]
    answered = labels[labels["error_code"].isna()]
    # What a user reads: typed columns, each value one the schema allows.
    assert len(answered) >= 190, labels["error_code"].value_counts().to_dict()
    assert set(answered["sentiment"]) <= SENTIMENTS and set(answered["topic"]) <= TOPICS
    assert answered["confidence"].dtype == "Float64" and answered["confidence"].between(0, 1).all()
    assert labels[labels["error_code"].notna()]["error"].notna().all()  # every other row says why
    # A review whose text an earlier row has (15 of the 200) is the same request asked again: it runs once, and
    # the other rows take its line, reused.
    reviews = pd.read_csv(env["REVIEWS_CSV"])
    texts = reviews["text"]
    repeats = int(texts.duplicated().sum())
    assert repeats > 0 and (meta["rows"], meta["computed"], meta["reused"]) == (200, 200 - repeats, repeats)
    for _, same in labels.groupby(texts):
        assert same["answer"].nunique(dropna=False) == 1 and same["error_code"].nunique(dropna=False) <= 1, same
    assert meta["completion_tokens"] > 0 and meta["model_revision"].startswith("sha256:")
    assert meta["engine_mode"] == "offline"  # the run's own process, as the README runs it

    # 10 reviews are edited upstream: those 10 run, the 190 others are reused, billed at zero.
    edited = list(range(0, 200, 20))
    reviews.loc[edited, "text"] = [f"Edited review {i}: it stopped working after a week." for i in edited]
    reviews.to_csv(env["REVIEWS_CSV"], index=False)
    again, meta2, took = materialize(defs, instance)
    print(f"re-materialization with 10 rows changed: {took:.1f}s")
    assert (meta2["computed"], meta2["reused"]) == (10, 190)
    assert again.loc[~again["row"].isin(edited), "reused"].all() and not again.loc[edited, "reused"].any()
    unchanged = [i for i in range(200) if i not in edited]
    assert again.loc[unchanged, "answer"].tolist() == labels.loc[unchanged, "answer"].tolist()
    assert meta2["completion_tokens"] < meta["completion_tokens"] / 10  # only the 10 computed rows are counted


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium (Debian: apt-get install chromium)")
def test_the_ui_shows_reviews_feeding_review_labels_in_the_lineage_graph(reviews_project, tmp_path):
    _, _, env, _, _ = reviews_project
    with webserver(["-m", "reviews_example.definitions", "-d", str(EXAMPLE / "src")], {**os.environ, **env},
                   tmp_path / "webserver.log") as url:
        dom = browse(f"{url}/assets/review_labels?view=lineage", tmp_path, "review-labels-lineage")
    # Each asset is a node of the graph (an SVG foreignObject at its place): reviews on the left, upstream of
    # review_labels, whose check has passed.
    nodes = {}
    for chunk in dom.split("<foreignObject")[1:]:
        x = re.match(r'\s+x="(\d+)"', chunk)
        name = re.search(r'data-tooltip="(review_labels|reviews)"', chunk)
        if x and name:
            nodes[name.group(1)] = int(x.group(1))
    assert set(nodes) == {"reviews", "review_labels"}, dom[-3000:]
    assert nodes["reviews"] < nodes["review_labels"]
    assert "1 / 1 Passed" in re.sub(r"<[^>]+>", "", dom)
