"""Shared pieces of the benchmarks: client uploads (trained once, cached), methods, selection, tables, plots.

Everything reuses the library: :class:`~fedfiot_flwr.app_config.AppConfig` for the split, the
model and the seeds (so a benchmark client is the Flower ClientApp's client), the client's
round (:func:`fedfiot_flwr.client.train_round`: training, Fisher, 16-bit packing), the
strategy's reply collection (:func:`~fedfiot_flwr.server.uploads.collect_uploads`) and its
aggregator (:class:`~fedfiot_flwr.server.aggregators.FedFiOTAggregator`). Every merge method is
a :class:`~fedfiot_flwr.server.config.FedFiOTConfig`: the paper's and the default preset, or the
merge engine's named methods (:data:`fedfiot_flwr.merge.METHODS`) as configurations.

Every method is applied to the SAME uploads of a setting, and each method's knobs are chosen
on the same server validation set (500 examples by default); the test set is used only for
the chosen model.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import platform
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, MetricRecord, RecordDict
from torch.utils.data import DataLoader

from benchmarks import portable
from fedfiot_flwr.app_config import AppConfig
from fedfiot_flwr.app_config import client_round_seed as client_seed
from fedfiot_flwr.client import ClientRound, train_round
from fedfiot_flwr.data import FederatedSplit
from fedfiot_flwr.merge import METHODS, PermutationSpec, merge, prepare_clients
from fedfiot_flwr.models import permutation_spec
from fedfiot_flwr.options import DEFAULT_GRID_GRAM_ALPHAS, DEFAULT_KFAC_DAMPING, DEFAULT_GRID_LAMS, DEFAULT_GRID_RHOS, DEFAULT_LAM, DEFAULT_RHO, INITS, Model
from fedfiot_flwr.server.aggregators import FedFiOTAggregator, FedFisherAggregator, RegMeanAggregator
from fedfiot_flwr.server.config import FedFiOTConfig
from fedfiot_flwr.server.outcome import RoundContext, RoundOutcome
from fedfiot_flwr.validation import make_validate_fn
from fedfiot_flwr.server.selection import SweepGrid
from fedfiot_flwr.server.shell import buffers_of
from fedfiot_flwr.server.uploads import CollectedUploads, collect_uploads
from fedfiot_flwr.task import default_device, evaluate

logger = logging.getLogger("fedfiot_flwr.benchmarks")


ROOT = Path(__file__).resolve().parent
CACHE_DIR = ROOT / "cache"
RESULTS_DIR = ROOT / "results"

DEFAULT_MODELS = {"digits": "mlp", "fashion-mnist": "fednet", "cifar10": "fednet", "svhn": "fednet", "cinic10": "fednet"}
SMALL_RHOS = (0.3, 0.5, 0.7)
SMALL_LAMS = (1e-3, 1e-5)
GRIDS = {"paper": (DEFAULT_GRID_RHOS, DEFAULT_GRID_LAMS), "small": (SMALL_RHOS, SMALL_LAMS),
         "tiny": ((DEFAULT_RHO,), (1e-3, 1e-5))}
UPLOADS = ("q16", "fp32")
"""The 16-bit uploads (as sent) and their float32 originals."""

# Row order of the tables; "fedfiot-fp32" is FedFiOT on the float32 (unquantized) uploads.
ONE_SHOT_METHODS = (
    "fedavg", "fisher-merge", "otfusion", "wb-fusion", "ablation-b", "ablation-c", "ablation-d", "fedfiot",
    "fedfiot-fp32", "fedfiot-default",
)
EXTRA_METHODS = ("fedfiot-val",)
# Rows derived from another method's outcome rather than merged on their own.
DERIVED_METHODS = {"fedfiot-own": "fedfiot-default"}
METHOD_LABELS = {
    "fedavg": "FedAvg",
    "fisher-merge": "Fisher merging",
    "otfusion": "OTFusion-like",
    "wb-fusion": "WB-fusion-like",
    "ablation-b": "B: no alignment",
    "ablation-c": "C: Euclidean matching",
    "ablation-d": "D: uniform aggregation",
    "fedfiot": "FedFiOT (paper preset)",
    "fedfiot-default": "FedFiOT default preset (server data only chooses)",
    "fedfiot-own": "FedFiOT default merge only, FedFiOT's own merge (no FedAvg candidate)",
    "fedfiot-fp32": "FedFiOT, float32 uploads",
    "fedfiot-val": "FedFiOT + validation fallback, size scaling",
    "fedfisher-diag": "FedFisher (diag)",
    "fedfisher-kfac": "FedFisher (K-FAC)",
    "regmean": "RegMean",
    "fedfiot-gram": "FedFiOT default preset, Gram curvature (server data only chooses)",
    "fedfiot-kfac": "FedFiOT default preset, K-FAC curvature with a diagonal output factor (server data only chooses)",
    "regmean-gram": "RegMean on the same Gram replies (Linear and Conv2d, the same alpha grid)",
}
# The paper's curvature baselines: they need each client's curvature of its trained model,
# computed here from the cached trained weights on the client's own unaugmented data and cached next
# to the uploads. Not in ONE_SHOT_METHODS: FedFisher's 2000 server steps (with a validation pass
# every 100) and the K-FAC factors of the true Fisher are slow on CPU; select them with --methods.
CURVATURE_METHODS = ("fedfisher-diag", "fedfisher-kfac", "regmean", "fedfiot-gram", "regmean-gram", "fedfiot-kfac")
GRAM_REPLY_METHODS = ("fedfiot-gram", "regmean-gram", "fedfiot-kfac")
FEDFIOT_CURVATURES = {"fedfiot-gram": "gram", "fedfiot-kfac": "kfac"}
"""The FedFiOT methods with a layer curvature, and the curvature each asks the clients for."""
"""Methods that merge the ClientApp's Gram reply (every Linear and Conv2d layer): the same cached replies."""
GRAM_METHODS = ("regmean", *GRAM_REPLY_METHODS)
"""Methods whose curvature is the clients' input Grams (no Fisher kind)."""
FEDFISHER_STEPS = 2000
"""FedFisher's server steps (paper, C.2; checkpoints every 100 steps, scored on validation)."""


# ----------------------------------------------------------------------------------- settings


@dataclass(frozen=True)
class Setting:
    """One cell of the benchmark: a data set, a split, an initialisation, a seed and a local-training length.

    Attributes
    ----------
    dataset, model : str
        Data set and model names (:func:`fedfiot_flwr.data.load_dataset`, :func:`fedfiot_flwr.models.build_model`).
    clients : int
        K, the number of clients.
    alpha : float
        Dirichlet concentration of the label split.
    init : {"shared", "independent"}
        One broadcast initialisation (paper Table 1) or one per client (Table 5).
    seed : int
        Training seed (initialisation, data order); the partition does not depend on it.
    epochs : int
        Local epochs.
    partition_seed, validation_size, batch_size, lr
        The split's seed, the server validation set's size, and local SGD settings.
    data_root : str
        Where the data set lies ("" = the data layer's default).
    """

    dataset: str
    model: str
    clients: int
    alpha: float
    init: str
    seed: int
    epochs: int
    partition_seed: int = 0
    validation_size: int = 500
    batch_size: int = 64
    lr: float = 0.02
    data_root: str = ""

    def __post_init__(self) -> None:
        if self.init not in INITS:
            raise ValueError(f"init must be one of {INITS}, got {self.init!r}")

    def app_config(self) -> AppConfig:
        """The Flower app's configuration of this setting (same split, model and seeds as ``flwr run``)."""
        return AppConfig(
            dataset=self.dataset, data_root=self.data_root, model=self.model, num_partitions=self.clients,
            alpha=self.alpha, partition_seed=self.partition_seed, validation_size=self.validation_size,
            local_epochs=self.epochs, batch_size=self.batch_size, lr=self.lr, seed=self.seed, init=self.init,
        )

    def cache_key(self) -> str:
        """Directory name of this setting's cached uploads (every field that changes them)."""
        return (
            f"{self.dataset}-{self.model}-K{self.clients}-a{self.alpha:g}-p{self.partition_seed}-v{self.validation_size}"
            f"/{self.init}-s{self.seed}-e{self.epochs}-b{self.batch_size}-lr{self.lr:g}"
        )

    def column(self) -> str:
        """Table column of this setting (seeds are aggregated)."""
        return f"{self.dataset} a={self.alpha:g} {self.init} E={self.epochs}"


