"""The library as it was at an earlier git revision, importable next to the current one.

Benchmarks compare the current merge against an earlier revision's in one process (same data,
same machine load): ``load_baseline("<rev>")`` extracts ``fedfiot_flwr/`` at that revision into a
temporary directory as the package ``fedfiot_flwr_baseline`` (or ``name``), with its absolute
imports renamed, and imports it.
"""

from __future__ import annotations

import importlib
import io
import re
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent
# The revision the speed work started from (the merge engine before shared sweep work).
DEFAULT_BASELINE_REV = "750926e"


def load_baseline(rev: str = DEFAULT_BASELINE_REV, name: str = "fedfiot_flwr_baseline") -> ModuleType:
    """Import ``fedfiot_flwr`` at git revision ``rev`` as the package ``name``.

    Raises
    ------
    RuntimeError
        When ``rev`` is not a revision of this repository.
    """
    if name in sys.modules:
        return sys.modules[name]
    try:
        tar = subprocess.run(["git", "archive", rev, "fedfiot_flwr"], cwd=ROOT, check=True, capture_output=True).stdout
    except subprocess.CalledProcessError as err:
        raise RuntimeError(f"cannot read revision {rev!r}: {err.stderr.decode().strip()}") from err
    target = Path(tempfile.mkdtemp(prefix="fedfiot-baseline-"))
    with tarfile.open(fileobj=io.BytesIO(tar)) as archive:
        archive.extractall(target, filter="data")
    (target / "fedfiot_flwr").rename(target / name)
    for source in (target / name).rglob("*.py"):  # absolute imports must reach the old code, not the current
        text = source.read_text()
        if "fedfiot_flwr" in text:
            source.write_text(re.sub(r"\bfedfiot_flwr\b", name, text))
    sys.path.insert(0, str(target))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(target))
