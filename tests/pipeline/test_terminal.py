"""What a person sees in the terminal: the progress bar and the summary; warnings, child processes' output and
Dagster's tracebacks go to the run's log file."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass

from batch_dagster.cli import _print_summary
from batch_dagster.defs.runner import run_batch
from batch_dagster.settings import Settings
from tests.helpers import FakeEngine, chat_request, fake_vllm, make_defs, rows, write_jsonl


@dataclass
class NoisyEngine(FakeEngine):
    """Writes to the real file descriptors as vLLM does, itself and from a child process, then crashes or runs."""

    def run(self, endpoint, requests, on_progress=None):
        os.write(2, b"WARNING numa binding: noisy-parent\n")
        subprocess.run([sys.executable, "-c", "import sys; print('tcmalloc: noisy-child', file=sys.stderr)"],
                       check=True)
        return super().run(endpoint, requests, on_progress)


def test_the_terminal_gets_the_bar_and_the_summary_the_log_gets_the_noise(tmp_path, data_dir, instance, capfd):
    defs = make_defs(data_dir, fake_vllm("noisy", NoisyEngine(crash_times=1)), shard_size=5)
    run = run_batch(write_jsonl(tmp_path / "in.jsonl", rows(10)), tmp_path / "out", defs=defs, instance=instance,
                    log_dir=tmp_path / "logs")
    summary = run.to_dict()
    _print_summary(run, Settings.from_env())
    out, err = capfd.readouterr()
    assert summary["status"] == "completed"
    log = (tmp_path / "logs" / f"run-{summary['batch_id']}.log").read_text()
    assert summary["log_file"] == str(tmp_path / "logs" / f"run-{summary['batch_id']}.log")
    for noise in ("noisy-parent", "noisy-child", "fake engine died", "STEP_UP_FOR_RETRY"):
        assert noise not in out + err, noise
        assert noise in log, noise  # the crash and its retry are in the log file (and the Dagster UI)
    assert "requests: 100%" in err and "10/10" in err  # the progress bar, on the terminal
    assert f"batch {summary['batch_id']}: completed" in out and f"log:      {summary['log_file']}" in out


def test_an_invalid_file_prints_its_errors_without_a_traceback(tmp_path, data_dir, instance, capfd):
    defs = make_defs(data_dir, fake_vllm("noisy-invalid", FakeEngine()))
    bad = [chat_request("a", "hi"), "{oops", chat_request("a", "again")]
    run = run_batch(write_jsonl(tmp_path / "bad.jsonl", bad), tmp_path / "out", defs=defs, instance=instance,
                    log_dir=tmp_path / "logs")
    summary = run.to_dict()
    _print_summary(run, Settings.from_env())
    out, err = capfd.readouterr()
    assert summary["status"] == "failed"
    lines = err.splitlines()
    assert [line.split(":")[0] for line in lines] == ["  line 2", "  line 3 (custom_id)", "  log"], err
    assert "[invalid_json]" in lines[0] and "[duplicate_custom_id]" in lines[1] and summary["log_file"] in lines[2]
    assert "Traceback" not in out + err and "dagster" not in (out + err).lower()
    assert "line 2: [invalid_json]" in err and "The input file is invalid" in (tmp_path / "logs").joinpath(
        f"run-{summary['batch_id']}.log").read_text()
