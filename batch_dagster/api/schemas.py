"""The public objects, field for field as in the OpenAI Files and Batches APIs, and request bodies."""

from __future__ import annotations

import json
from typing import Annotated, Any, Generic, Literal, Self, TypeVar

from pydantic import AfterValidator, BaseModel, Field, model_serializer

from batch_dagster.batchfile.contract import ENDPOINTS, STRUCTURED_COUNTS
from batch_dagster.batchfile.options import (
    MAX_METADATA_KEY,
    MAX_METADATA_PAIRS,
    MAX_METADATA_VALUE,
    BatchOptions,
    BatchRequest,
)
from batch_dagster.batchfile.status import BatchStatus
from batch_dagster.batchfile.windows import Window
from batch_dagster.db.models import DEADLINE_AT_RISK, EVENT_TYPES

T = TypeVar("T")
MAX_UNIX_S = 2**31 - 1  # a timestamp the store's integer columns hold (PostgreSQL's integer: 2038)


def _storable(value: str) -> str:
    """Text every store keeps and every response encodes: valid Unicode (no lone surrogate), no NUL."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("Invalid Unicode (a lone surrogate)") from None
    if "\x00" in value:
        raise ValueError("NUL characters are not allowed")
    return value


def shown(value: object) -> str:
    """A stored value as text a response can always encode: a lone surrogate (from a row written before these
    checks, or by another writer) becomes '?'; a non-string is shown as JSON."""
    text = value if isinstance(value, str) else json.dumps(value)
    return text.encode("utf-8", "replace").decode("utf-8")


# Every text a client sends (bodies, path and query parameters, form fields) is checked on the way in, so
# nothing the store or a response cannot hold ever gets as far as a write.
Text = Annotated[str, AfterValidator(_storable)]

class FileObject(BaseModel):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: Literal["batch", "batch_output"]
    # Deprecated in OpenAI's API but still part of its File object; always "processed" here.
    status: Literal["uploaded", "processed", "error"] = "processed"
    expires_at: int | None = None
    status_details: str | None = None


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool


class ListPage(BaseModel, Generic[T]):
    object: Literal["list"] = "list"
    data: list[T]
    first_id: str | None
    last_id: str | None
    has_more: bool

    @classmethod
    def of(cls, data: list[Any], has_more: bool) -> Self:
        """A page of `data`: first_id and last_id are the ids of its first and last objects."""
        return cls(data=data, first_id=data[0].id if data else None, last_id=data[-1].id if data else None,
                   has_more=has_more)


class BatchError(BaseModel):
    code: str | None = None
    message: str | None = None
    param: str | None = None
    line: int | None = None


class BatchErrors(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchError]


class BatchRequestCounts(BaseModel):
    total: int
    completed: int
    failed: int
    # Extensions, each present when not 0: of `completed`, the requests whose structured output (a JSON schema or
    # object, a forced tool call) their token limit cut short (finish_reason "length": their JSON is not whole), and
    # those whose whole answer does not follow its schema (each line marked with its first violation).
    incomplete_structured: int = 0
    invalid_structured: int = 0

    @model_serializer(mode="wrap")
    def _extension_when_any(self, handler: Any) -> Any:
        data = handler(self)
        for name in STRUCTURED_COUNTS:
            if isinstance(data, dict) and not data.get(name):
                data.pop(name, None)
        return data


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class BatchUsage(BaseModel):
    input_tokens: int = 0
    input_tokens_details: InputTokensDetails = InputTokensDetails()
    output_tokens: int = 0
    output_tokens_details: OutputTokensDetails = OutputTokensDetails()
    total_tokens: int = 0


class Batch(BatchOptions):  # with the options (extensions) the batch was created with
    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    errors: BatchErrors | None = None
    input_file_id: str
    completion_window: str
    status: BatchStatus
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: int
    in_progress_at: int | None = None
    expires_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: BatchRequestCounts
    metadata: dict[str, str] | None = None
    model: str | None = None
    usage: BatchUsage
    # Extensions (docs/http-api.md, "Queue position and ETA"): null once the batch has ended; the estimate once
    # it is validated. meets_deadline: whether estimated_completion_at is before expires_at; deadline_at_risk_at:
    # when the queue first estimated that the batch will end after its deadline (its batch.deadline_at_risk event).
    queue_position: int | None = None
    estimated_completion_at: int | None = None
    meets_deadline: bool | None = None
    deadline_at_risk_at: int | None = None
    estimate: BatchEstimate | None = None


class ExpiresAfter(BaseModel):
    anchor: Literal["created_at"]
    seconds: int = Field(ge=3600, le=2_592_000)


# The schema states the limits create_batch checks (their errors name the field with their own messages).
Metadata = Annotated[dict[Text, Text], Field(json_schema_extra={
    "maxProperties": MAX_METADATA_PAIRS, "propertyNames": {"maxLength": MAX_METADATA_KEY},
    "additionalProperties": {"type": "string", "maxLength": MAX_METADATA_VALUE}})]


class CreateBatchRequest(BatchOptions):  # OpenAI's fields, and the options (extensions; the SDK's extra_body)
    input_file_id: Text
    endpoint: Text = Field(json_schema_extra={"enum": list(ENDPOINTS)})
    # The windows the operator offers (BATCH_COMPLETION_WINDOWS): the app's OpenAPI document lists them as its enum.
    completion_window: Text
    metadata: Metadata | None = None
    output_expires_after: ExpiresAfter | None = None

    def asked(self, owner: str, window: Window) -> BatchRequest:
        """The batch request this body makes, for `owner`, in `window` (the operator's length of the one it names)."""
        return BatchRequest(owner=owner, input_file_id=self.input_file_id, endpoint=self.endpoint, window=window,
                            metadata=self.metadata, options=BatchOptions.of(self),
                            output_expires_after=self.output_expires_after.seconds if self.output_expires_after
                            else None)


class RetryRequest(BaseModel):
    """Extension: what a retry takes from its parent (batchfile/contract.py RETRY_FILTERS): its retryable failed
    requests (`failed`, the default), and its lines marked as not following their schema, whole
    (`invalid_structured`) or cut short (`incomplete_structured`)."""

    only: list[Literal["failed", "invalid_structured", "incomplete_structured"]] = Field(
        default=["failed"], min_length=1, max_length=3)


# Webhook endpoints: OpenAI's webhook_endpoint objects (the openai SDK's client.webhooks), for batch events only.
WEBHOOK_EVENT_TYPES = (*EVENT_TYPES.values(), DEADLINE_AT_RISK)
MAX_WEBHOOK_URL, MAX_WEBHOOK_NAME = 1024, 255
WebhookEventType = Annotated[Text, Field(json_schema_extra={"enum": list(WEBHOOK_EVENT_TYPES)})]


class WebhookEndpoint(BaseModel):
    id: str
    object: Literal["webhook_endpoint"] = "webhook_endpoint"
    created_at: int
    event_types: list[str]
    name: str
    signing_secret_hint: str | None = None
    url: str
    updated_at: int | None = None


class WebhookEndpointWithSecret(WebhookEndpoint):
    """The endpoint as created: the only answer that holds its signing secret."""

    signing_secret: str


class DeletedWebhookEndpoint(BaseModel):
    id: str
    deleted: bool
    object: Literal["webhook_endpoint.deleted"] = "webhook_endpoint.deleted"


class WebhookEventTypeList(BaseModel):
    object: Literal["list"] = "list"
    data: list[str]


class CreateWebhookEndpointRequest(BaseModel):
    """OpenAI's create parameters; here `name` and `event_types` may be left out (no name, every batch event)."""

    url: Text = Field(max_length=MAX_WEBHOOK_URL)
    name: Text = Field(default="", max_length=MAX_WEBHOOK_NAME)
    event_types: list[WebhookEventType] | None = Field(default=None, min_length=1)


# The estimate extension (POST /v1/batches/estimate): what a batch would cost and take, before it is created.
class EstimateCost(BaseModel):
    min: float
    max: float
    currency: str


class EstimateDuration(BaseModel):
    min: float
    max: float


class BatchEstimate(BaseModel):
    """features/estimate.py's Estimate.to_dict; the numbers are null for an invalid file."""

    object: Literal["batch.estimate"] = "batch.estimate"
    valid: bool
    errors: BatchErrors
    model: str | None = None
    endpoint: str | None = None
    total_requests: int
    refused_requests: int | None = None
    input_tokens: int | None = None
    max_output_tokens: int | None = None
    cost: EstimateCost | None = None
    duration_s: EstimateDuration | None = None
    tokens_per_s: float | None = None
    throughput_batches: int | None = None
    queued_ahead: int
    queued_ahead_requests: int
    queued_ahead_uncounted: int
    meets_deadline: bool | None = None


Batch.model_rebuild()  # its `estimate` is a BatchEstimate, defined after it
