"""Why clients cannot train from some Gram merges: the merged weights' norms, and one local epoch from each merge.

On the one-shot benchmark's cached uploads (one setting), merges the clients' Gram replies with the engine for
each ``(alpha, ridge)`` in ``--knobs``, both the aligned merge (kept whatever its objective, as the validation
choice may keep it) and the identity merge, and reports per merge: validation accuracy and loss, every weight's
Frobenius norm, its growth (the largest ratio of a tensor's norm to the longest client's, which the strategy's
``gram_growth`` bounds), and the training loss of the largest client's next local epoch started from it (SGD, the
benchmark's learning rate, momentum 0.9, weight decay 2e-3: the first epoch of the clients' schedule;
``--no-next-epoch`` leaves it out). FedAvg of the float32 uploads is the first row. Usage::

    python research/gram_weight_norms.py [--dataset fashion-mnist] [--alpha 0.1] [--seed 0] [--epochs 25]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import harness as H  # noqa: E402
from benchmarks.portable import command_line  # noqa: E402
from fedfiot_flwr.merge import MergeOptions, merge  # noqa: E402
from fedfiot_flwr.server.selection import longest_norms  # noqa: E402
from fedfiot_flwr.wire import decode_reply  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dataset", default="fashion-mnist")
    p.add_argument("--alpha", type=float, default=0.1)
    p.add_argument("--clients", type=int, default=6)
    p.add_argument("--init", default="shared", choices=("shared", "independent"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--epochs", type=int, default=25)
    p.add_argument("--lr", type=float, default=0.02)
    p.add_argument("--knobs", nargs="+", default=["1,0", "1,0.01", "1,0.1", "0.9,0", "0.5,0"],
                   help="alpha,ridge pairs")
    p.add_argument("--no-next-epoch", action="store_true", help="leave out the next local epoch (norms only)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=RESULTS / "gram_weight_norms.md")
    p.add_argument("--cache-dir", type=Path, default=H.CACHE_DIR)
    return p.parse_args(argv)


def next_epoch_losses(build: Any, model: dict[str, np.ndarray], data: Any, lr: float, every: int = 40) -> list[float]:
    """The training loss every ``every`` batches of one SGD epoch from ``model`` (batch 64, a fixed order)."""
    net = H.load_numpy(build(), model)
    net.train()
    opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9, weight_decay=2e-3)
    loader = DataLoader(data, batch_size=64, shuffle=True, generator=torch.Generator().manual_seed(0))
    out = []
    for b, (x, y) in enumerate(loader):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
        if b % every == 0:
            out.append(float(loss.item()))
    return out


def row(label: str, model: dict[str, np.ndarray], ev: H.Evaluator, build: Any, data: Any | None, lr: float,
        longest: dict[str, float]) -> dict[str, Any]:
    """One merge's validation scores, weight norms, growth and (with ``data``) next epoch's losses."""
    scores = ev.validate(model)
    growth = {n: float(np.linalg.norm(model[n])) / longest[n] for n in longest if longest[n] > 0}
    return {"merge": label, "val_accuracy": scores["accuracy"], "val_loss": scores["loss"],
            "norms": {n: float(np.linalg.norm(v)) for n, v in model.items() if n.endswith("weight")},
            "growth": max(growth.values()), "grown_tensor": max(growth, key=growth.__getitem__),
            "next_epoch": [] if data is None else next_epoch_losses(build, model, data, lr)}


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    setting = H.Setting(args.dataset, H.DEFAULT_MODELS[args.dataset], args.clients, args.alpha, args.init, args.seed,
                        args.epochs, 0, 200 if args.dataset == "digits" else 500, 64, args.lr, "")
    split = setting.app_config().split()
    build, spec, buffers = H.model_tools(setting, split)
    uploads = H.one_shot_uploads(setting, split, buffers, cache_dir=args.cache_dir, device=torch.device("cpu"))
    replies = H.curvature_replies("fedfiot-gram", setting, split, uploads, build, cache_dir=args.cache_dir,
                                  device=torch.device("cpu"))
    grams = [decode_reply(r, "gram", client=str(k), expected_shapes=None) for k, r in enumerate(replies.replies)]
    sizes = [g.num_examples for g in grams]
    largest = int(np.argmax(sizes))
    ev = H.Evaluator(split, build, torch.device("cpu"))
    share = np.asarray(sizes, dtype=np.float64) / sum(sizes)
    fedavg = {n: sum(c * w[n] for c, w in zip(share, uploads.float32.weights)).astype(uploads.float32.weights[0][n].dtype)
              for n in uploads.float32.weights[0]}
    data = None if args.no_next_epoch else split.clients[largest]
    longest = longest_norms(uploads.float32.weights)
    rows = [row("FedAvg (float32 uploads)", fedavg, ev, build, data, args.lr, longest)]
    for knob in args.knobs:
        alpha, ridge = (float(v) for v in knob.split(","))
        for fallback, label in (("none", "aligned"), ("objective", "by J")):
            opts = MergeOptions(curvature="gram", gram_alpha=alpha, gram_ridge=ridge, fallback=fallback)
            out = merge([g.weights for g in grams], [g.grams for g in grams], spec, opts, num_examples=sizes)
            kept = label if fallback == "none" else ("aligned" if out.aligned else "identity") + " (by J)"
            rows.append(row(f"Gram α={alpha:g}, ridge={ridge:g}, {kept}", out.model, ev, build, data, args.lr,
                            longest))
    write(args, argv, rows, largest)
    return rows


def write(args: argparse.Namespace, argv: list[str] | None, rows: list[dict[str, Any]], largest: int) -> None:
    names = list(rows[0]["norms"])
    lines = [
        "# Weight norms of the Gram merges, and the clients' next local epoch from them",
        "",
        f"Command: `{command_line(argv, script='research/gram_weight_norms.py', interpreter='python')}`",
        "",
        f"{args.dataset}, K = {args.clients}, α = {args.alpha:g}, {args.init} initialisation, seed {args.seed}, "
        f"{args.epochs} local epochs (the one-shot benchmark's cached uploads and Gram replies). 'aligned': the "
        "aligned merge kept whatever its objective (as a validation choice may keep it); 'by J': the paper's "
        f"identity rule. Growth: the largest ratio of a tensor's norm to the longest client's norm of it, and that "
        "tensor. " + ("" if args.no_next_epoch else
                      f"Next epoch: client {largest} (the largest), SGD lr {args.lr:g}, momentum 0.9, weight decay "
                      "2e-3, batch 64; its training loss every 40 batches."),
        "",
        "| merge | val acc | val loss | " + " | ".join(f"‖{n}‖" for n in names) + " | growth | next epoch's loss |",
        "|---|---:|---:|" + "---:|" * len(names) + "---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['merge']} | {100 * r['val_accuracy']:.1f} | {r['val_loss']:.3f} | "
                     + " | ".join(f"{r['norms'][n]:.1f}" for n in names) + f" | {r['growth']:.2f} ({r['grown_tensor']}) | "
                     + (", ".join(f"{v:.2f}" for v in r["next_epoch"]) or "–") + " |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
