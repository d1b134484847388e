"""`batch-dagster run` on the real engine, as a person sees it: the progress bar and the summary, nothing else;
vLLM's and torch's start-up and shutdown output is in the log file the summary names."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import MODEL_CACHE, chat_request, write_jsonl

pytestmark = pytest.mark.engine


def test_the_terminal_shows_the_bar_and_the_summary_and_the_log_has_the_engine_noise(tmp_path):
    env = {**os.environ, "BATCH_DATA_DIR": str(tmp_path / "data"), "DAGSTER_HOME": str(tmp_path / "home"),
           "BATCH_MODEL_CACHE": str(MODEL_CACHE)}
    rows = [chat_request(f"q{i}", f"Say one word about {i}.", max_tokens=8, temperature=0) for i in range(4)]
    cli = Path(sys.executable).with_name("batch-dagster")
    proc = subprocess.run([str(cli), "run", str(write_jsonl(tmp_path / "in.jsonl", rows)), "--out",
                           str(tmp_path / "out")], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    terminal = proc.stdout + proc.stderr
    [log_line] = [line for line in proc.stdout.splitlines() if line.startswith("  log:")]
    log = Path(log_line.split(":", 1)[1].strip())
    assert log.parent == tmp_path / "data" / "logs" and log.name.startswith("run-batch_")
    text = log.read_text()
    # What vLLM and torch print at start-up is there, not on the terminal.
    assert "vllm" in text.lower() and "WARNING" in text and "Shard 0: 4/4 requests" in text
    for noise in ("WARNING", "NUMA", "tcmalloc", "FutureWarning", "Traceback", "dagster - ", "EngineCore"):
        assert noise not in terminal, (noise, terminal)
    assert "requests: 100%" in proc.stderr and "4/4" in proc.stderr  # the bar
    assert "completed" in proc.stdout.splitlines()[0] and "  requests: 4 total, 4 completed" in proc.stdout
