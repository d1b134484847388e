"""A batch's steps as functions of its folder: the lifecycle assets (batch.py) run one each, a table batch
(defs/table/) runs them all in its one asset. Both get the same validation, shards, commits, retries and reuse."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import dagster as dg
import orjson
import pyarrow.parquet as pq

from batch_dagster.batchfile import contract as c
from batch_dagster.batchfile.columnar import read_shard, validate_to_parquet, write_shards
from batch_dagster.batchfile.cost_cap import COST_LIMIT
from batch_dagster.batchfile.estimate import Tally
from batch_dagster.batchfile.failure import not_run_lines, stopped_ending
from batch_dagster.batchfile.folder import BatchFolder, Manifest, Merged, Progress, Summary, Validation
from batch_dagster.batchfile.registry import served_endpoints
from batch_dagster.batchfile.results import MergeResult, commit_shard, committed_shards, merge, progress_of
from batch_dagster.batchfile.reuse import AnswerStore, keep, look_up, model_identity
from batch_dagster.batchfile.status import BatchStatus
from batch_dagster.batchfile.usage import cost_of
from batch_dagster.batchfile.validate import ValidationReport
from batch_dagster.defs.dagster_internals import dies_with_its_run
from batch_dagster.defs.resources import PipelineConfig, VLLMResource
from batch_dagster.engine.base import EngineCrash

from .cost_cap import apply_cost_cap, cost_cap_reached
from .eta import RunEta
from .token_limit import apply_token_limit, count_tokens

INFERENCE_RETRIES = 2


def now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def md_table(rows: list[dict[str, Any]]) -> dg.MetadataValue:
    if not rows:
        return dg.MetadataValue.md("_none_")
    head = list(rows[0])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lines.append("| " + " | ".join(str(r[h]).replace("|", "\\|").replace("\n", " ")[:120] for h in head) + " |")
    return dg.MetadataValue.md("\n".join(lines))


@dataclass
class Validated:
    """What validation found: its report, the batch's tokens (when counted), how long it took, its first rows."""

    report: ValidationReport
    tally: Tally | None
    elapsed_s: float
    size: int
    head: list[dict[str, Any]]


def validate(folder: BatchFolder, pipeline: PipelineConfig, vllm: VLLMResource, log: Any,
             count: bool = False) -> Validated:
    """Validate the folder's input into its requests file (published only when valid), count its tokens (for the
    enqueued-token limit, the cost cap and the estimate; `count`: whether or not a limit or a store asks), and
    write the validation report."""
    started = time.perf_counter()
    size = folder.storage.size(folder.input_key) or 0
    # The input is validated as it streams in; the requests file is published only when the file is valid.
    with folder.storage.open(folder.input_key) as source, folder.storage.writing(folder.requests_key) as out:
        report = validate_to_parquet(source, out, size=size, limits=pipeline.limits, endpoint=folder.endpoint(),
                                     models=served_endpoints(vllm.registry()))
        elapsed = time.perf_counter() - started
        tally = count_tokens(out, report, pipeline, vllm, log, count)  # the limit, the cap, the estimate
        prompt_tokens = apply_token_limit(folder, report, pipeline, tally)
        apply_cost_cap(folder, report, pipeline, tally)
        head = (pq.ParquetFile(out).read_row_group(0, columns=["custom_id", "prompt_chars", "body"]).slice(0, 5)
                .to_pylist() if report.valid else [])
        if not report.valid:
            out.unlink(missing_ok=True)  # over the token limit or the cost cap: valid rows, but the batch is refused
    folder.write_validation(Validation(
        valid=report.valid, total_requests=report.total_requests, model=report.shown_model, endpoint=report.endpoint,
        error_count=report.error_count, errors=report.listed_errors, validated_at=now(), prompt_tokens=prompt_tokens))
    return Validated(report, tally, elapsed, size, head)


def plan_shards(folder: BatchFolder, pipeline: PipelineConfig, log: Any) -> tuple[Manifest, bool]:
    """The batch's shards, cut once: (the manifest, whether it was planned before). Results may already be committed
    against a plan, so it is never cut again."""
    manifest = folder.manifest()
    if manifest is not None:
        log.info(f"Reusing the {manifest.shard_count} shards already planned")
        return manifest, True
    validation = folder.validation()
    assert validation is not None and validation.model and validation.endpoint  # validation ran
    shard_size = pipeline.shard_size
    with folder.storage.local_copy(folder.requests_key) as requests, \
            folder.storage.writing_folder(folder.shards_prefix) as shards:
        sizes = write_shards(requests, shards, shard_size)
    # The manifest is written last: it is what marks the shards as planned and complete.
    manifest = Manifest(batch_id=folder.batch_id, endpoint=validation.endpoint, model=validation.model,
                        total_requests=sum(sizes), shard_size=shard_size, shard_count=len(sizes), shard_sizes=sizes)
    folder.write_manifest(manifest)
    log.info(f"{sum(sizes)} requests in {len(sizes)} shards of up to {shard_size}")
    return manifest, False


