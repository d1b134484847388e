"""Sensors that connect the HTTP API to the pipeline: launch the batches it accepts, follow their runs."""

from __future__ import annotations

import json
import time
from collections.abc import Collection, Sequence
from dataclasses import asdict, dataclass, field, fields
from datetime import UTC, datetime

import dagster as dg
from sqlalchemy.orm import Session

from batch_dagster.batchfile.failure import keep_finished, public
from batch_dagster.batchfile.folder import BatchFolder
from batch_dagster.batchfile.status import TERMINAL, BatchStatus
from batch_dagster.batchfile.storage import Storage
from batch_dagster.db import BatchRecord, repo
from batch_dagster.db.lifecycle import sync_batch, sync_progress
from batch_dagster.defs.cli_runs import CLI_GONE, cli_process_gone
from batch_dagster.defs.dagster_internals import run_end_reason, worker_gone
from batch_dagster.defs.fairness import PRIORITY_TAG, with_launch_order
from batch_dagster.defs.jobs import batch_job
from batch_dagster.defs.partitions import batches
from batch_dagster.defs.resources import DatabaseResource, PipelineConfig, StorageResource, VLLMResource
from batch_dagster.defs.run_tags import OWNER_TAG, input_filenames, run_tags
from batch_dagster.defs.sensor_timing import timed
from batch_dagster.features.eta import set_launch_priorities

PARTITION_TAG = "dagster/partition"
RETRY_NUMBER_TAG = "dagster/retry_number"
WILL_RETRY_TAG = "dagster/will_retry"
# A batch marked launched with no run after this long (the tick's runs were lost) is requested again;
# the run key keeps Dagster from running it twice.
RELAUNCH_AFTER_S = 120
# Dagster tags a failed run `will_retry` just after it marks it failed; until then (at most this long)
# the sensor waits rather than failing a batch that run retries are about to resume.
RETRY_DECISION_WAIT_S = 60
# How long the sensor keeps trying to keep a failed run's finished work while the storage fails (an S3 outage): the
# batch stays in its status meanwhile, then ends failed without its files (the error log says so).
KEEP_FINISHED_FOR_S = 3600
MAX_FAILURE_CHARS = 1000  # of a step's error message, as a failed batch's errors.data shows it
# The status sensor follows the runs changed since its cursor (the run storage's update times), reads one progress
# document per batch whose run goes on, and walks every active batch only in a sweep, for what no run change shows:
# a launch with no run, a change it missed. A pass starts every SWEEP_EVERY_S and sweeps SWEEP_CHUNK batches a tick.
SWEEP_EVERY_S = 60
SWEEP_CHUNK = 500
# Runs changed this long before the cursor are read again: Dagster stores a run's creation time to the second, and
# a write can commit after a later one. Following a batch again changes nothing.
RUN_CURSOR_OVERLAP_S = 5.0
CHANGED_RUNS_PER_TICK = 5000  # past it, the rest waits for the next tick (and a sweep pass starts)
# Batches followed whole (a run that changed, the sweep's) once a tick has taken this long wait for the next tick, so
# a burst of runs that all start at once (thousands) spreads over ticks, each under 2 s (issue #19's goal).
FOLLOW_BUDGET_S = 1.5
MIN_FOLLOWED_PER_TICK = 50  # whatever the time: each tick moves this many at least
WATCH_LIMIT = 1000  # batches the cursor names to follow again (past it, the sweep does)
_ENDED_BADLY = (dg.DagsterRunStatus.FAILURE, dg.DagsterRunStatus.CANCELED)
_NOT_STARTED = (dg.DagsterRunStatus.NOT_STARTED, dg.DagsterRunStatus.QUEUED)
_RUNNING = (dg.DagsterRunStatus.STARTING, dg.DagsterRunStatus.STARTED)
WORKER_GONE = ("The run's worker is gone with the code server that started it "
               "(serve was stopped or killed while it ran).")


def _gone(run: dg.DagsterRun) -> str | None:
    """Why an unfinished run's process is gone with nothing left to mark it failed, if it is."""
    if worker_gone(run):
        return WORKER_GONE
    if cli_process_gone(run):
        return CLI_GONE
    return None


def _runs_filter(batch_id: str) -> dg.RunsFilter:
    return dg.RunsFilter(job_name=batch_job.name, tags={PARTITION_TAG: batch_id})


def run_key(instance: dg.DagsterInstance, batch_id: str) -> str:
    """The batch id for its first run; `<batch id>:<n>` when the batch already has n-1 runs (relaunched)."""
    runs = instance.get_runs_count(_runs_filter(batch_id))
    return batch_id if runs == 0 else f"{batch_id}:{runs + 1}"


