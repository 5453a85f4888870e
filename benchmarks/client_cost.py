"""Client cost on the paper's CNN: one local epoch vs the Fisher pass vs a naive loop.

Measures, on one data set in one run, with FedNet's 28x28x1 variant:

- one local training epoch (``fedfiot_flwr.task.train``, batch 64, the paper's SGD);
- the Fisher pass of ``diagonal_fisher`` (per-layer closed forms, ``method="auto"``);
- the same with plain ``torch.func`` (``vmap`` of a ``vjp`` over examples, ``method="vmap"``);
- the naive per-example loop (``method="loop"``), on the same examples;
- the Fisher pass of the baseline code (``--baseline-rev``), for a ratio against it;

and reports the Fisher pass as a multiple of one epoch and its speed-up over the loop. The
data are real Fashion-MNIST training images when the Debian package's IDX files are
installed, else random inputs of that shape. Lazy initialisation (the first optimizer
step imports torch._dynamo) is excluded by a warm-up.

Usage::

    python benchmarks/client_cost.py [--examples 10000] [--threads N] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import sys
import time
from pathlib import Path

import importlib

import torch
from torch.utils.data import DataLoader, TensorDataset

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.baseline_code import DEFAULT_BASELINE_REV, load_baseline  # noqa: E402
from benchmarks.portable import command_line  # noqa: E402

from fedfiot_flwr.fisher import diagonal_fisher
from fedfiot_flwr.models import build_model
from fedfiot_flwr.task import default_device, train

FMNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
RESULT = Path(__file__).resolve().parent / "results" / "client_cost.md"


def load_examples(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, str]:
    """``n`` normalised Fashion-MNIST training images (or random ones) and labels."""
    if all((FMNIST_DIR / f"{s}.gz").exists() for s in ("train-images-idx3-ubyte", "train-labels-idx1-ubyte")):
        from fedfiot_flwr.data import load_dataset

        bundle = load_dataset("fashion-mnist", download=False)
        data = bundle.train_eval
        idx = torch.randperm(len(data), generator=torch.Generator().manual_seed(seed))[:n].tolist()
        xs, ys = zip(*(data[i] for i in idx))
        return torch.stack(list(xs)), torch.tensor(ys), f"Fashion-MNIST (Debian package, {FMNIST_DIR}), {n} random training images"
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 1, 28, 28, generator=gen)
    y = torch.randint(0, 10, (n,), generator=gen)
    return x, y, f"random N(0, 1) inputs of shape 1x28x28 (Fashion-MNIST not installed), {n} examples"


def timed(fn, *args, **kwargs):  # type: ignore[no-untyped-def]
    """``(result, wall seconds, process CPU seconds)``."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start, cpu = time.perf_counter(), time.process_time()
    out = fn(*args, **kwargs)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return out, time.perf_counter() - start, time.process_time() - cpu


def best_of(repeats: int, fn, *args, **kwargs):  # type: ignore[no-untyped-def]
    """Fastest of ``repeats`` runs (wall and CPU minima; the last result)."""
    runs = [timed(fn, *args, **kwargs) for _ in range(max(1, repeats))]
    return runs[-1][0], min(r[1] for r in runs), min(r[2] for r in runs)


