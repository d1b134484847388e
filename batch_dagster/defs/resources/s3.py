"""dagster-aws's S3 resource, its client made only where a step or a sensor asks for one, and once per process."""

from __future__ import annotations

import functools
import os
from typing import Any

from dagster_aws.s3 import S3Resource


@functools.lru_cache(maxsize=8)
def _client(config: tuple[tuple[str, Any], ...], aws_environment: tuple[tuple[str, str], ...]) -> Any:
    from dagster_aws.s3.utils import construct_s3_client

    return construct_s3_client(**dict(config))


class LazyS3Resource(S3Resource):
    """S3Resource whose execution-context object is the resource, not a client, and whose client is made once.

    Dagster builds that object for every step and sensor tick that names the resource: with dagster-aws's own, a boto3
    client each time (a third of a second, most of it the endpoint rules), also for the uploaded batches that never
    read S3. The code here calls get_client() where it reads or writes S3, and gets the process's client for this
    configuration (boto3 clients are thread-safe, and refresh their own credentials): dagster-aws builds a new
    session for each, reading boto3's endpoint files again, every tick of the S3 sensor.
    """

    def get_object_to_set_on_execution_context(self) -> Any:
        return self

    def get_client(self) -> Any:
        config = (("max_attempts", self.max_attempts), ("region_name", self.region_name),
                  ("endpoint_url", self.endpoint_url), ("use_unsigned_session", self.use_unsigned_session),
                  ("profile_name", self.profile_name), ("use_ssl", self.use_ssl), ("verify", self.verify),
                  ("aws_access_key_id", self.aws_access_key_id),
                  ("aws_secret_access_key", self.aws_secret_access_key), ("aws_session_token", self.aws_session_token))
        # boto3 reads its endpoint, region and credentials from AWS_* when the client is made: a change makes another.
        return _client(config, tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("AWS_"))))
