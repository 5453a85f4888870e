"""Run configuration of the FedFiOT Flower app (``[tool.flwr.app.config]`` and ``--run-config``).

One frozen dataclass, :class:`AppConfig`, parses Flower's flat run config (kebab-case keys,
values str/int/float/bool) with defaults and checks every value, so the ServerApp and the
ClientApp read the same knobs the same way. Lists (the sweep grid) are comma-separated strings,
because Flower's run config holds scalars only.
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields, replace
from typing import TYPE_CHECKING, Any

from .merge import FISHER_SCALINGS

if TYPE_CHECKING:
    import torch

    from .data import FederatedSplit

INITS = ("shared", "independent")
STRATEGIES = ("fedfiot", "fedfisher-kfac", "fedfisher-diag", "regmean")
"""Values of the ``strategy`` key: FedFiOT or one of the paper's one-shot baselines."""
FISHER_KINDS = ("true", "empirical", "sampled")
PRESETS = ("default", "paper")
"""Values of ``preset``: :meth:`fedfiot_flwr.FedFiOTConfig.default` or ``.paper``."""
FALLBACKS = ("objective", "validation", "none")
"""Values of ``fallback`` (the FedFiOT configuration's ``selection``)."""
REFERENCES = ("largest", "broadcast")


def parse_float_list(text: str | Sequence[float], name: str) -> tuple[float, ...]:
    """Parse ``"0.2,0.3"`` (a run-config string) or a sequence into a tuple of floats.

    Raises
    ------
    ValueError
        Naming the config key when an entry is not a number or the list is empty.
    """
    items = [s.strip() for s in text.split(",") if s.strip()] if isinstance(text, str) else list(text)
    try:
        values = tuple(float(x) for x in items)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name}: expected comma-separated numbers, got {text!r}") from exc
    if not values:
        raise ValueError(f"{name}: expected at least one value, got {text!r}")
    return values


def parse_str_list(text: str | Sequence[str], name: str) -> tuple[str, ...]:
    """Parse ``"largest,broadcast"`` (a run-config string) or a sequence into a tuple of str."""
    items = [s.strip() for s in text.split(",") if s.strip()] if isinstance(text, str) else [str(x) for x in text]
    if not items:
        raise ValueError(f"{name}: expected at least one value, got {text!r}")
    return tuple(items)


