"""Which channel-group derivation is right on the model zoo: torch-pruning's DependencyGraph or ours?

For every zoo model, both derivations are turned into a :class:`PermutationSpec` and every group
is checked the same way :func:`fedfiot_flwr.merge.spec_from_module` checks its own: permute the
group in a copy of the model whose float tensors all carry random noise (so BN statistics, zero
biases and unit norm weights are not trivially symmetric) and compare the outputs in float64.

torch-pruning's groups are pruning groups (which channels must be removed together); a group
converts to a permutation when each of its members is a Linear/Conv/norm layer or a plain
parameter. Groups touching a module it prunes internally (attention, RNNs, embeddings) are
counted as "not convertible". The classifier (last Linear layer) is passed as an ignored layer,
as torch-pruning's users do.

Run: ``.venv/bin/python research/resnet_channel_groups.py`` (needs ``torch-pruning``, the
``groups-comparison`` extra; about a
minute on one CPU core). Writes ``research/results/resnet20_channel_groups.{md,json}``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from fedfiot_flwr.merge import PermutationSpec, spec_from_module  # noqa: E402
from fedfiot_flwr.merge.trace import _failing_permutations  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def zoo() -> dict[str, tuple[nn.Module, torch.Tensor]]:
    """The test suite's zoo (same constructors), plus a model with a non-equivariant operation."""
    from test_model_zoo import ZOO, build

    models = {name: (build(name, 0), torch.randn(ZOO[name][1])) for name in ZOO}

    class SortedMLP(nn.Module):  # torch.sort along the features: no permutation of fc1 is safe
        def __init__(self) -> None:
            super().__init__()
            self.fc1, self.fc2, self.fc3 = nn.Linear(3, 6), nn.Linear(6, 5), nn.Linear(5, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.sort(torch.relu(self.fc1(x)), dim=1).values
            return self.fc3(torch.relu(self.fc2(h)))

    class ConcatCNN(nn.Module):  # two branches concatenated along the channels, then a split
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(3, 6, 3, padding=1)
            self.mix = nn.Conv2d(10, 8, 1)
            self.fc = nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.relu(self.mix(torch.cat([torch.relu(self.a(x)), torch.relu(self.b(x))], dim=1)))
            left, right = torch.split(h, 4, dim=1)
            return self.fc((left * right).mean((2, 3)))

    models["sorted_mlp"] = (SortedMLP(), torch.randn(2, 3))
    models["concat_split_cnn"] = (ConcatCNN(), torch.randn(2, 3, 8, 8))
    return models


def torch_pruning_spec(model: nn.Module, example: torch.Tensor) -> tuple[PermutationSpec, dict[str, int]]:
    """torch-pruning's DependencyGraph groups as a PermutationSpec, and counts of what converted."""
    import torch_pruning as tp

    graph = tp.DependencyGraph().build_dependency(model, example_inputs=example)
    names = {m: n for n, m in model.named_modules()}
    param_names = {p: n for n, p in model.named_parameters()}
    state = model.state_dict()
    axes: dict[str, list[Any]] = {k: [None] * v.dim() for k, v in state.items()}
    counts = {"groups": 0, "converted": 0, "not_convertible": 0}
    # As torch-pruning's users do: keep the classifier's outputs (the last Linear layer) out of the groups.
    head = [m for m in model.modules() if isinstance(m, nn.Linear)][-1:]
    for gi, group in enumerate(graph.get_all_groups(ignored_layers=head)):
        counts["groups"] += 1
        perm = f"G{gi}"
        size = len(group.items[0].idxs)
        entries: dict[tuple[str, int], Any] = {}
        ok = True
        for item in group.items:
            mod, n = item.dep.target.module, len(item.idxs)
            out = item.dep.handler.__name__.endswith("out_channels")
            if n < size or n % size:  # a slice of a larger axis (split / concatenation)
                ok = False
                break
            block = n // size
            entry = perm if block == 1 else (perm, block)
            if isinstance(mod, nn.Parameter):
                name = param_names.get(mod)
                if name is None:
                    ok = False
                    break
                entries[(name, int(item.dep.target.pruning_dim))] = entry
                continue
            if mod not in names:  # elementwise / reshape / concat nodes of the graph
                continue
            prefix = names[mod]
            if isinstance(mod, (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear)):
                if out:
                    entries[(f"{prefix}.weight", 0)] = entry
                    if mod.bias is not None:
                        entries[(f"{prefix}.bias", 0)] = entry
                elif state[f"{prefix}.weight"].shape[1] == n:
                    entries[(f"{prefix}.weight", 1)] = entry
                elif state[f"{prefix}.weight"].shape[1] > 1:  # a slice of the inputs (concatenation)
                    ok = False
                    break
            elif isinstance(mod, (nn.modules.batchnorm._BatchNorm, nn.GroupNorm, nn.LayerNorm)):
                for local in ("weight", "bias", "running_mean", "running_var"):
                    key = f"{prefix}.{local}"
                    if key in state:
                        entries[(key, state[key].dim() - 1)] = entry
            else:
                ok = False
                break
        if not ok or any(axes[k][a] is not None for k, a in entries):
            counts["not_convertible"] += 1
            continue
        counts["converted"] += 1
        for (k, a), e in entries.items():
            axes[k][a] = e
    return PermutationSpec({k: tuple(v) for k, v in axes.items()}), counts


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Compare the two derivations on every zoo model (or ``--models``); write ``<out>/resnet20_channel_groups.{md,json}``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=None, help="zoo models to compare (default: all)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    trace_log = logging.getLogger("fedfiot_flwr.merge.trace")
    level = trace_log.level
    trace_log.setLevel(logging.ERROR)  # the derivations' warnings, for this comparison only
    try:
        return _compare(args)
    finally:
        trace_log.setLevel(level)


def _compare(args: argparse.Namespace) -> dict[str, Any]:
    rows = []
    for name, (model, example) in zoo().items():
        if args.models is not None and name not in args.models:
            continue
        model.eval()
        row: dict[str, Any] = {"model": name}
        t0 = time.perf_counter()
        ours = spec_from_module(model, example_input=example, verify=False)
        row["ours_seconds"] = time.perf_counter() - t0
        row["ours_groups"] = len(ours.perm_names)
        row["ours_failing"] = _failing_permutations(model, ours, example)
        try:
            t0 = time.perf_counter()
            theirs, counts = torch_pruning_spec(model, example)
            row["tp_seconds"] = time.perf_counter() - t0
            row.update({f"tp_{k}": v for k, v in counts.items()})
            row["tp_failing"] = _failing_permutations(model, theirs, example)
            row["tp_groups_as_perms"] = len(theirs.perm_names)
        except Exception as err:  # noqa: BLE001 - a failure is a result here
            row["tp_error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:160] if str(err) else ''}"
        rows.append(row)
        print(row, flush=True)
    lines = [
        "# Channel groups: torch-pruning's DependencyGraph vs the project's fx union-find", "",
        "Each derived group is permuted alone in a noise-perturbed float64 copy of the model; a group "
        "*fails* when the outputs change. `ours` is checked without its own numerical filter "
        "(`verify=False`), so the failures column shows what the graph rules alone get wrong.", "",
        "| model | ours: groups | ours: failing | torch-pruning: groups | converted | not convertible | failing |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "tp_error" in r:
            tp_cols = f"error: {r['tp_error']} | | |"
        else:
            tp_cols = f"{r['tp_groups']} | {r['tp_converted']} | {r['tp_not_convertible']} | {len(r['tp_failing'])}"
        lines.append(f"| {r['model']} | {r['ours_groups']} | {len(r['ours_failing'])} | {tp_cols} |")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "resnet20_channel_groups.md").write_text("\n".join(lines) + "\n")
    (args.out / "resnet20_channel_groups.json").write_text(json.dumps(rows, indent=1))
    return {"rows": rows}


if __name__ == "__main__":
    main()
