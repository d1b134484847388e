"""A batch's run stores its end in the API's store itself, so the API answers it without waiting for a sensor tick."""

from __future__ import annotations

from sqlalchemy import select

from batch_dagster.batchfile import contract as c
from batch_dagster.batchfile.options import BatchRequest
from batch_dagster.db import Database, repo
from batch_dagster.db.batches import add_input_file, create_batch
from batch_dagster.db.models import WebhookEvent
from batch_dagster.defs.partitions import batches
from batch_dagster.defs.resources import StorageResource
from tests.helpers import FakeEngine, chat_request, count_words, fake_vllm, make_defs, read_jsonl, write_jsonl


def test_the_run_stores_its_batch_completed_with_its_files_and_one_event(tmp_path, data_dir, instance, monkeypatch):
    count_words(monkeypatch)  # counted as the fake engine bills, by a worker that loads no vLLM
    url = f"sqlite:///{tmp_path / 'store.db'}"
    store = Database(url)
    store.upgrade()
    storage = StorageResource(data_dir=str(data_dir)).open()
    rows = [chat_request(f"r{i}", f"question {i}") for i in range(3)]
    source = write_jsonl(tmp_path / "in.jsonl", rows)
    with store.session() as session:  # as the API's create makes it, launched as its sensor marks it
        repo.ensure_owners(session, [repo.ANONYMOUS])
        file = add_input_file(session, owner=repo.ANONYMOUS, file_id=repo.new_file_id(), filename="in.jsonl",
                              size=source.stat().st_size)
        storage.write_bytes(file.path, source.read_bytes())
        row = create_batch(session, storage, BatchRequest(owner=repo.ANONYMOUS, input_file_id=file.id,
                                                          endpoint=c.CHAT), file)
        row.launched_at = row.created_at
        session.commit()
        batch_id = row.id
    instance.add_dynamic_partitions(batches.name, [batch_id])
    defs = make_defs(data_dir, fake_vllm("stores-end", FakeEngine()), database_url=url)

    result = defs.resolve_job_def("batch_job").execute_in_process(partition_key=batch_id, instance=instance)

    assert result.success
    with store.session() as session:  # no sensor ran: the run stored it
        batch = repo.get_batch(session, repo.ANONYMOUS, batch_id)
        assert batch.status == "completed" and batch.completed_at is not None
        assert (batch.request_completed, batch.request_total) == (3, 3)
        assert batch.run_id == result.run_id
        output = repo.get_file(session, repo.ANONYMOUS, batch.output_file_id)
        assert sorted(line["custom_id"] for line in read_jsonl(data_dir / output.path)) == ["r0", "r1", "r2"]
        events = session.scalars(select(WebhookEvent).where(WebhookEvent.batch_id == batch_id)).all()
        assert [e.type for e in events] == ["batch.completed"]
    # Run again (a backfill): the ended batch is left as stored, its files and its event not added twice.
    assert defs.resolve_job_def("batch_job").execute_in_process(partition_key=batch_id, instance=instance).success
    with store.session() as session:
        assert len(session.scalars(select(WebhookEvent).where(WebhookEvent.batch_id == batch_id)).all()) == 1
    store.dispose()
