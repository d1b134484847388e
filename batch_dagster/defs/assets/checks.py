"""Asset checks that guard the batch contract: unique ids in, every id exactly once out, usage true."""

import warnings
from collections import Counter

import dagster as dg
import pyarrow.compute as pc
import pyarrow.parquet as pq

from batch_dagster.batchfile.contract import is_billed
from batch_dagster.batchfile.results import iter_lines
from batch_dagster.batchfile.usage import Usage
from batch_dagster.defs.partitions import batches
from batch_dagster.defs.resources import StorageResource

# Partitioned asset checks are a preview API in Dagster 1.13; each batch is checked on its own.
warnings.filterwarnings("ignore", category=dg.PreviewWarning, message=".*partitions_def on an AssetCheckSpec.*")


@dg.asset_check(asset="validated_requests", partitions_def=batches, blocking=True)
def unique_custom_ids(context: dg.AssetCheckExecutionContext, storage: StorageResource) -> dg.AssetCheckResult:
    """No custom_id appears twice among the validated requests."""
    folder = storage.folder(context.partition_key)
    with folder.storage.local_copy(folder.requests_key) as requests:
        ids = pq.read_table(requests, columns=["custom_id"])["custom_id"]
    distinct = pc.count_distinct(ids).as_py()
    return dg.AssetCheckResult(passed=distinct == len(ids), metadata={"requests": len(ids), "distinct": distinct})


@dg.asset_check(asset="batch_output_files", partitions_def=batches, blocking=True)
def every_custom_id_exactly_once(
    context: dg.AssetCheckExecutionContext, storage: StorageResource
) -> dg.AssetCheckResult:
    """Every input custom_id is in the output file or the error file, exactly once, and nothing else is."""
    folder = storage.folder(context.partition_key)
    with folder.storage.local_copy(folder.requests_key) as requests:
        expected = pq.read_table(requests, columns=["custom_id"])["custom_id"].to_pylist()
    seen = Counter(line["custom_id"] for key in (folder.output_key, folder.error_key)
                   for line in iter_lines(folder.storage, key))
    missing = [cid for cid in expected if cid not in seen]
    duplicated = [cid for cid, n in seen.items() if n > 1]
    unexpected = len(set(seen) - set(expected))
    return dg.AssetCheckResult(
        passed=not (missing or duplicated or unexpected),
        metadata={
            "expected": len(expected),
            "found": sum(seen.values()),
            "missing": len(missing),
            "duplicated": len(duplicated),
            "unexpected": unexpected,
            "examples": ", ".join((missing + duplicated)[:5]) or "none",
        },
    )


@dg.asset_check(asset="batch_usage", partitions_def=batches)
def usage_equals_output_lines(context: dg.AssetCheckExecutionContext, storage: StorageResource) -> dg.AssetCheckResult:
    """The batch's usage totals equal the sums over the output file's billed lines (a reused answer is not billed)."""
    folder = storage.folder(context.partition_key)
    summed = Usage()
    for line in iter_lines(folder.storage, folder.output_key):
        if is_billed(line):
            summed.add_body(line["response"]["body"])
    summary = folder.summary()
    recorded = summary.usage if summary else None
    return dg.AssetCheckResult(
        passed=summed == recorded,
        metadata={
            "summed_total_tokens": summed.total_tokens,
            "recorded_total_tokens": recorded.total_tokens if recorded else -1,
        },
    )


lifecycle_checks = [unique_custom_ids, every_custom_id_exactly_once, usage_equals_output_lines]
