"""`make bench`: the same batch file through the raw engine, vLLM's run_batch and this pipeline.

The three stages run one after the other, each as its own process tree, on the same generated
input (bench/workload.py), the same model and the same engine settings (the registry's, via
`engine_kwargs(spec, path)` and `server_command(...)`). Per stage:

- wall_s: launch to exit of the stage's process, measured here. (Should the pipeline's process
  not exit within BENCH_EXIT_GRACE_S after printing its JSON summary, it is stopped, wall_s is the
  time of that summary and the stage says `hung_at_exit`.)
- peak_rss_mb: the largest sum of RSS over the process and all its descendants (vLLM's engine
  core and worker included), sampled every 0.2 s; pages shared between processes count twice.
- engine_start_s: vLLM's engine construction, from its "Resolved architecture" log line to its
  "init engine (profile, create kv cache, warmup model) took" line, both timed here as they
  arrive. All three stages print both, so the same span is measured in each; Python imports are
  left out (they are in wall_s).
- inference_s: from that "init engine ... took" line to the end of inference: the raw engine's
  "BENCH inference done" marker after its one `llm.chat` call; run_batch's "Writing outputs to
  local file" log line; the pipeline's shard_results step success in the Dagster event log
  (so shard reads and commits count, as they are part of the pipeline's inference phase).
- output_tokens: completion tokens of successful requests (raw: the RequestOutputs; run_batch:
  its output file's usage; pipeline: the batch's summary.json usage).
- output_tok_s: output_tokens / inference_s.
- prompt_tokens, cached_prompt_tokens, prefill_tokens: the prompt tokens of the successful
  requests, those of them vLLM's automatic prefix cache served, and the difference, the
  tokens the engine computed. All three stages read vLLM's own per-request count
  (`RequestOutput.num_cached_tokens`, from the scheduler's prefix-cache hits): the raw engine
  from its outputs, run_batch from `usage.prompt_tokens_details.cached_tokens` of its output
  file (it runs with `--enable-prompt-tokens-details`, which only adds that field), the
  pipeline from summary.json's `input_tokens_details.cached_tokens` (the same field, summed).
  The raw engine also reports vLLM's Prometheus counters (`llm.get_metrics()`:
  vllm:prompt_tokens and vllm:prefix_cache_hits) as `engine_counters`, a cross-check.

Workloads (bench/workload.py): BENCH_WORKLOAD=mixed (the default; BENCH_REQUESTS lines),
BENCH_WORKLOAD=structured (labelling in every structured mode; run_batch and the pipeline only, the raw engine's
`llm.chat` takes no tools; the report's `structured` gives per stage and mode the share of answers that follow their
schema, checked here with jsonschema, and the share the pipeline flagged: bench/structured_report.py),
BENCH_WORKLOAD=docqa (requests sharing context: BENCH_DOCQA_DOCS documents, default 60, times
BENCH_DOCQA_QUESTIONS questions each, default 5; BENCH_REQUESTS is not used) or BENCH_WORKLOAD=embeddings
(BENCH_REQUESTS texts, default 10,000, on the embedded embedding model: the raw engine's one `llm.embed` call;
requests_s, texts per second of inference, is its measure, as output tokens are none).

Answers: each stage's answer text per custom_id is compared with run_batch's, and the report's `answers` gives,
per stage, how many are identical (`identical` of `compared`; an embedding counts when no component differs by
more than EMBED_TOLERANCE): "same outputs" is measured, not assumed. In
bfloat16 greedy answers depend on how requests are batched and whether a prefix came from the cache;
BENCH_DTYPE=float32 runs every stage in float32 (the pipeline's through a registry naming that dtype), where
they do not.

Environment: BENCH_REQUESTS (default 5000), BENCH_MODEL (default smollm2-135m-instruct; all-minilm-l6-v2 for
embeddings), BENCH_DTYPE (default:
the registry's, `auto`),
BENCH_STAGES (comma list, default all three), BENCH_OUT (default bench/results/latest.json),
BENCH_PROFILE=1 (record a py-spy speedscope profile of each stage next to BENCH_OUT),
BENCH_KEEP_WORK=1 (keep the temporary work folder with every stage's timed log),
BENCH_RESUME=1 (keep the stages BENCH_OUT already holds for the same workload and run only
BENCH_STAGES), BENCH_QUIET_WAIT_S (default 600: before each stage, wait up to this long until no other vLLM
engine runs and the cores are mostly idle; each stage records `other_cpu_pct`, the CPU other
processes used meanwhile), BENCH_STAGE_TIMEOUT_S, BENCH_EXIT_GRACE_S (see `hung_at_exit`).
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import sys
import tempfile
import time
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson

from bench import structured_report
from bench.measure import Measured, run_measured, wait_for_quiet
from bench.workload import workload_from_env, workload_model

REPO = Path(__file__).resolve().parent.parent
STAGES = ("raw_engine", "run_batch", "pipeline")
METRICS = ("wall_s", "engine_start_s", "inference_s", "output_tokens", "output_tok_s", "requests_s", "prefill_tokens",
           "peak_rss_mb")
EMBED_TOLERANCE = 1e-4
ENGINE_BEGIN = "Resolved architecture"
ENGINE_READY = "init engine (profile, create kv cache, warmup model) took"
STAGE_ENV = {"VLLM_LOGGING_LEVEL": "INFO"}  # the start/ready lines above are INFO lines, in every stage


class StageFailed(RuntimeError):
    pass


def _engine_span(m: Measured, stage: str) -> tuple[float, float]:
    begin, ready = m.first(ENGINE_BEGIN), m.first(ENGINE_READY)
    if begin is None or ready is None:
        raise StageFailed(f"{stage}: no engine start-up lines in its log (exit {m.returncode}):\n{m.tail()}")
    return begin, ready


def _metrics(m: Measured, engine: tuple[float, float], inference_end: float, output_tokens: int,
             **extra: Any) -> dict[str, Any]:
    begin, ready = engine
    inference_s = inference_end - ready
    if not extra.get("requests_completed"):
        raise StageFailed(f"no request completed:\n{m.tail()}")
    prompt, cached = extra.get("prompt_tokens"), extra.get("cached_prompt_tokens")
    if prompt is not None and cached is not None:
        extra["prefill_tokens"] = prompt - cached  # what the engine computed: the prefix cache's misses
    hung = {}
    if m.hung_at_exit:
        # The work was done (and its output written) at done_at_s; the process never exited.
        hung = {"hung_at_exit": True, "stopped_at_s": round(m.wall_s, 2)}
    return {
        # A hung stage has done_at_s: it is what made it count as done.
        "wall_s": round(m.done_at_s if m.hung_at_exit and m.done_at_s is not None else m.wall_s, 2),
        "engine_start_s": round(ready - begin, 2),
        "inference_s": round(inference_s, 2),
        "output_tokens": output_tokens,
        "output_tok_s": round(output_tokens / inference_s, 1) if inference_s > 0 else 0.0,
        "requests_s": round(extra["requests_completed"] / inference_s, 1) if inference_s > 0 else 0.0,
        "peak_rss_mb": round(m.peak_rss_mb, 1),
        "engine_ready_at_s": round(ready, 2),
        "inference_end_at_s": round(inference_end, 2),
        "cpu_s": m.cpu_s,
        "other_cpu_pct": m.other_cpu_pct,
        "peak_rss_by_process_mb": m.peak_rss_by_process_mb,
    } | hung | extra


def _profiled(cmd: list[str], name: str, ctx: dict[str, Any]) -> list[str]:
    if not ctx["profile"]:
        return cmd
    out = ctx["out"].with_name(f"profile-{name}.speedscope.json")
    py_spy = Path(sys.executable).with_name("py-spy")
    return [str(py_spy), "record", "--subprocesses", "--rate", "20", "--format", "speedscope", "-o", str(out),
            "--", *cmd]


def _run(cmd: list[str], name: str, ctx: dict[str, Any], env: dict[str, str] | None = None,
         **kwargs: Any) -> Measured:
    log = ctx["work"] / f"{name}.log"
    m = run_measured(_profiled(cmd, name, ctx), env={**STAGE_ENV, **(env or {})}, cwd=REPO, log_path=log,
                     timeout_s=ctx["timeout_s"], **kwargs)
    if m.returncode != 0 and not m.hung_at_exit:
        raise StageFailed(f"{name} exited with {m.returncode}; log {log}:\n{m.tail()}")
    return m


def stage_raw_engine(ctx: dict[str, Any]) -> dict[str, Any]:
    """vllm.LLM in its own process, every request in one llm.chat call."""
    from batch_dagster.engine.flags import engine_kwargs

    result_path = ctx["work"] / "raw_engine.result.json"
    kwargs = engine_kwargs(ctx["spec"], ctx["model_path"])
    cmd = [sys.executable, "-m", "bench.raw_engine", str(ctx["input"]), json.dumps(kwargs), str(result_path)]
    m = _run(cmd, "raw_engine", ctx)
    res = json.loads(result_path.read_text())
    end = m.first("BENCH inference done")
    engine = _engine_span(m, "raw_engine")
    if end is None:
        raise StageFailed(f"raw_engine: no 'BENCH inference done' line:\n{m.tail()}")
    ctx["answers"]["raw_engine"] = res["answers"]
    return _metrics(m, engine, end, res["output_tokens"],
                    requests_completed=res["requests"], requests_failed=0,
                    llm_constructor_s=res["engine_start_s"], chat_call_s=res["inference_s"],
                    cached_prompt_tokens=res["cached_tokens"], prompt_tokens=res["input_tokens"],
                    engine_counters=res.get("engine_counters"))


def run_batch_command(spec: Any, model_path: str, input_path: Path, output_path: Path) -> list[str]:
    """vLLM's run_batch with the flags the project's own vLLM server command gets."""
    from batch_dagster.engine.server import server_command

    cmd = server_command(spec, model_path, "127.0.0.1", 0)
    cmd[cmd.index("vllm.entrypoints.openai.api_server")] = "vllm.entrypoints.openai.run_batch"
    for flag in ("--host", "--port"):  # a server's listening address; run_batch has no use for it
        i = cmd.index(flag)
        del cmd[i : i + 2]
    return cmd + ["-i", str(input_path), "-o", str(output_path)]


def stage_run_batch(ctx: dict[str, Any]) -> dict[str, Any]:
    """python -m vllm.entrypoints.openai.run_batch on the same file and settings."""
    out = ctx["work"] / "run_batch.output.jsonl"
    m = _run(run_batch_command(ctx["spec"], ctx["model_path"], ctx["input"], out), "run_batch", ctx)
    end = m.last("Writing outputs to local file")
    if end is None:
        raise StageFailed(f"run_batch: no 'Writing outputs' line:\n{m.tail()}")
    completed = failed = tokens = prompt = cached = 0
    answers = ctx["answers"]["run_batch"] = {}
    ctx["outputs"]["run_batch"] = out
    with open(out, "rb") as f:
        for raw in f:
            line = orjson.loads(raw)
            answers[line["custom_id"]] = answer(line)
            response = line.get("response") or {}
            if response.get("status_code") == 200 and not line.get("error"):
                completed += 1
                usage = response["body"]["usage"]
                tokens += usage.get("completion_tokens") or 0  # none in an embedding's usage
                prompt += usage["prompt_tokens"]
                cached += (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            else:
                failed += 1
    return _metrics(m, _engine_span(m, "run_batch"), end, tokens, requests_completed=completed,
                    requests_failed=failed, prompt_tokens=prompt, cached_prompt_tokens=cached)


def _dagster_timeline(home: Path, launched_at: float) -> dict[str, Any]:
    """Step timings of the pipeline's one run, from the Dagster event log (seconds since launch)."""
    import dagster as dg
    from dagster import DagsterEventType as T

    saved = os.environ.get("DAGSTER_HOME")
    os.environ["DAGSTER_HOME"] = str(home)  # the instance's dagster.yaml reads its storage dir from it
    try:
        with dg.DagsterInstance.from_config(str(home)) as instance:
            run = instance.get_runs(limit=1)[0]
            steps: dict[str, dict[str, float]] = {}
            shard_results_meta: dict[str, Any] = {}
            run_start = run_end = None
            for entry in instance.all_logs(run.run_id):
                ev = entry.dagster_event
                if ev is None:
                    continue
                at = entry.timestamp - launched_at
                kind = ev.event_type
                if kind == T.RUN_START:
                    run_start = at
                elif kind in (T.RUN_SUCCESS, T.RUN_FAILURE):
                    run_end = at
                elif kind == T.STEP_START and ev.step_key is not None:
                    steps.setdefault(ev.step_key, {})["start"] = at
                elif kind in (T.STEP_SUCCESS, T.STEP_FAILURE) and ev.step_key is not None:
                    steps.setdefault(ev.step_key, {})["end"] = at
                elif kind == T.ASSET_MATERIALIZATION and ev.step_key == "shard_results":
                    meta = ev.step_materialization_data.materialization.metadata
                    shard_results_meta = {k: getattr(v, "value", v) for k, v in meta.items()}
    finally:
        if saved is None:
            os.environ.pop("DAGSTER_HOME", None)
        else:
            os.environ["DAGSTER_HOME"] = saved
    return {"run_id": run.run_id, "run_start_at_s": run_start and round(run_start, 2),
            "run_end_at_s": run_end and round(run_end, 2),
            "steps": {k: {"start_at_s": round(v.get("start", 0), 2), "end_at_s": round(v.get("end", 0), 2),
                          "duration_s": round(v.get("end", 0) - v.get("start", 0), 2)} for k, v in steps.items()},
            "shard_results_metadata": shard_results_meta}


