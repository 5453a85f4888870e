"""The library as it was at an earlier git revision, importable next to the current one.

Benchmarks compare the current merge against an earlier revision's in one process (same data,
same machine load): ``load_baseline("<rev>")`` extracts ``fedfiot_flwr/`` at that revision into a
temporary directory as the package ``fedfiot_flwr_baseline`` and imports it.
"""

from __future__ import annotations

import importlib
import io
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent
# The revision the speed work started from (the merge engine before shared sweep work).
DEFAULT_BASELINE_REV = "750926e"


def load_baseline(rev: str = DEFAULT_BASELINE_REV) -> ModuleType:
    """Import ``fedfiot_flwr`` at git revision ``rev`` as ``fedfiot_flwr_baseline``.

    Raises
    ------
    RuntimeError
        When ``rev`` is not a revision of this repository.
    """
    if "fedfiot_flwr_baseline" in sys.modules:
        return sys.modules["fedfiot_flwr_baseline"]
    try:
        tar = subprocess.run(["git", "archive", rev, "fedfiot_flwr"], cwd=ROOT, check=True, capture_output=True).stdout
    except subprocess.CalledProcessError as err:
        raise RuntimeError(f"cannot read revision {rev!r}: {err.stderr.decode().strip()}") from err
    target = Path(tempfile.mkdtemp(prefix="fedfiot-baseline-"))
    with tarfile.open(fileobj=io.BytesIO(tar)) as archive:
        archive.extractall(target, filter="data")
    (target / "fedfiot_flwr").rename(target / "fedfiot_flwr_baseline")
    sys.path.insert(0, str(target))
    try:
        return importlib.import_module("fedfiot_flwr_baseline")
    finally:
        sys.path.remove(str(target))
