"""The inference step as a function of a batch's folder: each shard not committed yet run through the batch's
features (features/shards.py) to the engine and committed atomically, its progress reported. The lifecycle's
shard_results and a table batch's asset both run it."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import dagster as dg
from sqlalchemy.orm import Session

from batch_dagster.batchfile import contract as c
from batch_dagster.batchfile.failure import public
from batch_dagster.batchfile.folder import BatchFolder, Manifest, Progress
from batch_dagster.batchfile.results import CommittedShard, committed_shards, progress_of
from batch_dagster.defs.dagster_internals import dies_with_its_run
from batch_dagster.defs.eta import EtaObservations
from batch_dagster.defs.resources import PipelineConfig, VLLMResource
from batch_dagster.engine.base import EngineCrash
from batch_dagster.features.breaker import ErrorBreaker
from batch_dagster.features.cost_cap import CostCap
from batch_dagster.features.egress import Allow
from batch_dagster.features.eta import RunningEta
from batch_dagster.features.images import FetchImages, ImageFetcher, SendImages
from batch_dagster.features.quotas import store_while_running
from batch_dagster.features.reuse import AnswerReuse, AnswerStore, model_identity
from batch_dagster.features.scope import Salt, scope
from batch_dagster.features.shards import (
    Line,
    Request,
    RunningOrder,
    Shard,
    ShardFeature,
    after_shard,
    run_through,
    stop_before,
)

from .steps import batch_owner, batch_request, manifest_of

INFERENCE_RETRIES = 2  # an engine crash: the step's third attempt ends the shard in engine_error lines
STEP_RETRIES = 6


def step_retries(retry_delay_s: float) -> dg.RetryPolicy:
    """Every step of a batch, inference included, is tried again after a failure, `retry_delay_s` later and then
    doubling, 6 times (about 2 minutes at the default 2 s): long enough for a store that went away (a full disk,
    S3 unreachable) to come back. Each step writes whole files atomically, so a retry starts from what was
    committed. An engine crash is given INFERENCE_RETRIES of them (ShardEngine)."""
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
class Ran:
    """What this step ran: its requests and the output tokens they wrote."""

    requests: int = 0
    output_tokens: int = 0
    started: float = field(default_factory=time.perf_counter)

    def add(self, context: dg.AssetExecutionContext, committed: CommittedShard) -> None:
        self.requests += committed.request_counts.total
        self.output_tokens += committed.usage.output_tokens
        counts, reused = committed.request_counts, f", {committed.reused} reused" if committed.reused else ""
        context.log.info(f"Shard {committed.index}: {counts.completed} completed{reused}, {counts.failed} failed, "
                         f"{committed.usage.output_tokens} output tokens in {committed.duration_s:.1f}s")


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

    @classmethod
    def of(cls, manifest: Manifest, todo: list[int], done: dict[int, CommittedShard], ran: Ran,
           stopped: str | None) -> Inference:
        return cls(shards_run=len(todo), shards_skipped=manifest.shard_count - len(todo),
                   completed=sum(s.request_counts.completed for s in done.values()),  # committed before, and now
                   failed=sum(s.request_counts.failed for s in done.values()),
                   reused=sum(s.reused for s in done.values()), requests_run=ran.requests,
                   elapsed_s=time.perf_counter() - ran.started, output_tokens=ran.output_tokens, stopped=stopped)

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


def infer(context: dg.AssetExecutionContext, folder: BatchFolder, vllm: VLLMResource, pipeline: PipelineConfig,
          session: Session | None) -> Inference:
    """Run each shard not committed yet through the batch's features to the engine, and commit it atomically.

    A stop (a cancel, the deadline, a feature's: the cost cap, the breaker) ends the loop before the next shard."""
    manifest = manifest_of(folder)
    done = committed_shards(folder.storage, folder.results_prefix)
    todo = [i for i in range(manifest.shard_count) if i not in done]
    context.log.info(f"{len(done)} of {manifest.shard_count} shards already committed; running {len(todo)} "
                     f"(attempt {context.retry_number + 1})")
    base = _progress_again(folder, manifest, done)
    features = shard_features(context, folder, vllm, pipeline, session, manifest, done)
    engine, ran, stopped = ShardEngine(context, vllm, manifest), Ran(), None
    with dies_with_its_run(context), stops_when_terminated(context):
        for index in todo:
            if stopped := stop_before(folder, features, done):
                context.log.warning(f"Batch {stopped}: shard {index} and later are not run")
                break
            shard, started = Shard.read(folder, index), time.perf_counter()
            shard.progress = ShardProgress(folder, base, index, len(shard.requests), context.log)
            shard.lines = run_through(features, shard, engine.runs(shard))
            done[index] = shard.commit(folder, manifest.endpoint, time.perf_counter() - started,
                                       vllm.engine_start_s(manifest.model, started))
            base = progress_of(done, manifest.total_requests, manifest.shard_count)  # after the marker
            folder.write_progress(base)
            after_shard(features, shard, done)
            ran.add(context, done[index])
    return Inference.of(manifest, todo, done, ran, stopped)


def _progress_again(folder: BatchFolder, manifest: Manifest, done: dict[int, CommittedShard]) -> Progress:
    """The progress document, rewritten from the committed shards before any runs: an attempt killed between a
    shard's marker and the document left it behind."""
    before = folder.progress()
    base = progress_of(done, manifest.total_requests, manifest.shard_count, before.committed_at if before else None)
    folder.write_progress(base)
    return base


def shard_features(context: dg.AssetExecutionContext, folder: BatchFolder, vllm: VLLMResource,
                   pipeline: PipelineConfig, session: Session | None, manifest: Manifest,
                   done: dict[int, CommittedShard]) -> list[ShardFeature]:
    """The features a batch's shards run through, in order (features/shards.py), from its request's options resolved
    once against the operator's defaults. With a store (`session`), what the batch spends is recorded there after
    each shard, where other batches' cost caps read it."""
    request = batch_request(session, folder)
    options = request.options.resolved(pipeline.option_defaults())  # the batch's own, else the operator's
    model, endpoint = manifest.model, manifest.endpoint
    # Whose answers and prompt prefixes the batch's requests may meet: its owner's, unless the operator shares them.
    owner = batch_owner(session, request)
    where = scope(owner, pipeline.shared_owners, folder.batch_id)
    images = image_fetcher(folder, pipeline, session, owner.id) if vllm.spec(model).images_per_request else None
    features: list[ShardFeature] = [
        CostCap(session, folder.batch_id, options, model, pipeline.prices(), pipeline.key_daily_budget,
                folder.completion_window()),
        ErrorBreaker(pipeline.error_breaker_lines, options)]
    if images is not None:
        features.append(FetchImages(images, endpoint))
    if options.reuse:
        store = AnswerStore(folder.storage, pipeline.answer_store_bytes)
        features.append(AnswerReuse(store, where, model_identity(vllm.model_record(model)), endpoint))
    features += [Salt(where, pipeline.cache_salt_secret), RunningOrder(endpoint)]
    if images is not None:
        features.append(SendImages(images, endpoint))
    eta = RunningEta.of(folder.estimate(), manifest.total_requests, sum(s.request_counts.total for s in done.values()))
    return [*features, EtaObservations(context, eta)]


def image_fetcher(folder: BatchFolder, pipeline: PipelineConfig, session: Session | None,
                  owner: str) -> ImageFetcher:
    """The batch's image fetcher: its images kept count against its owner's stored bytes (with a store)."""
    def count(nbytes: int) -> str | None:
        assert session is not None
        return store_while_running(session, owner, folder.batch_id, nbytes, pipeline.key_max_stored_bytes)

    return ImageFetcher(folder, pipeline.image_sources, Allow.parse(pipeline.fetch_allow),
                        budget_bytes=pipeline.image_budget_bytes, budget_s=pipeline.image_budget_s,
                        keep=count if session is not None and owner else None)


class ShardEngine:
    """The engine a batch's shards run on, built at the first shard that sends it a request (a stopped batch, or one
    whose answers are all reused, never loads the model). An engine crash retries the step until its last attempt,
    whose shard then ends in engine_error lines."""

    def __init__(self, context: dg.AssetExecutionContext, vllm: VLLMResource, manifest: Manifest):
        self.context, self.vllm, self.model, self.endpoint = context, vllm, manifest.model, manifest.endpoint
        self.engine: Any = None

    def runs(self, shard: Shard) -> Callable[[list[Request]], list[Line]]:
        """What runs `shard`'s requests (its progress counting them as they finish)."""
        return lambda requests: self._run(shard, requests)

    def _run(self, shard: Shard, requests: list[Request]) -> list[Line]:
        if not requests:
            return []
        self.engine = self.engine or self.vllm.engine(self.model)
        try:
            return self.engine.run(self.endpoint, requests, on_progress=shard.progress)
        except EngineCrash as exc:
            self.vllm.reset(self.model)
            if self.context.retry_number < INFERENCE_RETRIES:
                self.context.log.error(f"Shard {shard.index}: engine crashed ({exc}); the step will retry")
                raise
            self.context.log.error(f"Shard {shard.index}: engine crashed on the last attempt; its requests become "
                                   "errors")
            self.engine = self.vllm.engine(self.model)
            return engine_error_lines(requests, public(str(exc)))
