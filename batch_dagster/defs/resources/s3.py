"""dagster-aws's S3 resource, its client made only where a step or a sensor asks for one."""

from __future__ import annotations

from typing import Any

from dagster_aws.s3 import S3Resource


class LazyS3Resource(S3Resource):
    """S3Resource whose execution-context object is the resource, not a client.

    Dagster builds that object for every step and sensor tick that names the resource: with dagster-aws's own, a boto3
    client each time (a third of a second, most of it the endpoint rules), also for the uploaded batches that never
    read S3. The code here calls get_client() where it reads or writes S3.
    """

    def get_object_to_set_on_execution_context(self) -> Any:
        return self
