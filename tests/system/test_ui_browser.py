"""The Dagster UI as an analyst sees it, in headless Chromium against the webserver on the project's instance.

After a valid and an invalid batch and the day's usage report: the invalid batch shows no failed asset or
check, runs carry readable tags, and the report's chart is an image in the page. Screenshots go to the
test's tmp dir (look at them when this fails). With DOCS_SCREENSHOTS set to a folder (`make docs-screenshots`:
docs/images/ui), the ones docs/dagster-ui.md shows are copied there.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from datetime import UTC, date, datetime, timedelta
from pathlib import Path

import dagster as dg
import pytest
from sqlalchemy import update

from batch_dagster.db import BatchRecord
from batch_dagster.defs.assets.batch import lifecycle
from batch_dagster.defs.assets.checks import lifecycle_checks
from batch_dagster.defs.assets.daily_report import report_definitions
from batch_dagster.defs.instance import INSTANCE_CONFIG
from batch_dagster.defs.jobs import batch_job
from batch_dagster.defs.resources import DatabaseResource, PipelineConfig, StorageResource
from batch_dagster.defs.runner import run_batch
from batch_dagster.settings import default
from tests.helpers import FakeEngine, chat_request, fake_vllm, rows, webserver, write_jsonl

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# The screenshots docs/dagster-ui.md shows, by file name.
DOC_SHOTS = ("runs", "batch-partition", "batch-run", "batch-checks", "validation-errors", "daily-usage-report")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no chromium (Debian: apt-get install chromium)")
REPO = Path(__file__).resolve().parents[2]


def browse(url: str, tmp_path: Path, name: str, budget_ms: int = 15_000) -> str:
    """The page's DOM after it settled; a screenshot of it as `name`.png under tmp_path."""
    base = [CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
            "--disable-component-update", "--disable-sync", "--no-first-run", "--hide-scrollbars",
            f"--user-data-dir={tmp_path / 'chromium'}", f"--virtual-time-budget={budget_ms}", "--window-size=1600,1100"]
    dom = subprocess.run([*base, "--dump-dom", url], capture_output=True, text=True, timeout=120).stdout
    subprocess.run([*base, f"--screenshot={tmp_path / (name + '.png')}", url], capture_output=True, timeout=120)
    return dom


@pytest.fixture
def ui(tmp_path, monkeypatch):
    """The project's instance in tmp_path with one valid and one invalid batch and day's report, and the
    Dagster webserver on it (what `make dev` serves, without the daemon): yields (url, instance, batch ids)."""
    home, data = tmp_path / "dagster_home", tmp_path / "data"
    home.mkdir()
    (home / "dagster.yaml").symlink_to(INSTANCE_CONFIG)
    monkeypatch.setenv("DAGSTER_HOME", str(home))
    monkeypatch.setenv("BATCH_DATA_DIR", str(data))
    resources = {"storage": StorageResource(data_dir=str(data)), "s3": dg.ResourceDefinition.none_resource(),
                 "vllm": fake_vllm("ui-browser", FakeEngine()), "pipeline": PipelineConfig(shard_size=1000),
                 "database": DatabaseResource(url=f"sqlite:///{data / 'batch-api.db'}")}
    defs = dg.Definitions(assets=lifecycle(default("BATCH_STEP_RETRY_DELAY_S")),
                          asset_checks=lifecycle_checks, jobs=[batch_job], resources=resources)
    with dg.DagsterInstance.from_config(str(home)) as instance:
        # The valid batch last: its checks are the latest executions the checks pages show.
        bad = run_batch(write_jsonl(tmp_path / "broken.jsonl", [chat_request("a", "hi"), "{oops"]),
                        tmp_path / "out-bad", show_progress=False, defs=defs, instance=instance).to_dict()
        good = run_batch(write_jsonl(tmp_path / "questions.jsonl", rows(5)), tmp_path / "out-good",
                         show_progress=False, defs=defs, instance=instance).to_dict()
        assert (good["status"], bad["status"]) == ("completed", "failed")
        # The day's report covers finished days: move both batches' ends to yesterday.
        day = (datetime.now(UTC) - timedelta(days=1)).date().isoformat()
        with resources["database"].session() as session:
            for column in ("completed_at", "failed_at"):
                session.execute(update(BatchRecord).where(getattr(BatchRecord, column).is_not(None))
                                .values({column: getattr(BatchRecord, column) - 86_400}))
            session.commit()
        report = dg.materialize(report_definitions(date(2026, 1, 1)).assets or [], partition_key=day,
                                instance=instance, resources={k: resources[k] for k in ("database", "storage")})
        assert report.success
        env = {**os.environ, "DAGSTER_HOME": str(home), "BATCH_DATA_DIR": str(data)}
        with webserver(["-w", "workspace.yaml"], env, tmp_path / "webserver.log", cwd=REPO) as url:
            yield url, instance, good, bad, day


