"""Results of a dropped file written back beside it: the last step of a batch that arrived by S3 or the inbox."""

import dagster as dg
from dagster_aws.s3 import S3Resource

from batch_dagster.assets.batch import GROUP, batch_usage
from batch_dagster.partitions import batches
from batch_dagster.resources import BatchStorage
from batch_dagster.resources.transfer import deliver
from batch_dagster.store import repo
from batch_dagster.store.intake import result_summary
from batch_dagster.store.resource import ApiStore


@dg.asset(
    partitions_def=batches,
    group_name=GROUP,
    kinds={"s3"},
    deps=[batch_usage],
    description="output.jsonl, errors.jsonl and summary.json of a dropped file's batch, written under the "
    "bucket's results prefix or the inbox's results folder (run once the batch has ended, however it ended).",
)
def delivered_results(
    context: dg.AssetExecutionContext, storage: BatchStorage, api_store: ApiStore, s3: S3Resource
) -> dg.MaterializeResult:
    batch_id = context.partition_key
    with api_store.session() as session:
        found = repo.get_intake(session, batch_id)
        if found is None:
            raise dg.Failure(f"{batch_id} did not arrive as a dropped file: it has nowhere to deliver to.",
                             allow_retries=False)
        intake, batch = found
        files = {name: path for name, path in (("output.jsonl", storage.output_path(batch_id)),
                                               ("errors.jsonl", storage.error_path(batch_id))) if path.exists()}
        pipeline_summary = storage.read_json(storage.summary_path(batch_id)) or {}
        summary_path = storage.batch_dir(batch_id) / "delivery" / "summary.json"
        storage.write_json(summary_path, result_summary(batch, intake, pipeline_summary.get("cost"), [*files]))
        written = deliver({**files, "summary.json": summary_path}, intake.deliver_to, s3.get_client)
        repo.mark_delivered(session, batch_id)
    context.log.info(f"{batch.status}: wrote {', '.join(written)}")
    return dg.MaterializeResult(metadata={
        "status": batch.status,
        "source": intake.source,
        "destination": intake.deliver_to,
        "files": dg.MetadataValue.json(written),
    })


deliver_results_job = dg.define_asset_job(
    "deliver_results_job",
    selection=[delivered_results],
    description="Write a dropped file's results back beside it (started by the S3 and inbox sensors).",
)