@dg.sensor(
    job=batch_job,
    minimum_interval_seconds=1,
    default_status=dg.DefaultSensorStatus.RUNNING,
    description="Adds each batch created through the API as a partition and runs batch_job for it.",
)
@timed
def api_batch_sensor(context: dg.SensorEvaluationContext, database: DatabaseResource,
                     vllm: VLLMResource) -> dg.SensorResult | dg.SkipReason:
    with database.session() as session:
        rows = repo.batches_to_launch(session)
        if not rows:
            return dg.SkipReason("No new batches.")
        waiting = [b.id for b in rows]
        repo.mark_launched(session, waiting)
        # The run waits in the run queue by the model its batch recorded at creation.
        filenames = input_filenames(session, rows)
        labels = database.labels()
        tags = [run_tags(b.id, way_in="api", filename=filenames.get(b.id), owner=b.owner, model=b.model,
                         vllm=vllm, labels=labels) for b in rows]
        priorities = [b.options.priority for b in rows]
        deadlines = [b.expires_at for b in rows]
    # Higher priority first, then the earlier deadline; among equals, oldest first and owners interleaved: the run
    # queue launches by these.
    tags = with_launch_order(context.instance, batch_job.name, tags, OWNER_TAG, priorities, deadlines)
    with database.session() as session:  # each batch's place in the launch order, for its queue_position
        set_launch_priorities(session, {b: int(t[PRIORITY_TAG]) for b, t in zip(waiting, tags, strict=True)})
    context.log.info(f"Launching {len(waiting)} batch(es): {', '.join(waiting)}")
    return dg.SensorResult(
        run_requests=[
            dg.RunRequest(partition_key=batch_id, run_key=run_key(context.instance, batch_id), tags=t)
            for batch_id, t in zip(waiting, tags, strict=True)
        ],
        dynamic_partitions_requests=[batches.build_add_request(waiting)],
    )


def run_failure_message(instance: dg.DagsterInstance, run: dg.DagsterRun) -> str:
    """The first step failure of a run, else how the run ended (e.g. its process was killed)."""
    retries = run.tags.get(RETRY_NUMBER_TAG)
    where = f"Dagster run {run.run_id}" + (f", retry {retries}" if retries else "")
    for record in instance.get_records_for_run(run.run_id, of_type=dg.DagsterEventType.STEP_FAILURE).records:
        event = record.event_log_entry.dagster_event
        if event is None or event.step_failure_data is None:
            continue
        error = event.step_failure_data.error
        if error is not None:
            while error.cause is not None:  # the step error wraps what the code raised
                error = error.cause
            # Cut, and without the deployment's addresses and paths: the message may quote anything, and the batch
            # object lists it.
            message = public(error.message.strip())[:MAX_FAILURE_CHARS]
            return f"The pipeline failed in step {event.step_key}: {message} ({where})"
    verb = "was canceled" if run.status == dg.DagsterRunStatus.CANCELED else "failed"
    reason = run_end_reason(instance, run)
    return f"The pipeline run {verb} ({where})" + (f": {public(reason)}" if reason else "; see the Dagster UI.")


def _run_retry_pending(instance: dg.DagsterInstance, run: dg.DagsterRun) -> bool:
    """Whether Dagster's run retries (dagster.yaml `run_retries`) will still run this failed run again."""
    if run.is_complete_and_waiting_to_retry:
        return True
    if run.status != dg.DagsterRunStatus.FAILURE or not instance.run_retries_enabled or WILL_RETRY_TAG in run.tags:
        return False
    record = instance.get_run_record_by_id(run.run_id)
    ended = record.end_time if record and record.end_time else None
    return ended is None or repo.now() - ended < RETRY_DECISION_WAIT_S


def _keep_again(instance: dg.DagsterInstance, run: dg.DagsterRun) -> bool:
    """Whether a failed run's finished work is still worth trying to keep: its run ended under
    KEEP_FINISHED_FOR_S ago."""
    record = instance.get_run_record_by_id(run.run_id)
    ended = record.end_time if record and record.end_time else None
    return ended is None or repo.now() - ended < KEEP_FINISHED_FOR_S


