"""/v1/files: upload a batch input file, list, retrieve, download and delete files."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import quote

from fastapi import APIRouter, File, Form, Query, Request, UploadFile
from fastapi.responses import FileResponse, StreamingResponse
from sqlalchemy.orm import Session

from batch_dagster.batchfile.failure import public
from batch_dagster.batchfile.folder import file_key
from batch_dagster.batchfile.storage import Storage
from batch_dagster.db import FileRecord, repo
from batch_dagster.features.quotas import KeyLimits, admit, refuse_early
from batch_dagster.features.retry import CannotRetry, merged_content
from batch_dagster.storage import LocalStorage, file_location

from .context import AppContext
from .deps import Context, DbSession, Owner
from .errors import ERROR_RESPONSES, IDEMPOTENT_RESPONSES, ApiError, clip, invalid, not_found
from .guard import METER
from .idempotency import Claim, Idempotent, fingerprint, gone
from .schemas import FileDeleted, FileObject, ListPage, Text, shown
from .uploads import jsonl_problem, sanitize_filename

router = APIRouter(tags=["files"], responses=ERROR_RESPONSES)
FILE_BYTES: dict[int | str, dict[str, Any]] = {200: {"description": "The file's bytes.",
                    "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}}}
_CHUNK = 1 << 20
_SNIFF = 64 * 1024


def content_disposition(filename: str) -> str:
    """An attachment header for `filename`, as Starlette's FileResponse writes it (RFC 5987 when not ASCII)."""
    quoted = quote(filename)
    return f"attachment; filename*=utf-8''{quoted}" if quoted != filename else f'attachment; filename="{filename}"'


def file_object(row: FileRecord) -> FileObject:
    return FileObject(id=row.id, bytes=row.bytes, created_at=row.created_at, filename=shown(row.filename),
                      purpose=row.purpose, expires_at=row.expires_at)


@router.post("/files", response_model=FileObject, responses=IDEMPOTENT_RESPONSES)
def create_file(
    request: Request,
    ctx: Context,
    session: DbSession,
    once: Idempotent,  # and the caller's owner: once.owner
    file: Annotated[UploadFile, File()],
    purpose: Annotated[Text, Form(json_schema_extra={"enum": ["batch"]})],
    expires_anchor: Annotated[Text | None, Form(alias="expires_after[anchor]",
                                                json_schema_extra={"enum": ["created_at"]})] = None,
    expires_seconds: Annotated[int | None, Form(alias="expires_after[seconds]",
                                                json_schema_extra={"minimum": 3600, "maximum": 2_592_000})] = None,
) -> FileObject:
    """Store an uploaded batch input file (JSONL) and return its File object. With an Idempotency-Key, a repeat
    (the same file bytes, name, purpose and expiry) answers the File the first request made and stores nothing."""
    if purpose != "batch":
        raise invalid(f"Purpose {clip(purpose)!r} is not supported here; upload batch input files with purpose "
                      "'batch'.", param="purpose", code="invalid_purpose")
    filename = sanitize_filename(file.filename)
    if not filename.lower().endswith(".jsonl"):
        raise invalid(f"File {clip(filename)!r} is not a .jsonl file; the Batch API takes JSONL files only.",
                      param="file", code="invalid_file_format")
    if expires_anchor is not None or expires_seconds is not None:
        if expires_anchor != "created_at" or expires_seconds is None or not 3600 <= expires_seconds <= 2_592_000:
            raise invalid("expires_after needs anchor 'created_at' and seconds between 3600 and 2592000.",
                          param="expires_after")
    route, owner = "POST /v1/files", once.owner
    asked = None
    if once.key is not None:  # the file's bytes were hashed as they streamed in (the guard's UploadMeter)
        asked = fingerprint(route, purpose, filename, expires_seconds, getattr(request.state, METER).sha256.hexdigest())
    return once.run(session, route, asked or "",
                    create=lambda claim: _create_file(ctx, session, owner, file, filename, purpose, expires_seconds,
                                                      claim),
                    found=lambda file_id: _made_file(session, owner, file_id))


def _create_file(ctx: AppContext, session: Session, owner: str, file: UploadFile, filename: str, purpose: str,
                 expires_seconds: int | None, claim: Claim) -> FileObject:
    file_id = repo.new_file_id()
    created_at = repo.now()
    expires_at = None if expires_seconds is None else created_at + expires_seconds
    # The guard (guard.py) held the upload to the key's room as it streamed in; counted again here, then with the
    # owner locked as the row is added (parallel uploads each see the others').
    limits = KeyLimits.of(session, owner, ctx.config)
    session.rollback()  # no transaction stays open while the upload is copied
    key = file_key(file_id)
    with ctx.storage.writing(key) as dest:
        size = _store_upload(file, dest, ctx.config.max_upload_bytes)
        refuse_early(limits, session, owner, nbytes=size)  # raised inside: the object is never written
        session.rollback()
    try:
        claim(session, file_id)  # the key first: a repeat that lost the race is not counted against the limits
        admit(limits, session, owner, nbytes=size)
        row = repo.add_file(session, FileRecord(
            id=file_id, owner=owner, bytes=size, created_at=created_at, expires_at=expires_at, filename=filename,
            purpose=purpose, path=key,
        ))
    except BaseException:
        session.rollback()
        ctx.storage.delete(key)
        raise
    return file_object(row)