@dataclass(frozen=True)
class AppConfig:
    """Every knob of the app; field ``foo_bar`` is run-config key ``foo-bar``.

    Attributes
    ----------
    dataset, data_root, model
        Data set name (``digits``, ``fashion-mnist``, ``cifar10``, ``svhn``, ``cinic10``), its
        directory (empty: the data layer's default) and model (``mlp``, ``lenet``, ``fednet``).
    num_partitions, alpha, partition_seed, validation_size, augment
        Federated split: K clients, Dirichlet alpha, partition seed, server validation examples,
        crop+flip augmentation of 32x32 RGB training data. ``num_partitions = 0`` (the default)
        means "follow the federation": each ClientApp takes K from its node config
        (``num-partitions``, set by Flower's simulation engine or ``flower-supernode
        --node-config``) and the ServerApp uses every SuperNode that connected (see
        :meth:`with_partitions`); K > 0 fixes K, and the federation must match it.
    local_epochs, batch_size, lr, seed, init
        Client training; ``seed`` is the shared initialisation (and training) seed; ``init`` is
        ``"shared"`` (paper Table 1) or ``"independent"`` (Table 5: every client its own random
        init in round 1).
    num_server_rounds, fraction_train, fraction_evaluate, min_valid_replies, node_wait_s, node_settle_s
        Rounds (1 = one-shot), fraction of nodes sampled per round for training and for
        federated evaluation (Flower's ``FedAvg`` defaults, 1.0), minimum valid replies to
        merge, how long the server waits for all ``num_partitions`` SuperNodes (with
        ``num_partitions = 0``: for the first one), and, with ``num_partitions = 0``, for how
        many seconds the set of connected SuperNodes must stay unchanged before the run starts.
    preset, lam, rho, max_iters, reference, matching, aggregation, fisher_scaling, fallback
        The merge: ``preset`` names :meth:`fedfiot_flwr.FedFiOTConfig.default` or ``.paper``; the
        other keys are that configuration's fields (``fallback`` is its ``selection``; empty: the
        preset's).
    sweep, sweep_rho, sweep_lam, sweep_reference, sweep_fisher_scaling
        Server-side selection on the validation set over the grid (comma-separated lists).
    server_refine
        Also train on the server's validation set: every round's model (whatever the strategy)
        goes through the server refinement (split into a fitting and a selection fold;
        :class:`fedfiot_flwr.refine.RefinementStage`), and so does the FedAvg it is compared
        with. Off: the validation set only chooses.
    strategy, fisher_kind, fedfisher_steps
        The aggregation: ``fedfiot`` (default) or a baseline, ``fedfisher-kfac``,
        ``fedfisher-diag`` (:class:`fedfiot_flwr.FedFisherStrategy`) or ``regmean``
        (:class:`fedfiot_flwr.RegMeanStrategy`); the clients send the matching upload.
        ``fisher_kind`` is the clients' Fisher (``true`` | ``empirical``; empty: the strategy's
        own, ``empirical`` for FedFiOT and ``true`` for FedFisher, as its code);
        ``fedfisher_steps`` the FedFisher server optimisation's length (paper: 2000).
    results_dir, run_name
        Results land in a new directory ``results_dir/run_name[-N]/`` (``results.json``,
        ``checkpoints/``; an existing run is never overwritten); an empty ``run_name`` is derived
        from the settings and the time. A relative ``results_dir`` is resolved against the
        ServerApp's working directory (the SuperLink's); the log prints the absolute path.
    """

    dataset: str = "digits"
    data_root: str = ""
    model: str = "mlp"
    num_partitions: int = 0
    alpha: float = 0.1
    partition_seed: int = 0
    validation_size: int = 200
    augment: bool = False
    local_epochs: int = 20
    batch_size: int = 64
    lr: float = 0.02
    seed: int = 0
    init: str = "shared"
    num_server_rounds: int = 1
    fraction_train: float = 1.0
    fraction_evaluate: float = 1.0
    min_valid_replies: int = 2
    node_wait_s: float = 120.0
    node_settle_s: float = 3.0
    lam: float = 1e-4
    rho: float = 0.5
    max_iters: int = 8
    reference: str = "largest"
    matching: str = "fisher"
    aggregation: str = "fisher"
    fisher_scaling: str = "none"
    preset: str = "default"
    fallback: str = ""
    sweep: bool = True
    server_refine: bool = False
    sweep_rho: str = "0.2,0.3,0.4,0.5,0.6,0.7"
    sweep_lam: str = "1e-3,1e-4,1e-5"
    sweep_reference: str = "largest,broadcast"
    sweep_fisher_scaling: str = ""
    strategy: str = "fedfiot"
    fisher_kind: str = ""
    fedfisher_steps: int = 2000
    results_dir: str = "results"
    run_name: str = ""

    def __post_init__(self) -> None:
        def bad(key: str, why: str) -> ValueError:
            return ValueError(f"run config {key!r}: {why}, got {getattr(self, key.replace('-', '_'))!r}")

        if self.num_partitions < 0:
            raise bad("num-partitions", "must be >= 1, or 0 to follow the federation")
        if self.node_wait_s < 0:
            raise bad("node-wait-s", "must be >= 0")
        if self.node_settle_s < 0:
            raise bad("node-settle-s", "must be >= 0")
        if not self.alpha > 0:
            raise bad("alpha", "must be > 0")
        if self.local_epochs < 1:
            raise bad("local-epochs", "must be >= 1")
        if self.batch_size < 1:
            raise bad("batch-size", "must be >= 1")
        if self.num_server_rounds < 1:
            raise bad("num-server-rounds", "must be >= 1")
        if not 0 < self.fraction_train <= 1:
            raise bad("fraction-train", "must lie in (0, 1]")
        if not 0 <= self.fraction_evaluate <= 1:
            raise bad("fraction-evaluate", "must lie in [0, 1]")
        if self.init not in INITS:
            raise bad("init", f"must be one of {INITS}")
        if self.fallback and self.fallback not in FALLBACKS:
            raise bad("fallback", f"must be one of {FALLBACKS} or empty (the preset's)")
        if self.preset not in PRESETS:
            raise bad("preset", f"must be one of {PRESETS}")
        if self.fisher_scaling not in FISHER_SCALINGS:
            raise bad("fisher-scaling", f"must be one of {FISHER_SCALINGS}")
        if not (self.reference in REFERENCES or re.fullmatch(r"\d+", self.reference)):
            raise bad("reference", f"must be one of {REFERENCES} or a client index")
        if self.min_valid_replies < 1:
            raise bad("min-valid-replies", "must be >= 1")
        if self.strategy not in STRATEGIES:
            raise bad("strategy", f"must be one of {STRATEGIES}")
        if self.fisher_kind and self.fisher_kind not in FISHER_KINDS:
            raise bad("fisher-kind", f"must be one of {FISHER_KINDS} or empty (the strategy's own)")
        if self.fedfisher_steps < 0:
            raise bad("fedfisher-steps", "must be >= 0")
        self.sweep_lists()  # validates the lists

    @classmethod
    def from_run_config(cls, run_config: Mapping[str, Any]) -> AppConfig:
        """Build from Flower's ``context.run_config`` (unknown keys are rejected).

        Raises
        ------
        ValueError
            For an unknown key or a value of the wrong type.
        """
        known = {f.name.replace("_", "-"): f for f in fields(cls)}
        unknown = sorted(set(run_config) - set(known))
        if unknown:
            raise ValueError(f"unknown run config keys {unknown}; known keys: {sorted(known)}")
        kwargs: dict[str, Any] = {}
        defaults = cls()
        for key, value in run_config.items():
            f = known[key]
            default = getattr(defaults, f.name)
            try:
                if isinstance(default, bool):
                    if isinstance(value, str):
                        if value.lower() not in ("true", "false", "1", "0"):
                            raise ValueError(value)
                        value = value.lower() in ("true", "1")
                    kwargs[f.name] = bool(value)
                elif isinstance(default, int):
                    if isinstance(value, float) and not value.is_integer():
                        raise ValueError(value)
                    kwargs[f.name] = int(value)
                elif isinstance(default, float):
                    kwargs[f.name] = float(value)
                else:
                    kwargs[f.name] = str(value)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"run config {key!r}: expected {type(default).__name__}, got {value!r}") from exc
        return cls(**kwargs)

    def with_partitions(self, num_partitions: int) -> AppConfig:
        """This configuration with K resolved to ``num_partitions`` (the federation's size).

        Parameters
        ----------
        num_partitions : int
            The number of SuperNodes (server) or the node config's ``num-partitions`` (client).

        Raises
        ------
        ValueError
            If ``num_partitions < 1``, or if this configuration fixes a different K > 0.
        """
        if num_partitions < 1:
            raise ValueError(f"num-partitions must be >= 1, got {num_partitions}")
        if self.num_partitions not in (0, num_partitions):
            raise ValueError(
                f"the federation has num-partitions = {num_partitions} but the run config fixes "
                f"num-partitions = {self.num_partitions}; set it to 0 to follow the federation"
            )
        return replace(self, num_partitions=int(num_partitions))

    def reference_value(self) -> str | int:
        """``reference`` as the strategy expects it (a client index becomes an int)."""
        return int(self.reference) if self.reference.isdigit() else self.reference

    def client_fisher_kind(self) -> str:
        """The Fisher kind the clients compute: ``fisher_kind``, or the strategy's own when empty."""
        return self.fisher_kind or ("empirical" if self.strategy == "fedfiot" else "true")

    def sweep_lists(self) -> dict[str, tuple[Any, ...] | None]:
        """The ``sweep-*`` lists, parsed and checked (``fisher_scalings`` None: the preset's)."""
        refs = parse_str_list(self.sweep_reference, "sweep-reference")
        scalings = parse_str_list(self.sweep_fisher_scaling, "sweep-fisher-scaling") if self.sweep_fisher_scaling else None
        for r in refs:
            if r not in REFERENCES:
                raise ValueError(f"run config 'sweep-reference': {r!r} is not one of {REFERENCES}")
        for sc in scalings or ():
            if sc not in FISHER_SCALINGS:
                raise ValueError(f"run config 'sweep-fisher-scaling': {sc!r} is not one of {FISHER_SCALINGS}")
        return {
            "rhos": parse_float_list(self.sweep_rho, "sweep-rho"),
            "lams": parse_float_list(self.sweep_lam, "sweep-lam"),
            "references": refs,
            "fisher_scalings": scalings,
        }

    def default_run_name(self) -> str:
        """``run_name``, or a name derived from the settings and the time when empty."""
        return self.run_name or (
            f"{self.dataset}-{self.model}-K{self.num_partitions or 'auto'}-a{self.alpha:g}-T{self.num_server_rounds}-"
            f"{self.init}{'' if self.strategy == 'fedfiot' else '-' + self.strategy}-{time.strftime('%Y%m%d-%H%M%S')}"
        )

    def as_dict(self) -> dict[str, Any]:
        """The configuration with run-config (kebab-case) keys."""
        return {k.replace("_", "-"): v for k, v in asdict(self).items()}

    def split(self) -> FederatedSplit:
        """Load the data set and draw the federated split (both cached per process).

        Raises
        ------
        ValueError
            If K is not resolved yet (``num_partitions = 0``; see :meth:`with_partitions`).
        """
        from .data import federated_split, load_dataset

        if self.num_partitions < 1:
            raise ValueError("num-partitions = 0 (follow the federation) must be resolved with with_partitions() first")
        bundle = load_dataset(self.dataset, root=self.data_root or None, augment=self.augment)
        return federated_split(
            bundle, num_partitions=self.num_partitions, alpha=self.alpha,
            partition_seed=self.partition_seed, validation_size=self.validation_size,
        )

    def build_model(self, split: FederatedSplit, seed: int | None = None) -> torch.nn.Module:
        """The configured model for ``split``'s data, Xavier-initialised with ``seed`` (default: ``self.seed``)."""
        from .models import build_model

        bundle = split.bundle
        return build_model(self.model, bundle.input_shape, bundle.num_classes, seed=self.seed if seed is None else seed)

    def client_init_seed(self, partition_id: int) -> int:
        """Seed of client ``partition_id``'s own random init under ``init = "independent"``."""
        return self.seed * 1000 + 1 + int(partition_id)
