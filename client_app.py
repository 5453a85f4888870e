"""FedFiOT ClientApp: local training, then weights and diagonal Fisher, 16-bit quantized.

A standard Flower PyTorch ClientApp; the only FedFiOT-specific line is ``train_and_pack``,
which trains with this package's trainer, computes the empirical Fisher and packs both into
the reply (your own app keeps its own training loop and calls ``fisher_reply``). With the run
config's ``strategy`` set to a baseline the client sends that baseline's upload instead:
the diagonal Fisher of ``fisher-kind`` (``fedfisher-diag``), K-FAC factors
(``fedfisher-kfac``) or input Grams (``regmean``), computed on the unaugmented examples.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from torch.utils.data import DataLoader

from fedfiot_flwr.app_config import AppConfig
from fedfiot_flwr.batches import default_device
from fedfiot_flwr.client import curvature_reply, train_and_pack
from fedfiot_flwr.task import evaluate
from fedfiot_flwr.task import train as local_train

app = ClientApp()


def _partition(context: Context, cfg: AppConfig) -> tuple[AppConfig, int]:
    """This node's partition id, and ``cfg`` with K resolved from the node config.

    Flower's simulation engine sets ``partition-id`` and ``num-partitions`` in every node
    config; a real SuperNode gets them from ``--node-config "partition-id=<i> num-partitions=<K>"``.
    With the run config's ``num-partitions = 0`` the node config's K is used; an explicit K > 0
    must equal it.
    """
    node_config = context.node_config
    if "partition-id" not in node_config:
        raise ValueError(
            "node config lacks 'partition-id': start the SuperNode with "
            '--node-config "partition-id=<i> num-partitions=<K>"'
        )
    pid = int(node_config["partition-id"])
    if "num-partitions" in node_config:
        k = int(node_config["num-partitions"])
    elif cfg.num_partitions > 0:
        k = cfg.num_partitions
    else:
        raise ValueError(
            f"node config of partition-id={pid} lacks 'num-partitions' and the run config has "
            "num-partitions = 0 (follow the federation): start the SuperNode with "
            '--node-config "partition-id=<i> num-partitions=<K>" or set num-partitions in the run config'
        )
    if cfg.num_partitions not in (0, k) or not 0 <= pid < k:
        raise ValueError(
            f"node config partition-id={pid}, num-partitions={k} does not fit the run config's "
            f"num-partitions={cfg.num_partitions} (simulation: use num-supernodes={cfg.num_partitions}, "
            "or num-partitions=0 to follow the federation)"
        )
    return cfg.with_partitions(k), pid


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Train on this node's partition from the broadcast model and reply with weights + curvature."""
    cfg, pid = _partition(context, AppConfig.from_run_config(context.run_config))
    split = cfg.split()
    config = msg.content["config"]
    server_round = int(config["server-round"])
    if cfg.init == "independent" and server_round == 1:
        # Paper, Table 5: every client starts from its own random initialisation.
        model = cfg.build_model(split, seed=cfg.client_init_seed(pid))
    else:
        model = cfg.build_model(split)
        model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    seed = cfg.client_round_seed(server_round, pid)
    gen = torch.Generator().manual_seed(seed)
    loader = DataLoader(split.clients[pid], batch_size=int(config.get("batch-size", cfg.batch_size)),
                        shuffle=True, generator=gen)
    device = default_device()
    torch.manual_seed(seed)
    # The Fisher runs over the same examples without augmentation (paper, eq. 106).
    fisherloader = DataLoader(split.client_eval(pid), batch_size=256)
    epochs, lr = int(config.get("local-epochs", cfg.local_epochs)), float(config.get("lr", cfg.lr))
    if cfg.strategy in ("fedfiot", "fedfisher-diag"):
        content = train_and_pack(
            model, loader, epochs, device=device, fisherloader=fisherloader, lr=lr, progress=False,
            fisher_kind=cfg.client_fisher_kind(), config=config,
        )
    else:
        metrics = local_train(model, loader, epochs, device=device, lr=lr, progress=False)
        content = curvature_upload(cfg, model, fisherloader, metrics, device)
    return Message(content=content, reply_to=msg)


def curvature_upload(
    cfg: AppConfig, model: torch.nn.Module, loader: DataLoader, metrics: Mapping[str, float], device: torch.device
) -> RecordDict:
    """The reply of a FedFisher (K-FAC) or RegMean client for its trained ``model``.

    K-FAC factors (``strategy = "fedfisher-kfac"``, Fisher kind from ``fisher-kind``) or the
    Linear layers' input Grams (``"regmean"``) over ``loader`` (the client's examples without
    augmentation), 8-bit low rank within FedAvg's upload size (``rank="fedavg"``), plus the
    16-bit weights (:func:`fedfiot_flwr.client.curvature_reply`).
    """
    return curvature_reply(cfg.strategy, model, loader, metrics=metrics, fisher_kind=cfg.client_fisher_kind(),
                       rank="fedavg", device=device)


@app.evaluate()
def evaluate_local(msg: Message, context: Context) -> Message:
    """Evaluate the broadcast model on this node's (unaugmented) partition."""
    cfg, pid = _partition(context, AppConfig.from_run_config(context.run_config))
    split = cfg.split()
    model = cfg.build_model(split)
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    device = default_device()
    data = split.client_eval(pid)
    loss, acc = evaluate(model, DataLoader(data, batch_size=512), device=device)
    metrics = MetricRecord({"eval-loss": float(loss), "eval-accuracy": float(acc), "num-examples": len(data)})
    return Message(content=RecordDict({"metrics": metrics}), reply_to=msg)

