"""The offline engine: a `vllm.LLM` in this process, built once per model and reused."""

from __future__ import annotations

import logging
import multiprocessing.util
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from batch_dagster.batchfile import contract as c
from batch_dagster.batchfile import responses
from batch_dagster.batchfile.registry import ModelSpec

from . import orphans, watchdog
from . import translate as t
from .base import EngineCrash, Line, OnProgress, ProgressTicker, Request, is_out_of_memory
from .hardware import dtype_choice

log = logging.getLogger(__name__)


def _rejection_types() -> tuple[type[Exception], ...]:
    """Exceptions by which vLLM rejects one request (bad parameters), as opposed to failing itself."""
    from vllm.exceptions import VLLMClientError

    return (VLLMClientError, ValueError, TypeError, OverflowError)


def _preparation_rejections() -> tuple[type[Exception], ...]:
    """What the tokenizer, the chat template or SamplingParams raise for one bad body.

    Preparing runs no model: whatever goes wrong there is that request's fault, and becomes its
    400 line while the rest of the shard runs.
    """
    from jinja2 import TemplateError

    return (*_rejection_types(), LookupError, AttributeError, TemplateError)


def _culprit(build: Any, kwargs: dict[str, Any]) -> str | None:
    """The sampling field that makes `build(**kwargs)` fail, tried one at a time (only on the error path)."""
    base = {"max_tokens": kwargs["max_tokens"]}
    for name, value in kwargs.items():
        if name == "max_tokens":
            continue
        try:
            build(**base, **{name: value})
        except Exception:
            return name
    return None


@dataclass
class _Prepared:
    """A request turned into token prompts and sampling settings, ready for the engine."""

    custom_id: str
    prompts: list[list[int]]
    params: Any = None  # SamplingParams for generation; None for embeddings
    encoding_format: str = "float"
    prompt_tokens: int = 0
    body: dict[str, Any] | None = None  # a /v1/responses body, echoed in its `response` object


