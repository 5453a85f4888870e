"""What the Gram curvature costs next to the diagonal Fisher, on the paper's CNN: client pass, upload, server merge.

In one process, with FedNet's 28x28x1 variant and K clients of ``--examples`` Fashion-MNIST training
images each (random inputs of that shape when the Debian package is missing):

- client: one local training epoch, the diagonal Fisher pass and the input-Gram pass (one forward pass,
  every Linear and Conv2d layer), as multiples of the epoch;
- upload: the bytes of the Fisher reply and of the Gram reply (8-bit low rank, ``rank="fedavg"``) next to
  FedAvg's float32 upload;
- server: FedFiOT's merge of the K clients with each curvature (the engine, one candidate, the paper's
  identity rule), best of ``--repeats``, interleaved, and their ratio.

The clients are independently initialised and trained for ``--epochs`` epochs on their own images, so the
alignment has units to move. Usage::

    python benchmarks/curvature_cost.py [--clients 6] [--examples 2000] [--epochs 1] [--threads N]
"""

from __future__ import annotations

import argparse
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
    x, y, source = load_examples(args.clients * args.examples, 0)
    load0 = os.getloadavg()[0]
    fisher_replies, gram_replies, client_rows = [], [], []
    for k in range(args.clients):
        part = slice(k * args.examples, (k + 1) * args.examples)
        data = TensorDataset(x[part], y[part])
        model = build_model("fednet", (1, 28, 28), 10, seed=k)
        gen = torch.Generator().manual_seed(k)
        train(model, DataLoader(data, batch_size=64, shuffle=True, generator=gen), args.epochs, progress=False)
        _, t_epoch, c_epoch = timed(train, model, DataLoader(data, batch_size=64, shuffle=True, generator=gen), 1,
                                    progress=False)
        loader = DataLoader(data, batch_size=256)
        fr, t_f, c_f = timed(fisher_reply, model, loader, {})
        gr, t_g, c_g = timed(fisher_reply, model, loader, {}, config={CURVATURE_CONFIG_KEY: "gram"})
        fisher_replies.append(fr)
        gram_replies.append(gr)
        client_rows.append((t_epoch, c_epoch, t_f, c_f, t_g, c_g))
    state = model.state_dict()
    spec = permutation_spec(model)
    shapes = {n: tuple(t.shape) for n, t in state.items()}
    diag = [decode_reply(r, "fisher", client=str(k), expected_shapes=shapes) for k, r in enumerate(fisher_replies)]
    gram = [decode_reply(r, "gram", client=str(k), expected_shapes=shapes) for k, r in enumerate(gram_replies)]
    sizes = [args.examples] * args.clients
    runs: dict[str, list] = {"diagonal": [], "gram": []}
    for _ in range(max(1, args.repeats)):
        runs["diagonal"].append(timed(merge, [d.weights for d in diag], [d.fisher for d in diag], spec,
                                      MergeOptions(), num_examples=sizes))
        runs["gram"].append(timed(merge, [g.weights for g in gram], [g.grams for g in gram], spec,
                                  MergeOptions(curvature="gram", gram_alpha=0.9), num_examples=sizes))
    load1 = os.getloadavg()[0]
    best = {k: (min(r[1] for r in v), min(r[2] for r in v), v[-1][0]) for k, v in runs.items()}
    mean = [sum(col) / len(client_rows) for col in zip(*client_rows)]
    t_epoch, c_epoch, t_f, c_f, t_g, c_g = mean
    fedavg = fedavg_payload_bytes(state)
    b_fisher = payload_bytes(fisher_replies[0])["total"]
    b_gram = payload_bytes(gram_replies[0])["total"]
    lines = [
        "# Cost of the Gram curvature next to the diagonal Fisher (benchmarks/curvature_cost.py)",
        "",
        f"- model: FedNet, 28x28x1 variant ({sum(p.numel() for p in model.parameters()):,} weights, no biases); "
        f"{args.clients} clients of {args.examples} images each ({source}), independently initialised, "
        f"{args.epochs} local epoch(s) before the passes",
        f"- {platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} CPU threads, load average "
        f"{load0:.2f} -> {load1:.2f} on {os.cpu_count()} cores",
        "",
        "Client (mean over the clients; wall s / CPU s; batch 64 for the epoch, 256 for the passes):",
        "",
        "| pass | wall s | CPU s | x epoch (wall) | x epoch (CPU) |",
        "|---|---:|---:|---:|---:|",
        f"| one local training epoch | {t_epoch:.2f} | {c_epoch:.2f} | 1.00 | 1.00 |",
        f"| diagonal Fisher pass (per-example gradients) | {t_f:.2f} | {c_f:.2f} | {t_f / t_epoch:.2f} | "
        f"{c_f / c_epoch:.2f} |",
        f"| input Grams, every Linear and Conv2d layer (one forward pass) | {t_g:.2f} | {c_g:.2f} | "
        f"{t_g / t_epoch:.2f} | {c_g / c_epoch:.2f} |",
        "",
        f"Upload per client: FedAvg (float32) {fedavg:,} bytes; Fisher reply {b_fisher:,} ({b_fisher / fedavg:.2f}x); "
        f"Gram reply {b_gram:,} ({b_gram / fedavg:.2f}x), rank {gram[0].rank}.",
        "",
        f"Server merge of the {args.clients} clients (the engine, one candidate, best of {args.repeats}):",
        "",
        "| curvature | wall s | CPU s | neurons moved | kept |",
        "|---|---:|---:|---:|---|",
    ]
    for name in ("diagonal", "gram"):
        wall, cpu, res = best[name]
        moved = 100 * sum(res.fraction_permuted) / len(res.fraction_permuted)
        lines.append(f"| {name} | {wall:.2f} | {cpu:.2f} | {moved:.0f} % | {'aligned' if res.aligned else 'identity'} |")
    lines += [
        "",
        f"Gram merge / diagonal merge: {best['gram'][0] / best['diagonal'][0]:.2f}x wall, "
        f"{best['gram'][1] / best['diagonal'][1]:.2f}x CPU.",
        "",
        f"Command: `{command_line(argv, interpreter='python')}`",
        "",
    ]
    text = "\n".join(lines)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)
    return {"gram_pass_per_epoch": t_g / t_epoch, "fisher_pass_per_epoch": t_f / t_epoch,
            "gram_bytes_per_fedavg": b_gram / fedavg, "fisher_bytes_per_fedavg": b_fisher / fedavg,
            "gram_merge_per_diagonal_merge": best["gram"][0] / best["diagonal"][0]}


if __name__ == "__main__":
    main()
