"""Run the API alone: `python -m batch_dagster.api [--host HOST] [--port PORT] [--metrics-host H] [--metrics-port P]
[--root-path /PREFIX]`, by default on BATCH_API_HOST's and BATCH_API_PORT's defaults (`make serve` passes the
variables' values), its metrics on a listener of their own (BATCH_METRICS_HOST, BATCH_METRICS_PORT)."""

from __future__ import annotations

import argparse
import logging

import uvicorn

from batch_dagster.settings import Settings, default

from . import metrics
from .app import create_app
from .bind import check_bind


def main(argv: list[str] | None = None) -> None:
    config = Settings.from_env()
    parser = argparse.ArgumentParser(prog="python -m batch_dagster.api", description=__doc__)
    parser.add_argument("--host", default=default("BATCH_API_HOST"))
    parser.add_argument("--port", type=int, default=default("BATCH_API_PORT"))
    parser.add_argument("--metrics-host", default=config.metrics_host, help="the metrics listener's address (the "
                        "operator's; default BATCH_METRICS_HOST, loopback)")
    parser.add_argument("--metrics-port", type=int, default=config.metrics_port,
                        help="the metrics listener's port (default BATCH_METRICS_PORT; 0: a free one, logged)")
    parser.add_argument("--root-path", default="", help="the prefix a proxy in front serves the API under (and "
                        "strips), as uvicorn's --root-path")
    parser.add_argument("--launch-nudge", help="serve's: the Unix socket on which its daemon's launch sensor is told "
                        "of each batch created (api/launch_nudge.py)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("alembic").setLevel(logging.WARNING)
    check_bind(args.host, config)
    app = create_app(config, args.launch_nudge)
    listener = metrics.serve(app, args.metrics_host, args.metrics_port)
    try:
        uvicorn.run(app, host=args.host, port=args.port, root_path=args.root_path, log_level="info")
    finally:
        listener.close()


if __name__ == "__main__":
    main()