def record_fields(setting: Setting) -> dict[str, Any]:
    """The identifying fields of a setting in a result record."""
    return {
        "dataset": setting.dataset, "model": setting.model, "clients": setting.clients, "alpha": setting.alpha,
        "init": setting.init, "epochs": setting.epochs, "seed": setting.seed, "partition_seed": setting.partition_seed,
        "validation_size": setting.validation_size,
    }


# ------------------------------------------------------------------------------ client uploads


@dataclass
class Uploads:
    """All clients' uploads of one setting (or one round).

    Attributes
    ----------
    quantized : CollectedUploads
        Dequantized 16-bit uploads, collected with the strategy's own code.
    float32 : CollectedUploads
        The same uploads before quantization.
    replies : list[RecordDict]
        The packed replies (for Flower's own aggregation).
    broadcast : dict or None
        The broadcast model (shared init / previous global model); None for independent init.
    train_seconds, fisher_seconds : float
        Summed over clients (as measured when the uploads were produced, also when loaded from cache).
    cached : bool
        Whether the uploads came from the disk cache.
    """

    quantized: CollectedUploads
    float32: CollectedUploads
    replies: list[RecordDict]
    broadcast: Model | None
    train_seconds: float
    fisher_seconds: float
    cached: bool = False

    def collected(self, upload: str = "q16") -> CollectedUploads:
        """The 16-bit uploads (``"q16"``) or their float32 originals (``"fp32"``)."""
        if upload not in UPLOADS:
            raise ValueError(f"upload must be one of {UPLOADS}, got {upload!r}")
        return self.quantized if upload == "q16" else self.float32


def state_numpy(model: torch.nn.Module) -> Model:
    """``model.state_dict()`` as float32/int NumPy arrays on the CPU."""
    return {k: v.detach().cpu().numpy().copy() for k, v in model.state_dict().items()}


def load_numpy(model: torch.nn.Module, state: Mapping[str, np.ndarray]) -> torch.nn.Module:
    """Load a NumPy state dict into ``model`` (cast to each entry's dtype); returns ``model``."""
    ref = model.state_dict()
    model.load_state_dict({k: torch.as_tensor(np.asarray(state[k])).to(ref[k].dtype) for k in ref})
    return model


def fisher_loader(split: FederatedSplit, partition_id: int) -> DataLoader:
    """A client's examples as its Fisher (or curvature) pass sees them: once, without augmentation, in batches of 1000."""
    return DataLoader(split.client_eval(partition_id), batch_size=1000)


def client_start(cfg: AppConfig, split: FederatedSplit, partition_id: int,
                 start: Mapping[str, np.ndarray] | None) -> torch.nn.Module:
    """The model client ``partition_id`` starts its round from (what :func:`train_client` trains).

    Parameters
    ----------
    cfg : AppConfig
        Model and seeds.
    split : FederatedSplit
        ``cfg.split()``.
    partition_id : int
        The client.
    start : dict, optional
        The broadcast model; None starts from the client's own initialisation, seeded by
        :meth:`AppConfig.client_init_seed`.

    Returns
    -------
    torch.nn.Module
    """
    if start is None:
        return cfg.build_model(split, seed=cfg.client_init_seed(partition_id))
    return load_numpy(cfg.build_model(split), start)


def shared_init(setting: Setting, split: FederatedSplit) -> Model | None:
    """The broadcast initialisation of ``setting`` (seeded by its ``seed``); None for independent init."""
    return state_numpy(setting.app_config().build_model(split)) if setting.init == "shared" else None


def initial_weights(setting: Setting, split: FederatedSplit) -> list[Model]:
    """Every client's weights before its round-1 training, recomputed from the setting's seeds.

    Shared init: the broadcast model for every client; independent init: each client's own
    initialisation. The cache holds only trained weights; these are rebuilt with the same
    functions the training used (:func:`shared_init`, :func:`client_start`), so they are the
    exact starting points.

    Parameters
    ----------
    setting : Setting
        The cell.
    split : FederatedSplit
        ``setting.app_config().split()``.

    Returns
    -------
    list[dict[str, np.ndarray]]
        One state dict per client, in client order.
    """
    cfg = setting.app_config()
    broadcast = shared_init(setting, split)
    return [state_numpy(client_start(cfg, split, pid, broadcast)) for pid in range(setting.clients)]


def train_client(
    cfg: AppConfig,
    split: FederatedSplit,
    partition_id: int,
    start: Mapping[str, np.ndarray] | None,
    server_round: int = 1,
    device: torch.device | None = None,
) -> ClientRound:
    """One client's round, as the Flower ClientApp runs it (:func:`fedfiot_flwr.client.train_round`).

    The ClientApp's model, seeds and data order; the Fisher pass sees the client's examples once,
    without augmentation, in batches of 1000. The result keeps the float32 weights and Fisher
    (for the 16-bit vs float32 comparison) and the time of training and of the Fisher pass.

    Parameters
    ----------
    cfg : AppConfig
        Split, model, seeds and local-training settings.
    split : FederatedSplit
        ``cfg.split()``.
    partition_id : int
        The client.
    start : dict, optional
        The broadcast model; None (round 1 with ``cfg.init == "independent"``) starts from the
        client's own random initialisation.
    server_round : int
        Round number (seeds the data order).
    device : torch.device, optional
        Defaults to CUDA when available.

    Returns
    -------
    ClientRound
    """
    device = device or default_device()
    model = client_start(cfg, split, partition_id, start)
    seed = client_seed(cfg.seed, server_round, partition_id)
    gen = torch.Generator().manual_seed(seed)
    loader = DataLoader(split.clients[partition_id], batch_size=cfg.batch_size, shuffle=True, generator=gen)
    torch.manual_seed(seed)
    return train_round(model, loader, cfg.local_epochs, device=device, fisherloader=fisher_loader(split, partition_id),
                       num_examples=len(split.client_indices[partition_id]), progress=False, lr=cfg.lr)


