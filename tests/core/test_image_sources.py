"""Where an image part may come from and how big it may be: validation refuses the rest at its line and param."""

from __future__ import annotations

import base64
import json

from batch_dagster.batchfile import contract as c
from batch_dagster.batchfile.fields import Serves
from batch_dagster.batchfile.image_sources import ImageSources, refusal
from batch_dagster.batchfile.validate import validate_file

SOURCES = ImageSources.of(["images.example.com", " CDN.Example.com "], max_bytes=100)
PNG = "data:image/png;base64," + base64.b64encode(b"\x89PNG" + b"0" * 50).decode()


def test_data_urls_and_allowed_hosts_pass_and_the_rest_says_why():
    assert refusal(PNG, SOURCES) is None and refusal("https://cdn.example.com/a.png", SOURCES) is None
    assert refusal("http://images.example.com:8080/x?y=1", SOURCES) is None
    assert "larger than 100 bytes" in refusal("data:image/png;base64," + "A" * 200, SOURCES)
    assert "base64" in refusal("data:image/png;base64,@@@@", SOURCES)
    assert "data:image/<type>;base64" in refusal("data:text/plain;base64,QQ==", SOURCES)
    assert "BATCH_IMAGE_HOSTS" in refusal("https://evil.example.org/a.png", SOURCES)
    for url in ("file:///etc/passwd", "ftp://images.example.com/a.png", "images.example.com/a.png", "http://"):
        assert "data URL or an http(s) URL" in refusal(url, SOURCES), url
    # Not known here (an engine re-checking a stored body): the form only; the fetch checks the host again.
    assert refusal("https://evil.example.org/a.png", None) is None and refusal(5, SOURCES) is None


def test_validation_refuses_each_image_at_its_line_and_part(tmp_path):
    def line(cid: str, url: str) -> dict:
        parts = [{"type": "text", "text": "what?"}, {"type": "image_url", "image_url": {"url": url}}]
        return {"custom_id": cid, "method": "POST", "url": c.CHAT,
                "body": {"model": "vlm", "messages": [{"role": "user", "content": parts}]}}

    rows = [line("ok", PNG), line("fetched", "https://images.example.com/a.png"),
            line("host", "https://evil.example.org/a.png"), line("big", "data:image/png;base64," + "A" * 400)]
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    vlm = Serves((c.CHAT,), images=1, image_sources=SOURCES)
    report = validate_file(path, models={"vlm": vlm})
    assert report.valid and [(e.line, e.param) for e in report.rejected] == [
        (3, "body.messages[0].content[1]"), (4, "body.messages[0].content[1]")]