def latest_runs(instance: dg.DagsterInstance, batch_ids: Collection[str], chunk: int = 500) -> dict[str, dg.DagsterRun]:
    """The latest run of each of `batch_ids` that has one: one run query per `chunk` batches."""
    ids, latest = sorted(batch_ids), dict[str, dg.DagsterRun]()
    for i in range(0, len(ids), chunk):
        # Newest first (by storage id): the first run seen of a partition is its latest.
        for run in instance.get_runs(dg.RunsFilter(job_name=batch_job.name, tags={PARTITION_TAG: ids[i:i + chunk]})):
            latest.setdefault(run.tags.get(PARTITION_TAG, ""), run)
    return latest


def _follow(context: dg.SensorEvaluationContext, session: Session, folders: Storage, batch: BatchRecord,
            run: dg.DagsterRun | None, followed: set[str], pipeline: PipelineConfig) -> bool:
    """Bring one batch up to date with its latest run (each change of its status committed by itself).
    True when it waits on Dagster (a run retry to be decided), to be followed again next tick."""
    instance = context.instance
    if run is None:
        # active_batches() returns launched batches only: launched_at is set (the check narrows its type).
        if batch.launched_at is not None and repo.now() - batch.launched_at > RELAUNCH_AFTER_S:
            context.log.warning(f"{batch.id}: no run since it was launched; requesting it again")
            repo.unmark_launched(session, batch.id)
        return False
    followed.add(run.run_id)
    if run.status in _NOT_STARTED:
        # Nothing of this run is in the folder yet, and its start is a change the cursor sees. Its id is stored with
        # the tick's other waiting runs' (a burst of thousands), in one commit.
        batch.run_id = run.run_id
        return False
    if batch.run_id != run.run_id:
        batch.run_id = run.run_id
        session.commit()
    sync_batch(session, folders, batch)
    if batch.status not in TERMINAL and (gone := _gone(run)):
        context.log.warning(f"{batch.id}: run {run.run_id}: {gone} Marking it failed")
        instance.report_run_failed(run, gone)
        return False  # a change of its run: next tick, Dagster retries it (dagster.yaml run_retries), or it fails
    if run.status in _ENDED_BADLY and batch.status not in TERMINAL:
        # A retried run is a new run of the same partition: a later tick follows that one.
        if _run_retry_pending(instance, run):
            context.log.info(f"{batch.id}: run {run.run_id} failed; Dagster will retry it")
            return True
        failure = run_failure_message(instance, run)
        try:
            keep_finished(BatchFolder(folders, batch.id), failure, pipeline.prices())  # read when one is needed
        except Exception as exc:
            if _keep_again(instance, run):  # a storage outage passes: what the run finished is kept next tick
                context.log.warning(f"{batch.id}: could not keep what its run finished yet ({str(exc)[:500]}); "
                                    "trying again next tick")
                return True
            context.log.error(f"{batch.id}: could not keep what its run finished ({str(exc)[:500]}) for "
                              f"{KEEP_FINISHED_FOR_S} s; it ends without its files")
        sync_batch(session, folders, batch, run_failure=failure)
    return False


def _follow_progress(context: dg.SensorEvaluationContext, session: Session, folders: Storage, batch: BatchRecord,
                     run: dg.DagsterRun, followed: set[str]) -> None:
    """A batch whose run goes on unchanged: its counts from its progress document (or, validating, its validation
    report): one read, whatever its shard count. Its run is checked for a process gone with nothing to say so."""
    followed.add(run.run_id)
    if batch.status == BatchStatus.VALIDATING:
        sync_batch(session, folders, batch)
    else:
        sync_progress(session, folders, batch)
    if batch.status not in TERMINAL and (gone := _gone(run)):
        context.log.warning(f"{batch.id}: run {run.run_id}: {gone} Marking it failed")
        instance = context.instance
        instance.report_run_failed(run, gone)


@dataclass
class StatusCursor:
    """Where the status sensor is: the runs it has seen change, its sweep over every active batch, and the batches
    it follows again whatever their runs do (one that could not be brought up to date, one waiting on a retry)."""

    runs_after: float | None = None  # the latest update time (epoch s) of the runs seen; None: not read yet
    swept_at: float = 0.0  # when the last sweep pass started (epoch s)
    sweep_after: int | None = None  # the pk of the last batch the pass under way swept; None: no pass under way
    watch: list[str] = field(default_factory=list)

    @classmethod
    def parse(cls, text: str | None) -> StatusCursor:
        """The cursor a tick stored (none, or one it cannot read: from scratch, which starts with a sweep)."""
        try:
            data = json.loads(text) if text else {}
            return cls(**{k: v for k, v in data.items() if k in {f.name for f in fields(cls)}})
        except (ValueError, TypeError):
            return cls()

    def dumps(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))