def test_the_ui_shows_an_invalid_batch_as_a_result_and_the_report_chart_inline(ui, tmp_path):
    url, instance, good, bad, day = ui
    # The invalid batch's lifecycle: nothing after validation failed, and no check "Execution failed".
    for asset in ("batch_shards", "batch_usage"):
        dom = browse(f"{url}/assets/{asset}?view=partitions&partition={bad['batch_id']}", tmp_path,
                     f"{asset}-invalid-partition")
        # The partition filter counts: none failed; the valid batch materialized, the invalid one missing.
        text = re.sub(r"<[^>]+>", "", dom)
        assert "Failed (0)" in text and "Materialized (1)" in text and "Missing (1)" in text, text[-3000:]
    # Its validation errors stay visible: the `invalid` observation of validated_requests, with the error table.
    dom = browse(f"{url}/assets/validated_requests?view=events&partition={bad['batch_id']}", tmp_path,
                 "validated-requests-events")
    assert "invalid_json" in dom and "broken.jsonl" in dom
    dom = browse(f"{url}/assets/validated_requests?view=checks", tmp_path, "validated-requests-checks")
    assert "unique_custom_ids" in dom and "Execution failed" not in dom
    dom = browse(f"{url}/runs", tmp_path, "runs")
    assert "broken.jsonl" in dom and "questions.jsonl" in dom  # runs tagged with their input file
    assert "Failure" not in dom
    # The day's report: the chart is an <img> in the asset's overview, not behind "[Show Markdown]".
    dom = browse(f"{url}/assets/daily_usage_report?partition={day}", tmp_path, "daily-usage-report", 20_000)
    assert re.search(r"<img[^>]+src=\"data:image/svg\+xml", dom), "no inline chart image"
    # The valid batch as docs/dagster-ui.md shows it: its partition, its run, its checks.
    dom = browse(f"{url}/assets/batch_usage?view=partitions&partition={good['batch_id']}", tmp_path,
                 "batch-partition")
    assert good["batch_id"] in dom
    [run] = instance.get_runs(filters=dg.RunsFilter(tags={"batch_id": good["batch_id"]}))
    dom = browse(f"{url}/runs/{run.run_id}", tmp_path, "batch-run", 20_000)
    assert good["batch_id"] in dom and "batch_job" in dom  # the run of the batch's partition
    dom = browse(f"{url}/assets/batch_output_files?view=checks", tmp_path, "batch-checks")
    assert "every_custom_id_exactly_once" in dom and "Execution failed" not in dom
    shutil.copyfile(tmp_path / "validated-requests-events.png", tmp_path / "validation-errors.png")
    if folder := os.environ.get("DOCS_SCREENSHOTS"):
        Path(folder).mkdir(parents=True, exist_ok=True)
        for name in DOC_SHOTS:
            shutil.copyfile(tmp_path / f"{name}.png", Path(folder) / f"{name}.png")