def _save_client(path: Path, result: ClientRound) -> None:
    """Cache one client: the reply's raw Arrays (the wire payload), its metrics, and the float32 upload."""
    arrays = result.reply["fedfiot"]
    meta = {
        "arrays": {k: {"dtype": a.dtype, "shape": list(a.shape), "stype": a.stype} for k, a in arrays.items()},
        "metrics": dict(result.reply["metrics"]),
        "train_seconds": result.train_seconds,
        "fisher_seconds": result.fisher_seconds,
    }
    payload: dict[str, np.ndarray] = {f"wire/{k}": np.frombuffer(a.data, dtype=np.uint8) for k, a in arrays.items()}
    payload.update({f"w32/{k}": v for k, v in result.weights.items()})
    payload.update({f"f32/{k}": v for k, v in result.fisher.items()})
    payload["meta"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.npz")
    np.savez(tmp, **payload)
    os.replace(tmp, path)


def _load_client(path: Path) -> ClientRound:
    """One cached client (:func:`_save_client`'s file)."""
    with np.load(path) as data:
        meta = json.loads(bytes(data["meta"]).decode())
        arrays = ArrayRecord()
        for k, m in meta["arrays"].items():
            arrays[k] = Array(dtype=m["dtype"], shape=tuple(m["shape"]), stype=m["stype"], data=data[f"wire/{k}"].tobytes())
        reply = RecordDict({"fedfiot": arrays, "metrics": MetricRecord(meta["metrics"])})
        w32 = {k[4:]: data[k] for k in data.files if k.startswith("w32/")}
        f32 = {k[4:]: data[k] for k in data.files if k.startswith("f32/")}
    order = list(meta["arrays"])
    return ClientRound(reply, {k: w32[k] for k in order}, {k: f32[k] for k in order if k in f32},
                       float(meta["train_seconds"]), float(meta["fisher_seconds"]))


def collect(results: Sequence[ClientRound], buffers: Sequence[str], broadcast: Model | None) -> Uploads:
    """Collect client results as the strategy does (unpack, dequantize, validate) plus their float32 twin."""
    ids = [str(i) for i in range(len(results))]
    expected = {k: tuple(v.shape) for k, v in results[0].weights.items()}
    quantized = collect_uploads(list(zip(ids, (r.reply for r in results))), expected, buffers)
    if quantized.rejections:
        raise ValueError(f"benchmark uploads rejected: {[vars(r) for r in quantized.rejections]}")
    float32 = CollectedUploads(
        client_ids=list(ids), weights=[r.weights for r in results], fishers=[r.fisher for r in results],
        num_examples=list(quantized.num_examples), metrics=list(quantized.metrics),
    )
    return Uploads(quantized, float32, [r.reply for r in results], broadcast,
                   sum(r.train_seconds for r in results), sum(r.fisher_seconds for r in results))


def one_shot_uploads(
    setting: Setting,
    split: FederatedSplit,
    buffers: Sequence[str],
    cache_dir: Path | None = CACHE_DIR,
    device: torch.device | None = None,
    log: Callable[[str], None] = logger.info,
) -> Uploads:
    """Round-1 uploads of every client of ``setting``, trained once and cached on disk.

    The cache holds, per client, the packed reply's bytes and the float32 weights and Fisher,
    under ``cache_dir / setting.cache_key() / client<k>.npz``; ``cache_dir=None`` disables it.
    """
    cfg = setting.app_config()
    broadcast = shared_init(setting, split)
    results: list[ClientRound] = []
    cached = True
    for pid in range(setting.clients):
        path = None if cache_dir is None else Path(cache_dir) / setting.cache_key() / f"client{pid}.npz"
        if path is not None and path.is_file():
            results.append(_load_client(path))
            continue
        cached = False
        res = train_client(cfg, split, pid, broadcast, 1, device)
        log(f"  client {pid}: {len(split.client_indices[pid])} examples, train {res.train_seconds:.1f}s, "
            f"Fisher {res.fisher_seconds:.1f}s, train acc {float(res.reply['metrics']['train-accuracy']):.3f}")
        if path is not None:
            _save_client(path, res)
        results.append(res)
    out = collect(results, buffers, broadcast)
    out.cached = cached
    return out


# -------------------------------------------------------------------------------- evaluation


class Evaluator:
    """Validation and test scores of model dicts; validation is the shipped scorer the strategies use.

    Parameters
    ----------
    split : FederatedSplit
        Gives the validation and test sets.
    build : callable
        ``() -> nn.Module`` of the benchmark's architecture.
    device : torch.device, optional
        Defaults to CUDA when available.
    batch_size : int
        Evaluation batch size.

    Attributes
    ----------
    validation : list of (inputs, labels)
        The validation set's batches, on ``device``.
    validate : SelectionScorer
        :func:`fedfiot_flwr.validation.make_validate_fn` on the validation set: ``model dict ->
        {"accuracy", "loss"}``, with the bounded scoring the strategies' raced selection uses, so a
        benchmark chooses exactly as a strategy given the same examples would.
    """

    def __init__(self, split: FederatedSplit, build: Callable[[], torch.nn.Module],
                 device: torch.device | None = None, batch_size: int = 1000) -> None:
        self.device = device or default_device()
        self.model = build().to(self.device)
        self.validation = self._batches(split.validation, batch_size)
        self.validate = make_validate_fn(build().to(self.device), self.validation, self.device)
        self.test_set = split.test
        self.batch_size = batch_size
        self._test: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    def _batches(self, dataset: Any, batch_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(x.to(self.device), y.to(self.device)) for x, y in DataLoader(dataset, batch_size=batch_size)]

    def _test_batches(self) -> Iterable[Any]:
        if self._test is not None:
            return self._test
        x0, _ = self.test_set[0]
        if len(self.test_set) * int(np.prod(tuple(x0.shape))) <= 2e8:  # keep up to ~800 MB of float32 in memory
            self._test = self._batches(self.test_set, self.batch_size)
            return self._test
        return DataLoader(self.test_set, batch_size=self.batch_size)

    def test(self, model: Mapping[str, np.ndarray]) -> tuple[float, float]:
        """``(loss, accuracy)`` on the full test set."""
        return evaluate(load_numpy(self.model, model), self._test_batches(), device=self.device)


# ------------------------------------------------------------------------------------ methods


UPLOAD_OF = {"fedfiot-fp32": "fp32"}
"""Methods that merge the float32 uploads; every other method merges the 16-bit ones."""


def upload_of(method: str) -> str:
    """``"fp32"`` for the methods of :data:`UPLOAD_OF`, else ``"q16"``."""
    return UPLOAD_OF.get(method, "q16")


def engine_config(method: str, **changes: Any) -> FedFiOTConfig:
    """The FedFiOT configuration that runs the merge engine's named method.

    Parameters
    ----------
    method : str
        A key of :data:`fedfiot_flwr.merge.METHODS`: its matching, aggregation, inner iterations
        and identity rule (the preset's ``fallback`` is the configuration's ``selection``).
    **changes
        Further :class:`~fedfiot_flwr.server.config.FedFiOTConfig` fields (e.g. ``sweep``).

    Returns
    -------
    FedFiOTConfig
    """
    options = dict(METHODS[method])
    if "fallback" in options:
        options["selection"] = options.pop("fallback")
    return FedFiOTConfig(**{**options, **changes})


DEFAULT_PRESET = FedFiOTConfig.default()
"""The library's default preset, which the ``fedfiot-default`` row runs (on the benchmark's grid)."""


def method_configs(names: Sequence[str], init: str, grid: str = "paper", broadcast_reference: bool = True,
                   server_round: int = 1) -> dict[str, FedFiOTConfig]:
    """The configurations of the named methods, by name.

    Knobs per method (each chosen on the validation set):

    - FedAvg: none.
    - Fisher merging (Matena & Raffel; FedFisher's diagonal variant): the raw Fisher (rho = 1),
      damping lam, and the Fisher's client-size scaling (none | n_k/n).
    - OTFusion-like, WB-fusion-like: the reference (Euclidean matching and uniform averaging
      ignore rho and lam).
    - Ablations B, C, D and FedFiOT (:meth:`FedFiOTConfig.paper`): rho x lam (x reference when
      there is alignment), the paper's rule for the identity fallback, the paper's unscaled Fisher.
    - ``fedfiot-val``: FedFiOT's grid plus Fisher scaling, keeping the aligned or the identity
      merge by validation accuracy instead of the objective (a point the paper leaves open).
    - ``fedfiot-default``: :data:`DEFAULT_PRESET` on the benchmark's grid (validation picks
      aligned, identity or FedAvg).

    ``reference="broadcast"`` (the shared initialisation in one-shot, the previous global
    model later) is a candidate when ``broadcast_reference`` and there is a broadcast model; in
    round 1 with a shared initialisation the configurations offer it with
    ``broadcast_in_round_one``.

    Parameters
    ----------
    names : sequence of str
        Method names (keys of :data:`METHOD_LABELS`).
    init : {"shared", "independent"}
        The setting's initialisation.
    grid : str
        A key of :data:`GRIDS`.
    broadcast_reference : bool
        Offer the broadcast model as a reference.
    server_round : int
        The round the configurations merge (1-based).

    Returns
    -------
    dict[str, FedFiOTConfig]
        In the order of ``names``.
    """
    rhos, lams = GRIDS[grid]
    refs: tuple[str, ...] = ("largest",)
    if broadcast_reference and (init == "shared" or server_round > 1):
        refs = ("largest", "broadcast")
    configs = {
        "fedavg": engine_config("fedavg"),
        "fisher-merge": engine_config("fisher-merge", rho=1.0,
                                      sweep=SweepGrid((1.0,), lams, ("largest",), ("none", "size"))),
        "otfusion": engine_config("otfusion", sweep=SweepGrid((DEFAULT_RHO,), (DEFAULT_LAM,), refs)),
        "wb-fusion": engine_config("wb-fusion", sweep=SweepGrid((DEFAULT_RHO,), (DEFAULT_LAM,), refs)),
        "ablation-b": engine_config("ablation-b", sweep=SweepGrid(rhos, lams, ("largest",))),
        "ablation-c": engine_config("ablation-c", sweep=SweepGrid(rhos, lams, refs)),
        "ablation-d": engine_config("ablation-d", sweep=SweepGrid(rhos, lams, refs)),
        "fedfiot": FedFiOTConfig.paper(sweep=SweepGrid(rhos, lams, refs)),
        "fedfiot-fp32": FedFiOTConfig.paper(sweep=SweepGrid(rhos, lams, refs)),
        "fedfiot-val": engine_config("fedfiot", selection="validation",
                                     sweep=SweepGrid(rhos, lams, refs, ("none", "size"))),
        "fedfiot-default": FedFiOTConfig.default(
            sweep=SweepGrid(rhos, lams, refs, DEFAULT_PRESET.sweep.fisher_scalings)),
    }
    unknown = [n for n in names if n not in configs]
    if unknown:
        raise ValueError(f"unknown methods {unknown}; choose from {list(configs)}")
    offer_init = broadcast_reference and init == "shared"
    return {n: replace(configs[n], broadcast_in_round_one=offer_init) for n in names}


def method_config(name: str, init: str, grid: str = "paper", broadcast_reference: bool = True,
                  server_round: int = 1) -> FedFiOTConfig:
    """The configuration of one method (:func:`method_configs`)."""
    return method_configs([name], init, grid, broadcast_reference, server_round)[name]


def _weighs_by_fisher(config: FedFiOTConfig) -> bool:
    """Whether ``rho`` and ``lam`` change the merge (a Fisher matching cost or Fisher-weighted average)."""
    return config.matching == "fisher" or config.aggregation == "fisher"


def knobs_description(config: FedFiOTConfig, upload: str = "q16") -> str:
    """Human-readable description of a configuration's grid (for the results page).

    Parameters
    ----------
    config : FedFiOTConfig
        The method's configuration.
    upload : {"q16", "fp32"}
        The uploads it merges.

    Returns
    -------
    str
        ``"none"`` without a sweep.
    """
    if config.sweep is None:
        return "none"
    g = config.sweep
    parts = []
    for label, values, fixed in (("rho", g.rhos, config.rho), ("lam", g.lams, config.lam),
                                 ("reference", g.references, None),
                                 ("Fisher scaling", g.fisher_scalings, config.fisher_scaling)):
        values = tuple(dict.fromkeys((*values, *(() if fixed is None else (fixed,)))))
        if label in ("rho", "lam"):
            values = tuple(sorted(values, reverse=label == "lam"))
        if len(values) > 1:
            parts.append(f"{label} {list(values)}")
        elif label in ("rho", "lam") and _weighs_by_fisher(config):
            parts.append(f"{label} = {values[0]:g}")
    text = " x ".join(parts) or "none"
    if config.selection == "validation":
        text += "; aligned or identity merge chosen on validation"
    elif config.matching != "none" and config.selection == "objective":
        text += "; identity fallback by objective (paper)"
    return text + f" [{upload} uploads]"


def swept_knobs(config: FedFiOTConfig) -> list[str]:
    """The knobs a configuration chooses among (the others are fixed or have no effect)."""
    if config.sweep is None:
        return []
    g = config.sweep
    grid = (("rho", g.rhos), ("lam", g.lams), ("reference", g.references), ("fisher_scaling", g.fisher_scalings))
    swept = [k for k, values in grid if len({*values, getattr(config, k)}) > 1]
    if config.selection == "validation":
        swept.append("variant")
    return swept


@dataclass
class MethodResult:
    """A method's chosen model on one setting and how it was chosen.

    ``outcome`` is the aggregator's :class:`~fedfiot_flwr.server.outcome.RoundOutcome`;
    ``upload`` is ``"q16"`` or ``"fp32"`` (the uploads merged).
    """

    method: str
    model: Model
    outcome: RoundOutcome
    validation_accuracy: float
    knobs: dict[str, Any]
    fraction_permuted: float
    alignment_fraction_permuted: float
    merge_seconds: float
    sweep_seconds: float
    candidates: int
    upload: str = "q16"
    test_accuracy: float = math.nan
    test_loss: float = math.nan
    test_seconds: float = 0.0

    @property
    def own_model(self) -> Model:
        """FedFiOT's own merge: ``model`` unless FedAvg of the same uploads won the validation choice."""
        return self.outcome.alternatives.get("fedfiot-own", self.model)

    @property
    def own_validation_accuracy(self) -> float:
        """Validation accuracy of :attr:`own_model`."""
        own = self.outcome.alternative_validation.get("fedfiot-own")
        return self.validation_accuracy if own is None else float(own.get("accuracy", self.validation_accuracy))

    @property
    def own_variant(self) -> str:
        """``"aligned"`` or ``"identity"``: which merge :attr:`own_model` is."""
        return str(self.outcome.record["own_variant"])

    def record(self) -> dict[str, Any]:
        """JSON-friendly summary (no model)."""
        return {
            "method": self.method, "test_accuracy": self.test_accuracy, "test_loss": self.test_loss,
            "validation_accuracy": self.validation_accuracy, "knobs": self.knobs,
            "fraction_permuted": self.fraction_permuted, "alignment_fraction_permuted": self.alignment_fraction_permuted,
            "merge_seconds": self.merge_seconds, "sweep_seconds": self.sweep_seconds, "candidates": self.candidates,
            "test_seconds": self.test_seconds,
        }


def round_context(uploads: Uploads, buffers: Sequence[str], validate: Callable[[Model], Mapping[str, float]],
                  server_round: int = 1) -> RoundContext:
    """What the strategy hands its aggregator in ``server_round``: the broadcast model, buffers, ``validate``."""
    return RoundContext(server_round, broadcast=uploads.broadcast, buffers=tuple(buffers), validate=validate)


def merge_outcome(
    config: FedFiOTConfig,
    uploads: Uploads,
    spec: PermutationSpec,
    buffers: Sequence[str],
    validate: Callable[[Model], Mapping[str, float]],
    server_round: int = 1,
    upload: str = "q16",
) -> RoundOutcome:
    """The shipped aggregator's merge and selection of ``uploads`` (:meth:`FedFiOTAggregator.aggregate`),
    with everything it tried (both merges of the chosen candidate, its permutations)."""
    context = round_context(uploads, buffers, validate, server_round)
    return FedFiOTAggregator(spec, config).aggregate(uploads.collected(upload), context)


def _knobs(config: FedFiOTConfig, outcome: RoundOutcome) -> dict[str, Any]:
    """The knobs the aggregator chose, which of them were swept, and whether the method aligns."""
    knobs: dict[str, Any] = dict(outcome.chosen)
    if config.fedavg_candidate:
        knobs["fedavg_won"] = outcome.chosen["variant"] == "fedavg"
        knobs["own_variant"] = outcome.record["own_variant"]
    knobs["swept"] = swept_knobs(config)
    knobs["aligning"] = config.matching != "none"
    return knobs


def apply_method(
    method: str,
    config: FedFiOTConfig,
    uploads: Uploads,
    spec: PermutationSpec,
    buffers: Sequence[str],
    validate: Callable[[Model], Mapping[str, float]],
    server_round: int = 1,
    upload: str | None = None,
) -> MethodResult:
    """Merge ``uploads`` with one method: the shipped aggregator (:class:`FedFiOTAggregator`) with
    ``config``, knobs chosen on validation accuracy.

    Parameters
    ----------
    method : str
        The row name.
    config : FedFiOTConfig
        What the aggregator runs (:func:`method_configs`).
    uploads : Uploads
        The setting's (or round's) uploads.
    spec, buffers
        The architecture's permutation spec and buffers.
    validate : callable
        ``model dict -> {"accuracy": ...}`` on the server's validation set.
    server_round : int
        Round number (1-based).
    upload : {"q16", "fp32"}, optional
        The uploads merged; default :func:`upload_of` ``(method)``.

    Returns
    -------
    MethodResult
    """
    upload = upload or upload_of(method)
    t0 = time.perf_counter()
    outcome = FedFiOTAggregator(spec, config).aggregate(uploads.collected(upload),
                                                        round_context(uploads, buffers, validate, server_round))
    sweep_seconds = time.perf_counter() - t0
    # With selection="validation" a candidate appears twice (aligned, identity) with one merge time.
    distinct = {(t["rho"], t["lam"], str(t["reference"]), t["fisher_scaling"]): t["merge_seconds"]
                for t in outcome.record["trials"]}
    moved = outcome.metrics["alignment-moved-fraction"]
    alignment_fraction = float(np.mean(moved)) if moved else 0.0
    kept_aligned = outcome.chosen["variant"] == "aligned" and config.matching != "none"
    return MethodResult(
        method=method, model=outcome.model, outcome=outcome,
        validation_accuracy=float((outcome.validation or {}).get("accuracy", math.nan)),
        knobs=_knobs(config, outcome), fraction_permuted=alignment_fraction if kept_aligned else 0.0,
        alignment_fraction_permuted=alignment_fraction, merge_seconds=float(sum(distinct.values())),
        sweep_seconds=sweep_seconds, candidates=len(distinct), upload=upload,
    )


def fedfiot_alignment_fraction(uploads: CollectedUploads, spec: PermutationSpec, buffers: Sequence[str]) -> float:
    """Mean fraction of hidden neurons FedFiOT's alignment (default knobs) moves on ``uploads``: a misalignment gauge."""
    clients = prepare_clients(uploads.weights, uploads.fishers, buffers=buffers, num_examples=uploads.num_examples,
                              cache_bytes=0)
    res = merge(clients, None, spec)
    return float(np.mean(res.fraction_permuted))


def flower_fedavg(replies: Sequence[RecordDict], uploads: CollectedUploads) -> Model:
    """FedAvg of the dequantized uploads computed by Flower's own ``aggregate_arrayrecords``."""
    from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords

    records = [
        RecordDict({"arrays": ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in w.items()}),
                    "metrics": MetricRecord({"num-examples": int(n)})})
        for w, n in zip(uploads.weights, uploads.num_examples)
    ]
    agg = aggregate_arrayrecords(records, "num-examples")
    return {k: v.numpy() for k, v in agg.items()}