def stage_pipeline(ctx: dict[str, Any]) -> dict[str, Any]:
    """`batch-dagster run FILE --out DIR --json`, through Dagster, in a fresh DAGSTER_HOME and data dir."""
    from batch_dagster.batchfile.folder import OUTPUT, BatchFolder, batch_ids
    from batch_dagster.settings import Settings
    from batch_dagster.storage import LocalStorage

    base = ctx["work"] / "pipeline"
    home, data, out = base / "dagster_home", base / "data", base / "out"
    env = {
        "DAGSTER_HOME": str(home),
        "BATCH_DATA_DIR": str(data),
        # The prepared models stay where `make setup` put them.
        "BATCH_MODEL_CACHE": str(Settings.from_env().model_cache_dir),
        **ctx["env"],
    }
    cli = Path(sys.executable).with_name("batch-dagster")
    # The CLI sends the engine's and Dagster's output to its run log (the summary names it): the engine's
    # log lines are read from that file as it grows. The CLI's JSON summary ends with a "}" line: the
    # batch is done and its files are in place.
    m = _run([str(cli), "run", str(ctx["input"]), "--out", str(out), "--json"], "pipeline", ctx, env,
             follow_glob=str(data / "logs" / "run-*.log"),
             done_when=lambda printed: any(line == "}" and src == "out" for _, line, src in printed[-50:]),
             exit_grace_s=float(os.environ.get("BENCH_EXIT_GRACE_S") or 60))
    storage = LocalStorage(data)
    ids = batch_ids(storage)
    done = [BatchFolder(storage, batch_id).summary() for batch_id in ids]
    if len(done) != 1 or done[0] is None:
        raise StageFailed(f"pipeline: expected one finished batch, found {ids}:\n{m.tail()}")
    summary = done[0].to_dict()
    ctx["answers"]["pipeline"] = answers_of(out / OUTPUT)
    ctx["outputs"]["pipeline"] = out / OUTPUT
    timeline = _dagster_timeline(home, m.launched_at)
    step = timeline["steps"].get("shard_results")
    if not step:
        raise StageFailed(f"pipeline: no shard_results step in the event log:\n{m.tail()}")
    rc = summary["request_counts"]
    usage = summary["usage"]
    return _metrics(m, _engine_span(m, "pipeline"), step["end_at_s"], usage["output_tokens"],
                    requests_completed=rc["completed"], requests_failed=rc["failed"],
                    prompt_tokens=usage["input_tokens"],
                    cached_prompt_tokens=(usage.get("input_tokens_details") or {}).get("cached_tokens") or 0,
                    summary_inference_s=summary.get("inference_s"), request_counts=rc, dagster=timeline)


