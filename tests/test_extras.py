"""Optional dependencies: the core install imports without them, and each use names its extra."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from fedfiot_flwr.extras import require

ROOT = Path(__file__).resolve().parents[1]
CORE = {"flwr", "torch", "numpy", "scipy"}
BLOCKED = ("curvlinops", "matplotlib", "datasets", "flwr_datasets", "ray", "tqdm", "sklearn")


def _pyproject() -> dict:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))


# ------------------------------------------------------------------------------ the helper


def test_require_names_the_distribution_and_the_extra_of_a_missing_module() -> None:
    with pytest.raises(ImportError) as info:
        require("fedfiot_no_such_module", "no-such-dist", "some-extra", "the widget")
    message = str(info.value)
    assert "'no-such-dist' is needed for the widget" in message
    assert "pip install 'fedfiot-flwr[some-extra]'" in message
    assert info.value.name == "fedfiot_no_such_module"
    assert isinstance(info.value.__cause__, ModuleNotFoundError)


def test_require_returns_an_installed_module() -> None:
    import math

    assert require("math", "python", "core", "arithmetic") is math


# --------------------------------------------------------------------- pyproject vs the code


def _extra_closure(extras: dict[str, list[str]], extra: str) -> list[Requirement]:
    """Requirements of ``extra`` with the self-references (``fedfiot-flwr[a,b]``) expanded."""
    out: list[Requirement] = []
    for text in extras[extra]:
        req = Requirement(text)
        if req.name == "fedfiot-flwr":
            for inner in sorted(req.extras):
                out += _extra_closure(extras, inner)
        else:
            out.append(req)
    return out


def _require_calls() -> list[tuple[str, str, str, str]]:
    """``(file, module, distribution, extra)`` of every ``require(...)`` in the package."""
    calls = []
    for path in sorted((ROOT / "fedfiot_flwr").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "require":
                args = [a.value for a in node.args[:3] if isinstance(a, ast.Constant)]
                assert len(args) == 3, f"{path}: require() needs literal module, distribution and extra"
                calls.append((path.name, *args))
    return calls


def test_core_dependencies_are_flwr_torch_numpy_scipy() -> None:
    deps = [Requirement(d) for d in _pyproject()["project"]["dependencies"]]
    assert {d.name for d in deps} == CORE
    assert all(not d.extras for d in deps)  # plain flwr: Ray is the `simulation` extra


def test_every_require_names_an_extra_that_installs_its_distribution() -> None:
    extras = _pyproject()["project"]["optional-dependencies"]
    calls = _require_calls()
    assert len(calls) >= 8
    for where, module, distribution, extra in calls:
        assert extra in extras, f"{where}: require({module!r}) names the unknown extra {extra!r}"
        wanted = Requirement(distribution)
        provided = [r for r in _extra_closure(extras, extra) if r.name == wanted.name and wanted.extras <= r.extras]
        assert provided, f"{where}: extra {extra!r} does not install {distribution!r}"


def test_the_test_extra_holds_every_other_extra_but_the_optional_tools() -> None:
    extras = _pyproject()["project"]["optional-dependencies"]
    test = {str(r) for r in _extra_closure(extras, "test")}
    for extra in ("simulation", "data", "baselines", "plots", "progress", "app", "benchmarks"):
        assert {str(r) for r in _extra_closure(extras, extra)} <= test, extra


def _imported_top_level_modules(path: Path) -> set[str]:
    """Top-level names of every module ``path`` imports, wherever the import statement is."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names |= {alias.name.partition(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.partition(".")[0])
    return names


def test_the_package_imports_nothing_only_the_test_extra_installs() -> None:
    """Test-only tools (the local federation launcher and its TLS helpers) live outside the wheel."""
    extras = _pyproject()["project"]["optional-dependencies"]
    test_only = {Requirement(t).name for t in extras["test"] if Requirement(t).name != "fedfiot-flwr"}
    assert "cryptography" in test_only
    found = {path.relative_to(ROOT).as_posix(): sorted(_imported_top_level_modules(path) & test_only)
             for path in sorted((ROOT / "fedfiot_flwr").rglob("*.py"))}
    assert {where: names for where, names in found.items() if names} == {}
    assert "cryptography" in _imported_top_level_modules(ROOT / "scripts" / "launch.py")  # the scan sees them


def test_every_lazy_name_of_the_data_package_resolves() -> None:
    import fedfiot_flwr.data as data

    assert sorted(data.__all__) == sorted(data._LAZY)
    for name in data.__all__:
        assert getattr(data, name) is not None  # imports the submodule that defines it
    assert set(data.__all__) <= set(dir(data))
    with pytest.raises(AttributeError):
        data.no_such_name  # noqa: B018


# ------------------------------------------------------- the core install, extras blocked

