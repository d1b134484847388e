"""Results of a dropped file written back beside it: the last step of a batch that arrived by S3 or the inbox."""

import tempfile
from contextlib import ExitStack
from pathlib import Path

import dagster as dg
from dagster_aws.s3 import S3Resource

from batch_dagster.db import repo
from batch_dagster.db.batches import delivered_summary
from batch_dagster.defs.assets.batch import GROUP
from batch_dagster.defs.assets.dropped_tables import answered_table
from batch_dagster.defs.partitions import batches
from batch_dagster.defs.resources import DatabaseResource, StorageResource
from batch_dagster.storage.transfer import deliver


@dg.asset(
    partitions_def=batches,
    group_name=GROUP,
    kinds={"s3"},
    deps=["batch_usage"],
    description="The output file, error file and summary of a dropped file's batch (and a dropped table's answered "
    "table), written under the bucket's results prefix or the inbox's results folder (run once the batch has ended, "
    "however it ended).",
)
def delivered_results(
    context: dg.AssetExecutionContext, storage: StorageResource, database: DatabaseResource, s3: S3Resource
) -> dg.MaterializeResult:
    batch_id = context.partition_key
    with database.session() as session:
        found = repo.get_intake(session, batch_id)
        if found is None:
            raise dg.Failure(f"{batch_id} did not arrive as a dropped file: it has nowhere to deliver to.",
                             allow_retries=False)
        intake, batch = found
        folder = storage.folder(batch_id)
        keys = [key for key in (folder.output_key, folder.error_key) if folder.storage.exists(key)]
        summary = folder.summary()
        cost = summary.cost if summary else None
        names = [key.rsplit("/", 1)[-1] for key in keys]
        keys.append(folder.write_delivery_summary(delivered_summary(batch, intake, cost, names)))
        with ExitStack() as stack:
            files = {key.rsplit("/", 1)[-1]: stack.enter_context(folder.storage.local_copy(key)) for key in keys}
            answered = answered_table(folder, Path(stack.enter_context(tempfile.TemporaryDirectory())))
            if answered is not None:  # a dropped table's answers, in its own format, beside the other results
                files[answered.name] = answered
            written = deliver(files, intake.deliver_to, s3.get_client)
        repo.mark_delivered(session, batch_id)
    context.log.info(f"{batch.status}: wrote {', '.join(written)}")
    return dg.MaterializeResult(metadata={
        "status": batch.status,
        "source": intake.source,
        "destination": intake.deliver_to,
        "files": dg.MetadataValue.json(written),
    })
