"""What the Gram and K-FAC curvatures cost next to the diagonal Fisher, on the paper's CNN: client pass, upload, merge.

In one process, with FedNet's 28x28x1 variant and K clients of ``--examples`` Fashion-MNIST training
images each (random inputs of that shape when the Debian package is missing):

- client: one local training epoch, the diagonal Fisher pass, the input-Gram pass (one forward pass,
  every Linear and Conv2d layer) and the K-FAC pass (the Grams and, from one backward pass, each layer's
  output factor), as multiples of the epoch;
- upload: the bytes of the Fisher, Gram and K-FAC replies (8-bit low rank, ``rank="fedavg"``) next to
  FedAvg's float32 upload;
- server: FedFiOT's merge of the K clients with each curvature (the engine, one candidate, the paper's
  identity rule), best of ``--repeats``, interleaved, and their ratio.

The clients are independently initialised and trained for ``--epochs`` epochs on their own images, so the
alignment has units to move. Usage::

    python benchmarks/curvature_cost.py [--clients 6] [--examples 2000] [--epochs 1] [--threads N]
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
import os
import platform
import sys
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.client_cost import load_examples  # noqa: E402
from benchmarks.portable import command_line  # noqa: E402
from fedfiot_flwr.client import fisher_reply  # noqa: E402
from fedfiot_flwr.merge import MergeOptions, merge  # noqa: E402
from fedfiot_flwr.models import build_model, permutation_spec  # noqa: E402
from fedfiot_flwr.options import CURVATURE_CONFIG_KEY  # noqa: E402
from fedfiot_flwr.task import train  # noqa: E402
from fedfiot_flwr.wire import decode_reply, fedavg_payload_bytes, payload_bytes  # noqa: E402

RESULT = Path(__file__).resolve().parent / "results" / "curvature_cost.md"


def timed(fn, *args, **kwargs):  # type: ignore[no-untyped-def]
    """``(result, wall seconds, process CPU seconds)`` of one call."""
    w, c = time.perf_counter(), time.process_time()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - w, time.process_time() - c


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Run the measurement, write the page (``--out``) and return its ratios."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, default=6)
    parser.add_argument("--examples", type=int, default=2000, help="examples per client")
    parser.add_argument("--epochs", type=int, default=1, help="local epochs before the passes")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULT)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    load0 = os.getloadavg()[0]
    passes = client_passes(args)
    spec = permutation_spec(passes.model)
    shapes = {n: tuple(t.shape) for n, t in passes.model.state_dict().items()}
    uploads = {name: [decode_reply(r, kind, client=str(k), expected_shapes=shapes) for k, r in enumerate(replies)]
               for name, (kind, replies) in {"diagonal": ("fisher", passes.replies["diagonal"]),
                                             "gram": ("gram", passes.replies["gram"]),
                                             "kfac": ("gram-output", passes.replies["kfac"])}.items()}
    sizes = [args.examples] * args.clients
    options = {"diagonal": MergeOptions(), "gram": MergeOptions(curvature="gram", gram_alpha=0.9),
               "kfac": MergeOptions(curvature="kfac", gram_alpha=0.9)}
    runs: dict[str, list] = {name: [] for name in options}
    for _ in range(max(1, args.repeats)):
        for name, opts in options.items():
            ups = uploads[name]
            curv = [u.fisher for u in ups] if name == "diagonal" else [u.grams for u in ups]
            runs[name].append(timed(merge, [u.weights for u in ups], curv, spec, opts, num_examples=sizes))
    best = {k: (min(r[1] for r in v), min(r[2] for r in v), v[-1][0]) for k, v in runs.items()}
    text = report(args, argv, passes, uploads, best, (load0, os.getloadavg()[0]))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)
    epoch = passes.seconds["epoch"][0]
    fedavg = fedavg_payload_bytes(passes.model.state_dict())
    out = {f"{name}_merge_per_diagonal_merge": best[name][0] / best["diagonal"][0] for name in ("gram", "kfac")}
    for name in ("diagonal", "gram", "kfac"):
        label = "fisher" if name == "diagonal" else name
        out[f"{label}_pass_per_epoch"] = passes.seconds[name][0] / epoch
        out[f"{label}_bytes_per_fedavg"] = payload_bytes(passes.replies[name][0])["total"] / fedavg
    return out


@dataclass
class ClientPasses:
    """The last client's model, every client's reply per curvature, and the mean (wall, CPU) seconds per pass."""

    model: torch.nn.Module
    replies: dict[str, list]
    seconds: dict[str, tuple[float, float]]
    source: str


def client_passes(args: argparse.Namespace) -> ClientPasses:
    """Train each client, then time one more epoch and each curvature's reply pass."""
    x, y, source = load_examples(args.clients * args.examples, 0)
    configs = {"diagonal": None, "gram": {CURVATURE_CONFIG_KEY: "gram"}, "kfac": {CURVATURE_CONFIG_KEY: "kfac"}}
    replies: dict[str, list] = {name: [] for name in configs}
    times: dict[str, list] = {name: [] for name in ("epoch", *configs)}
    for k in range(args.clients):
        part = slice(k * args.examples, (k + 1) * args.examples)
        data = TensorDataset(x[part], y[part])
        model = build_model("fednet", (1, 28, 28), 10, seed=k)
        gen = torch.Generator().manual_seed(k)
        train(model, DataLoader(data, batch_size=64, shuffle=True, generator=gen), args.epochs, progress=False)
        _, t_epoch, c_epoch = timed(train, model, DataLoader(data, batch_size=64, shuffle=True, generator=gen), 1,
                                    progress=False)
        times["epoch"].append((t_epoch, c_epoch))
        loader = DataLoader(data, batch_size=256)
        for name, config in configs.items():
            reply, wall, cpu = timed(fisher_reply, model, loader, {}, config=config)
            replies[name].append(reply)
            times[name].append((wall, cpu))
    seconds = {name: (sum(t[0] for t in v) / len(v), sum(t[1] for t in v) / len(v)) for name, v in times.items()}
    return ClientPasses(model, replies, seconds, source)