def _made_file(session: Session, owner: str, file_id: str) -> FileObject:
    row = repo.get_file(session, owner, file_id)
    if row is None:
        raise gone("file", file_id)
    return file_object(row)


def _store_upload(upload: UploadFile, dest: Path, limit: int) -> int:
    """Copy the upload to `dest` in chunks, checking its size and that it starts like JSONL."""
    size = 0
    with open(dest, "wb") as out:
        head = upload.file.read(_SNIFF)
        if problem := jsonl_problem(head):
            raise invalid(problem, param="file", code="invalid_file_format")
        chunk = head
        while chunk:
            size += len(chunk)
            if size > limit:
                raise ApiError(413, f"The file is larger than the upload limit of {limit} bytes.",
                               param="file", code="file_too_large")
            out.write(chunk)
            chunk = upload.file.read(_CHUNK)
    return size


@router.get("/files", response_model=ListPage[FileObject])
def list_files(
    session: DbSession,
    owner: Owner,
    after: Text | None = None,
    # OpenAI's bound; its default (10,000) would make one call of a long history the API's whole work, so the
    # default is a page like the batch list's: the SDK's list follows `has_more` either way.
    limit: Annotated[int, Query(ge=1, le=10_000)] = 100,
    order: Literal["asc", "desc"] = "desc",
    purpose: Text | None = None,
) -> ListPage[FileObject]:
    """Newest first by default; `limit` up to 10,000 as OpenAI's, 100 unless asked."""
    page = repo.list_files(session, owner, after=after, limit=limit, ascending=order == "asc", purpose=purpose)
    if page is None:  # only when `after` names no file
        raise not_found("File", str(after), param="after")
    rows, has_more = page
    data = [file_object(r) for r in rows]
    return ListPage[FileObject].of(data, has_more)


def _owned_file(session, owner: str, file_id: str) -> FileRecord:
    row = repo.get_file(session, owner, file_id)
    if row is None:
        raise not_found("File", file_id, param="file_id")
    return row


@router.get("/files/{file_id}", response_model=FileObject)
def retrieve_file(file_id: Text, session: DbSession, owner: Owner) -> FileObject:
    return file_object(_owned_file(session, owner, file_id))


@router.get("/files/{file_id}/content", response_class=FileResponse, response_model=None, responses=FILE_BYTES)
def file_content(ctx: Context, file_id: Text, session: DbSession, owner: Owner,
                 merged: bool = False) -> FileResponse | StreamingResponse:
    """The file's bytes; `merged=true` (an extension) on a retry batch's result file adds its parents' lines."""
    row = _owned_file(session, owner, file_id)
    files, key = file_location(ctx.storage, row.path)
    if not files.exists(key):
        raise ApiError(404, f"The content of file {clip(file_id)} is gone.", param="file_id", code="not_found")
    if merged:
        return _merged_content(session, ctx.storage, row)
    return _content(files, key, row.filename)


def _content(files: Storage, key: str, filename: str) -> FileResponse | StreamingResponse:
    if isinstance(files, LocalStorage):
        return FileResponse(files.local_path(key), media_type="application/octet-stream", filename=filename)
    # From an object store: streamed through in chunks (a remote object is never read whole).
    stream = files.open(key)

    def body() -> Iterator[bytes]:
        with stream as f:
            while chunk := f.read(_CHUNK):
                yield chunk

    return StreamingResponse(body(), media_type="application/octet-stream",
                             headers={"Content-Disposition": content_disposition(filename)})


@router.delete("/files/{file_id}", response_model=FileDeleted)
def delete_file(ctx: Context, file_id: Text, session: DbSession, owner: Owner) -> FileDeleted:
    repo.delete_file(session, ctx.storage, _owned_file(session, owner, file_id))
    return FileDeleted(id=file_id, deleted=True)


def _merged_content(session, storage: Storage, row: FileRecord) -> FileResponse | StreamingResponse:
    if row.purpose != "batch_output":
        raise invalid(f"File {row.id} is not a batch's output or error file; only those can be merged.",
                      param="merged", code="invalid_merge")
    try:
        lines = merged_content(session, storage, row)
        if lines is None:  # not a retry batch's file: it is its own merged result
            return _content(*file_location(storage, row.path), row.filename)
        first = next(lines, b"")  # a parent's file that is gone shows here, before the response starts
    except (CannotRetry, FileNotFoundError) as exc:
        raise ApiError(404, f"The merged content of file {row.id} cannot be read: {public(str(exc))}", param="file_id",
                       code="not_found") from exc

    def body():
        yield first
        yield from lines

    return StreamingResponse(body(), media_type="application/octet-stream",
                             headers={"Content-Disposition": content_disposition(f"merged_{row.filename}")})