def changed_runs(instance: dg.DagsterInstance, after: float | None) -> tuple[list[dg.RunRecord], float, bool]:
    """batch_job's runs changed since `after` (from RUN_CURSOR_OVERLAP_S before it), oldest change first; the latest
    change time seen; whether there were more than a tick reads. With no `after`: none, and the latest change time
    of all (a sweep then follows every batch once)."""
    if after is None:
        records = instance.get_run_records(dg.RunsFilter(job_name=batch_job.name), limit=1, order_by="update_timestamp")
        return [], records[0].update_timestamp.timestamp() if records else 0.0, False
    since = datetime.fromtimestamp(max(after - RUN_CURSOR_OVERLAP_S, 0.0), tz=UTC)
    records = list(instance.get_run_records(dg.RunsFilter(job_name=batch_job.name, updated_after=since),
                                            limit=CHANGED_RUNS_PER_TICK, order_by="update_timestamp", ascending=True))
    latest = max([after, *(r.update_timestamp.timestamp() for r in records)])
    return records, latest, len(records) >= CHANGED_RUNS_PER_TICK


@dataclass
class TickPlan:
    """Which batches a status tick brings up to date, and how: `whole` ones with their latest runs (their runs changed,
    they are watched or swept, or their run is not the one going on), the others by their run's progress document."""

    found: dict[str, BatchRecord]  # every batch the tick looks at, by id
    whole: set[str]
    latest: dict[str, dg.DagsterRun]  # of the batches followed whole, their latest run (none: no run yet)
    going_on: dict[tuple[str, str | None], dg.DagsterRun]  # the runs going on, by (batch id, run id)
    newest: dict[str, dg.RunRecord]  # of each batch whose runs changed, its newest changed run
    swept: list[BatchRecord]  # the sweep's chunk this tick, by pk
    sweep_from: int | None  # the pk the sweep's chunk started after (None: no pass under way)

    def in_order(self) -> list[BatchRecord]:
        """Those followed whole first (oldest first), then the progress reads: the budget never starves an end."""
        return sorted(self.found.values(), key=lambda b: (b.id not in self.whole, b.pk))


def plan_tick(instance: dg.DagsterInstance, session: Session, cursor: StatusCursor, changed: list[dg.RunRecord],
              running: Sequence[dg.DagsterRun]) -> TickPlan:
    """The tick's batches from the runs changed since the cursor, the runs going on, the watch list and the sweep
    (whose place it moves on in `cursor`)."""
    newest = dict[str, dg.RunRecord]()
    for record in changed:
        batch_id = record.dagster_run.tags.get(PARTITION_TAG, "")
        if batch_id not in newest or record.storage_id > newest[batch_id].storage_id:
            newest[batch_id] = record
    whole = newest.keys() | set(cursor.watch)
    going_on: dict[tuple[str, str | None], dg.DagsterRun] = {
        (r.tags.get(PARTITION_TAG, ""), r.run_id): r for r in running}
    swept, sweep_from = list[BatchRecord](), cursor.sweep_after
    if cursor.sweep_after is not None:
        swept = repo.active_batches(session, limit=SWEEP_CHUNK, after=cursor.sweep_after)
        cursor.sweep_after = swept[-1].pk if len(swept) == SWEEP_CHUNK else None
    found = {b.id: b for b in swept}
    others = (whole | {batch_id for batch_id, _ in going_on}) - found.keys()
    found.update((b.id, b) for b in repo.active_batches_by_id(session, others))
    swept_ids = {b.id for b in swept}
    whole |= swept_ids
    whole |= {b.id for b in found.values() if b.id not in whole and (b.id, b.run_id) not in going_on}
    # A batch's newest changed run is its latest when it is the one it records (a later one would have changed
    # since too); the others' latest runs are queried, in one query per 500.
    known = {b.id: newest[b.id].dagster_run for b in found.values()
             if b.id in newest and newest[b.id].dagster_run.run_id == b.run_id and b.id not in swept_ids}
    latest = {**latest_runs(instance, (whole & found.keys()) - known.keys()), **known}
    return TickPlan(found, whole, latest, going_on, newest, swept, sweep_from)


@dataclass
class TickDone:
    """What following a plan did: status changes, the runs seen, the batches to watch and those left for later."""

    moved: int = 0
    followed: set[str] = field(default_factory=set)  # run ids
    watch: list[str] = field(default_factory=list)
    postponed: list[BatchRecord] = field(default_factory=list)