def answer(line: dict[str, Any]) -> Any:
    """The answer's text (or embedding) in a line of an OpenAI Batch output file (run_batch's and the pipeline's
    alike)."""
    body = (line.get("response") or {}).get("body") or {}
    if body.get("object") == "list":
        return ((body.get("data") or [{}])[0]).get("embedding")
    choice = (body.get("choices") or [{}])[0]
    return (choice.get("message") or {}).get("content") or choice.get("text") or ""


def answers_of(output_file: Path) -> dict[str, Any]:
    """custom_id -> the answer's text (or embedding), for each line of an output file."""
    with open(output_file, "rb") as f:
        return {line["custom_id"]: answer(line) for line in map(orjson.loads, f)}


def same(a: Any, b: Any) -> bool:
    """The same text, or embeddings no component of which differs by more than EMBED_TOLERANCE."""
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(abs(x - y) <= EMBED_TOLERANCE for x, y in zip(a, b, strict=True))
    return a == b


def same_answers(answers: dict[str, dict[str, Any]], reference: str = "run_batch") -> dict[str, Any]:
    """Per stage, how many of the reference stage's answers it gave identically (same custom_id, same text)."""
    ref = answers.get(reference)
    if ref is None:
        return {}
    return {"reference": reference} | {
        stage: {"identical": sum(same(got.get(cid), text) for cid, text in ref.items()), "compared": len(ref)}
        for stage, got in answers.items() if stage != reference
    }


