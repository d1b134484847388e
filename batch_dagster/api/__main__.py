"""Run the API alone: `python -m batch_dagster.api [--host HOST] [--port PORT]`, by default on BATCH_API_HOST's
and BATCH_API_PORT's defaults (`make serve` passes the variables' values)."""

from __future__ import annotations

import argparse
import logging

import uvicorn

from batch_dagster.settings import Settings, default

from .app import create_app
from .bind import check_bind


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m batch_dagster.api", description=__doc__)
    parser.add_argument("--host", default=default("BATCH_API_HOST"))
    parser.add_argument("--port", type=int, default=default("BATCH_API_PORT"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("alembic").setLevel(logging.WARNING)
    config = Settings.from_env()
    check_bind(args.host, config)
    uvicorn.run(create_app(config), host=args.host, port=args.port, log_level="info")


if __name__ == "__main__":
    main()