@dataclass
class OfflineEngine:
    """Runs shards on an in-process `vllm.LLM` for one model."""

    spec: ModelSpec
    model_path: str
    _llm: Any = field(default=None, init=False, repr=False)
    start_s: float = field(default=0.0, init=False)  # how long building the `vllm.LLM` took
    started_at: float | None = field(default=None, init=False)  # time.perf_counter() when it was ready
    _watch: threading.Event | None = field(default=None, init=False, repr=False)

    def llm_kwargs(self) -> dict[str, Any]:
        s = self.spec
        kwargs: dict[str, Any] = {
            "model": self.model_path,
            "dtype": dtype_choice(s.dtype).dtype,  # "auto" resolved here: vLLM's "auto" is the checkpoint's
            "seed": s.seed,
            "tensor_parallel_size": s.tensor_parallel_size,
        }
        if s.task == "embed":
            kwargs["runner"] = "pooling"
        optional = {
            "max_model_len": s.max_model_len,
            "max_num_seqs": s.max_num_seqs,
            "enable_prefix_caching": s.enable_prefix_caching,
            "gpu_memory_utilization": s.gpu_memory_utilization,
            # 0 means "unset" so a GPU entry can let gpu_memory_utilization size the cache.
            "kv_cache_memory_bytes": s.kv_cache_memory_bytes or None,
        }
        kwargs.update({k: v for k, v in optional.items() if v is not None})
        return kwargs | s.engine_args

    @property
    def llm(self) -> Any:
        if self._llm is None:
            from vllm import LLM

            choice = dtype_choice(self.spec.dtype)
            log.info("Starting vLLM for %s from %s in %s: %s", self.spec.name, self.model_path, choice.dtype,
                     choice.reason)
            before = _engine_processes()
            t0 = time.perf_counter()
            self._llm = LLM(**self.llm_kwargs())
            self.started_at = time.perf_counter()
            self.start_s = round(self.started_at - t0, 3)
            cores = sorted(_engine_processes() - before)
            # Killed, this process would leave its engine core running (vLLM does not watch its parent).
            orphans.watch(cores)
            # Killed itself, the engine core would leave a call waiting forever.
            self._watch = watchdog.watch(cores, self._llm.llm_engine.engine_core)
            # multiprocessing's exit hook joins every child process, the engine core included,
            # which waits forever unless the engine was stopped first. A finalizer with an exit
            # priority runs before that join, in the main process and in a multiprocessing
            # child (Dagster's step processes) alike, where atexit handlers never run.
            multiprocessing.util.Finalize(None, shutdown_all, exitpriority=100)
            self._tokenizer = self._llm.get_tokenizer()
            self.max_model_len = self._llm.llm_engine.model_config.max_model_len
        return self._llm

    def shutdown(self) -> None:
        """Drop the engine (after a crash, so the next attempt starts a fresh one, or at the end)."""
        llm, self._llm = self._llm, None
        if self._watch is not None:
            self._watch.set()
        if llm is not None:
            try:
                # No grace period, as vLLM's own run_batch stops its engine: nothing is in flight when an
                # engine is dropped, and a graceful stop waits ~5 s for the worker to tear itself down.
                llm.llm_engine.engine_core.shutdown(timeout=0)
            except Exception:  # already dead: nothing left to stop
                pass

    # -- preparing requests ------------------------------------------------------------

    def _encode(self, prompt: str | list[int], add_special_tokens: bool) -> list[int]:
        if isinstance(prompt, list):
            if not all(isinstance(x, int) and x >= 0 for x in prompt):
                raise t.RequestError("Token ids must be non-negative integers.", param="prompt")
            return prompt  # ids beyond the vocabulary are rejected by the engine, request by request
        return self._tokenizer.encode(prompt, add_special_tokens=add_special_tokens)

    def _prepare(self, endpoint: str, custom_id: str, body: dict[str, Any]) -> _Prepared:
        from vllm import SamplingParams

        _REJECTED = _preparation_rejections()

        t.check(endpoint, body)
        if endpoint == c.EMBEDDINGS:
            fmt = t.encoding_format_of(body)
            prompts = [self._encode(p, True) for p in t.prompt_list(body, "input")]
            for p in prompts:
                t.check_prompt_length(endpoint, len(p), self.max_model_len)
            return _Prepared(custom_id, prompts, None, fmt, sum(map(len, prompts)))
        source = None
        if endpoint == c.RESPONSES:  # runs as the chat request it amounts to
            source, body = body, responses.chat_body(body)
        if endpoint in (c.CHAT, c.RESPONSES):
            messages, template_kwargs = t.chat_messages(body), t.chat_template_kwargs(body)
            try:
                text = self._tokenizer.apply_chat_template(
                    messages, tokenize=False, add_generation_prompt=True, **template_kwargs
                )
            except _REJECTED as exc:
                param = "chat_template_kwargs" if template_kwargs else "messages"
                raise t.RequestError(f"The chat template refused the request: {exc}", param=param) from exc
            prompts = [self._tokenizer.encode(text, add_special_tokens=False)]
        else:
            prompts = [self._encode(p, True) for p in t.prompt_list(body, "prompt")]
        longest = max(len(p) for p in prompts)
        max_tokens = t.max_tokens_of(endpoint, body, longest, self.max_model_len)
        kwargs = t.sampling_kwargs(body, max_tokens)
        try:
            params = SamplingParams(**kwargs)
        except _REJECTED as exc:
            culprit = getattr(exc, "parameter", None) or _culprit(SamplingParams, kwargs)
            raise t.RequestError(str(exc), param=culprit) from exc
        return _Prepared(custom_id, prompts, params, prompt_tokens=sum(map(len, prompts)), body=source)

    # -- running -----------------------------------------------------------------------

    def run(self, endpoint: str, requests: Sequence[Request], on_progress: OnProgress | None = None) -> list[Line]:
        """All of a shard's requests go to the engine in one call, so continuous batching stays full."""
        self._on_progress = on_progress
        try:
            self.llm  # noqa: B018 - start-up failures are crashes of the engine, not of a request
        except Exception as exc:
            raise EngineCrash(f"The engine failed to start: {exc}") from exc
        lines: list[Line] = []
        ready: list[_Prepared] = []
        rejected = _preparation_rejections()
        # Every request is prepared (prompt and SamplingParams) before the shard runs, so a bad one
        # is an error line of its own and never reaches, or fails, the engine call.
        for custom_id, body in requests:
            try:
                ready.append(self._prepare(endpoint, custom_id, body))
            except t.RequestError as exc:
                lines.append(exc.line(custom_id))
            except rejected as exc:
                param = getattr(exc, "parameter", None)
                lines.append(t.RequestError(f"{type(exc).__name__}: {exc}", param=param).line(custom_id))
        if ready:
            ran = self._run_isolating(endpoint, ready)
            if len(ready) > 1 and all(line["response"]["status_code"] != 200 for line in ran):
                # Every request failed on its own: the engine is at fault, not the requests.
                first_error = ran[0]["response"]["body"]["error"]["message"]
                raise EngineCrash(f"Every request of the shard failed: {first_error}")
            lines += ran
        return lines

    def _run_isolating(self, endpoint: str, items: list[_Prepared]) -> list[Line]:
        """Run items; on out-of-memory or a rejected request, split in halves until the culprit is alone."""
        _REJECTED = _rejection_types()
        try:
            return self._execute(endpoint, items)
        except Exception as exc:
            oom = is_out_of_memory(exc)
            rejected = isinstance(exc, _REJECTED) and not oom
            if not (oom or rejected):
                raise EngineCrash(f"{type(exc).__name__}: {exc}") from exc
            if len(items) == 1:
                if oom:
                    return [c.request_error_line(items[0].custom_id, "out_of_memory",
                                                 f"The engine ran out of memory on this request: {exc}",
                                                 status_code=500)]
                return [t.RequestError(str(exc), param=getattr(exc, "parameter", None)).line(items[0].custom_id)]
            log.warning("Splitting %d requests after %s", len(items), type(exc).__name__)
            mid = len(items) // 2
            return self._run_isolating(endpoint, items[:mid]) + self._run_isolating(endpoint, items[mid:])

    def _ticker(self) -> ProgressTicker | bool:
        on_progress = getattr(self, "_on_progress", None)
        return ProgressTicker(on_progress) if on_progress else False

    def _execute(self, endpoint: str, items: list[_Prepared]) -> list[Line]:
        if endpoint == c.EMBEDDINGS or len(items) < 2:
            return self._submit(endpoint, items)
        # Submitted in token order, requests sharing a prefix are neighbours in vLLM's first-come queue: the
        # first one's prefix blocks are cached when it is scheduled, and the rest hit them, in the same step or
        # the next, before the cache evicts them. In file order they scatter and each recomputes the prefix.
        order = sorted(range(len(items)), key=lambda i: items[i].prompts[0])
        lines = self._submit(endpoint, [items[i] for i in order])
        by_item = dict(zip(order, lines, strict=True))
        return [by_item[i] for i in range(len(items))]

    def _submit(self, endpoint: str, items: list[_Prepared]) -> list[Line]:
        from vllm.inputs import TokensPrompt

        prompts = [TokensPrompt(prompt_token_ids=p) for it in items for p in it.prompts]
        model = self.spec.name
        if endpoint == c.EMBEDDINGS:
            outputs = iter(self.llm.embed(prompts, use_tqdm=self._ticker()))
            lines = []
            for it in items:
                vectors = [list(next(outputs).outputs.embedding) for _ in it.prompts]
                body = t.embedding_list(model, vectors, it.prompt_tokens, it.encoding_format)
                lines.append(c.success_line(it.custom_id, body))
            return lines
        params = [it.params for it in items for _ in it.prompts]
        outputs = iter(self.llm.generate(prompts, params, use_tqdm=self._ticker()))
        make_body = t.chat_completion if endpoint == c.CHAT else t.text_completion
        lines = []
        for it in items:
            choices, cached = [], 0
            for _ in it.prompts:
                out = next(outputs)
                cached += out.num_cached_tokens or 0
                choices += [t.Choice(o.text, o.finish_reason, len(o.token_ids), o.stop_reason) for o in out.outputs]
            if endpoint == c.RESPONSES:
                lines.append(c.success_line(it.custom_id, _response_body(model, it, choices[0], cached)))
                continue
            lines.append(c.success_line(it.custom_id, make_body(model, choices, it.prompt_tokens, cached)))
        return lines


