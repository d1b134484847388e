"""Sweeping a process's scratch folder: what a process killed while it held a local copy or a staged upload left."""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def newest_mtime(path: Path) -> float:
    """When anything under `path` (a file, or a folder and everything in it) was last modified."""
    newest = path.lstat().st_mtime
    if path.is_dir() and not path.is_symlink():
        for root, dirs, files in os.walk(path):
            for name in (*dirs, *files):
                try:
                    newest = max(newest, os.lstat(os.path.join(root, name)).st_mtime)
                except FileNotFoundError:
                    continue
    return newest


def sweep(scratch: Path, older_than: float) -> int:
    """Remove the entries of `scratch` untouched since `older_than` (epoch seconds); how many were removed.

    A live reader keeps its local copy for the length of one read or write, far less than the age swept."""
    if not scratch.is_dir():
        return 0
    removed = 0
    for entry in scratch.iterdir():
        try:
            if newest_mtime(entry) >= older_than:
                continue
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
            removed += 1
        except FileNotFoundError:  # its process removed it meanwhile
            continue
    return removed
