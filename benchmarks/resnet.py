"""FedFiOT on residual BatchNorm networks: one-shot ResNet-20 on Fashion-MNIST, and ResNet-18 merge time.

``one-shot``: K clients train a narrow ResNet-20 (BatchNorm, ``--width`` base channels) from a
shared or from independent initialisations on a Dirichlet label split; every method merges the
SAME cached uploads (:mod:`benchmarks.harness`), chooses its knobs on the server validation set,
and only the chosen model is tested. Each method is reported twice: with the merged BatchNorm
statistics (the size-weighted average of the clients' permuted running statistics) and with the
statistics recomputed on the server's validation images
(:func:`fedfiot_flwr.batchnorm.recompute_batchnorm_statistics`; the same recalibration is used
when selecting knobs). The permutation spec is derived automatically (``spec_from_module``).

``merge-time``: FedFiOT's merge of K torchvision ResNet-18s (11.2M parameters, 32x32 inputs)
with random positive Fisher, independent and shared (+ small noise) initialisations: wall time
and fraction of neurons permuted.

Run (about 30 min on one busy CPU core for both inits, most of it the clients' Fisher pass):

    .venv/bin/python benchmarks/resnet.py one-shot              # uploads cached under benchmarks/cache/subset-*
    .venv/bin/python benchmarks/resnet.py merge-time

Outputs: ``benchmarks/results/resnet20_one_shot.{md,json}`` and
``benchmarks/results/resnet20_merge_time_resnet18.{md,json}``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from torch.utils.data import DataLoader, Subset  # noqa: E402

from benchmarks import harness as H  # noqa: E402
from benchmarks import server_methods as S  # noqa: E402
from fedfiot_flwr.batchnorm import recompute_batchnorm_statistics  # noqa: E402
from fedfiot_flwr.client import train_round  # noqa: E402
from fedfiot_flwr.merge import MergeOptions, merge, prepare_clients, spec_from_module  # noqa: E402
from fedfiot_flwr.task import default_device  # noqa: E402

METHODS = ("fedavg", "fisher-merge", "regmean", "fedfiot", "fedfiot-default", "fedfiot-refined", "best-single-client")
LABELS = {**H.METHOD_LABELS, **S.LABELS, "regmean": "RegMean"}
SERVER_DATA = ("fedfiot-refined", "best-single-client", "mean-client", "ensemble")
"""Rows that use the server's data beyond selection (:mod:`benchmarks.server_methods`); the refined
default recomputes BatchNorm statistics on its fitting fold, the clients keep their own."""


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    one = sub.add_parser("one-shot")
    one.add_argument("--width", type=int, default=8)
    one.add_argument("--clients", type=int, default=6)
    one.add_argument("--alpha", type=float, default=0.1)
    one.add_argument("--epochs", type=int, default=1)
    one.add_argument("--seed", type=int, default=0)
    one.add_argument("--inits", nargs="+", choices=H.INITS, default=list(H.INITS))
    one.add_argument("--methods", nargs="+", default=list(METHODS))
    one.add_argument("--grid", choices=sorted(H.GRIDS), default="tiny")
    one.add_argument("--fraction", type=float, default=0.25,
                     help="fraction of each client's examples it trains on (CPU budget)")
    one.add_argument("--fisher-examples", type=int, default=500,
                     help="examples of the client's training subset its Fisher is estimated on")
    one.add_argument("--cache-dir", type=Path, default=H.CACHE_DIR)
    one.add_argument("--name", default="resnet20_one_shot", help="output file stem")
    mt = sub.add_parser("merge-time")
    mt.add_argument("--clients", type=int, default=6)
    mt.add_argument("--max-iters", type=int, default=8)
    for q in (one, mt):
        q.add_argument("--out", type=Path, default=H.RESULTS_DIR)
        q.add_argument("--threads", type=int, default=1)
    return p.parse_args(argv)


def subset_uploads(setting: H.Setting, split: Any, buffers: Sequence[str], fraction: float, fisher_examples: int,
                   cache_dir: Path, device: torch.device, log: Callable[[str], None]) -> H.Uploads:
    """Like :func:`benchmarks.harness.one_shot_uploads`, each client training on a random ``fraction``
    of its examples (reported as its ``num_examples``) and estimating its Fisher on at most
    ``fisher_examples`` of them; cached per client under ``cache_dir`` (which must be specific to
    ``fraction`` and ``fisher_examples``: see :func:`subset_cache`)."""
    cfg = setting.app_config()
    broadcast = H.state_numpy(cfg.build_model(split)) if setting.init == "shared" else None
    results = []
    cached = True
    for pid in range(setting.clients):
        path = Path(cache_dir) / setting.cache_key() / f"client{pid}.npz"
        if path.is_file():
            results.append(H._load_client(path))
            continue
        cached = False
        if broadcast is None:
            model = cfg.build_model(split, seed=cfg.client_init_seed(pid))
        else:
            model = H.load_numpy(cfg.build_model(split), broadcast)
        seed = H.client_seed(cfg.seed, 1, pid)
        gen = torch.Generator().manual_seed(seed)
        n = len(split.clients[pid])
        keep = torch.randperm(n, generator=gen)[: max(1, round(fraction * n))].tolist()
        loader = DataLoader(Subset(split.clients[pid], keep), batch_size=cfg.batch_size, shuffle=True, generator=gen)
        fisher_loader = DataLoader(Subset(split.client_eval(pid), keep[:fisher_examples]), batch_size=1000)
        torch.manual_seed(seed)
        res = train_round(model, loader, cfg.local_epochs, device=device, fisherloader=fisher_loader,
                          num_examples=len(keep), progress=False, lr=cfg.lr)
        log(f"  client {pid}: {len(keep)} of {n} examples, train {res.train_seconds:.1f}s, "
            f"Fisher {res.fisher_seconds:.1f}s, "
            f"train acc {float(res.reply['metrics'].get('train-accuracy', math.nan)):.3f}")
        H._save_client(path, res)
        results.append(res)
    out = H.collect(results, buffers, broadcast)
    out.cached = cached
    return out


def subset_cache(cache_dir: Path, fraction: float, fisher_examples: int) -> Path:
    """Cache root of the subset uploads (and of the curvature baselines computed from them)."""
    return Path(cache_dir) / f"subset-f{fraction:g}-F{fisher_examples}"


def recalibrator(build: Callable[[], torch.nn.Module], batches: Sequence[Any]) -> Callable[[H.Model], H.Model]:
    """``model dict -> model dict`` with BN statistics recomputed on ``batches``."""
    model = build().to(batches[0][0].device)

    def recalibrate(state: H.Model) -> H.Model:
        H.load_numpy(model, state)
        recompute_batchnorm_statistics(model, batches)
        return H.state_numpy(model)

    return recalibrate


def one_shot(args: argparse.Namespace) -> dict[str, Any]:
    log = H.setup_logging(True)
    device = default_device()
    start = time.perf_counter()
    payload: dict[str, Any] = {"command": H.command_line(), "machine": H.machine_description(), "records": [],
                               "settings": [], "model": f"resnet20-w{args.width}"}
    cache = subset_cache(args.cache_dir, args.fraction, args.fisher_examples)
    for init in args.inits:
        setting = H.Setting("fashion-mnist", f"resnet20-w{args.width}", args.clients, args.alpha, init, args.seed,
                            args.epochs)
        split = setting.app_config().split()
        build, _, buffers = H.model_tools(setting, split)
        spec = spec_from_module(build())
        ev = H.Evaluator(split, build, device)
        recal = recalibrator(build, ev.validation)
        log(f"{setting.column()} (K={setting.clients}, {setting.model}, {len(spec.perm_names)} permutations)")
        uploads = subset_uploads(setting, split, buffers, args.fraction, args.fisher_examples, cache, device, log)
        payload["settings"].append({**H.record_fields(setting), "cached": uploads.cached,
                                    "train_seconds": uploads.train_seconds, "fisher_seconds": uploads.fisher_seconds,
                                    "client_sizes": list(uploads.quantized.num_examples),
                                    "fraction": args.fraction, "fisher_examples": args.fisher_examples})
        configs = H.method_configs([m for m in args.methods if m not in H.CURVATURE_METHODS + SERVER_DATA], init,
                                   args.grid)
        for bn in ("merged", "recomputed"):
            validate = ev.validate if bn == "merged" else (lambda m: ev.validate(recal(m)))
            for name, config in configs.items():
                res = H.apply_method(name, config, uploads, spec, buffers, validate)
                model = res.model if bn == "merged" else recal(res.model)
                loss, acc = ev.test(model)
                payload["records"].append({**H.record_fields(setting), "method": name, "bn": bn,
                                           "test_accuracy": acc, "test_loss": loss,
                                           "validation_accuracy": res.validation_accuracy,
                                           "fraction_permuted": res.fraction_permuted,
                                           "alignment_fraction_permuted": res.alignment_fraction_permuted,
                                           "knobs": res.knobs, "merge_seconds": res.merge_seconds})
                log(f"  {name:16s} BN {bn:10s} test {100 * acc:5.1f}%  val {100 * res.validation_accuracy:5.1f}%"
                    f"  permuted {100 * res.fraction_permuted:4.1f}%  {H.knob_text(res.knobs)}")
            for method in [m for m in args.methods if m in H.CURVATURE_METHODS]:
                cres = H.apply_curvature_method(method, setting, split, uploads, build, buffers, validate,
                                                H.FEDFISHER_STEPS, "true", cache, device, log)
                model = cres.model if bn == "merged" else recal(cres.model)
                loss, acc = ev.test(model)
                payload["records"].append({**H.record_fields(setting), "method": method, "bn": bn,
                                           "test_accuracy": acc, "test_loss": loss,
                                           "validation_accuracy": cres.validation_accuracy, "fraction_permuted": 0.0,
                                           "knobs": cres.knobs, "merge_seconds": cres.merge_seconds})
                log(f"  {method:16s} BN {bn:10s} test {100 * acc:5.1f}%  val {100 * cres.validation_accuracy:5.1f}%")
        server = [m for m in args.methods if m in SERVER_DATA]
        if server:
            options = replace(S.DEFAULT_REFINE, seed=setting.seed)
            for rec in S.run_server_methods(server, setting, split, uploads, build, spec, buffers, ev, options,
                                            args.grid, None, device, log):
                payload["records"].append({**H.record_fields(setting), **rec, "bn": "recomputed"})
        payload["wall_seconds"] = time.perf_counter() - start
        write(args.out, args.name, payload, one_shot_markdown(payload))
    return payload


def one_shot_markdown(payload: dict[str, Any]) -> str:
    recs = payload["records"]
    inits = list(dict.fromkeys(r["init"] for r in recs))
    methods = list(dict.fromkeys(r["method"] for r in recs))
    s0 = payload["settings"][0]
    lines = [
        f"# One-shot {payload['model']} (BatchNorm) on Fashion-MNIST", "",
        f"K = {s0['clients']}, Dirichlet alpha = {s0['alpha']:g}, {s0['epochs']} local epoch(s), seed {s0['seed']}, "
        f"server validation {s0['validation_size']} images. To fit a shared CPU, each client trains on a random "
        f"{100 * s0['fraction']:g}% of its examples (client sizes {s0['client_sizes']}) and estimates its Fisher on "
        f"at most {s0['fisher_examples']} of them; RegMean's Gram matrices use the clients' full data. Every method merges the same 16-bit uploads and "
        "chooses its knobs on validation accuracy. Test accuracy (%) on the 10,000 test images. The default preset "
        "(merge + server refinement) recomputes BatchNorm statistics on its 250-example fitting fold and is "
        "listed under 'BN recomputed'; the best single client keeps its own statistics.", "",
        "| method | " + " | ".join(f"{i} init, BN merged | {i} init, BN recomputed" for i in inits) + " |",
        "|---|" + "---|---|" * len(inits),
    ]
    for m in methods:
        cells = []
        for i in inits:
            for bn in ("merged", "recomputed"):
                hit = [r for r in recs if r["method"] == m and r["init"] == i and r["bn"] == bn]
                cells.append(f"{100 * hit[0]['test_accuracy']:.1f}" if hit else "")
        lines.append(f"| {LABELS.get(m, m)} | " + " | ".join(cells) + " |")
    lines += ["", "Fraction of neurons FedFiOT (paper preset) permuted: " + ", ".join(
        f"{i}: {100 * r['alignment_fraction_permuted']:.1f}%" for i in inits
        for r in recs if r["method"] == "fedfiot" and r["init"] == i and r["bn"] == "merged"), "",
        "Client training / Fisher time (s): " + ", ".join(
        f"{s['init']}: {s['train_seconds']:.0f} / {s['fisher_seconds']:.0f}" for s in payload["settings"]), "",
        f"Wall time {payload.get('wall_seconds', math.nan) / 60:.1f} min. Machine: {payload['machine']}.", "",
        f"Command: `{payload['command']}`", ""]
    return "\n".join(lines)


def merge_time(args: argparse.Namespace) -> dict[str, Any]:
    import torchvision

    rng = np.random.default_rng(0)
    rows = []
    for init in ("independent", "shared"):
        models = []
        for k in range(args.clients):
            torch.manual_seed(k if init == "independent" else 0)
            models.append(H.state_numpy(torchvision.models.resnet18(num_classes=10)))
        if init == "shared":  # clients that moved a little away from the broadcast model
            models = [{n: v + (0.05 * np.std(v) * rng.standard_normal(v.shape)).astype(v.dtype)
                       if v.dtype.kind == "f" and v.ndim else v for n, v in m.items()} for m in models]
        reference_model = torchvision.models.resnet18(num_classes=10)
        params = {n for n, _ in reference_model.named_parameters()}
        t0 = time.perf_counter()
        spec = spec_from_module(reference_model, example_input=torch.randn(2, 3, 32, 32))
        spec_seconds = time.perf_counter() - t0
        fishers = [{n: (rng.standard_normal(v.shape) ** 2).astype(np.float32) for n, v in m.items() if n in params}
                   for m in models]
        buffers = [n for n in models[0] if n not in params]
        sizes = list(rng.integers(500, 5000, args.clients))
        clients = prepare_clients(models, fishers, buffers=buffers, num_examples=sizes, cache_bytes=0)
        fedavg = merge(clients, None, spec, MergeOptions(matching="none", aggregation="size"))
        res = merge(clients, None, spec, MergeOptions(max_iters=args.max_iters))
        rows.append({"init": init, "clients": args.clients, "parameters": int(sum(np.size(models[0][n]) for n in params)),
                     "permutations": len(spec.perm_names), "neurons": int(sum(r.size for r in res.reports.values())),
                     "merge_seconds": res.seconds, "spec_seconds": spec_seconds, "fedavg_seconds": fedavg.seconds,
                     "fraction_permuted": float(np.mean(res.fraction_permuted)), "aligned_kept": res.aligned,
                     "iterations": {p: r.iterations for p, r in res.reports.items()}})
        print(rows[-1], flush=True)
    lines = ["# FedFiOT merge of torchvision ResNet-18 (K = %d)" % args.clients, "",
             "Random positive Fisher (squared normals); max_iters = %d; numpy engine, %s thread(s). "
             "Shared init: the same initialisation plus 5%%-of-std Gaussian noise per client." % (
                 args.max_iters, args.threads), "",
             "| init | parameters | permutations (neurons) | spec derivation (s) | merge (s) | FedAvg, same engine (s) "
             "| ratio | neurons permuted |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['init']} | {r['parameters']:,} | {r['permutations']} ({r['neurons']}) | "
                     f"{r['spec_seconds']:.1f} | {r['merge_seconds']:.1f} | {r['fedavg_seconds']:.1f} | "
                     f"{r['merge_seconds'] / r['fedavg_seconds']:.0f}x | {100 * r['fraction_permuted']:.1f}% |")
    lines += ["", f"Machine: {H.machine_description()}.", "", f"Command: `{H.command_line()}`", ""]
    payload = {"rows": rows, "machine": H.machine_description(), "command": H.command_line()}
    write(args.out, "resnet20_merge_time_resnet18", payload, "\n".join(lines))
    return payload


def write(out: Path, name: str, payload: dict[str, Any], markdown: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(payload, indent=1, default=str))
    (out / f"{name}.md").write_text(markdown)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    H.set_threads(args.threads)
    return one_shot(args) if args.command == "one-shot" else merge_time(args)


if __name__ == "__main__":
    main()