CHILD = textwrap.dedent(
    """
    import json
    import sys

    # As if not installed: `import x` raises ModuleNotFoundError and importlib.util.find_spec
    # returns None (a meta-path finder that raises would break torch, which probes with find_spec).
    BLOCKED = sys.argv[1].split(",")
    for name in BLOCKED:
        sys.modules[name] = None
    out = {}


    def attempt(key, fn):
        try:
            fn()
            out[key] = "ok"
        except ImportError as err:
            out[key] = f"ImportError: {err}"
        except Exception as err:
            out[key] = f"{type(err).__name__}: {err}"


    def imports():
        import fedfiot_flwr, fedfiot_flwr.server, fedfiot_flwr.client, fedfiot_flwr.data  # noqa: F401
        from fedfiot_flwr import FedFiOT, FedFiOTConfig, fisher_reply  # noqa: F401
        from fedfiot_flwr.data import dirichlet_class_split, load_dataset  # noqa: F401


    attempt("imports", imports)

    import numpy as np
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from fedfiot_flwr.client import curvature_reply, fisher_reply, train_round

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    loader = DataLoader(TensorDataset(torch.randn(8, 4), torch.arange(8) % 3), batch_size=4)
    attempt("fisher_reply", lambda: fisher_reply(model, loader, {"num-examples": 8}, device="cpu"))
    attempt("train_round_auto_bar", lambda: train_round(model, loader, 1, device="cpu", progress=None))
    attempt("train_round_bar", lambda: train_round(model, loader, 1, device="cpu", progress=True))
    attempt("regmean", lambda: curvature_reply("regmean", model, loader, device="cpu"))
    attempt("gram_reply", lambda: fisher_reply(model, loader, {"num-examples": 8}, device="cpu",
                                               config={"fedfiot-curvature": "gram"}))
    attempt("kfac", lambda: curvature_reply("fedfisher-kfac", model, loader, device="cpu"))

    from fedfiot_flwr.data import dirichlet_class_split, load_dataset, save_partition_heatmap

    attempt("dirichlet", lambda: dirichlet_class_split(np.arange(60) % 3, 2, 0.5, 0))
    attempt("digits", lambda: load_dataset("digits"))
    attempt("heatmap", lambda: save_partition_heatmap([np.array([0, 1]), np.array([1])], sys.argv[2], num_classes=2))
    out["loaded"] = sorted(m for m, mod in sys.modules.items() if mod is not None and m.partition(".")[0] in BLOCKED)
    print(json.dumps(out))
    """
)


@pytest.fixture(scope="module")
def blocked_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """What the core install can and cannot do: one child process with the extras blocked."""
    png = tmp_path_factory.mktemp("extras") / "heatmap.png"
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, ",".join(BLOCKED), str(png)],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_strategy_client_and_data_packages_import_without_the_extras(blocked_run: dict) -> None:
    assert blocked_run["imports"] == "ok"
    assert blocked_run["loaded"] == []


def test_fisher_reply_runs_without_the_extras(blocked_run: dict) -> None:
    assert blocked_run["fisher_reply"] == "ok"
    assert blocked_run["train_round_auto_bar"] == "ok"  # a bar only where tqdm is installed
    assert blocked_run["dirichlet"] == "ok"  # numpy only


@pytest.mark.parametrize(
    ("key", "distribution", "extra"),
    [
        ("kfac", "curvlinops-for-pytorch", "baselines"),
        ("train_round_bar", "tqdm", "progress"),
        ("digits", "scikit-learn", "data"),
        ("heatmap", "matplotlib", "plots"),
    ],
)
def test_a_use_of_a_missing_extra_names_it(blocked_run: dict, key: str, distribution: str, extra: str) -> None:
    message = blocked_run[key]
    assert message.startswith("ImportError: the optional dependency "), message
    assert f"'{distribution}'" in message and f"pip install 'fedfiot-flwr[{extra}]'" in message, message


def test_curvature_messages_say_what_needs_curvlinops(blocked_run: dict) -> None:
    assert "FedFisher's K-FAC factors" in blocked_run["kfac"]


def test_input_grams_need_no_extra(blocked_run: dict) -> None:
    assert blocked_run["regmean"] == "ok"  # RegMean's Grams: one forward pass, no curvlinops
    assert blocked_run["gram_reply"] == "ok"  # FedFiOT's Gram curvature likewise


def test_launch_in_simulation_mode_without_ray_names_the_simulation_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib.util

    from scripts import launch

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a))
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    federation = launch.LocalFederation(mode="simulation", num_supernodes=1, workdir=tmp_path)
    try:
        with pytest.raises(ImportError, match=re.escape("pip install 'fedfiot-flwr[simulation]'")):
            federation.start()
        assert federation.processes == {}  # raised before starting anything
    finally:
        federation.stop()  # should the check ever let a SuperLink start
