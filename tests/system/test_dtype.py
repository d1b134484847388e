"""The demo's path on the real engine in the dtype this host chooses (`dtype = "auto"`), named in the record.

Runs in the session's in-process engine (engine_for keeps one per model and process), as
test_engine_e2e's run_batch tests do.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from batch_dagster.batchfile.folder import BatchFolder
from batch_dagster.demo import sample_batch_path
from batch_dagster.engine.hardware import cpu_flags, dtype_choice
from batch_dagster.storage import LocalStorage
from tests.helpers import CHAT_MODEL, real_vllm, run_on_real_engine

pytestmark = pytest.mark.engine


def test_the_demo_runs_in_the_chosen_dtype_and_its_record_names_it(tmp_path, data_dir, instance):
    rows = [json.loads(line) for line in sample_batch_path().read_text(encoding="utf-8").splitlines()[:4]]
    summary, out, err = run_on_real_engine(tmp_path, data_dir, instance, rows)

    assert summary["status"] == "completed" and len(out) == 4 and not err
    assert "Paris" in out["qa-001"]["response"]["body"]["choices"][0]["message"]["content"]
    chosen = dtype_choice("auto")
    native = [f for f in ("avx512_bf16", "amx_bf16") if f in cpu_flags()]
    assert chosen.dtype == ("bfloat16" if native else "float32") or chosen.gpu
    record = BatchFolder(LocalStorage(data_dir), summary["batch_id"]).summary().record  # summary.json's
    assert record["engine_settings"]["dtype"] == "auto"  # what the registry says...
    assert record["dtype"] == chosen.dtype  # ...and what ran, with the CPU features that decided it
    assert record["dtype_choice"]["cpu_bf16_flags"] == native
    # The weights were prepared in that dtype: no cast at start, and never a folder of another dtype.
    vllm = real_vllm()
    path = Path(vllm.model_path(vllm.spec(CHAT_MODEL)))
    assert chosen.dtype in path.name
    assert json.loads((path / "config.json").read_text())["dtype"] == chosen.dtype
