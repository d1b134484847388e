"""A table batch's one asset at work: the upstream table's rows rendered into requests, run as a batch (by this
process's pipeline, or by a batch-dagster service), and answered back into a table beside the input's key columns.

In this process the batch lives in a folder of the batch storage, one per asset partition (`table_<hash>`): a retry
of the step, or the next run with the same rows, finds its committed shards and runs only the rest; a run whose rows
or options changed discards the folder an earlier failed run left; the folder is deleted once its answers are in the
table. So at most one folder per asset partition is ever left, and only until that partition runs again.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import dagster as dg
import pyarrow as pa
import pyarrow.compute as pc

from batch_dagster.batchfile import table as t
from batch_dagster.batchfile.contract import BatchError
from batch_dagster.batchfile.folder import BatchFolder
from batch_dagster.batchfile.options import BatchOptions, BatchRequest
from batch_dagster.batchfile.results import iter_lines
from batch_dagster.batchfile.table import Rendered, TableRequest
from batch_dagster.batchfile.table_answers import answers_table
from batch_dagster.batchfile.usage import Usage, cost_of
from batch_dagster.client import BatchService
from batch_dagster.defs.assets import inference, steps
from batch_dagster.defs.resources import PipelineConfig, StorageResource, VLLMResource
from batch_dagster.features.scope import Owner

from .io_manager import as_arrow, as_pandas

CHECK = "every_row_answered_once"
# A table batch's options where its component leaves them unset: its answers reused (the rows of a table come back).
TABLE_DEFAULTS = BatchOptions(reuse=True)
SHOWN_ERRORS = 20  # rows whose errors the log and the metadata name one by one


@dataclass(frozen=True)
class TableBatch:
    """What a component asks of each row, and how: the request, the key columns carried over, the batch's options
    (whether answers are reused, what it may cost), the service that runs it (None: this process's pipeline), and
    the namespace it runs under in this process (its owner: whose kept answers and cached prompt prefixes it
    meets; a service's batch is its key's)."""

    request: TableRequest
    key_columns: tuple[str, ...] = ()
    options: BatchOptions = field(default_factory=lambda: BatchOptions().resolved(TABLE_DEFAULTS))
    service: BatchService | None = None
    namespace: str = ""

    def batch_request(self) -> BatchRequest:
        """The batch request a table batch run in this process makes: its endpoint, options and owner (its
        namespace's)."""
        return BatchRequest(owner=Owner.of_table(self.namespace).id if self.namespace else "",
                            endpoint=self.request.endpoint, options=self.options)


@dataclass
class Ran:
    """What running the batch gave: every output and error line, and how it ran."""

    lines: list[dict[str, Any]]
    metadata: dict[str, Any]


def _partition_of(context: dg.AssetExecutionContext) -> str:
    """The asset partition the step materializes, as text (its asset key, and its partition key if any)."""
    return f"{context.asset_key.to_user_string()}\n{context.partition_key if context.has_partition_key else ''}\n"


def batch_tag(context: dg.AssetExecutionContext, batch: TableBatch, payload: bytes) -> str:
    """The batch's content hash: the same rows asked the same way of the same asset partition give the same tag (a
    retried step finds the remote batch it created by it)."""
    h = hashlib.sha256(f"{_partition_of(context)}{batch.options.to_dict()}\n".encode())
    h.update(payload)
    return f"table_{h.hexdigest()[:32]}"


def folder_id_of(context: dg.AssetExecutionContext) -> str:
    """The batch folder of the asset partition: the one batch of its latest attempt."""
    return f"table_{hashlib.sha256(_partition_of(context).encode()).hexdigest()[:32]}"


def _asks_the_same(folder: BatchFolder, batch: TableBatch, payload: bytes) -> bool:
    """Whether the batch in `folder` is the one `payload` and `batch` make: the same request (its options and owner),
    and the same input, byte for byte."""
    if folder.batch_request() != batch.batch_request() or folder.storage.size(folder.input_key) != len(payload):
        return False
    h = hashlib.sha256()
    with folder.storage.open(folder.input_key) as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.digest() == hashlib.sha256(payload).digest()


def _invalid(errors: list[BatchError], rows: list[int]) -> str:
    """Validation's errors, each named by the row its line came from."""
    shown = []
    for e in errors[:SHOWN_ERRORS]:
        where = f"row {rows[e.line - 1]}" if e.line is not None and 0 < e.line <= len(rows) else "the batch"
        shown.append(f"{where}: [{e.code}] {e.message}" + (f" (field: {e.param})" if e.param else ""))
    return "; ".join(shown)


def _in_pipeline(context: dg.AssetExecutionContext, batch: TableBatch, rendered: Rendered, rows: list[int],
                 storage: StorageResource, pipeline: PipelineConfig, vllm: VLLMResource) -> Ran:
    """Run the rendered requests through this process's pipeline: validation, shards, inference with reuse,
    per-shard commits, the merged files and the summary, as any batch."""
    folder, payload = storage.folder(folder_id_of(context)), rendered.payload()
    if folder.has_input() and not _asks_the_same(folder, batch, payload):
        context.log.warning(f"The batch folder {folder.batch_id} an earlier run left asks other rows or options: "
                            "discarded, the batch starts afresh (answers it kept are still reused)")
        _remove(folder)
    if not folder.has_input():
        folder.declare(batch.batch_request())  # it has no row: its request is kept in its folder alone
        with folder.storage.writing(folder.input_key) as path:
            path.write_bytes(payload)
    if folder.manifest() is None:  # a retry, or a run after one that failed, resumes at the shards
        validated = steps.validate(folder, pipeline, vllm, None, context.log, count=True)  # no store: no key
        if not validated.report.valid:  # refused whole (a model not served, the cost cap): nothing to resume
            _remove(folder)
            raise dg.Failure(f"The requests made of the table are refused: {_invalid(validated.report.errors, rows)}",
                             allow_retries=False)
        estimate = validated.estimate
        if estimate and estimate.get("cost"):
            context.log.info(f"Estimate: {estimate['input_tokens']} prompt tokens, at most "
                             f"{estimate['max_output_tokens']} output tokens, cost at most {estimate['cost']['max']} "
                             f"{estimate['cost']['currency']}")
        steps.plan_shards(folder, pipeline, context.log)
    done = inference.infer(context, folder, vllm, pipeline, None)
    steps.merge_results(folder)
    summary = steps.summarize(folder, pipeline, vllm, context.log)
    lines = [*iter_lines(folder.storage, folder.output_key), *iter_lines(folder.storage, folder.error_key)]
    meta = {"model_revision": summary.record.get("revision"), "engine_mode": summary.record.get("engine_mode"),
            "shards": done.shards_run + done.shards_skipped, "shards_skipped": done.shards_skipped,
            "cost": summary.cost.total_cost, "currency": summary.cost.currency,
            **steps.estimate_metadata(folder.estimate())}
    if summary.errors:
        context.log.warning(f"The batch stopped early: {summary.errors[0].message}")
    _remove(folder)
    return Ran(lines, meta)


def _remove(folder: BatchFolder) -> None:
    """The batch's folder, once its answers are read: they live on in the table and (reused) in the answer store."""
    folder.storage.delete_folder(folder.prefix)


def _on_service(context: dg.AssetExecutionContext, batch: TableBatch, rendered: Rendered, rows: list[int],
                pipeline: PipelineConfig) -> Ran:
    """Run the rendered requests as a batch of a batch-dagster service; a retried step finds the batch it created."""
    service = batch.service
    assert service is not None
    payload = rendered.payload()
    tag = batch_tag(context, batch, payload)
    found = service.find(tag)
    extra = batch.options.to_dict()  # the create body's extension fields
    created = found or service.create(payload, f"{context.asset_key.path[-1]}.jsonl",
                                      batch.request.endpoint, tag, extra)
    context.log.info(f"{'Following' if found else 'Created'} batch {created['id']} at {service.url}")
    shown: list[Any] = [None]

    def on_poll(state: dict[str, Any]) -> None:
        counts = (state["status"], state["request_counts"]["completed"], state["request_counts"]["failed"])
        if counts != shown[0]:
            shown[0] = counts
            context.log.info(f"Batch {state['id']}: {counts[0]}, {counts[1]} completed, {counts[2]} failed of "
                             f"{state['request_counts']['total']}")

    def cancel() -> None:  # a terminated run's batch is not left running for nobody; what it finished stays
        context.log.warning(f"The run was terminated: cancelling batch {created['id']} at {service.url}")
        service.cancel(created["id"])

    # Any other interrupt leaves the batch running: the step's retry follows it (found by its tag).
    with inference.stops_when_terminated(context, f"followed batch {created['id']}", cancel):
        ended = service.wait(created["id"], on_poll)
    if ended["status"] == "failed" and not ended.get("output_file_id") and not ended.get("error_file_id"):
        errors = [BatchError.from_dict(e) for e in (ended.get("errors") or {}).get("data") or []]
        raise dg.Failure(f"The service refused the batch {ended['id']}: {_invalid(errors, rows)}", allow_retries=False)
    usage = Usage.from_dict(ended.get("usage") or {})
    cost = cost_of(usage, batch.request.model, pipeline.prices())
    return Ran(list(service.lines(ended)), {"service_batch": ended["id"], "service_status": ended["status"],
                                                   "cost": cost.total_cost, "currency": cost.currency})


def check_every_row(table: pa.Table, rows: int) -> dg.AssetCheckResult:
    """Every upstream row has exactly one row here, at its place, with an answer or an error and not both."""
    answer = table.column(t.EMBEDDING if t.EMBEDDING in table.column_names else t.ANSWER)
    failed = pc.is_valid(table.column("error"))
    answered = pc.and_(pc.is_valid(answer), pc.invert(failed))
    positions = table.column(t.ROW).to_pylist() == list(range(rows))
    neither = rows - pc.sum(pc.or_(answered, failed)).as_py() if rows else 0
    return dg.AssetCheckResult(check_name=CHECK, passed=table.num_rows == rows and positions and neither == 0,
                               metadata={"upstream_rows": rows, "rows": table.num_rows, "in_place": positions,
                                         "answered": pc.sum(answered).as_py() or 0,
                                         "failed": pc.sum(failed).as_py() or 0, "neither": neither})


def answer_table(context: dg.AssetExecutionContext, upstream: Any, batch: TableBatch, storage: StorageResource,
                 pipeline: PipelineConfig, vllm: VLLMResource) -> Iterator[dg.Output | dg.AssetCheckResult]:
    """The asset's body: the answered table (pandas or pyarrow, as the upstream gave it) and its check."""
    started = time.perf_counter()
    table, spec = as_arrow(upstream), batch.request
    absent = t.missing_columns(spec, table.column_names) + [k for k in batch.key_columns if k not in
                                                             table.column_names]
    if absent:
        fields = ", ".join(f"request.{name}" for name in spec.templates())
        raise dg.Failure(f"Column(s) {', '.join(map(repr, absent))} named by {fields} or key_columns are not in the "
                         f"table {context.asset_key.to_user_string()}'s upstream; its columns are "
                         f"{', '.join(table.column_names)}. No row was sent.", allow_retries=False)
    rendered = t.render(spec, table.select(spec.columns()).to_pylist(), pipeline.limits)
    refused = {e.row for e in rendered.errors}
    sent = [row for row in range(table.num_rows) if row not in refused]  # line i+1 of the batch is row sent[i]
    context.log.info(f"{table.num_rows} rows: {len(rendered.lines)} requests for {spec.model} at {spec.endpoint}, "
                     f"{len(rendered.errors)} rows refused before any request")
    ran = Ran([], {})
    if rendered.lines:
        ran = _on_service(context, batch, rendered, sent, pipeline) if batch.service is not None else \
            _in_pipeline(context, batch, rendered, sent, storage, pipeline, vllm)
    keys = table.select(list(batch.key_columns))
    answered, counts = answers_table(spec, keys, ran.lines, rendered.errors)
    key_rows = keys.to_pylist()
    for error in counts.errors[:SHOWN_ERRORS]:
        context.log.warning(error.shown(key_rows[error.row]))
    wall = time.perf_counter() - started
    context.log.info(f"{counts.answered} rows answered ({counts.reused} reused), {counts.failed} failed, "
                     f"{counts.computed} computed in {wall:.1f}s")
    preview = answered.slice(0, 5).drop_columns([c for c in (t.EMBEDDING,) if c in answered.column_names])
    metadata = {
        **counts.to_dict(), "wall_s": round(wall, 3), "model": spec.model, "endpoint": spec.endpoint,
        **{k: v for k, v in ran.metadata.items() if v is not None},
        "errors": steps.md_table([{"row": e.row, "keys": key_rows[e.row], "code": e.code, "field": e.param or "",
                             "message": e.message} for e in counts.errors[:SHOWN_ERRORS]]),
        "preview": steps.md_table(preview.to_pylist()),
        "dagster/row_count": answered.num_rows,
    }
    value = answered if isinstance(upstream, pa.Table) else as_pandas(answered)
    yield dg.Output(value, metadata=metadata)
    yield check_every_row(answered, table.num_rows)

