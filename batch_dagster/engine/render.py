"""The count worker's own process: request bodies rendered into prompt tokens by vLLM's render path, so an estimate
counts what the engine will bill.

It holds vLLM's GPU-less render server state (`vllm launch render`'s: the same renderer, chat template, template
kwargs merge and checks that the chat, completions and responses servers run) for each model it is asked about,
built from the engine's own flags (engine/flags.py). It answers one body at a time over its stdin and stdout (one JSON
document a line), and is started, bounded and killed by engine/count_worker.py: vLLM is imported here only, once per
worker, never in the process that asks.
"""

from __future__ import annotations

import asyncio
import importlib
import os
import sys
from collections.abc import Callable
from typing import IO, Any, Protocol

import orjson

from batch_dagster.batchfile import contract as c

from .models import Models
from .tokens import without_images


class Refused(Exception):
    """A body the engine answers with a 4xx before it runs (vLLM's message and param): it bills nothing."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class RenderTimedOut(Exception):
    """A body whose chat template did not render within vLLM's render timeout: its render thread may still run."""


class Renderer(Protocol):
    def load(self, model: str) -> int:
        """Make ready to count `model`'s bodies; its context length."""
        ...

    def count(self, model: str, endpoint: str, body: dict[str, Any]) -> list[int]:
        """Each prompt's tokens (one, or one per completions prompt); Refused, RenderTimedOut."""
        ...


class VllmRenderer:
    """vLLM's render server state for each model asked about, on the engine's flags."""

    def __init__(self, models: Models):
        # Imported now, while the worker starts: a body's deadline never pays for it.
        import vllm.entrypoints.launchers.render.app_state  # noqa: F401

        self.models = models
        self.states: dict[str, Any] = {}
        self.loop = asyncio.new_event_loop()

    def load(self, model: str) -> int:
        from starlette.datastructures import State
        from vllm import AsyncEngineArgs, envs
        from vllm.config import VllmConfig
        from vllm.entrypoints.launchers.render.app_state import init_render_app_state

        from .flags import parsed_args

        spec = self.models.spec(model)
        args = parsed_args(spec, self.models.path(spec))
        # As `vllm launch render` builds it (vllm/entrypoints/launchers/render/entry.py): no engine, no KV cache.
        engine_args = AsyncEngineArgs.from_cli_args(args)
        model_config = engine_args.create_model_config()
        model_config.quantization = None
        envs.VLLM_CPU_KVCACHE_SPACE = 0
        config = VllmConfig(model_config=model_config, logging_config=engine_args.create_logging_config(),
                            structured_outputs_config=engine_args.create_structured_outputs_config())
        state = State()
        self.loop.run_until_complete(init_render_app_state(config, state, args))
        self.states[model] = state
        return int(model_config.max_model_len)

    def count(self, model: str, endpoint: str, body: dict[str, Any]) -> list[int]:
        from pydantic import BaseModel, ValidationError
        from vllm.entrypoints.anthropic.protocol import AnthropicMessagesRequest
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest
        from vllm.entrypoints.openai.responses.protocol import ResponsesRequest
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse
        from vllm.entrypoints.serve.exception_handling.error_response import create_error_response

        from .lines import vllm_body

        serving = self.states[model].serving_render
        kinds: dict[str, tuple[type[BaseModel], Callable[[Any], Any]]] = {
            c.CHAT: (ChatCompletionRequest, serving.render_chat_request),
            c.COMPLETIONS: (CompletionRequest, serving.render_completion_request),
            c.RESPONSES: (ResponsesRequest, serving.render_responses_request),
            c.MESSAGES: (AnthropicMessagesRequest, serving.render_messages_request),
        }
        if endpoint not in kinds:
            raise Refused(f"{endpoint} is not counted by a generation model's renderer.")
        kind, render = kinds[endpoint]
        try:
            request = kind.model_validate(vllm_body(endpoint, without_images(endpoint, body)))
            result = self.loop.run_until_complete(render(request))
        except ValidationError as exc:  # vLLM's server answers its request model's errors with a 400
            raise Refused(str(exc).splitlines()[0]) from None
        except TimeoutError as exc:  # vLLM's own render timeout (VLLM_CHAT_TEMPLATE_RENDER_TIMEOUT)
            raise RenderTimedOut(str(exc)) from None
        except Exception as exc:  # classified as vLLM's server classifies it
            result = create_error_response(exc)
        if isinstance(result, ErrorResponse):
            if result.error.code >= 500:
                raise RuntimeError(f"vLLM's renderer failed: {result.error.message}")
            raise Refused(result.error.message, result.error.param)
        return [len(r.token_ids) for r in (result if isinstance(result, list) else [result])]


def vllm_renderer(models: Models) -> Renderer:
    return VllmRenderer(models)


def _answer(out: IO[bytes], document: dict[str, Any]) -> None:
    out.write(orjson.dumps(document) + b"\n")
    out.flush()


def serve(renderer: Renderer, requests: IO[bytes], out: IO[bytes]) -> None:
    """Answer each request line until stdin closes (the asking process is gone, or done with this worker)."""
    for raw in requests:
        ask = orjson.loads(raw)
        model = ask["model"]
        try:
            if ask.get("load"):
                _answer(out, {"loaded": renderer.load(model)})
            else:
                _answer(out, {"tokens": renderer.count(model, ask["endpoint"], ask["body"])})
        except Refused as exc:
            _answer(out, {"refused": str(exc), "param": exc.param})
        except RenderTimedOut as exc:
            _answer(out, {"timed_out": str(exc)})
        except Exception as exc:  # the worker's own failure (a model that does not load): the asker decides
            _answer(out, {"failed": f"{type(exc).__name__}: {str(exc)[:1000]}"})


def main(argv: list[str]) -> None:
    """`python -m batch_dagster.engine.render MODELS_FILE MODEL_CACHE [module:factory]`."""
    # The protocol owns the real stdout; anything printed or logged on stdout (vLLM logs there) goes to stderr.
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    models_file, cache, factory = argv[0], argv[1], argv[2] if len(argv) > 2 else f"{__name__}:vllm_renderer"
    module, _, name = factory.partition(":")
    renderer = getattr(importlib.import_module(module), name)(Models(models_file, cache))
    _answer(out, {"ready": True})
    serve(renderer, sys.stdin.buffer, out)


if __name__ == "__main__":
    # Through the package's module, not this `__main__` copy: a renderer raises the package's Refused.
    from batch_dagster.engine.render import main as run

    run(sys.argv[1:])
