"""A stand-in for a vLLM OpenAI server, for tests of the fleets' mechanics (ports, routers, sleep and wake) without
an engine: `python -m tests.fake_replica PORT [MODEL]` answers /health, /v1/models, /version and /metrics, and a
POST to /v1/* with which model and port answered and the body it got (`got`). FAKE_REPLICA_FAIL=1 makes it exit at
once, as a server that cannot start does."""

from __future__ import annotations

import json
import os
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def main() -> None:
    if os.environ.get("FAKE_REPLICA_FAIL"):
        sys.exit("fake replica: told to fail")
    port, model = int(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "fake"

    class Handler(BaseHTTPRequestHandler):
        def _send(self, body: bytes, kind: str = "application/json") -> None:
            self.send_response(200)
            self.send_header("content-type", kind)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            if self.path == "/metrics":
                return self._send(b"vllm:num_requests_running 0\n", "text/plain")
            if self.path == "/v1/models":
                return self._send(json.dumps({"object": "list", "data": [{"id": model, "object": "model"}]}).encode())
            self._send(json.dumps({"version": "fake"} if self.path == "/version" else {}).encode())

        def do_POST(self) -> None:  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers.get("content-length") or 0)) or b"null")
            self._send(json.dumps({"model": model, "port": port, "got": body}).encode())

        def log_message(self, *args) -> None:
            pass

    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()


if __name__ == "__main__":
    main()
