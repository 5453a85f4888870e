"""Many-round benchmark: the shipped ``FedFiOT`` strategy against Flower's ``FedAvg``, round by round.

Both strategies run Flower's own round loop (``Strategy.start``) over an in-process grid whose
nodes run the same client code: the broadcast model is loaded, trained with the project's
trainer (SGD, momentum 0.9, weight decay 2e-3, cosine over the local epochs) on the same data
in the same order (the order's seed depends on the run seed, the round and the client only),
and answered as each strategy expects: Flower's float32 ``ArrayRecord`` for ``FedAvg``,
:func:`fedfiot_flwr.fisher_reply` for FedFiOT (which skips the Fisher pass when the round's
train config says the server will not use it). Partial participation samples clients with
Flower's own sampling, seeded identically for every method. Every method has Flower's evaluation
step: each node scores the models it is sent on its own held-out examples (a fifth as many as it
trains on, from the part of its partition ``--train-fraction`` leaves unused, else from its
share). No server data (except for ``fedfiot-server-data``): FedFiOT runs as a user who swaps it
into a Flower app without a ``validate_fn`` gets it.

Methods (``--methods``): ``fedavg`` (Flower's ``FedAvg``), ``fedfiot`` (``FedFiOTConfig.default()``
as shipped: the clients' evaluation chooses between each round's merge and FedAvg of the same
uploads, hands over to FedAvg after two FedAvg wins in a row, and asks for the curvature again in a
probe round after two FedAvg rounds, then four, eight, ...), ``fedfiot-gram`` (the same with the
Gram curvature), ``fedfiot-for-good`` (the default whose first hand-over is for good, no probe
rounds), ``fedfiot-every-round`` (the Fisher-weighted merge in every round, no choice),
``fedfiot-clients-every-round`` (the clients' choice without the hand-over),
``fedfiot-r<N>`` (the Fisher in rounds 1 to N, no choice) and ``fedfiot-server-data`` (the
default given half of the server's held-out examples as ``server_data``: it chooses each round's
merge on them, FedAvg of the same uploads included).

Per round and method: test accuracy and loss (the data set's test set), validation accuracy and
loss (the other half of the split's held-out server examples, never used by any method: it is
where a default is chosen), the clients' choice, the fraction of neurons the alignment moved, the
array bytes sent and received, the client seconds (training; the reply: Fisher pass and packing;
mean per client), the server seconds (``aggregate_train``) and the round's wall time.

Run:

    .venv/bin/python benchmarks/many_rounds.py --dataset fashion-mnist --clients 10 --rounds 30 \\
        --alphas 0 0.3 --seeds 0 1 2 --train-fraction 0.1 --name many_rounds_fashion
    .venv/bin/python benchmarks/many_rounds.py --quick          # digits, K = 4, 5 rounds, seconds

``--alphas 0`` is an IID split (equal random shares). Outputs (``--out``, default
``benchmarks/results``): ``<name>.md`` (margins per round, losses, seconds), ``<name>.json``
(one record per method, setting, seed and round), ``<name>.png`` (the curves).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg
from torch.utils.data import DataLoader, Subset

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import harness as H  # noqa: E402
from fedfiot_flwr import FedFiOT, FedFiOTConfig, fisher_reply  # noqa: E402
from fedfiot_flwr.app_config import client_round_seed  # noqa: E402
from fedfiot_flwr.batches import evaluate  # noqa: E402
from fedfiot_flwr.data import federated_split, load_dataset  # noqa: E402
from fedfiot_flwr.models import build_model  # noqa: E402
from fedfiot_flwr.task import train as local_train  # noqa: E402
from fedfiot_flwr.wire.sizes import content_bytes  # noqa: E402

METHODS = ("fedavg", "fedfiot", "fedfiot-gram", "fedfiot-for-good", "fedfiot-every-round",
           "fedfiot-clients-every-round", "fedfiot-server-data")


@dataclass(frozen=True)
class RoundsSetting:
    """One federation and training recipe; every method runs it with the same seed.

    Attributes
    ----------
    dataset, model : str
        Data set and model names.
    clients : int
        K, the number of SuperNodes.
    alpha : float
        Dirichlet concentration of the label split; 0: IID (equal random shares).
    epochs : int
        Local epochs per round.
    fraction_train : float
        Flower's ``fraction_train`` (clients sampled per round).
    rounds : int
        Server rounds.
    train_fraction : float
        Share of each client's partition it keeps (the CPU budget).
    seed : int
        Model initialisation, data order and client sampling.
    """

    dataset: str
    model: str
    clients: int
    alpha: float
    epochs: int
    fraction_train: float
    rounds: int
    train_fraction: float
    seed: int
    batch_size: int = 64
    lr: float = 0.02
    optimizer: str = "sgd"

    def label(self) -> str:
        """Table column of the setting (seeds aggregated)."""
        split = "IID" if self.alpha == 0 else f"Dir({self.alpha:g})"
        part = "" if self.fraction_train == 1 else f", {self.fraction_train:g} of clients per round"
        opt = "" if self.optimizer == "sgd" else f", {self.optimizer} lr={self.lr:g}"
        return f"{self.dataset} K={self.clients} {split} E={self.epochs}{part}{opt}"


@dataclass
class Federation:
    """The data of one setting: each client's examples, the server's held-out fold and the test set."""

    clients: list[Subset]
    client_eval: list[Subset]
    validation: Subset
    server_data: Subset
    test: Any
    input_shape: tuple[int, ...]
    num_classes: int


def build_federation(setting: RoundsSetting) -> Federation:
    """The split of ``setting`` (IID when ``alpha`` is 0), each client cut to ``train_fraction``.

    Each client also holds out examples of its own partition for its evaluate step, a fifth as many as it
    trains on: from the part of its partition ``train_fraction`` leaves unused when that is large
    enough (the training examples stay those of a run without the hold-out), else from its kept share.
    """
    bundle = load_dataset(setting.dataset)
    split = federated_split(bundle, num_partitions=setting.clients, alpha=setting.alpha or 1.0, partition_seed=0)
    rng = np.random.default_rng(0)
    if setting.alpha == 0:
        pooled = rng.permutation(np.concatenate(split.client_indices))
        parts = np.array_split(pooled, setting.clients)
    else:
        parts = [rng.permutation(idx) for idx in split.client_indices]
    keep, own_eval = [], []
    for p in parts:
        n = max(1, round(len(p) * setting.train_fraction))
        n_eval = max(1, round(0.2 * n))
        if len(p) - n >= n_eval:
            keep.append(p[:n])
            own_eval.append(p[n:n + n_eval])
        else:
            keep.append(p[: max(1, n - n_eval)])
            own_eval.append(p[max(1, n - n_eval):n])
    held_out = split.validation_indices
    half = len(held_out) // 2  # the server's own labelled examples and the fold that reports, apart
    return Federation([Subset(bundle.train, idx.tolist()) for idx in keep],
                      [Subset(bundle.train_eval, idx.tolist()) for idx in own_eval],
                      Subset(bundle.train_eval, held_out[half:].tolist()), Subset(bundle.train_eval, held_out[:half].tolist()),
                      bundle.test, tuple(bundle.input_shape), int(bundle.num_classes))


class InProcessGrid(Grid):
    """A Flower ``Grid`` whose nodes are functions run in this process (``node_id -> reply``)."""

    def __init__(self, nodes: dict[int, Callable[[Message], Message]]) -> None:
        self.nodes = nodes
        self._run: Any = None
        self._count = 0
        self.sent_bytes: dict[int, int] = {}
        """Per round, the array bytes of every message sent (training and evaluation)."""
        self.received_bytes: dict[int, int] = {}
        """Per round, the array bytes of every reply received."""

    def set_run(self, run_id: int) -> None:  # noqa: D102 - Grid's interface
        self._run = run_id

    @property
    def run(self) -> Any:  # noqa: D102
        return self._run

    def create_message(self, content: RecordDict, message_type: str, dst_node_id: int, group_id: str,
                       ttl: float | None = None) -> Message:  # noqa: D102
        return Message(content=content, dst_node_id=dst_node_id, message_type=message_type, group_id=group_id)

    def get_node_ids(self) -> list[int]:  # noqa: D102
        return list(self.nodes)

    def push_messages(self, messages: Iterable[Message]) -> list[str]:  # noqa: D102
        ids = []
        for msg in messages:
            self._count += 1
            msg.metadata.__dict__["_message_id"] = f"m{self._count}"
            ids.append(msg.metadata.message_id)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:  # noqa: D102
        raise NotImplementedError("the in-process grid answers in send_and_receive")

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> list[Message]:
        """Answer every message with its node's function, in order."""
        messages = list(messages)
        self.push_messages(messages)
        replies = [self.nodes[int(m.metadata.dst_node_id)](m) for m in messages]
        for msg, reply in zip(messages, replies):
            r = int(msg.content.config_records.get("config", {}).get("server-round", 0))
            self.sent_bytes[r] = self.sent_bytes.get(r, 0) + content_bytes(msg.content)
            self.received_bytes[r] = self.received_bytes.get(r, 0) + content_bytes(reply.content)
        return replies