def registry_file(spec: Any, out: Path) -> Path:
    """A registry holding `spec` alone, for the pipeline's process (BATCH_MODELS_FILE) to run what the other stages
    run (a BENCH_DTYPE)."""

    def value(v: Any) -> str:
        if isinstance(v, dict):
            return "{ " + ", ".join(f"{k} = {value(x)}" for k, x in v.items()) + " }"
        return json.dumps(v)  # strings, numbers and booleans are written alike in JSON and TOML

    fields = {k: v for k, v in vars(spec).items() if k != "name" and v is not None}
    out.write_text(f"[models.{spec.name}]\n" + "".join(f"{k} = {value(v)}\n" for k, v in fields.items()))
    return out


RUNNERS = {"raw_engine": stage_raw_engine, "run_batch": stage_run_batch, "pipeline": stage_pipeline}


def ratios(results: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    def ratio(a: str, b: str, key: str) -> float | None:
        if a in results and b in results and results[b][key]:
            return round(results[a][key] / results[b][key], 3)
        return None

    return {
        "pipeline_vs_run_batch_wall": ratio("pipeline", "run_batch", "wall_s"),
        # Each runner's output tokens/s as a share of the raw engine's best (every request in one call, in the
        # pipeline's order).
        "pipeline_vs_raw_engine_tok_s": ratio("pipeline", "raw_engine", "output_tok_s"),
        "run_batch_vs_raw_engine_tok_s": ratio("run_batch", "raw_engine", "output_tok_s"),
        "pipeline_vs_run_batch_tok_s": ratio("pipeline", "run_batch", "output_tok_s"),
        "pipeline_vs_run_batch_requests_s": ratio("pipeline", "run_batch", "requests_s"),
        "pipeline_vs_raw_engine_requests_s": ratio("pipeline", "raw_engine", "requests_s"),
        "run_batch_vs_raw_engine_wall": ratio("run_batch", "raw_engine", "wall_s"),
        "pipeline_vs_run_batch_inference": ratio("pipeline", "run_batch", "inference_s"),
        "pipeline_vs_run_batch_prefill_tokens": ratio("pipeline", "run_batch", "prefill_tokens"),
    }


def markdown_table(report: dict[str, Any]) -> str:
    head = ["stage", "wall s", "engine start s", "inference s", "output tokens", "output tok/s", "requests/s",
            "prefill tokens", "peak RSS MB"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for stage in STAGES:
        r = report.get(stage)
        if r:
            rows.append("| " + " | ".join([stage, *(f"{r[k]:,}" if isinstance(r[k], int) else f"{r[k]:,.1f}"
                                                     if r.get(k) is not None else "-" for k in METRICS)]) + " |")
    meta = report["meta"]
    ratio_text = ", ".join(f"{k} = {v}" for k, v in report["ratios"].items() if v is not None)
    shares = ", ".join(f"{stage} {report['ratios'][f'{stage}_vs_raw_engine_tok_s']:.0%}" for stage in STAGES[1:]
                       if report["ratios"].get(f"{stage}_vs_raw_engine_tok_s") is not None)
    answers = report.get("answers") or {}
    same = ", ".join(f"{stage} {a['identical']:,}/{a['compared']:,}" for stage, a in answers.items()
                     if stage != "reference")
    return "\n".join(rows) + (f"\n\n{meta['requests']:,} requests ({meta['workload']}), model {meta['model']} in "
                              f"{meta['dtype']['dtype']}, {meta['machine']}."
                              + (f"\nRatios: {ratio_text}." if ratio_text else "")
                              + (f"\nOutput tok/s as a share of the raw engine's best: {shares}." if shares else "")
                              + (f"\nAnswers identical to {answers['reference']}'s: {same}." if same else ""))


def machine() -> str:
    import psutil

    cpu = platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    gpus = 0
    try:
        import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # no torch, or a CPU build: no GPU either way
        pass
    return (f"{os.cpu_count()} cores ({cpu}), {psutil.virtual_memory().total / 2**30:.0f} GiB RAM, "
            + (f"{gpus} GPU(s)" if gpus else "no GPU"))


def _write(out: Path, report: dict[str, Any]) -> dict[str, Any]:
    report = {k: v for k, v in report.items() if v is not None}
    report["ratios"] = ratios(report)
    out.write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2) + b"\n")
    return report


