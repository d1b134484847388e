"""What a feature does around each shard of a batch, through one narrow interface (`ShardFeature`): before a shard
(whether the batch stops there), on the shard's requests on their way to the engine and their lines back, and after
the shard is committed.

The inference step's loop (defs/assets/inference.py) calls a batch's features in order; each feature's own code is in
its module (cost_cap.py, breaker.py, images.py, reuse.py, scope.py, eta.py), and the one every batch runs with,
the running order, is here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from batch_dagster.batchfile.columnar import read_shard
from batch_dagster.batchfile.folder import BatchFolder
from batch_dagster.batchfile.results import CommittedShard, commit_shard
from batch_dagster.batchfile.shard import OutputShares, running_order
from batch_dagster.batchfile.structured import expectations

Request = tuple[str, dict[str, Any]]
Line = dict[str, Any]
Run = Callable[[list[Request]], list[Line]]  # requests in, their lines out


def _uncounted(n: int) -> None:
    pass


@dataclass
class Shard:
    """One shard as the loop runs it: its index, its requests as its file holds them, what counts its requests as
    they are answered (a feature that answers some itself counts them), and its lines once run."""

    index: int
    requests: list[Request]
    progress: Callable[[int], None] = _uncounted
    lines: list[Line] = field(default_factory=list)

    @classmethod
    def read(cls, folder: BatchFolder, index: int) -> Shard:
        """Shard `index` of the batch in `folder`, its requests read from its file."""
        with folder.storage.local_copy(folder.shard_key(index)) as path:
            return cls(index, read_shard(path))

    def commit(self, folder: BatchFolder, endpoint: str, duration_s: float, engine_start_s: float) -> CommittedShard:
        """Its lines committed atomically, its marker last (batchfile/results.py commit_shard)."""
        return commit_shard(folder.storage, folder.results_prefix, self.index, self.lines, duration_s,
                            engine_start_s=engine_start_s, structured=expectations(endpoint, self.requests))


class ShardFeature:
    """A feature's part in running a batch's shards. Each method's default does nothing."""

    def before(self, done: Mapping[int, CommittedShard]) -> str | None:
        """Before a shard, given the shards committed so far: a reason for the batch to stop here, or None."""
        return None

    def run(self, shard: Shard, requests: list[Request], then: Run) -> list[Line]:
        """The shard's requests on their way to the engine (`then` runs those passed on) and their lines back."""
        return then(requests)

    def after(self, shard: Shard, done: Mapping[int, CommittedShard]) -> None:
        """Once the shard is committed (`done`: every committed shard of the batch, this one included)."""


def stop_before(folder: BatchFolder, features: Sequence[ShardFeature], done: Mapping[int, CommittedShard]
                ) -> str | None:
    """Why the batch stops before its next shard: a stop its folder holds (a cancel, its deadline), else the first
    feature's reason, written to the folder as a cancel is (the batch's status follows from its files); None: it
    goes on."""
    if stopped := folder.stop_reason():
        return stopped
    reason = next((reason for feature in features if (reason := feature.before(done))), None)
    if reason:
        folder.request_stop(reason)
    return reason


def run_through(features: Sequence[ShardFeature], shard: Shard, engine: Run) -> list[Line]:
    """The shard's lines: its requests passed through each feature in order, the last passing them to `engine`."""
    def step(i: int) -> Run:
        return engine if i == len(features) else lambda requests: features[i].run(shard, requests, step(i + 1))

    return step(0)(shard.requests)


def after_shard(features: Sequence[ShardFeature], shard: Shard, done: Mapping[int, CommittedShard]) -> None:
    for feature in features:
        feature.after(shard, done)


class RunningOrder(ShardFeature):
    """Every batch's: a shard's requests sent with shared prefixes together and the longest work first, each group's
    max_tokens weighed by what its requests in the earlier shards wrote (batchfile/shard.py running_order)."""

    def __init__(self, endpoint: str):
        self.endpoint, self.written = endpoint, OutputShares()

    def run(self, shard: Shard, requests: list[Request], then: Run) -> list[Line]:
        return then([requests[i] for i in running_order(self.endpoint, requests, self.written.shares())])

    def after(self, shard: Shard, done: Mapping[int, CommittedShard]) -> None:
        self.written.add(self.endpoint, shard.requests, shard.lines)