@dataclass
class ClientTimes:
    """Per-round client seconds (training; the reply: Fisher pass and packing), summed over the round's clients."""

    train: dict[int, float]
    fisher: dict[int, float]
    count: dict[int, int]

    def add(self, server_round: int, train_s: float, fisher_s: float) -> None:
        """Record one client's round."""
        self.train[server_round] = self.train.get(server_round, 0.0) + train_s
        self.fisher[server_round] = self.fisher.get(server_round, 0.0) + fisher_s
        self.count[server_round] = self.count.get(server_round, 0) + 1


def client_node(setting: RoundsSetting, fed: Federation, pid: int, method: str,
                times: ClientTimes) -> Callable[[Message], Message]:
    """Node ``pid``'s ClientApp: load the broadcast model, train, answer as ``method`` expects; or, for an
    evaluate message, score it on the node's own held-out examples (loss, accuracy, their count)."""
    eval_batches = list(DataLoader(fed.client_eval[pid], batch_size=1000))

    def answer(msg: Message) -> Message:
        config = msg.content["config"]
        server_round = int(config.get("server-round", 0))
        model = build_model(setting.model, fed.input_shape, fed.num_classes, seed=setting.seed)
        model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        if msg.metadata.message_type == MessageType.EVALUATE:
            loss, accuracy = evaluate(model, eval_batches, device="cpu")
            metrics = {"eval-loss": loss, "eval-accuracy": accuracy, "num-examples": len(fed.client_eval[pid])}
            return Message(content=RecordDict({"metrics": MetricRecord(metrics)}), reply_to=msg)
        seed = client_round_seed(setting.seed, server_round, pid)
        torch.manual_seed(seed)
        data = fed.clients[pid]
        loader = DataLoader(data, batch_size=setting.batch_size, shuffle=True,
                            generator=torch.Generator().manual_seed(seed))
        t0 = time.perf_counter()
        if setting.optimizer == "adam":
            metrics = adam_train(model, loader, setting.epochs, setting.lr)
        else:
            metrics = local_train(model, loader, setting.epochs, lr=setting.lr, device="cpu", progress=False)
        t1 = time.perf_counter()
        metrics["num-examples"] = len(data)
        if method == "fedavg":
            content = RecordDict({"arrays": ArrayRecord(model.state_dict()), "metrics": MetricRecord(metrics)})
        else:
            content = fisher_reply(model, DataLoader(data, batch_size=256), metrics, config=config, device="cpu")
        times.add(server_round, t1 - t0, time.perf_counter() - t1)
        return Message(content=content, reply_to=msg)

    return answer