def _response_body(model: str, it: _Prepared, choice: t.Choice, cached: int) -> dict[str, Any]:
    assert it.body is not None
    return responses.response_object(
        it.body, model=model, text=choice.text, finish_reason=choice.finish_reason, input_tokens=it.prompt_tokens,
        output_tokens=choice.tokens, cached_tokens=cached, temperature=it.params.temperature,
        top_p=it.params.top_p, max_output_tokens=it.params.max_tokens,
    )


_ENGINES: dict[str, OfflineEngine] = {}
_LOCK = threading.Lock()


def _engine_processes() -> set[int]:
    """This process's children that are vLLM engine processes (vLLM names them VLLM::...)."""
    import psutil

    out = set()
    for child in psutil.Process().children():
        try:
            if child.name().startswith("VLLM"):
                out.add(child.pid)
        except psutil.NoSuchProcess:
            pass
    return out


def shutdown_all() -> None:
    """Stop every engine of this process.

    Registered at exit: otherwise multiprocessing's exit hook waits forever on the engine-core
    child that nobody told to stop, and the process never ends.
    """
    with _LOCK:
        engines = list(_ENGINES.values())
        _ENGINES.clear()
    if engines:
        # At exit the streams vLLM logs to may be closed already (pytest's capture, for one);
        # a late warning from its threads must not print a traceback.
        logging.getLogger("vllm").disabled = True
        logging.raiseExceptions = False
    for engine in engines:
        engine.shutdown()


def engine_for(spec: ModelSpec, model_path: str) -> OfflineEngine:
    """The process's engine for this model: built once, reused across shards and runs."""
    with _LOCK:
        engine = _ENGINES.get(spec.name)
        if engine is None or engine.spec != spec or engine.model_path != model_path:
            if engine is not None:
                engine.shutdown()
            engine = _ENGINES[spec.name] = OfflineEngine(spec, model_path)
        return engine


def start_seconds(model: str, since: float) -> float:
    """How long the model's engine took to start, if it started after `since` (perf_counter); 0 for one reused."""
    with _LOCK:
        engine = _ENGINES.get(model)
    if engine is None or engine.started_at is None or engine.started_at < since:
        return 0.0
    return engine.start_s


def drop_engine(model: str) -> None:
    with _LOCK:
        engine = _ENGINES.pop(model, None)
    if engine is not None:
        engine.shutdown()
