"""The job that materializes a batch's whole lifecycle for one partition."""

import dagster as dg

from batch_dagster.assets.batch import lifecycle_assets

batch_job = dg.define_asset_job(
    "batch_job",
    selection=dg.AssetSelection.assets(*lifecycle_assets),
    description="Validate, shard, infer, merge and price one batch (the partition key is the batch id).",
)