def adam_train(model: torch.nn.Module, loader: DataLoader, epochs: int, lr: float) -> dict[str, float]:
    """A user's own training loop, as in Flower's PyTorch examples: Adam at a constant ``lr``, cross-entropy."""
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    model.train()
    total, n = 0.0, 0
    for _ in range(epochs):
        for x, y in loader:
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            total, n = total + float(loss) * len(y), n + len(y)
    return {"train-loss": total / max(n, 1)}


def make_strategy(method: str, model: torch.nn.Module, fraction_train: float, server_data: Any) -> FedAvg:
    """The server strategy of ``method``, sampling ``fraction_train`` of the clients; every node evaluates.

    ``server_data`` (labelled examples) is given to ``fedfiot-server-data`` only: the default then
    chooses its merge (aligned, identity or FedAvg of the same uploads) on them every round.
    """
    common = {"fraction_train": fraction_train, "fraction_evaluate": 1.0, "min_train_nodes": 2,
              "min_evaluate_nodes": 2, "min_available_nodes": 2}
    fixed = {"round_choice": "none"}  # a fixed number of curvature rounds, without the clients' choice
    configs = {
        "fedfiot": None,
        "fedfiot-gram": FedFiOTConfig.default(curvature="gram"),
        "fedfiot-for-good": FedFiOTConfig.default(reprobe_after=None),
        "fedfiot-every-round": FedFiOTConfig.default(fisher_rounds=None, **fixed),
        "fedfiot-clients-every-round": FedFiOTConfig.default(handover_after=10**6),
    }
    if method == "fedavg":
        return FedAvg(**common)
    if method == "fedfiot-server-data":
        return FedFiOT(model=model, server_data=server_data, **common)
    if method in configs:
        return FedFiOT(model=model, config=configs[method], **common)
    if method.startswith("fedfiot-r") and method[len("fedfiot-r"):].isdigit():
        return FedFiOT(model=model, config=FedFiOTConfig.default(fisher_rounds=int(method[len("fedfiot-r"):]), **fixed),
                       **common)
    raise ValueError(f"unknown method {method!r}; choose from {METHODS} or fedfiot-r<N>")


