"""How far a reader walks to follow one request through a shard: `python tools/walk.py [--all]`.

It runs a batch of one request (a chat request at temperature 0, whose answer the answer store keeps) through the
lifecycle on the fake engine of the tests, with a metadata store (so the cost cap and the spend it records are in
play) and answer reuse on, and records every call into the package while the inference step runs its shard: from the
loop's first question about the shard (BatchFolder.stop_reason) to the end of the step's function (`infer`).

The walk is the calls the loop's own module makes (a reader reads that module whole, its helpers too; what it calls
elsewhere is a room the reader enters): `--all` counts every call into the package, at any depth, instead. It prints
the rooms (modules) and floors (packages) entered, the stays (each time the walk enters a room other than the one it is
in), and the names (the distinct functions and classes called), then the walk itself.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "batch_dagster"
sys.path.insert(0, str(REPO))


INLINE = ("<genexpr>", "<listcomp>", "<setcomp>", "<dictcomp>")  # a comprehension is its caller's own code


def _module(filename: str) -> str | None:
    path = Path(filename)
    if not path.is_relative_to(PACKAGE):
        return None
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


class Walk:
    """Calls into the package while `infer` runs, once the loop has asked its first question about the shard."""

    def __init__(self, loop_module: str, every_call: bool):
        self.loop_module, self.every_call = loop_module, every_call
        self.started = False
        self.calls: list[tuple[str, str]] = []  # (module, qualified name)

    def profile(self, frame: Any, event: str, arg: Any) -> None:
        if event != "call":
            return
        module = _module(frame.f_code.co_filename)
        if module is None:
            return
        name = frame.f_code.co_qualname
        if name.rpartition(".")[2] in INLINE:
            return
        if not self.started and name == "BatchFolder.stop_reason":
            self.started = True
            self._ancestors(frame.f_back)
        if self.started and self._counted(frame):
            self.calls.append((module, name))

    def _counted(self, frame: Any) -> bool:
        caller = frame.f_back
        return self.every_call or (caller is not None and _module(caller.f_code.co_filename) == self.loop_module)

    def _ancestors(self, frame: Any) -> None:
        """The calls that led from the loop to its first question (a helper of the loop asking it), oldest first."""
        chain = []
        while frame is not None and frame.f_code.co_name != "infer":
            module = _module(frame.f_code.co_filename)
            if module is not None and frame.f_code.co_name not in INLINE and self._counted(frame):
                chain.append((module, frame.f_code.co_qualname))
            frame = frame.f_back
        self.calls += reversed(chain)

    def report(self) -> str:
        rooms = list(dict.fromkeys(module for module, _ in self.calls))
        floors = list(dict.fromkeys(module.rpartition(".")[0] for module in rooms))
        stays, here = 0, self.loop_module
        for module, _ in self.calls:
            if module != here:
                stays, here = stays + 1, module
        names = list(dict.fromkeys(f"{module}.{name}" for module, name in self.calls))
        lines = [f"{stays} stays, {len(set(rooms) | {self.loop_module})} rooms (modules), "
                 f"{len(set(floors))} floors (packages), {len(names)} names, {len(self.calls)} calls",
                 "rooms: " + ", ".join(sorted(set(rooms) | {self.loop_module}))]
        return "\n".join(lines + [f"  {name}" for name in names])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--all", action="store_true", help="count every call into the package, at any depth")
    args = parser.parse_args()

    import dagster as dg

    from batch_dagster.defs.assets import inference
    from batch_dagster.defs.runner import run_batch
    from tests.helpers import FakeEngine, chat_request, fake_vllm, make_defs, write_jsonl

    walk = Walk(inference.__name__, args.all)
    infer: Callable[..., Any] = inference.infer

    def traced(*a: Any, **k: Any) -> Any:
        sys.setprofile(walk.profile)
        try:
            return infer(*a, **k)
        finally:
            sys.setprofile(None)

    inference.infer = traced  # type: ignore[assignment]
    with tempfile.TemporaryDirectory(prefix="walk-") as scratch:
        tmp = Path(scratch)
        defs = make_defs(tmp / "data", fake_vllm("walk", FakeEngine()), reuse_answers=True,
                         database_url=f"sqlite:///{tmp / 'store.db'}")
        source = write_jsonl(tmp / "in.jsonl", [chat_request("r1", "What is a shard?", temperature=0)])
        with dg.instance_for_test() as instance:
            outcome = run_batch(source, tmp / "out", show_progress=False, defs=defs, instance=instance)
    assert outcome.batch.status == "completed", outcome.to_dict()
    print(walk.report())


if __name__ == "__main__":
    main()
