"""The API's metadata store: files, batches and which API key owns them (SQLAlchemy, Alembic)."""

from . import repo
from .models import TERMINAL, ApiKey, BatchRecord, FileRecord, IntakeRecord
from .session import Database

__all__ = ["TERMINAL", "ApiKey", "BatchRecord", "FileRecord", "IntakeRecord", "Database", "repo"]