def scorer(model: torch.nn.Module, data: Any) -> Callable[[ArrayRecord], tuple[float, float]]:
    """``arrays -> (accuracy %, mean loss)`` of ``model``'s architecture on ``data`` (:func:`fedfiot_flwr.batches.evaluate`)."""
    batches = list(DataLoader(data, batch_size=1000))

    def score(arrays: ArrayRecord) -> tuple[float, float]:
        model.load_state_dict(arrays.to_torch_state_dict())
        loss, accuracy = evaluate(model, batches, device="cpu")
        return 100.0 * accuracy, loss

    return score


def classifier_name(model: torch.nn.Module) -> str:
    """The state-dict name of the last layer's weight (the logits layer)."""
    return [name for name, p in model.named_parameters() if p.ndim == 2][-1]


def merge_diagnostics(model: torch.nn.Module, strategy: Any, batches: Sequence[Any]) -> dict[str, float]:
    """What this round's Fisher-weighted merge did that FedAvg of the same uploads would not.

    On the server's held-out fold: the mean logit norm and loss of the returned model and of FedAvg
    of the same uploads; on the uploads: the share of each client's logits-layer Fisher held by its
    largest 1 % of entries (mean over clients) and the returned logits layer's relative distance to
    FedAvg's.
    """
    last = getattr(strategy, "last_round", None)
    if last is None or last.uploads is None or "fedavg" not in last.alternatives:
        return {}
    name = classifier_name(model)

    @torch.no_grad()
    def logits_stats(weights: dict[str, np.ndarray]) -> tuple[float, float]:
        model.load_state_dict({k: torch.as_tensor(np.asarray(v)) for k, v in weights.items()})
        model.eval()
        outs, ys = zip(*((model(x), y) for x, y in batches))
        out, y = torch.cat(outs), torch.cat(ys)
        return float(out.norm(dim=1).mean()), float(torch.nn.functional.cross_entropy(out, y))

    own_norm, own_loss = logits_stats(last.model)
    avg_norm, avg_loss = logits_stats(last.alternatives["fedavg"])
    shares = []
    for fisher in last.uploads.fishers:
        f = np.sort(np.asarray(fisher.get(name, []), dtype=np.float64).ravel())[::-1]
        if f.size and f.sum() > 0:
            shares.append(float(f[: max(1, f.size // 100)].sum() / f.sum()))
    own_w, avg_w = np.asarray(last.model[name]), np.asarray(last.alternatives["fedavg"][name])
    return {"logit_norm": own_norm, "fedavg_same_logit_norm": avg_norm, "val_loss_own": own_loss,
            "fedavg_same_val_loss": avg_loss, "fisher_top1pct_share": float(np.mean(shares)) if shares else None,
            "logits_layer_distance_to_fedavg": float(np.linalg.norm(own_w - avg_w) / max(np.linalg.norm(avg_w), 1e-12))}


def run_method(setting: RoundsSetting, fed: Federation, method: str) -> list[dict[str, Any]]:
    """One method's trajectory: a record per round (round 0: the initial model)."""
    model = build_model(setting.model, fed.input_shape, fed.num_classes, seed=setting.seed)
    times = ClientTimes({}, {}, {})
    grid = InProcessGrid({pid + 1: client_node(setting, fed, pid, method, times) for pid in range(setting.clients)})
    strategy = make_strategy(method, model, setting.fraction_train, fed.server_data)
    server_s: dict[int, float] = {}
    aggregate = strategy.aggregate_train

    def timed(server_round: int, replies: Iterable[Message]) -> Any:
        t0 = time.perf_counter()
        out = aggregate(server_round, replies)
        server_s[server_round] = time.perf_counter() - t0
        return out

    strategy.aggregate_train = timed  # type: ignore[method-assign]
    test, val = scorer(model, fed.test), scorer(model, fed.validation)
    scores: dict[int, tuple[float, float, float, float]] = {}
    diagnostics: dict[int, dict[str, float]] = {}
    val_batches = list(DataLoader(fed.validation, batch_size=1000))

    wall: dict[int, float] = {}
    clock = [time.perf_counter()]

    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        wall[server_round] = time.perf_counter() - clock[0]  # the round, without this scoring
        scores[server_round] = (*test(arrays), *val(arrays))
        if server_round > 0:
            diagnostics[server_round] = merge_diagnostics(model, strategy, val_batches)
        clock[0] = time.perf_counter()
        return MetricRecord({"test-accuracy": scores[server_round][0]})

    random.seed(setting.seed)  # Flower samples clients with `random`: the same draws for every method
    initial = ArrayRecord(build_model(setting.model, fed.input_shape, fed.num_classes, seed=setting.seed).state_dict())
    strategy.start(grid, initial, num_rounds=setting.rounds, evaluate_fn=evaluate)
    server_metrics = getattr(strategy, "server_metrics", {})
    return [{**round_record(setting, method, r, scores[r], times, server_s, server_metrics),
             "round_s": wall.get(r, 0.0) if r > 0 else 0.0, "bytes_sent": grid.sent_bytes.get(r, 0),
             "bytes_replied": grid.received_bytes.get(r, 0), "diagnostics": diagnostics.get(r, {})}
            for r in sorted(scores)]


def round_record(setting: RoundsSetting, method: str, r: int, score: tuple[float, float, float, float],
                 times: ClientTimes, server_s: dict[int, float], server_metrics: dict[int, Any]) -> dict[str, Any]:
    """The JSON record of one round."""
    metrics = dict(server_metrics.get(r, {}))
    moved = metrics.get("alignment-moved-fraction")
    count = max(1, times.count.get(r, 0))
    return {
        **asdict(setting), "setting": setting.label(), "method": method, "round": r,
        "test_accuracy": score[0], "test_loss": score[1], "val_accuracy": score[2], "val_loss": score[3],
        "moved_fraction": None if moved is None else float(np.mean(np.asarray(moved, dtype=float))),
        "fisher_used": metrics.get("fisher-used"), "bytes_received": metrics.get("bytes-received"),
        "clients_kept_merge": metrics.get("clients-kept-merge"),
        "client_train_s": times.train.get(r, 0.0) / count, "client_reply_s": times.fisher.get(r, 0.0) / count,
        "server_s": server_s.get(r, 0.0),
    }


# ------------------------------------------------------------------------------------ report


def _series(records: Sequence[dict[str, Any]], setting: str, method: str, key: str) -> dict[int, list[float]]:
    out: dict[int, list[float]] = {}
    for rec in records:
        if rec["setting"] == setting and rec["method"] == method and rec[key] is not None:
            out.setdefault(rec["round"], []).append(float(rec[key]))
    return out


def margin_table(records: Sequence[dict[str, Any]], setting: str, methods: Sequence[str],
                 key: str = "test_accuracy") -> list[str]:
    """Rows: each FedFiOT variant's margin over FedAvg (mean ± std over seeds) at chosen rounds."""
    base = _series(records, setting, "fedavg", key)
    last = max(base) if base else 0
    rounds = sorted({r for r in (1, 2, 3, 5, 10, 15, 20, 25, 30, last) if r in base and r > 0})
    lines = ["| " + key + " | " + " | ".join(f"r{r}" for r in rounds) + " |", "|---" * (len(rounds) + 1) + "|"]
    lines.append("| fedavg | " + " | ".join(f"{np.mean(base[r]):.3f} ± {np.std(base[r]):.3f}" for r in rounds) + " |")
    for method in methods:
        if method == "fedavg":
            continue
        own = _series(records, setting, method, key)
        cells = []
        for r in rounds:
            diffs = [a - b for a, b in zip(own.get(r, []), base[r])]
            cells.append(f"{np.mean(diffs):+.2f} ± {np.std(diffs):.2f}" if diffs else "-")
        lines.append(f"| {method} − fedavg | " + " | ".join(cells) + " |")
    return lines


def cost_table(records: Sequence[dict[str, Any]], setting: str, methods: Sequence[str]) -> list[str]:
    """Mean seconds per round (client training, client Fisher pass, server aggregation, the whole round and
    its ratio to FedAvg's, overall and in the rounds without the curvature) and array bytes per round."""
    lines = ["| method | client train s | client reply s (Fisher pass, packing) | server s | round s | "
             "round / FedAvg's | without the curvature: round / FedAvg's | MB sent + received per round | "
             "rounds with Fisher |", "|---|---|---|---|---|---|---|---|---|"]

    def rounds_of(method: str) -> list[dict[str, Any]]:
        return [r for r in records if r["setting"] == setting and r["method"] == method and r["round"] > 0]

    base = np.mean([r.get("round_s", 0.0) for r in rounds_of("fedavg")]) if rounds_of("fedavg") else float("nan")
    for method in methods:
        recs = rounds_of(method)
        if not recs:
            continue
        used = sorted({r["round"] for r in recs if r["fisher_used"]})
        wall = np.mean([r.get("round_s", 0.0) for r in recs])
        plain = [r.get("round_s", 0.0) for r in recs if not r["fisher_used"]]
        plain_ratio = f"{np.mean(plain) / base:.2f}" if plain and method != "fedavg" else "-"
        mb = np.mean([(r.get("bytes_sent", 0) + r.get("bytes_replied", 0)) / 2**20 for r in recs])
        lines.append(f"| {method} | {np.mean([r['client_train_s'] for r in recs]):.2f} | "
                     f"{np.mean([r['client_reply_s'] for r in recs]):.2f} | {np.mean([r['server_s'] for r in recs]):.2f} | "
                     f"{wall:.2f} | {wall / base:.2f} | {plain_ratio} | {mb:.2f} | "
                     f"{(str(used[0]) + '-' + str(used[-1])) if used else '-'} |")
    return lines


def choice_table(records: Sequence[dict[str, Any]], setting: str, methods: Sequence[str]) -> list[str]:
    """Per method and seed, the clients' choice of every round: 1 the merge, 0 FedAvg, ``-`` no choice."""
    rows = []
    for method in methods:
        recs = [r for r in records if r["setting"] == setting and r["method"] == method and r["round"] > 0]
        if not any(r.get("clients_kept_merge") is not None for r in recs):
            continue
        for seed in sorted({r["seed"] for r in recs}):
            marks = "".join("-" if r.get("clients_kept_merge") is None else str(int(r["clients_kept_merge"]))
                            for r in sorted((r for r in recs if r["seed"] == seed), key=lambda r: r["round"]))
            rows.append(f"| {method} | {seed} | `{marks}` |")
    if not rows:
        return []
    return ["The clients' choice from round 1 on (1: the merge went on, 0: FedAvg of the same uploads, -: no "
            "choice, the curvature was not used):", "", "| method | seed | rounds |", "|---|---|---|", *rows]


def diagnostics_table(records: Sequence[dict[str, Any]], setting: str, methods: Sequence[str]) -> list[str]:
    """What the Fisher-weighted rounds did that FedAvg of the same uploads would not (mean over seeds)."""
    lines = ["| method | round | logit norm / FedAvg-of-the-same-uploads' | held-out loss − FedAvg's | "
             "Fisher share of the top 1 % logits-layer entries |", "|---|---|---|---|---|"]
    for method in methods:
        for r in (1, 2, 3, 5, 10, 20, 30):
            diags = [rec["diagnostics"] for rec in records if rec["setting"] == setting and rec["method"] == method
                     and rec["round"] == r and rec.get("diagnostics", {}).get("fisher_top1pct_share") is not None]
            if diags:
                ratio = np.mean([d["logit_norm"] / d["fedavg_same_logit_norm"] for d in diags])
                dloss = np.mean([d["val_loss_own"] - d["fedavg_same_val_loss"] for d in diags])
                share = np.mean([d["fisher_top1pct_share"] for d in diags])
                lines.append(f"| {method} | {r} | {ratio:.2f} | {dloss:+.3f} | {share:.2f} |")
    return lines if len(lines) > 2 else []


def markdown(payload: dict[str, Any]) -> str:
    """The results page."""
    records, methods = payload["records"], payload["methods"]
    lines = ["# Many rounds: FedFiOT against Flower's FedAvg", "", f"Command: `{payload['command']}`", "",
             f"Machine: {payload['machine']}. Seeds: {payload['seeds']}.", ""]
    for setting in dict.fromkeys(r["setting"] for r in records):
        lines += [f"## {setting}", ""]
        for key in ("test_accuracy", "test_loss", "val_accuracy"):
            lines += margin_table(records, setting, methods, key) + [""]
        moved = [r["moved_fraction"] for r in records if r["setting"] == setting and r["moved_fraction"] is not None]
        if moved:
            lines += [f"Neurons moved by the alignment: mean {100 * np.mean(moved):.2f} %, "
                      f"largest {100 * np.max(moved):.2f} % (over rounds, seeds and FedFiOT variants).", ""]
        lines += cost_table(records, setting, methods) + [""]
        choice = choice_table(records, setting, methods)
        if choice:
            lines += choice + [""]
        diag = diagnostics_table(records, setting, methods)
        if diag:
            lines += ["What a Fisher-weighted round returns against FedAvg of the same uploads, on the held-out "
                      "fold (mean over seeds):", ""] + diag + [""]
    return "\n".join(lines) + "\n"


def plot(payload: dict[str, Any], out: Path, name: str) -> Path | None:
    """Test accuracy and loss against the round, one column per setting (mean over seeds)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    records = payload["records"]
    settings = list(dict.fromkeys(r["setting"] for r in records))
    fig, axes = plt.subplots(2, len(settings), figsize=(5 * len(settings), 7), squeeze=False)
    for col, setting in enumerate(settings):
        for row, key in enumerate(("test_accuracy", "test_loss")):
            ax = axes[row][col]
            for method in payload["methods"]:
                series = _series(records, setting, method, key)
                rounds = sorted(r for r in series if r > 0)
                ax.plot(rounds, [np.mean(series[r]) for r in rounds], label=method)
            ax.set_xlabel("round")
            ax.set_ylabel(key.replace("_", " "))
            ax.set_title(setting, fontsize=8)
        axes[0][col].legend(fontsize=7)
    fig.tight_layout()
    path = out / f"{name}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# --------------------------------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command-line options (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", default="fashion-mnist")
    p.add_argument("--model", default=None, help="default: the data set's (fednet; mlp for digits)")
    p.add_argument("--clients", type=int, default=10)
    p.add_argument("--alphas", type=float, nargs="+", default=[0.0, 0.3], help="0: IID")
    p.add_argument("--epochs", type=int, nargs="+", default=[1])
    p.add_argument("--fraction-train", type=float, nargs="+", default=[1.0])
    p.add_argument("--rounds", type=int, default=None, help="default 30 (5 with --quick)")
    p.add_argument("--train-fraction", type=float, default=0.1)
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--methods", nargs="+", default=list(METHODS),
                   help=f"{', '.join(METHODS)}, or fedfiot-r<N> (the default with fisher_rounds=N)")
    p.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd",
                   help="sgd: the project's trainer (momentum 0.9, weight decay 2e-3, cosine over the local "
                        "epochs); adam: a plain Adam loop at a constant --lr, as Flower's PyTorch examples train")
    p.add_argument("--lr", type=float, default=None, help="default 0.02 (sgd), 1e-3 (adam)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    p.add_argument("--name", default="many_rounds")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--quick", action="store_true", help="digits, K = 4, 5 rounds, one seed")
    args = p.parse_args(argv)
    if args.quick:
        args.dataset, args.clients, args.train_fraction = "digits", 4, 1.0
        args.alphas, args.seeds = [0.0], [0]
    args.rounds = args.rounds or (5 if args.quick else 30)
    return args


def set_task_identity() -> None:
    """Messages need the identity of the running task, which Flower sets inside a real ServerApp."""
    from flwr.supercore.task_identity import TaskIdentity

    try:
        TaskIdentity.run_id  # noqa: B018 - the getter raises while unset
    except RuntimeError:
        TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run every setting, seed and method; write the page, the JSON and the plot."""
    args = parse_args(argv)
    set_task_identity()
    H.set_threads(args.threads)
    log = H.setup_logging(True)
    model = args.model or ("mlp" if args.dataset == "digits" else "fednet")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    payload: dict[str, Any] = {"command": H.command_line(argv, "benchmarks/many_rounds.py"),
                               "machine": H.machine_description(), "seeds": args.seeds, "methods": args.methods,
                               "records": []}
    lr = args.lr or (1e-3 if args.optimizer == "adam" else 0.02)
    for alpha in args.alphas:
        for epochs in args.epochs:
            for fraction in args.fraction_train:
                for seed in args.seeds:
                    setting = RoundsSetting(args.dataset, model, args.clients, alpha, epochs, fraction, args.rounds,
                                            args.train_fraction, seed, lr=lr, optimizer=args.optimizer)
                    fed = build_federation(setting)
                    for method in args.methods:
                        t0 = time.perf_counter()
                        recs = run_method(setting, fed, method)
                        payload["records"] += recs
                        log(f"{setting.label()} seed {seed} {method}: final test {recs[-1]['test_accuracy']:.2f} %, "
                            f"loss {recs[-1]['test_loss']:.3f} ({time.perf_counter() - t0:.0f} s)")
                    H.write_results(out, args.name, payload, markdown(payload))
    if not args.no_plots:
        plot(payload, out, args.name)
    return payload


if __name__ == "__main__":
    main()