def model_tools(setting: Setting, split: FederatedSplit) -> tuple[Callable[[], torch.nn.Module], PermutationSpec, tuple[str, ...]]:
    """``(build, spec, buffers)`` of the setting's architecture."""
    cfg = setting.app_config()
    build = lambda: cfg.build_model(split)  # noqa: E731
    model = build()
    spec, buffers = permutation_spec(model), buffers_of(model)
    return build, spec, buffers


# ------------------------------------------------------------------- curvature baselines


def _save_reply(path: Path, reply: RecordDict, extra: Mapping[str, Any]) -> None:
    """Cache a packed reply: its raw Arrays (the wire payload) and its config/metric records."""
    meta: dict[str, Any] = {"arrays": {}, "configs": {}, "metrics": {}, **extra}
    payload: dict[str, np.ndarray] = {}
    for rname, rec in reply.items():
        if isinstance(rec, ArrayRecord):
            meta["arrays"][rname] = {k: {"dtype": a.dtype, "shape": list(a.shape), "stype": a.stype}
                                     for k, a in rec.items()}
            payload.update({f"wire/{rname}/{k}": np.frombuffer(a.data, dtype=np.uint8) for k, a in rec.items()})
        elif isinstance(rec, MetricRecord):
            meta["metrics"][rname] = dict(rec)
        else:
            meta["configs"][rname] = dict(rec)
    payload["meta"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.npz")
    np.savez(tmp, **payload)
    os.replace(tmp, path)


def _load_reply(path: Path) -> tuple[RecordDict, dict[str, Any]]:
    from flwr.app import ConfigRecord

    with np.load(path) as data:
        meta = json.loads(bytes(data["meta"]).decode())
        content = RecordDict()
        for rname, arrays in meta["arrays"].items():
            content[rname] = ArrayRecord({
                k: Array(dtype=m["dtype"], shape=tuple(m["shape"]), stype=m["stype"],
                         data=data[f"wire/{rname}/{k}"].tobytes())
                for k, m in arrays.items()})
        for rname, values in meta["metrics"].items():
            content[rname] = MetricRecord(values)
        for rname, values in meta["configs"].items():
            content[rname] = ConfigRecord(values)
    return content, meta


@dataclass
class CurvatureReplies:
    """One setting's client replies of a curvature baseline.

    Attributes
    ----------
    replies : list[RecordDict]
        Packed replies, exactly as the Flower ClientApp of that strategy sends them.
    seconds : float
        Client time spent on the curvature (summed; as measured when computed, also from the cache).
    cached : bool
        Whether every reply came from the disk cache (or is the FedFiOT upload itself).
    """

    replies: list[RecordDict]
    seconds: float
    cached: bool


def curvature_replies(
    method: str,
    setting: Setting,
    split: FederatedSplit,
    uploads: Uploads,
    build: Callable[[], torch.nn.Module],
    fisher_kind: str = "true",
    cache_dir: Path | None = CACHE_DIR,
    device: torch.device | None = None,
    log: Callable[[str], None] = logger.info,
) -> CurvatureReplies:
    """Every client's reply for ``method``, from its cached trained weights (float32) and its own data.

    The curvature is computed as the ClientApp computes it
    (:func:`fedfiot_flwr.client.curvature_reply`, on the client's examples without augmentation,
    batches of 1000) and cached as ``client<k>-<method>[-<kind>].npz`` next to the uploads.
    ``fedfisher-diag`` with the empirical Fisher is FedFiOT's upload itself (nothing to compute).
    """
    from fedfiot_flwr.client import curvature_reply, fisher_reply
    from fedfiot_flwr.options import CURVATURE_CONFIG_KEY

    if method not in CURVATURE_METHODS:
        raise ValueError(f"unknown curvature method {method!r}; choose from {CURVATURE_METHODS}")
    if method == "fedfisher-diag" and fisher_kind == "empirical":
        return CurvatureReplies(list(uploads.replies), uploads.fisher_seconds, True)
    device = device or default_device()
    short = {"regmean": "gram", "fedfisher-kfac": "kfac", "fedfisher-diag": "diag"}
    tag = ("fedfiot-kfac" if method == "fedfiot-kfac" else "fedfiot-gram" if method in GRAM_REPLY_METHODS
           else short[method] if method == "regmean" else f"{short[method]}-{fisher_kind}")  # the cache's file names
    replies: list[RecordDict] = []
    seconds, cached = 0.0, True
    for pid in range(setting.clients):
        path = None if cache_dir is None else Path(cache_dir) / setting.cache_key() / f"client{pid}-{tag}.npz"
        if path is not None and path.is_file():
            reply, meta = _load_reply(path)
            replies.append(reply)
            seconds += float(meta["seconds"])
            continue
        cached = False
        model = load_numpy(build(), uploads.float32.weights[pid])
        loader = fisher_loader(split, pid)
        t0 = time.perf_counter()
        if method in GRAM_REPLY_METHODS:  # the ClientApp's reply when the train config asks for the Gram curvature
            reply = fisher_reply(model, loader, uploads.quantized.metrics[pid],
                                 num_examples=len(split.client_indices[pid]), device=device,
                                 config={CURVATURE_CONFIG_KEY: FEDFIOT_CURVATURES.get(method, "gram")})
        else:
            reply = curvature_reply(method, model, loader, num_examples=len(split.client_indices[pid]),
                                    metrics=uploads.quantized.metrics[pid], fisher_kind=fisher_kind, device=device)
        dt = time.perf_counter() - t0
        kind = "Gram" if method in GRAM_METHODS else fisher_kind
        log(f"  client {pid}: {method} curvature ({kind}) {dt:.1f}s")
        if path is not None:
            _save_reply(path, reply, {"seconds": dt, "method": method, "fisher_kind": fisher_kind})
        replies.append(reply)
        seconds += dt
    return CurvatureReplies(replies, seconds, cached)


@dataclass
class CurvatureMethodResult:
    """A curvature baseline's chosen model on one setting (the same record keys as :class:`MethodResult`)."""

    method: str
    model: Model
    validation_accuracy: float
    knobs: dict[str, Any]
    merge_seconds: float
    candidates: int
    upload_bytes: float
    curvature_bytes: float
    fedavg_bytes: int
    curvature_seconds: float
    curvature_cached: bool
    fisher_kind: str | None
    fraction_permuted: float = 0.0
    test_accuracy: float = math.nan
    test_loss: float = math.nan
    test_seconds: float = 0.0

    @property
    def upload(self) -> str:
        """The upload this method merged (the record's ``upload`` field)."""
        return {"fedfisher-diag": "q16 weights + Fisher", "fedfisher-kfac": "q16 weights + 8-bit K-FAC",
                "regmean": "q16 weights + 8-bit Grams",
                "fedfiot-gram": "q16 weights + 8-bit Grams (Linear and Conv2d)",
                "regmean-gram": "q16 weights + 8-bit Grams (Linear and Conv2d)",
                "fedfiot-kfac": "q16 weights + 8-bit Grams + float32 output factors"}[self.method]

    def record(self) -> dict[str, Any]:
        """JSON-friendly summary (no model)."""
        return {
            "method": self.method, "test_accuracy": self.test_accuracy, "test_loss": self.test_loss,
            "validation_accuracy": self.validation_accuracy, "knobs": self.knobs,
            "fraction_permuted": self.fraction_permuted if self.knobs.get("variant") == "aligned" else 0.0,
            "alignment_fraction_permuted": self.fraction_permuted, "merge_seconds": self.merge_seconds,
            "sweep_seconds": self.merge_seconds, "candidates": self.candidates, "test_seconds": self.test_seconds,
            "upload_bytes": self.upload_bytes, "curvature_bytes": self.curvature_bytes,
            "fedavg_bytes": self.fedavg_bytes, "curvature_seconds": self.curvature_seconds,
            "curvature_cached": self.curvature_cached, "fisher_kind": self.fisher_kind,
        }


def curvature_aggregator(method: str, steps: int = FEDFISHER_STEPS, fisher_kind: str = "true",
                         device: torch.device | None = None, spec: PermutationSpec | None = None,
                         ) -> FedFisherAggregator | RegMeanAggregator | FedFiOTAggregator:
    """The aggregator the Flower strategy of ``method`` runs (FedFisher, RegMean, or FedFiOT with the Gram
    curvature: the default preset with server data that only chooses, which needs the model's ``spec``)."""
    if method == "regmean":
        return RegMeanAggregator()
    if method == "regmean-gram":  # the engine without alignment, on FedFiOT's replies and alpha grid
        return RegMeanAggregator(alphas=DEFAULT_GRID_GRAM_ALPHAS)
    if method in FEDFIOT_CURVATURES:
        if spec is None:
            raise ValueError(f"{method} needs the model's permutation spec")
        return FedFiOTAggregator(spec, FedFiOTConfig.default(curvature=FEDFIOT_CURVATURES[method]).for_server(True))
    variant = {"fedfisher-kfac": "kfac", "fedfisher-diag": "diag"}[method]
    return FedFisherAggregator(variant, steps=steps, fisher_kind=fisher_kind, device=device)


def curvature_knobs(method: str, steps: int = FEDFISHER_STEPS, fisher_kind: str = "true") -> str:
    """Human-readable description of a curvature baseline's selection (for the grids list)."""
    if method == "regmean":
        return "alpha [0.1, 0.9] (off-diagonal Gram scaling) [q16 weights + 8-bit rank-capped Grams, <= FedAvg bytes]"
    if method == "regmean-gram":
        return (f"alpha {list(DEFAULT_GRID_GRAM_ALPHAS)} (FedFiOT's Gram grid), no alignment [the fedfiot-gram "
                "replies: q16 weights + 8-bit rank-capped Grams of every Linear and Conv2d layer]")
    if method in FEDFIOT_CURVATURES:
        what = ("Gram curvature" if method == "fedfiot-gram" else
                f"K-FAC curvature (output-factor damping {DEFAULT_KFAC_DAMPING:g}), float32 output factors")
        return (f"alpha x ridge x reference x (aligned | identity | FedAvg), the default preset's sweep with the {what} "
                "[q16 weights + 8-bit rank-capped Grams of every Linear and Conv2d layer, <= FedAvg bytes]")
    return (f"checkpoint every 100 of {steps} steps (FedFisher's update rule, lr 0.01, size-weighted), "
            f"{fisher_kind} Fisher" + (" [q16 weights + 8-bit rank-capped K-FAC, <= FedAvg bytes]"
                                        if method == "fedfisher-kfac" else " [q16 weights + Fisher]"))


def apply_curvature_method(
    method: str,
    setting: Setting,
    split: FederatedSplit,
    uploads: Uploads,
    build: Callable[[], torch.nn.Module],
    buffers: Sequence[str],
    validate: Callable[[Model], Mapping[str, float]],
    steps: int = FEDFISHER_STEPS,
    fisher_kind: str = "true",
    cache_dir: Path | None = CACHE_DIR,
    device: torch.device | None = None,
    log: Callable[[str], None] = logger.info,
) -> CurvatureMethodResult:
    """Merge one setting with a curvature baseline, selecting on validation accuracy.

    The replies (:func:`curvature_replies`) are decoded as the Flower strategy decodes them
    (:func:`~fedfiot_flwr.server.uploads.collect_uploads`) and merged by the same aggregator
    (FedFisher: best checkpoint; RegMean: best alpha), so the benchmark merges exactly what the app would.
    """
    from fedfiot_flwr.wire import fedavg_payload_bytes

    cr = curvature_replies(method, setting, split, uploads, build, fisher_kind, cache_dir, device, log)
    spec = permutation_spec(build()) if method in FEDFIOT_CURVATURES else None
    aggregator = curvature_aggregator(method, steps, fisher_kind, device, spec)
    ids = [str(i) for i in range(len(cr.replies))]
    expected = {k: tuple(v.shape) for k, v in uploads.float32.weights[0].items()}
    collected = collect_uploads(list(zip(ids, cr.replies)), expected, buffers, kind=aggregator.reply_kind,
                                fisher_kind=aggregator.fisher_kind)
    if collected.rejections:
        raise ValueError(f"{method} uploads rejected: {[vars(r) for r in collected.rejections]}")
    outcome = aggregator.aggregate(collected, RoundContext(1, buffers=tuple(buffers), validate=validate))
    chosen = dict(outcome.chosen)
    if isinstance(aggregator, RegMeanAggregator):
        chosen["swept"], candidates = ["alpha"], len(aggregator.alphas)
    elif isinstance(aggregator, FedFiOTAggregator):
        chosen["swept"], candidates = ["gram_alpha", "gram_ridge", "reference", "variant"], len(outcome.trials)
    else:
        chosen["swept"], candidates = ["best_step"], len(outcome.record.get("history", []))
    moved = float(np.mean(outcome.metrics.get("alignment-moved-fraction") or [0.0]))
    curv = getattr(collected, "curvature_bytes_per_client", {})
    return CurvatureMethodResult(
        method=method, model=outcome.model, validation_accuracy=float(validate(outcome.model)["accuracy"]),
        knobs=chosen, merge_seconds=outcome.seconds, candidates=candidates,
        upload_bytes=float(np.mean(list(collected.bytes_per_client.values()))),
        curvature_bytes=float(np.mean(list(curv.values()))) if curv else 0.0,
        fedavg_bytes=fedavg_payload_bytes(uploads.float32.weights[0]),
        curvature_seconds=cr.seconds, curvature_cached=cr.cached,
        fisher_kind=None if method in GRAM_METHODS else fisher_kind, fraction_permuted=moved,
    )


def upload_table(records: Sequence[Mapping[str, Any]], summaries: Sequence[Mapping[str, Any]]) -> str:
    """Markdown: array payload per client of each curvature baseline next to FedAvg's float32 upload.

    Bytes are the Arrays' payload (``len(array.data)``, Flower's record headers excluded),
    averaged over clients and settings.
    """
    curv = [r for r in records if "upload_bytes" in r]
    if not curv:
        return ""
    fedavg = float(np.mean([r["fedavg_bytes"] for r in curv]))
    lines = ["| method | upload per client (bytes) | of which curvature | vs FedAvg float32 | client curvature time (s) |",
             "|---|---|---|---|---|",
             f"| FedAvg (float32 weights) | {fedavg:,.0f} | – | 1.00x | – |"]
    ours = [s["fedfiot_upload_bytes"] for s in summaries if "fedfiot_upload_bytes" in s]
    if ours:
        lines.append(f"| FedFiOT (16-bit weights + Fisher) | {np.mean(ours):,.0f} | ≈{np.mean(ours) / 2:,.0f} (Fisher) | "
                     f"{np.mean(ours) / fedavg:.2f}x | – |")
    for method in CURVATURE_METHODS:
        rs = [r for r in curv if r["method"] == method]
        if not rs:
            continue
        up, cb = float(np.mean([r["upload_bytes"] for r in rs])), float(np.mean([r["curvature_bytes"] for r in rs]))
        kind = rs[0].get("fisher_kind")
        label = METHOD_LABELS[method] + (f", {kind} Fisher" if kind else "")
        cbt = f"{cb:,.0f}" if method != "fedfisher-diag" else f"≈{up / 2:,.0f} (Fisher)"
        lines.append(f"| {label} | {up:,.0f} | {cbt} | {up / fedavg:.2f}x | "
                     f"{np.mean([r['curvature_seconds'] for r in rs]):.1f} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- tables, files


def machine_description() -> str:
    """CPU/GPU, core count and library versions, in one line."""
    import flwr

    dev = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    cpu = platform.processor() or platform.machine()
    return (f"{cpu}, {os.cpu_count()} cores ({torch.get_num_threads()} torch threads), {dev}; "
            f"Python {platform.python_version()}, torch {torch.__version__}, flwr {flwr.__version__}, numpy {np.__version__}")


def command_line(argv: Sequence[str] | None = None, script: str | None = None,
                 interpreter: str = ".venv/bin/python") -> str:
    """The command that is running, as one shell line run from the repository root.

    ``argv`` defaults to this process's arguments (``script`` to its script). Paths inside the
    repository are written relative to its root, paths outside it as placeholders
    (``--cache-dir <cache-dir>``, ``--out <out-dir>``): see :mod:`benchmarks.portable`.
    """
    return portable.command_line(argv, script, interpreter)


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (nan for a single value)."""
    arr = np.asarray([v for v in values if not math.isnan(v)], dtype=float)
    if arr.size == 0:
        return math.nan, math.nan
    return float(arr.mean()), float(arr.std(ddof=1)) if arr.size > 1 else math.nan


def fmt_pct(mean: float, std: float) -> str:
    """``"54.3 ± 1.2"`` in percent (std omitted for one seed)."""
    if math.isnan(mean):
        return "–"
    return f"{100 * mean:.1f}" + ("" if math.isnan(std) else f" ± {100 * std:.1f}")


def setting_columns(records: Sequence[Mapping[str, Any]]) -> list[tuple[Any, ...]]:
    """Distinct (dataset, alpha, init, epochs) in first-seen order."""
    out: list[tuple[Any, ...]] = []
    for r in records:
        key = (r["dataset"], r["alpha"], r["init"], r["epochs"])
        if key not in out:
            out.append(key)
    return out


def column_label(key: tuple[Any, ...]) -> str:
    dataset, alpha, init, epochs = key
    return f"{dataset} α={alpha:g} {init} E={epochs}"


def accuracy_table(records: Sequence[Mapping[str, Any]], methods: Sequence[str], value: str = "test_accuracy") -> str:
    """Markdown table: one row per method, one column per setting, mean ± sample std over seeds (percent)."""
    cols = setting_columns(records)
    lines = ["| method | " + " | ".join(column_label(c) for c in cols) + " |", "|---|" + "---|" * len(cols)]
    best: dict[tuple[Any, ...], float] = {}
    cells: dict[tuple[str, tuple[Any, ...]], tuple[float, float, int]] = {}
    for m in methods:
        for c in cols:
            vals = [r[value] for r in records if r["method"] == m and (r["dataset"], r["alpha"], r["init"], r["epochs"]) == c]
            if vals:
                mu, sd = mean_std(vals)
                cells[(m, c)] = (mu, sd, len(vals))
                if m != "fedfiot-fp32" and not math.isnan(mu):
                    best[c] = max(best.get(c, -1.0), mu)
    for m in methods:
        row = []
        for c in cols:
            if (m, c) not in cells:
                row.append("–")
                continue
            mu, sd, _ = cells[(m, c)]
            text = fmt_pct(mu, sd)
            row.append(f"**{text}**" if m != "fedfiot-fp32" and mu == best.get(c) else text)
        lines.append(f"| {METHOD_LABELS.get(m, m)} | " + " | ".join(row) + " |")
    seeds = sorted({r["seed"] for r in records})
    lines.append("")
    lines.append(f"Test accuracy (%), mean ± sample std over seeds {seeds}; bold: best per column (float32 row excluded).")
    return "\n".join(lines)


def fraction_table(records: Sequence[Mapping[str, Any]], method: str = "fedfiot") -> str:
    """Markdown: per setting, the fraction of hidden neurons FedFiOT's chosen merge permuted (and alignment found)."""
    cols = setting_columns(records)
    lines = ["| setting | permuted in the returned merge (%) | permuted by the alignment (%) | aligned merge kept |",
             "|---|---|---|---|"]
    for c in cols:
        rs = [r for r in records if r["method"] == method and (r["dataset"], r["alpha"], r["init"], r["epochs"]) == c]
        if not rs:
            continue
        kept = sum(r["knobs"].get("variant") == "aligned" for r in rs)
        lines.append(f"| {column_label(c)} | {fmt_pct(*mean_std([r['fraction_permuted'] for r in rs]))} | "
                     f"{fmt_pct(*mean_std([r['alignment_fraction_permuted'] for r in rs]))} | {kept}/{len(rs)} |")
    return "\n".join(lines)


def knob_table(records: Sequence[Mapping[str, Any]], methods: Sequence[str]) -> str:
    """Markdown: the knobs each method chose, per setting and seed."""
    lines = ["| setting | seed | " + " | ".join(METHOD_LABELS.get(m, m) for m in methods) + " |",
             "|---|---|" + "---|" * len(methods)]
    for c in setting_columns(records):
        for seed in sorted({r["seed"] for r in records}):
            cells = []
            for m in methods:
                r = next((r for r in records if r["method"] == m and r["seed"] == seed
                          and (r["dataset"], r["alpha"], r["init"], r["epochs"]) == c), None)
                cells.append("–" if r is None else knob_text(r["knobs"]))
            if any(x != "–" for x in cells):
                lines.append(f"| {column_label(c)} | {seed} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def knob_text(knobs: Mapping[str, Any]) -> str:
    """Short text of the knobs a method chose (only those it swept; "identity" when the fallback was taken)."""
    swept = knobs.get("swept", [])
    parts = []
    if "rho" in swept:
        parts.append(f"ρ={knobs['rho']:g}")
    if "lam" in swept:
        parts.append(f"λ={knobs['lam']:.0e}")
    if "reference" in swept:
        parts.append(f"ref={knobs['reference']}")
    if "fisher_scaling" in swept:
        parts.append(f"scale={knobs['fisher_scaling']}")
    if knobs.get("variant") == "identity" and knobs.get("aligning", False):
        parts.append("identity")
    if "alpha" in swept:  # RegMean
        parts.append(f"α={knobs['alpha']:g}")
    if "gram_alpha" in swept:  # FedFiOT with the Gram curvature
        parts.append(f"α={knobs['gram_alpha']:g}")
        if "gram_ridge" in swept:
            parts.append(f"ridge={knobs['gram_ridge']:g}")
        if knobs.get("variant") in ("identity", "fedavg"):
            parts.append(str(knobs["variant"]))
    if "best_step" in swept:  # FedFisher
        parts.append(f"step {knobs['best_step']}")
    return ", ".join(parts) or "–"


def write_json(path: Path, payload: Mapping[str, Any]) -> None:
    """Write JSON atomically (NaN as null; a path relative to the repository root or as a placeholder)."""
    def clean(x: Any, key: str = "") -> Any:
        if isinstance(x, float) and not math.isfinite(x):
            return None
        if isinstance(x, os.PathLike) or (isinstance(x, str) and os.path.isabs(x)):
            # A path is recorded relative to the repository, or as a placeholder outside it.
            return portable.portable_path(x, portable.CONFIG_PLACEHOLDERS.get(key, "<path>"))
        if isinstance(x, dict):
            return {k: clean(v, k) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [clean(v) for v in x]
        if isinstance(x, (np.floating, np.integer)):
            return clean(x.item())
        return x

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(clean(payload), indent=1))
    os.replace(tmp, path)


def write_results(out: Path, name: str, payload: Mapping[str, Any], page: str) -> None:
    """A benchmark's results: ``out/<name>.json`` (:func:`write_json`) and its markdown page ``out/<name>.md``."""
    write_json(out / f"{name}.json", payload)
    (out / f"{name}.md").write_text(page)


def cell_analysis_parser(doc: str | None, name: str, knobs: int,
                         extra_args: Callable[[argparse.ArgumentParser], None] | None = None) -> argparse.ArgumentParser:
    """Command line of an analysis of cached one-shot uploads, cell by cell and seed by seed.

    ``name`` names the results files; ``knobs`` is how many of the analysis's knob settings run by
    default; ``extra_args`` adds the analysis's own options.
    """
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", default="fashion-mnist")
    p.add_argument("--model", default="fednet")
    p.add_argument("--validation-size", type=int, default=500)
    p.add_argument("--alphas", nargs="+", type=float, default=[0.1])
    p.add_argument("--inits", nargs="+", choices=INITS, default=["independent"])
    p.add_argument("--seeds", nargs="+", type=int, default=[0])
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--clients", type=int, default=6)
    p.add_argument("--knobs", type=int, default=knobs, help="how many of the knob settings to run")
    p.add_argument("--cache-dir", type=Path, default=CACHE_DIR)
    p.add_argument("--out", type=Path, default=RESULTS_DIR)
    p.add_argument("--name", default=name)
    p.add_argument("--threads", type=int, default=None)
    if extra_args is not None:
        extra_args(p)
    return p


def run_cell_analysis(
    argv: Sequence[str] | None,
    doc: str | None,
    name: str,
    knobs: int,
    run_setting: Callable[[Setting, argparse.Namespace, Callable[[str], None]], list[dict[str, Any]]],
    page: Callable[[dict[str, Any]], str],
    extra_args: Callable[[argparse.ArgumentParser], None] | None = None,
) -> dict[str, Any]:
    """An analysis script's ``main``: parse ``argv`` (:func:`cell_analysis_parser`, with the
    analysis's ``extra_args``), then run ``run_setting`` on every (alpha, init, seed) it names.

    The payload (command, machine, rows, seconds) and its page are rewritten after every cell.
    """
    args = cell_analysis_parser(doc, name, knobs, extra_args).parse_args(argv)
    set_threads(args.threads)
    log = setup_logging(True)
    start = time.perf_counter()
    payload: dict[str, Any] = {"command": command_line(argv), "machine": machine_description(), "rows": []}
    for alpha in args.alphas:
        for init in args.inits:
            for seed in args.seeds:
                setting = Setting(args.dataset, args.model, args.clients, alpha, init, seed, args.epochs,
                                  validation_size=args.validation_size)
                log(f"{setting.column()} seed {seed}")
                payload["rows"] += run_setting(setting, args, log)
                payload["seconds"] = time.perf_counter() - start
                write_results(args.out, args.name, payload, page(payload))
    return payload


def setup_logging(verbose: bool = True) -> Callable[[str], None]:
    """Timestamped progress lines on stderr; returns the log function."""
    start = time.perf_counter()

    def log(msg: str) -> None:
        if verbose:
            print(f"[{time.perf_counter() - start:7.1f}s] {msg}", file=sys.stderr, flush=True)

    return log


def set_threads(threads: int | None) -> None:
    """Limit torch's CPU threads (None: leave the default)."""
    if threads:
        torch.set_num_threads(int(threads))


def replace_setting(setting: Setting, **changes: Any) -> Setting:
    """``dataclasses.replace`` for :class:`Setting`."""
    return replace(setting, **changes)


__all__ = [
    "CACHE_DIR", "CURVATURE_METHODS", "CurvatureMethodResult", "CurvatureReplies", "DEFAULT_MODELS",
    "FEDFISHER_STEPS", "apply_curvature_method", "curvature_knobs", "curvature_replies", "curvature_aggregator",
    "upload_table", "DEFAULT_PRESET", "EXTRA_METHODS", "Evaluator", "GRIDS", "METHOD_LABELS",
    "MethodResult", "ONE_SHOT_METHODS", "RESULTS_DIR", "Setting", "UPLOADS", "UPLOAD_OF", "Uploads",
    "accuracy_table", "apply_method", "client_seed", "client_start", "collect", "command_line", "engine_config",
    "fedfiot_alignment_fraction", "fisher_loader", "flower_fedavg", "fraction_table", "initial_weights", "knob_table",
    "knobs_description", "load_numpy", "machine_description", "mean_std", "merge_outcome", "method_config", "method_configs",
    "model_tools", "one_shot_uploads", "record_fields", "round_context", "set_threads", "setup_logging",
    "shared_init", "state_numpy", "swept_knobs", "train_client", "upload_of", "write_json",
]
