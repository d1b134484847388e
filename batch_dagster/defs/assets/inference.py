"""The inference step as a function of a batch's folder: each shard not committed yet run on the engine (or answered
from the answer store) and committed atomically, its progress and ETA reported. The lifecycle's shard_results and a
table batch's asset both run it."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import dagster as dg
from sqlalchemy.orm import Session

from batch_dagster.batchfile import contract as c
from batch_dagster.batchfile.columnar import read_shard
from batch_dagster.batchfile.failure import COST_LIMIT, ERROR_RATE, breaker_tripped, public
from batch_dagster.batchfile.folder import BatchFolder, Progress
from batch_dagster.batchfile.options import BatchOptions
from batch_dagster.batchfile.results import CommittedShard, commit_shard, committed_shards, progress_of
from batch_dagster.batchfile.shard import OutputShares, running_order
from batch_dagster.batchfile.structured import asks_structured
from batch_dagster.db.lifecycle import record_usage
from batch_dagster.defs.dagster_internals import dies_with_its_run
from batch_dagster.defs.resources import PipelineConfig, VLLMResource
from batch_dagster.engine.base import EngineCrash
from batch_dagster.features.cost_cap import cap_reached
from batch_dagster.features.egress import Allow
from batch_dagster.features.eta import RunningEta
from batch_dagster.features.images import ImageFetcher
from batch_dagster.features.quotas import store_while_running
from batch_dagster.features.reuse import AnswerStore, keep, look_up, model_identity
from batch_dagster.features.scope import salted, scope

from .steps import batch_owner, batch_request, manifest_of

INFERENCE_RETRIES = 2  # an engine crash: the step's third attempt ends the shard in engine_error lines
STEP_RETRIES = 6


def step_retries(retry_delay_s: float) -> dg.RetryPolicy:
    """Every step of a batch, inference included, is tried again after a failure, `retry_delay_s` later and then
    doubling, 6 times (about 2 minutes at the default 2 s): long enough for a store that went away (a full disk,
    S3 unreachable) to come back. Each step writes whole files atomically, so a retry starts from what was
    committed. An engine crash is given INFERENCE_RETRIES of them (_run_shard)."""
    return dg.RetryPolicy(max_retries=STEP_RETRIES, delay=retry_delay_s, backoff=dg.Backoff.EXPONENTIAL)


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
            try:  # live counts only: a store that blinks must not throw away the shard's answers
                self.folder.write_progress(replace(self.base, shard=self.index, done=self.done,
                                                   updated_at=time.time()))
            except Exception as exc:
                if self.log is not None:
                    self.log.warning(f"Shard {self.index}: progress not written ({exc}); the shard goes on")
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


def image_fetcher(folder: BatchFolder, pipeline: PipelineConfig, session: Session | None,
                  owner: str) -> ImageFetcher:
    """The batch's image fetcher: its images kept count against its owner's stored bytes (with a store)."""
    def count(nbytes: int) -> str | None:
        assert session is not None
        return store_while_running(session, owner, folder.batch_id, nbytes, pipeline.key_max_stored_bytes)

    return ImageFetcher(folder, pipeline.image_sources, Allow.parse(pipeline.fetch_allow),
                        budget_bytes=pipeline.image_budget_bytes, budget_s=pipeline.image_budget_s,
                        keep=count if session is not None and owner else None)


def _over_cost_cap(session: Session | None, folder: BatchFolder, options: BatchOptions, model: str,
                   committed: dict[int, CommittedShard], pipeline: PipelineConfig) -> bool:
    """Whether the batch's spend has reached its cost cap; the store's transaction ends here, so none is held while a
    shard runs."""
    reached = cap_reached(session, folder.batch_id, options, model, committed.values(), pipeline.prices(),
                          pipeline.key_daily_budget, folder.completion_window())
    if session is not None:
        session.commit()
    return reached


def _eta_observation(context: dg.AssetExecutionContext, eta: RunningEta, done: int) -> dg.AssetObservation:
    """The inference step's own ETA once `done` requests in all have finished: its progress blended with its
    estimate's work at the estimate's rate (features/eta.py RunningEta)."""
    now = time.time()
    left = eta.remaining_s(done, now) or 0.0
    partition = context.partition_key if context.has_partition_key else None  # a table batch's may have none
    return dg.AssetObservation(asset_key=context.asset_key, partition=partition, metadata={
        "queue_position": 0, "requests_done": done, "fraction_done": round(done / eta.total, 4),
        "estimated_completion_at": dg.MetadataValue.timestamp(now + left)})


def _run_shard(context: dg.AssetExecutionContext, vllm: VLLMResource, model: str, endpoint: str, engine: Any,
               requests: list[tuple[str, dict[str, Any]]], progress: ShardProgress, index: int) -> tuple[Any, list]:
    """A shard's requests run on the engine (built now if it is not yet): (the engine, their lines). An engine crash
    retries the step until its last attempt, whose shard then ends in engine_error lines."""
    engine = engine or vllm.engine(model)
    try:
        return engine, engine.run(endpoint, requests, on_progress=progress)
    except EngineCrash as exc:
        vllm.reset(model)
        if context.retry_number < INFERENCE_RETRIES:
            context.log.error(f"Shard {index}: engine crashed ({exc}); the step will retry")
            raise
        context.log.error(f"Shard {index}: engine crashed on the last attempt; its requests become errors")
        return vllm.engine(model), engine_error_lines(requests, public(str(exc)))


def infer(context: dg.AssetExecutionContext, folder: BatchFolder, vllm: VLLMResource, pipeline: PipelineConfig,
          session: Session | None) -> Inference:
    """Run each shard not committed yet on the engine and commit it atomically; a shard's requests whose answers
    the answer store holds are taken from it instead (when the batch reuses answers).

    A stop (cancel, expiry, the cost cap) ends the loop before the next shard. With a store (`session`), what the
    batch has spent is recorded there after each shard, where other batches' cost caps read it."""
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
    request = batch_request(session, folder)
    options = request.options.resolved(pipeline.option_defaults())  # the batch's own, else the operator's
    store = AnswerStore(folder.storage, pipeline.answer_store_bytes) if options.reuse else None
    identity = model_identity(vllm.model_record(manifest.model)) if store is not None else {}
    owner = batch_owner(session, request)
    # Whose answers and prompt prefixes the batch's requests may meet: its owner's, unless the operator shares them.
    where = scope(owner, pipeline.shared_owners, folder.batch_id)
    images = image_fetcher(folder, pipeline, session, owner.id) if vllm.spec(manifest.model).images_per_request \
        else None
    started = time.perf_counter()
    ran_requests = ran_tokens = 0
    written = OutputShares()  # how much of the output asked each prefix group writes, over the shards run
    stopped = None
    eta = RunningEta.of(folder.estimate(), manifest.total_requests, sum(s.request_counts.total for s in done.values()))
    with dies_with_its_run(context), stops_when_terminated(context):
        for index in todo:
            stopped = folder.stop_reason()
            if not stopped and _over_cost_cap(session, folder, options, manifest.model, done, pipeline):
                folder.request_stop(COST_LIMIT)  # as a cancel stops it: the status follows from the files
                stopped = COST_LIMIT
            if not stopped and breaker_tripped(done.values(), pipeline.error_breaker_lines, options.error_breaker_rate):
                folder.request_stop(ERROR_RATE)  # no more engine time for a batch whose lines nearly all fail
                stopped = ERROR_RATE
            if stopped:
                context.log.warning(f"Batch {stopped}: shard {index} and later are not run")
                break
            with folder.storage.local_copy(folder.shard_key(index)) as shard:
                requests = read_shard(shard)
            t0 = time.perf_counter()
            progress = ShardProgress(folder, base, index, len(requests), context.log)
            # Images named by URL, fetched once per batch (a request whose image cannot be had is its 400 line), are
            # named by their content's hash from here on: what the answer store keys them by.
            fetched, unfetched = images.fetch(manifest.endpoint, requests) if images else (requests, [])
            if unfetched:
                progress(len(unfetched))
            reuse = look_up(store, where, identity, manifest.endpoint, fetched) if store is not None else None
            to_run = reuse.to_run if reuse is not None else fetched
            lines: list[dict[str, Any]] = []
            if reuse is not None and reuse.lines:
                progress(len(reuse.lines))
            if to_run:
                # Shared prefixes together, the longest work first, as the earlier shards wrote; each request salted
                # with its scope's cache_salt, so that no prefix-cache hit crosses owners.
                sent = salted(to_run, where, pipeline.cache_salt_secret)
                sent = [sent[i] for i in running_order(manifest.endpoint, sent, written.shares())]
                for group in images.inlined(manifest.endpoint, sent) if images else [sent]:
                    engine, ran = _run_shard(context, vllm, manifest.model, manifest.endpoint, engine, group,
                                             progress, index)
                    lines += ran
            lines += unfetched
            if reuse is not None and store is not None:
                keep(store, reuse, lines)  # before the commit: a retry finds them even if this process dies now
                twins = reuse.twin_lines(lines)  # the same request again in the shard: the same answer
                if twins:
                    progress(len(twins))
                lines += reuse.lines + twins
            written.add(manifest.endpoint, requests, lines)
            structured = {cid for cid, body in requests if asks_structured(manifest.endpoint, body)}
            committed = commit_shard(folder.storage, folder.results_prefix, index, lines, time.perf_counter() - t0,
                                     engine_start_s=vllm.engine_start_s(manifest.model, t0), structured=structured)
            done[index] = committed
            base = progress_of(done, manifest.total_requests, manifest.shard_count)  # after the marker
            folder.write_progress(base)
            if session is not None:  # what the batch has spent, where other batches' cost caps read it
                record_usage(session, folder.batch_id, base.usage)
            context.log_event(_eta_observation(context, eta, sum(s.request_counts.total for s in done.values())))
            ran_requests += committed.request_counts.total
            ran_tokens += committed.usage.output_tokens
            counts, reused = committed.request_counts, f", {committed.reused} reused" if committed.reused else ""
            context.log.info(f"Shard {index}: {counts.completed} completed{reused}, {counts.failed} failed, "
                             f"{committed.usage.output_tokens} output tokens in {committed.duration_s:.1f}s")
    return Inference(
        shards_run=len(todo), shards_skipped=manifest.shard_count - len(todo),
        completed=sum(s.request_counts.completed for s in done.values()),  # those committed before, and now
        failed=sum(s.request_counts.failed for s in done.values()), reused=sum(s.reused for s in done.values()),
        requests_run=ran_requests, elapsed_s=time.perf_counter() - started, output_tokens=ran_tokens,
        stopped=stopped)