def follow_plan(context: dg.SensorEvaluationContext, session: Session, folders: Storage, plan: TickPlan,
                pipeline: PipelineConfig, started_at: float) -> TickDone:
    """Each planned batch brought up to date; past FOLLOW_BUDGET_S (and MIN_FOLLOWED_PER_TICK), the batches to follow
    whole are postponed."""
    done, followed_whole = TickDone(), 0
    for batch in plan.in_order():
        batch_id, before, whole = batch.id, batch.status, batch.id in plan.whole
        if whole and followed_whole >= MIN_FOLLOWED_PER_TICK and time.time() - started_at > FOLLOW_BUDGET_S:
            done.postponed.append(batch)
            continue
        followed_whole += whole
        try:
            if whole:
                if _follow(context, session, folders, batch, plan.latest.get(batch_id), done.followed, pipeline):
                    done.watch.append(batch_id)
            else:
                _follow_progress(context, session, folders, batch, plan.going_on[(batch_id, batch.run_id)],
                                 done.followed)
        except Exception as exc:  # a value the store refuses, a damaged document: the other batches still move
            session.rollback()
            context.log.error(f"{batch_id}: could not be brought up to date ({str(exc)[:500]}); left as stored, "
                              "tried again on the next tick")
            done.watch.append(batch_id)
            continue
        if batch.status != before:
            done.moved += 1
            context.log.info(f"{batch_id}: {before} -> {batch.status}")
    return done


def next_cursor(cursor: StatusCursor, plan: TickPlan, done: TickDone, latest_change: float) -> StatusCursor:
    """Where the next tick starts. The postponed batches are taken up again: the changed runs from the earliest one
    not followed, the sweep from its first batch not swept, the watched ones still watched (a batch whose run started
    unseen is one again by itself). (Just before the earliest: the run storage's updated_after is strict.)"""
    watch = list(done.watch)
    if done.postponed:
        newest, swept_pks = plan.newest, {b.pk for b in plan.swept}
        latest_change = min([latest_change, *(newest[b.id].update_timestamp.timestamp() - 0.001
                                              for b in done.postponed if b.id in newest)])
        first_swept = min((b.pk for b in done.postponed if b.pk in swept_pks), default=None)
        if first_swept is not None:
            cursor.sweep_after = max([b.pk for b in plan.swept if b.pk < first_swept], default=plan.sweep_from)
        watch += [b.id for b in done.postponed if b.id in cursor.watch]
    cursor.runs_after, cursor.watch = latest_change, watch[:WATCH_LIMIT]
    return cursor


@dg.sensor(
    minimum_interval_seconds=1,
    default_status=dg.DefaultSensorStatus.RUNNING,
    description="Brings the API's batches up to date with their runs: progress, the end, and runs that failed "
    "for good (after Dagster's run retries; the batch keeps the shards they finished) or whose process is gone "
    f"with serve. Follows the runs that changed since its cursor; sweeps every active batch every {SWEEP_EVERY_S} s.",
)
@timed
def api_batch_status_sensor(
    context: dg.SensorEvaluationContext, database: DatabaseResource, storage: StorageResource,
    pipeline: PipelineConfig,
) -> dg.SkipReason:
    instance, folders = context.instance, storage.open()
    cursor, started_at = StatusCursor.parse(context.cursor), time.time()
    changed, latest_change, truncated = changed_runs(instance, cursor.runs_after)
    running = instance.get_runs(dg.RunsFilter(job_name=batch_job.name, statuses=list(_RUNNING)))
    if cursor.sweep_after is None and (cursor.runs_after is None or truncated
                                       or started_at - cursor.swept_at >= SWEEP_EVERY_S):
        cursor.sweep_after, cursor.swept_at = 0, started_at  # a pass starts: a launch with no run, a change missed
    with database.session() as session:
        plan = plan_tick(instance, session, cursor, changed, running)
        done = follow_plan(context, session, folders, plan, pipeline, started_at)
        session.commit()  # the ids of the runs waiting to start
    # A stopped serve leaves the runs of ended batches (backfills) STARTED too. Until marked failed they keep their
    # place in the run queue's limits (dagster.yaml), and offline runs would wait for them for ever.
    for run in running:
        if run.run_id not in done.followed and run.status == dg.DagsterRunStatus.STARTED and (gone := _gone(run)):
            context.log.warning(f"Run {run.run_id}: {gone} Marking it failed")
            instance.report_run_failed(run, gone)
    if done.postponed:
        context.log.info(f"{len(done.postponed)} batch(es) left for the next tick (this one took {FOLLOW_BUDGET_S} s)")
    context.update_cursor(next_cursor(cursor, plan, done, latest_change).dumps())
    return dg.SkipReason(f"{done.moved} batch(es) changed status.")
