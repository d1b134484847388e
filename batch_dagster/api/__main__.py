"""Run the API alone: `python -m batch_dagster.api [--host 127.0.0.1] [--port 8000]`."""

from __future__ import annotations

import argparse
import logging

import uvicorn

from .app import create_app
from .bind import check_bind
from .context import ApiConfig


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m batch_dagster.api", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("alembic").setLevel(logging.WARNING)
    config = ApiConfig.from_settings()
    check_bind(args.host, config)
    uvicorn.run(create_app(config), host=args.host, port=args.port, log_level="info")


if __name__ == "__main__":
    main()