def manifest_of(folder: BatchFolder) -> Manifest:
    manifest = folder.manifest()
    if manifest is None:
        raise dg.Failure(f"{folder.batch_id} has no shard manifest: batch_shards has not run.", allow_retries=False)
    return manifest


class ShardProgress:
    """Counts a shard's finished requests: writes them to the progress document beside the committed totals
    (`base`; the API's live request_counts read them) at most once a second or every 5% of the shard; logs them
    with the engine's load every 5 s and every 10%."""

    WRITE_EVERY_S = 1.0
    LOG_EVERY_S = 5.0

    def __init__(self, folder: BatchFolder, base: Progress, index: int, size: int, log: Any = None):
        self.folder, self.base, self.index, self.size, self.log = folder, base, index, size, log
        self.done = 0
        self.written_at = 0.0
        self.written_done = 0
        self.logged_at = time.monotonic()
        self.first: tuple[float, int] | None = None
        self.logged_decile = 0
        self.load = ""

    def report_load(self, load: str) -> None:
        """The engine's own view of its load (e.g. vLLM's unfinished requests and token rates)."""
        self.load = load

    def __call__(self, n: int) -> None:
        self.done = min(self.done + n, self.size)
        now = time.monotonic()
        step = max(self.size // 20, 1)
        if (now - self.written_at >= self.WRITE_EVERY_S or self.done - self.written_done >= step
                or self.done == self.size):
            self.written_at, self.written_done = now, self.done
            self.folder.write_progress(replace(self.base, shard=self.index, done=self.done, updated_at=time.time()))
        decile = 10 * self.done // self.size
        if self.first is None:  # the rate counts from the first finished request: the engine's start is not in it
            self.first = (now, self.done)
        if self.log is not None and (now - self.logged_at >= self.LOG_EVERY_S or decile > self.logged_decile):
            self.logged_at, self.logged_decile = now, decile
            since, done_then = self.first
            rate = f", {(self.done - done_then) / (now - since):.1f} requests/s" if now - since >= 0.5 else ""
            load = f"; engine: {self.load}" if self.load else ""
            self.log.info(f"Shard {self.index}: {self.done}/{self.size} requests "
                          f"({100 * self.done // self.size}%){rate}{load}")


def terminated(context: dg.AssetExecutionContext) -> bool:
    """Whether the step's run is being terminated on purpose (the UI's Terminate: the run is CANCELING)."""
    run = context.instance.get_run_by_id(context.run.run_id)
    return run is not None and run.status == dg.DagsterRunStatus.CANCELING


@contextmanager
def stops_when_terminated(context: dg.AssetExecutionContext, doing: str = "ran the batch's shards",
                          on_stop: Callable[[], None] | None = None) -> Iterator[None]:
    """A run terminated on purpose ends this step for good (after `on_stop`), keeping what it committed. Dagster 1.13
    answers the interrupt with the step's RetryPolicy, so the step would run the batch on. Any other interrupt (serve
    stopped, the process signalled) is Dagster's to handle, as before."""
    try:
        yield
    except (dg.DagsterExecutionInterruptedError, KeyboardInterrupt) as exc:
        if not terminated(context):
            raise
        if on_stop is not None:
            on_stop()
        raise dg.Failure(f"The run was terminated while it {doing}.", allow_retries=False) from exc


def engine_error_lines(requests: list[tuple[str, dict[str, Any]]], reason: str) -> list[dict[str, Any]]:
    message = f"The engine failed on this shard after {INFERENCE_RETRIES + 1} attempts: {reason}"
    return [c.request_error_line(cid, c.ENGINE_ERROR, message, status_code=500) for cid, _ in requests]


@dataclass
class Inference:
    """What the inference step did: shards run and skipped, the batch's counts so far, what this step ran."""

    shards_run: int
    shards_skipped: int
    completed: int
    failed: int
    reused: int
    requests_run: int
    elapsed_s: float
    output_tokens: int
    stopped: str | None

    def metadata(self) -> dict[str, Any]:
        return {
            "shards_run": self.shards_run,
            "shards_skipped": self.shards_skipped,
            "completed": self.completed,
            "failed": self.failed,
            "reused": self.reused,
            "requests_run": self.requests_run,
            "inference_s": round(self.elapsed_s, 3),
            "output_tokens_per_s": round(self.output_tokens / self.elapsed_s, 1) if self.requests_run else 0.0,
            "status": str(self.stopped or ("ran" if self.shards_run else "cached")),  # metadata takes no enum
        }


def answer_store(folder: BatchFolder, pipeline: PipelineConfig) -> AnswerStore | None:
    """The answer store, when the batch reuses answers: it said so at creation, or said nothing and the operator's
    default (BATCH_REUSE_ANSWERS) does."""
    declared = folder.declared()
    reuse = declared.reuse if declared is not None and declared.reuse is not None else pipeline.reuse_answers
    return AnswerStore(folder.storage, pipeline.answer_store_bytes) if reuse else None


def infer(context: dg.AssetExecutionContext, folder: BatchFolder, vllm: VLLMResource,
          pipeline: PipelineConfig) -> Inference:
    """Run each shard not committed yet on the engine and commit it atomically; a shard's requests whose answers
    the answer store holds are taken from it instead (when the batch reuses answers).

    An engine crash retries the step (the step's RetryPolicy) until the last attempt, whose shard then ends in
    engine_error lines. A stop (cancel, expiry, the cost cap) ends the loop before the next shard."""
    manifest = manifest_of(folder)
    done = committed_shards(folder.storage, folder.results_prefix)
    todo = [i for i in range(manifest.shard_count) if i not in done]
    context.log.info(f"{len(done)} of {manifest.shard_count} shards already committed; running {len(todo)} "
                     f"(attempt {context.retry_number + 1})")
    # Rewritten first: an attempt killed between a shard's marker and the document left it behind.
    before = folder.progress()
    base = progress_of(done, manifest.total_requests, manifest.shard_count, before.committed_at if before else None)
    folder.write_progress(base)
    engine = None  # built at the first shard that runs: a stopped batch never loads the model
    store = answer_store(folder, pipeline)
    identity = model_identity(vllm.model_record(manifest.model)) if store is not None else {}
    started = time.perf_counter()
    ran_requests = ran_tokens = 0
    stopped = None
    eta = RunEta(folder, manifest.total_requests, sum(s.request_counts.total for s in done.values()))
    with dies_with_its_run(context), stops_when_terminated(context):
        for index in todo:
            stopped = folder.stop_reason()
            if not stopped and cost_cap_reached(folder, manifest.model, done.values(), pipeline):
                folder.request_stop(COST_LIMIT)  # as a cancel stops it: the status follows from the files
                stopped = COST_LIMIT
            if stopped:
                context.log.warning(f"Batch {stopped}: shard {index} and later are not run")
                break
            with folder.storage.local_copy(folder.shard_key(index)) as shard:
                requests = read_shard(shard)
            t0 = time.perf_counter()
            progress = ShardProgress(folder, base, index, len(requests), context.log)
            reuse = look_up(store, identity, manifest.endpoint, requests) if store is not None else None
            to_run = reuse.to_run if reuse is not None else requests
            lines: list[dict[str, Any]] = []
            if reuse is not None and reuse.lines:
                progress(len(reuse.lines))
            if to_run:
                engine = engine or vllm.engine(manifest.model)
                try:
                    lines = engine.run(manifest.endpoint, to_run, on_progress=progress)
                except EngineCrash as exc:
                    vllm.reset(manifest.model)
                    if context.retry_number < INFERENCE_RETRIES:
                        context.log.error(f"Shard {index}: engine crashed ({exc}); the step will retry")
                        raise
                    context.log.error(f"Shard {index}: engine crashed on the last attempt; its requests become "
                                      "errors")
                    lines = engine_error_lines(to_run, str(exc))
                    engine = vllm.engine(manifest.model)
            if reuse is not None and store is not None:
                keep(store, reuse, lines)  # before the commit: a retry finds them even if this process dies now
                lines += reuse.lines
            summary = commit_shard(folder.storage, folder.results_prefix, index, lines, time.perf_counter() - t0,
                                   engine_start_s=vllm.engine_start_s(manifest.model, t0))
            done[index] = summary
            base = progress_of(done, manifest.total_requests, manifest.shard_count)  # after the marker
            folder.write_progress(base)
            context.log_event(eta.observation(context, sum(s.request_counts.total for s in done.values())))
            ran_requests += summary.request_counts.total
            ran_tokens += summary.usage.output_tokens
            reused = f", {summary.reused} reused" if summary.reused else ""
            context.log.info(
                f"Shard {index}: {summary.request_counts.completed} completed{reused}, "
                f"{summary.request_counts.failed} failed, {summary.usage.output_tokens} output tokens in "
                f"{summary.duration_s:.1f}s"
            )
    return Inference(
        shards_run=len(todo), shards_skipped=manifest.shard_count - len(todo),
        completed=sum(s.request_counts.completed for s in done.values()),  # those committed before, and now
        failed=sum(s.request_counts.failed for s in done.values()), reused=sum(s.reused for s in done.values()),
        requests_run=ran_requests, elapsed_s=time.perf_counter() - started, output_tokens=ran_tokens,
        stopped=stopped)


def preview(output: Path) -> list[dict[str, str]]:
    """The first answers of an output file, for the asset's metadata."""
    shown = []
    with open(output, "rb") as f:
        for raw, _ in zip(f, range(3), strict=False):
            line = orjson.loads(raw)
            body = line["response"]["body"]
            choice = (body.get("choices") or [{}])[0]
            text = (choice.get("message") or {}).get("content", choice.get("text", "")) if choice else ""
            shown.append({"custom_id": line["custom_id"], "answer": text or f"[{body.get('object')}]"})
    return shown


def merge_results(folder: BatchFolder) -> tuple[MergeResult, list[dict[str, str]]]:
    """The output and error files, merged whole from the committed shards (and, for a batch stopped early, a line
    for each request of the shards that never ran: nothing is dropped); the totals and the first answers."""
    manifest = manifest_of(folder)
    done = committed_shards(folder.storage, folder.results_prefix)
    missing = [i for i in range(manifest.shard_count) if i not in done]
    stopped = folder.stop_reason() if missing else None
    not_run: Any = []
    ending = stopped_ending(stopped) if stopped else None
    if ending:
        not_run = not_run_lines(folder, missing, ending.code, ending.message)
    with folder.storage.writing(folder.output_key) as out, folder.storage.writing(folder.error_key) as err:
        result = merge(folder.storage, folder.results_prefix, manifest.shard_count, out, err,
                       not_run=not_run, missing_ok=bool(stopped))
        shown = preview(out)
    folder.write_merged(Merged(status=ending.status if ending else BatchStatus.COMPLETED,
                               request_counts=result.request_counts, usage=result.usage,
                               error_codes=result.error_codes, reused=result.reused))
    return result, shown


def summarize(folder: BatchFolder, pipeline: PipelineConfig, vllm: VLLMResource, log: Any) -> Summary:
    """The batch's summary (usage, cost, how it ran), written last."""
    manifest = manifest_of(folder)
    merged = folder.merged()
    if merged is None:
        raise dg.Failure(f"{folder.batch_id} has no merged files: batch_output_files has not run.",
                         allow_retries=False)
    usage = merged.usage
    prices = pipeline.prices()
    cost = cost_of(usage, manifest.model, prices)
    if unpriced := prices.unlisted(manifest.model):  # said where the cost is read, not left as a silent 0
        log.warning(f"{unpriced}; add it to {pipeline.prices_file} (BATCH_PRICES_FILE)")
    shards = committed_shards(folder.storage, folder.results_prefix).values()
    inference_s = sum(s.duration_s for s in shards)
    summary = Summary(
        batch_id=folder.batch_id,
        status=merged.status,
        endpoint=manifest.endpoint,
        model=manifest.model,
        request_counts=merged.request_counts,
        usage=usage,
        cost=cost,
        error_codes=merged.error_codes,
        inference_s=round(inference_s, 3),
        output_tokens_per_s=round(usage.output_tokens / inference_s, 1) if inference_s else 0.0,
        # The engine starts its shards paid (in their duration_s; 0 when the engine was running already).
        record=vllm.model_record(manifest.model) | {"engine_start_s": round(sum(s.engine_start_s for s in shards), 3)},
        output_file=folder.storage.uri(folder.output_key),
        error_file=folder.storage.uri(folder.error_key),
        completed_at=now(),
        # Why a batch its cost cap stopped failed (a cancelled or expired one has no errors.data).
        errors=stopped_ending(stop.reason).errors if merged.status != BatchStatus.COMPLETED
        and (stop := folder.stop()) is not None else [],
        reused=merged.reused,
    )
    folder.write_summary(summary)
    return summary