def max_rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k].double() - b[k].double()).abs().max() / b[k].double().abs().max()) for k in b)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--examples", type=int, default=10_000, help="examples in the local data set")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: CUDA when available)")
    parser.add_argument("--skip-vmap", action="store_true", help="skip the plain torch.func pass")
    parser.add_argument("--out", type=Path, default=RESULT)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=2, help="runs of the epoch and of the fast Fisher pass")
    parser.add_argument("--baseline-rev", default=DEFAULT_BASELINE_REV, help="git revision of the baseline Fisher pass")
    parser.add_argument("--skip-loop", action="store_true", help="skip the (slow) naive loop")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device) if args.device else default_device()

    x, y, source = load_examples(args.examples, args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    train_dl = DataLoader(TensorDataset(x, y), batch_size=args.batch_size, shuffle=True, generator=gen)
    eval_dl = DataLoader(TensorDataset(x, y), batch_size=args.batch_size)
    model = build_model("fednet", (1, 28, 28), 10, seed=args.seed)

    # warm-up: lazy imports and allocator / kernel selection
    warm = DataLoader(TensorDataset(x[:256], y[:256]), batch_size=args.batch_size)
    train(build_model("fednet", (1, 28, 28), 10, seed=1), warm, 1, device=device, progress=False)
    for method in ("auto", "vmap", "loop"):
        diagonal_fisher(model.to(device), [(x[:8], y[:8])], method=method)

    load0 = os.getloadavg()[0]
    init = copy.deepcopy(model.state_dict())

    def one_epoch() -> dict[str, float]:
        model.load_state_dict(init)  # every repeat trains the same epoch from the same weights
        return train(model, train_dl, 1, device=device, progress=False)

    old_fisher = importlib.import_module(f"{load_baseline(args.baseline_rev).__name__}.fisher").diagonal_fisher
    old_fisher(model, [(x[:8], y[:8])], method="auto")
    # Interleaved: epoch, Fisher pass, baseline Fisher pass, repeated; minima kept.
    runs: dict[str, list] = {"epoch": [], "auto": [], "old": []}
    for _ in range(max(1, args.repeats)):
        runs["epoch"].append(timed(one_epoch))
        runs["auto"].append(timed(diagonal_fisher, model, eval_dl, method="auto", progress=False))
        runs["old"].append(timed(old_fisher, model, eval_dl, method="auto", progress=False))
    best = {k: (v[-1][0], min(r[1] for r in v), min(r[2] for r in v)) for k, v in runs.items()}
    (metrics, t_epoch, c_epoch), (fisher_auto, t_auto, c_auto), (fisher_old, t_old, c_old) = (
        best["epoch"], best["auto"], best["old"])
    rows = [("one local training epoch (SGD, batch %d)" % args.batch_size, t_epoch, c_epoch),
            ("Fisher pass, per-layer closed forms (`method=\"auto\"`)", t_auto, c_auto),
            ("Fisher pass, baseline code (`--baseline-rev`, `benchmarks/baseline_code.py`)", t_old, c_old)]
    t_vmap = c_vmap = None
    if not args.skip_vmap:
        fisher_vmap, t_vmap, c_vmap = timed(diagonal_fisher, model, eval_dl, method="vmap")
        rows.append(("Fisher pass, plain torch.func vmap (`method=\"vmap\"`)", t_vmap, c_vmap))
    if args.skip_loop:
        fisher_loop, t_loop, c_loop = fisher_auto, float("nan"), float("nan")
    else:
        fisher_loop, t_loop, c_loop = timed(diagonal_fisher, model, eval_dl, method="loop")
        rows.append(("naive per-example loop (`method=\"loop\"`)", t_loop, c_loop))
    load1 = os.getloadavg()[0]
    ratio_epoch, speedup = t_auto / t_epoch, t_loop / t_auto

    lines = [
        "# Client cost: local epoch vs Fisher pass (benchmarks/client_cost.py)",
        "",
        f"- model: FedNet, 28x28x1 variant ({sum(p.numel() for p in model.parameters()):,} weights, no biases)",
        f"- data: {source}",
        f"- device: {device} ({platform.processor() or platform.machine()}), torch {torch.__version__}, "
        f"{torch.get_num_threads()} CPU threads, load average {load0:.2f} -> {load1:.2f} "
        f"on {os.cpu_count()} cores (shared machine)",
        f"- batch size {args.batch_size} for training and for the Fisher passes; the Fisher passes "
        f"run on the trained model, without augmentation; train accuracy of the epoch "
        f"{metrics['train-accuracy']:.3f}",
        "",
        f"Wall-clock seconds, and process CPU seconds (robust to other jobs on a shared machine "
        f"when threads <= free cores); epoch and per-layer Fisher: best of {args.repeats}.",
        "",
        "| pass | wall s | CPU s | wall ms / example | x epoch (wall) | x epoch (CPU) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, t, c in rows:
        lines.append(
            f"| {name} | {t:.2f} | {c:.2f} | {1000 * t / args.examples:.3f} | {t / t_epoch:.2f} | {c / c_epoch:.2f} |"
        )
    ratio_cpu, speedup_cpu = c_auto / c_epoch, c_loop / c_auto
    lines += [
        "",
        "Ratios (wall / CPU):",
        "",
        f"- Fisher pass / one epoch: {ratio_epoch:.2f}x / {ratio_cpu:.2f}x (baseline code: {t_old / t_epoch:.2f}x / "
        f"{c_old / c_epoch:.2f}x; this pass / the baseline's {t_auto / t_old:.2f} / {c_auto / c_old:.2f})",
        *([] if args.skip_loop else [
            f"- Fisher pass against the naive loop: {speedup:.1f}x / {speedup_cpu:.1f}x faster"]),
    ]
    if t_vmap is not None and c_vmap is not None:
        lines.append(f"- per-layer closed forms vs plain vmap: {t_vmap / t_auto:.1f}x / {c_vmap / c_auto:.1f}x faster")
    lines += [
        "",
        "Agreement (max over tensors of max |difference| / max |reference|, float32): "
        + ("" if args.skip_loop else f"auto vs loop {max_rel_diff(fisher_auto, fisher_loop):.1e}, ")
        + f"auto vs baseline {max_rel_diff(fisher_auto, fisher_old):.1e}"
        + (f", vmap vs loop {max_rel_diff(fisher_vmap, fisher_loop):.1e}" if t_vmap is not None else ""),
        "",
        f"Command: `{command_line(interpreter='python')}`",
        "",
    ]
    text = "\n".join(lines)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