def report(args: argparse.Namespace, argv: list[str] | None, passes: ClientPasses, uploads: dict[str, list],
           best: dict[str, tuple], load: tuple[float, float]) -> str:
    """The result page."""
    model, sec = passes.model, passes.seconds
    t_epoch, c_epoch = sec["epoch"]
    fedavg = fedavg_payload_bytes(model.state_dict())
    rows = {"diagonal": "diagonal Fisher pass (per-example gradients)",
            "gram": "input Grams, every Linear and Conv2d layer (one forward pass)",
            "kfac": "input Grams and output factors (one forward and one backward pass)"}
    lines = [
        "# Cost of the Gram and K-FAC curvatures next to the diagonal Fisher (benchmarks/curvature_cost.py)",
        "",
        f"- model: FedNet, 28x28x1 variant ({sum(p.numel() for p in model.parameters()):,} weights, no biases); "
        f"{args.clients} clients of {args.examples} images each ({passes.source}), independently initialised, "
        f"{args.epochs} local epoch(s) before the passes",
        f"- {platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} CPU threads, load average "
        f"{load[0]:.2f} -> {load[1]:.2f} on {os.cpu_count()} cores",
        "",
        "Client (mean over the clients; wall s / CPU s; batch 64 for the epoch, 256 for the passes):",
        "",
        "| pass | wall s | CPU s | x epoch (wall) | x epoch (CPU) |",
        "|---|---:|---:|---:|---:|",
        f"| one local training epoch | {t_epoch:.2f} | {c_epoch:.2f} | 1.00 | 1.00 |",
    ]
    lines += [f"| {label} | {sec[n][0]:.2f} | {sec[n][1]:.2f} | {sec[n][0] / t_epoch:.2f} | {sec[n][1] / c_epoch:.2f} |"
              for n, label in rows.items()]
    sizes = {n: payload_bytes(passes.replies[n][0])["total"] for n in rows}
    lines += [
        "",
        f"Upload per client: FedAvg (float32) {fedavg:,} bytes; Fisher reply {sizes['diagonal']:,} "
        f"({sizes['diagonal'] / fedavg:.2f}x); Gram reply {sizes['gram']:,} ({sizes['gram'] / fedavg:.2f}x), rank "
        f"{uploads['gram'][0].rank}; K-FAC reply {sizes['kfac']:,} ({sizes['kfac'] / fedavg:.2f}x), rank "
        f"{uploads['kfac'][0].rank}.",
        "",
        f"Server merge of the {args.clients} clients (the engine, one candidate, best of {args.repeats}):",
        "",
        "| curvature | wall s | CPU s | neurons moved | kept |",
        "|---|---:|---:|---:|---|",
    ]
    for name in rows:
        wall, cpu, res = best[name]
        moved = 100 * sum(res.fraction_permuted) / len(res.fraction_permuted)
        lines.append(f"| {name} | {wall:.2f} | {cpu:.2f} | {moved:.0f} % | {'aligned' if res.aligned else 'identity'} |")
    for name, label in (("gram", "Gram"), ("kfac", "K-FAC")):
        lines += ["", f"{label} merge / diagonal merge: {best[name][0] / best['diagonal'][0]:.2f}x wall, "
                      f"{best[name][1] / best['diagonal'][1]:.2f}x CPU."]
    lines += ["", f"Command: `{command_line(argv, interpreter='python')}`", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