def git_state() -> str | None:
    """The commit measured, with "+dirty" when the working tree has changes."""
    import subprocess

    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+dirty" if dirty else "")


def main() -> None:
    from batch_dagster.defs.resources.from_env import resources_from_env
    from batch_dagster.engine.hardware import dtype_choice
    from batch_dagster.settings import Settings

    model = workload_model()
    try:
        n, shape, write = workload_from_env(model)
    except ValueError as exc:
        sys.exit(str(exc))
    # The raw engine's llm.chat takes no tools or response formats: the structured workload runs the other two.
    default = STAGES[1:] if shape == "structured" else STAGES
    stages = [s.strip() for s in (os.environ.get("BENCH_STAGES") or ",".join(default)).split(",") if s.strip()]
    unknown = set(stages) - set(STAGES)
    if unknown:
        sys.exit(f"Unknown BENCH_STAGES {sorted(unknown)}; choose from {', '.join(STAGES)}")
    out = Path(os.environ.get("BENCH_OUT") or REPO / "bench" / "results" / "latest.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    keep = os.environ.get("BENCH_KEEP_WORK") == "1"

    work = Path(tempfile.mkdtemp(prefix="batch-dagster-bench-"))
    # Its variables read, as a run reads them.
    vllm = resources_from_env(Settings.from_env())["vllm"].process_config_and_initialize()
    spec, stage_env = vllm.spec(model), {}
    if os.environ.get("BENCH_DTYPE"):
        spec = replace(spec, dtype=os.environ["BENCH_DTYPE"])
        stage_env = {"BATCH_MODELS_FILE": str(registry_file(spec, work / "models.toml"))}
    ctx = {"work": work, "spec": spec, "model_path": vllm.model_path(spec), "out": out, "answers": {}, "outputs": {},
           "env": stage_env,
           "profile": os.environ.get("BENCH_PROFILE") == "1",
           "timeout_s": float(os.environ.get("BENCH_STAGE_TIMEOUT_S") or 4 * 3600),
           "quiet_wait_s": float(os.environ.get("BENCH_QUIET_WAIT_S") or 600),
           "input": write(work / "input.jsonl")}
    import psutil

    report: dict[str, Any] = {"meta": {
        "requests": n, "workload": shape, "model": model, "machine": machine(),
        "dtype": dtype_choice(spec.dtype).record(), "python": platform.python_version(),
        "vllm": vllm.model_record(model)["vllm_version"], "engine_settings": spec.engine_settings(),
        "input_bytes": ctx["input"].stat().st_size, "stages": stages, "git": git_state(),
        "load_avg_before": [round(x, 2) for x in psutil.getloadavg()],
        "started_at": datetime.now(UTC).isoformat(timespec="seconds"),
    }}
    if os.environ.get("BENCH_RESUME") == "1" and out.exists():
        # Keep the stages an earlier run of the same workload finished (a stage takes ~25 min at 5000).
        earlier = json.loads(out.read_text())
        same = {k: earlier["meta"].get(k) for k in ("requests", "workload", "model", "input_bytes")} == \
            {k: report["meta"][k] for k in ("requests", "workload", "model", "input_bytes")}
        if same:
            report |= {s: earlier[s] for s in STAGES if s in earlier and s not in stages}
            report["meta"]["resumed_from"] = earlier["meta"].get("started_at")
    print(f"bench: {n} requests of {model}, work dir {work}", file=sys.stderr)
    failed = False
    try:
        for stage in stages:
            waited = wait_for_quiet(ctx["quiet_wait_s"])
            started = time.perf_counter()
            print(f"bench: {stage} ...{f' (waited {waited:.0f} s for a quiet machine)' if waited > 5 else ''}",
                  file=sys.stderr, flush=True)
            try:
                report[stage] = RUNNERS[stage](ctx) | {"quiet_wait_s": waited}
            except StageFailed as exc:
                failed = True
                report[stage] = None
                print(f"bench: {stage} FAILED: {exc}", file=sys.stderr)
                continue
            r = report[stage]
            print(f"bench: {stage} done in {time.perf_counter() - started:.0f} s: "
                  + ", ".join(f"{k}={r.get(k)}" for k in METRICS), file=sys.stderr, flush=True)
            report["answers"] = same_answers(ctx["answers"]) or report.get("answers")
            if shape == "structured":
                report["structured"] = structured_report.report(ctx["input"], ctx["outputs"])
            _write(out, report)  # after every stage, so a run stopped midway keeps what it measured
    finally:
        if keep or failed:
            print(f"bench: work dir kept: {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)
    report["meta"]["load_avg_after"] = [round(x, 2) for x in psutil.getloadavg()]
    report = _write(out, report)
    print(markdown_table(report))
    if report.get("structured"):
        print("\n" + structured_report.markdown(report["structured"]))
    print(f"\nResults: {out}", file=sys.stderr)
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
