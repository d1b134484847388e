"""Validation's count worker gives its memory back before the model's engine starts in the same process, and stays
beside an engine already running there (a process's next batch), instead of starting again for each count."""

from __future__ import annotations

from types import SimpleNamespace

from batch_dagster.defs.resources import VLLMResource
from batch_dagster.engine import counting, offline
from batch_dagster.settings import Settings
from tests.helpers import (
    CHAT_MODEL,
    WORD_RENDERER,
    FakeEngine,
    FakeVLLM,
    chat_request,
    database_url,
    fake_vllm,
    make_defs,
    write_jsonl,
)


class InProcess(FakeVLLM):
    """A fake whose engine would start in this process, as the in-process engine does."""

    engine_starts_here = VLLMResource.engine_starts_here


def test_the_count_worker_goes_before_an_engine_starts_and_stays_beside_a_running_one(tmp_path, data_dir, instance,
                                                                                       monkeypatch):
    from batch_dagster.defs.runner import run_batch

    monkeypatch.setattr(counting, "FACTORY", WORD_RENDERER)  # a renderer of words
    defs = make_defs(data_dir, fake_vllm("kept", FakeEngine(), InProcess), database_url=database_url(data_dir))
    worker = counting.shared_worker(str(Settings.from_env().models_file), "/nonexistent")  # the fake's registry

    def run(name: str) -> int | None:
        rows = [chat_request(f"{name}-{i}", f"question {i}") for i in range(3)]
        summary = run_batch(write_jsonl(tmp_path / f"{name}.jsonl", rows), tmp_path / name, show_progress=False,
                            defs=defs, instance=instance).to_dict()
        assert summary["request_counts"]["completed"] == 3 and summary["usage"]["input_tokens"] > 0, summary
        return worker.pid

    try:
        assert run("first") is None  # counted, then closed: the engine started next
        # The model's engine runs in this process (started before this batch: it reports no start of its own).
        monkeypatch.setitem(offline._ENGINES, CHAT_MODEL, SimpleNamespace(started_at=None))
        kept = run("second")
        assert kept is not None and run("third") == kept  # the same worker counted both
    finally:
        counting.close_workers()
