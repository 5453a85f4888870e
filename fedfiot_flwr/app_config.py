"""Run configuration of the FedFiOT Flower app (``[tool.flwr.app.config]`` and ``--run-config``).

One frozen dataclass, :class:`AppConfig`, parses Flower's flat run config (kebab-case keys,
values str/int/float/bool) with defaults and checks every value, so the ServerApp and the
ClientApp read the same knobs the same way. Lists (the sweep grid) are comma-separated strings,
because Flower's run config holds scalars only. Every key has a :class:`Rule` (:func:`rules`);
all bad values of a config are reported at once, before any round, in one ``ValueError`` that
names each key, its value and what is allowed.
"""

from __future__ import annotations

import difflib
import functools
import math
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, fields, replace
from typing import TYPE_CHECKING, Any, ClassVar

from fedfiot_flwr.options import (
    AGGREGATIONS,
    CLIENT_FISHER_KINDS,
    CURVATURES,
    DEFAULT_GRAM_ALPHA,
    DEFAULT_GRAM_RIDGE,
    DEFAULT_GRID_LAMS,
    DEFAULT_GRID_REFERENCES,
    DEFAULT_GRID_RHOS,
    DEFAULT_LAM,
    DEFAULT_MAX_ITERS,
    DEFAULT_RHO,
    FISHER_SCALINGS,
    INITS,
    MATCHINGS,
    PRESETS,
    REFERENCES,
    ROUND_CHOICES,
    SELECTIONS,
    STRATEGIES,
)

from .models import MODEL_NAMES, is_model_name

if TYPE_CHECKING:
    import torch

    from .data import FederatedSplit



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


def _one_of(names: Sequence[str]) -> str:
    return "one of " + ", ".join(names)


def _numbers_within(text: Any, ok: Callable[[float], bool]) -> bool:
    """Whether ``text`` is a non-empty comma-separated list of numbers that all pass ``ok``."""
    values = parse_float_list(text, "")
    return all(math.isfinite(v) and ok(v) for v in values)


def _names_within(text: Any, allowed: Sequence[str]) -> bool:
    """Whether ``text`` is a non-empty comma-separated list of names from ``allowed``."""
    return all(name in allowed for name in parse_str_list(text, ""))


def client_round_seed(seed: int, server_round: int, partition_id: int) -> int:
    """Seed of a client's data order and augmentation in a round, from the run's ``seed``.

    >>> client_round_seed(0, 1, 2)
    7921
    """
    return seed * 100_003 + 7919 * server_round + int(partition_id)


@dataclass(frozen=True)
class Rule:
    """What one run-config key accepts.

    Attributes
    ----------
    expected : str
        The allowed values in words, for error messages (``"an integer >= 1"``).
    ok : callable
        ``value -> bool`` on the value parsed to the field's type; an ``AttributeError``,
        ``TypeError`` or ``ValueError`` it raises counts as a rejection.
    """

    expected: str
    ok: Callable[[Any], bool]

    def accepts(self, value: Any) -> bool:
        """Whether ``ok(value)`` holds (an exception in ``ok`` is a rejection)."""
        try:
            return bool(self.ok(value))
        except (AttributeError, TypeError, ValueError):  # e.g. a number where a name belongs
            return False


@functools.cache
def rules() -> dict[str, Rule]:
    """The rule of every run-config key, by field name (built once, on the first check)."""
    # Imported here, not with this module: the data layer pulls in torchvision.
    from .data.loaders import DATASET_NAMES, canonical_name

    positive = "a number > 0"
    return {
        "dataset": Rule(_one_of(DATASET_NAMES), lambda v: canonical_name(v) in DATASET_NAMES),
        "data_root": Rule("a directory path, or empty (the data layer's default)", lambda v: isinstance(v, str)),
        "model": Rule(_one_of(MODEL_NAMES) + " (resnet20-w<N> for width N)", is_model_name),
        "num_partitions": Rule("an integer >= 1, or 0 to follow the federation", lambda v: v >= 0),
        "alpha": Rule(positive, lambda v: math.isfinite(v) and v > 0),
        "partition_seed": Rule("an integer >= 0", lambda v: v >= 0),
        "validation_size": Rule("an integer >= 0", lambda v: v >= 0),
        "augment": Rule("true or false", lambda v: isinstance(v, bool)),
        "local_epochs": Rule("an integer >= 1", lambda v: v >= 1),
        "batch_size": Rule("an integer >= 1", lambda v: v >= 1),
        "lr": Rule(positive, lambda v: math.isfinite(v) and v > 0),
        "seed": Rule("an integer >= 0", lambda v: v >= 0),
        "init": Rule(_one_of(INITS), lambda v: v in INITS),
        "num_server_rounds": Rule("an integer >= 1", lambda v: v >= 1),
        "fraction_train": Rule("a number in (0, 1]", lambda v: 0 < v <= 1),
        "fraction_evaluate": Rule("a number in [0, 1]", lambda v: 0 <= v <= 1),
        "min_valid_replies": Rule("an integer >= 1", lambda v: v >= 1),
        "node_wait_s": Rule("a number of seconds >= 0", lambda v: v >= 0),
        "node_settle_s": Rule("a number of seconds >= 0", lambda v: v >= 0),
        "lam": Rule(positive, lambda v: math.isfinite(v) and v > 0),
        "rho": Rule("a number in (0, 1]", lambda v: 0 < v <= 1),
        "max_iters": Rule("an integer >= 1", lambda v: v >= 1),
        "fisher_rounds": Rule("an integer: -1 (the preset's), 0 (every round) or n >= 1", lambda v: v >= -1),
        "reprobe_after": Rule("an integer: -1 (the preset's), 0 (a hand-over for good) or n >= 1", lambda v: v >= -1),
        "reference": Rule(_one_of(REFERENCES) + " or a client index (0, 1, ...)",
                          lambda v: v in REFERENCES or re.fullmatch(r"\d+", v) is not None),
        "matching": Rule(_one_of(MATCHINGS), lambda v: v in MATCHINGS),
        "aggregation": Rule(_one_of(AGGREGATIONS), lambda v: v in AGGREGATIONS),
        "fisher_scaling": Rule(_one_of(FISHER_SCALINGS), lambda v: v in FISHER_SCALINGS),
        "curvature": Rule(_one_of(CURVATURES), lambda v: v in CURVATURES),
        "gram_alpha": Rule("a number in [0, 1]", lambda v: 0 <= v <= 1),
        "gram_ridge": Rule("a finite number >= 0", lambda v: math.isfinite(v) and v >= 0),
        "preset": Rule(_one_of(PRESETS), lambda v: v in PRESETS),
        "fallback": Rule(_one_of(SELECTIONS) + ", or empty (the preset's)", lambda v: v == "" or v in SELECTIONS),
        "round_choice": Rule(_one_of(ROUND_CHOICES) + ", or empty (the preset's)",
                             lambda v: v == "" or v in ROUND_CHOICES),
        "sweep": Rule("true or false", lambda v: isinstance(v, bool)),
        "server_refine": Rule("true or false", lambda v: isinstance(v, bool)),
        "sweep_rho": Rule("comma-separated numbers in (0, 1], e.g. '0.3,0.5'",
                          lambda v: _numbers_within(v, lambda x: 0 < x <= 1)),
        "sweep_lam": Rule("comma-separated numbers > 0, e.g. '1e-3,1e-4'",
                          lambda v: _numbers_within(v, lambda x: x > 0)),
        "sweep_reference": Rule("comma-separated names from: " + ", ".join(REFERENCES),
                                lambda v: _names_within(v, REFERENCES)),
        "sweep_fisher_scaling": Rule("comma-separated names from: " + ", ".join(FISHER_SCALINGS)
                                     + ", or empty (the preset's)",
                                     lambda v: v == "" or _names_within(v, FISHER_SCALINGS)),
        "strategy": Rule(_one_of(STRATEGIES), lambda v: v in STRATEGIES),
        "fisher_kind": Rule(_one_of(CLIENT_FISHER_KINDS) + ", or empty (the strategy's own)",
                            lambda v: v == "" or v in CLIENT_FISHER_KINDS),
        "fedfisher_steps": Rule("an integer >= 0", lambda v: v >= 0),
        "results_dir": Rule("a directory path", lambda v: isinstance(v, str)),
        "run_name": Rule("a name, or empty (derived from the settings and the time)", lambda v: isinstance(v, str)),
        "resume_from": Rule("a run directory (or one round's checkpoint file), or empty (start at round 1)",
                            lambda v: isinstance(v, str)),
    }


def _to_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false", "1", "0"):
        return value.strip().lower() in ("true", "1")
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise ValueError(value)


def _to_int(value: Any) -> int:
    if isinstance(value, bool):
        raise ValueError(value)  # a bool is an int to Python, never to a user
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and re.fullmatch(r"\s*[+-]?\d+\s*", value):
        return int(value)
    raise ValueError(value)


def _to_float(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(value)
    return float(value)


def _to_str(value: Any) -> str:
    if isinstance(value, bool):
        raise ValueError(value)
    return str(value)  # a client index may come as a TOML integer (reference=2)


def parse_value(value: Any, like: Any) -> Any:
    """``value`` (from TOML or the command line) as the type of ``like``, the field's default.

    Raises
    ------
    ValueError
        When ``value`` is not one (``"abc"`` for an integer, ``true`` for a number...).
    """
    for kind, parse in ((bool, _to_bool), (int, _to_int), (float, _to_float)):
        if isinstance(like, kind):
            return parse(value)
    return _to_str(value)


def problem(key: str, value: Any, shown: Any = None) -> str | None:
    """Why run-config ``key`` cannot be ``value`` (parsed), or None when it can.

    ``shown`` is the value as the user wrote it (default: ``value``).
    """
    rule = rules()[key.replace("-", "_")]
    if rule.accepts(value):
        return None
    written = value if shown is None else shown
    return f"{key.replace('_', '-')}={written!r}: expected {rule.expected}"


def raise_problems(problems: Sequence[str | None]) -> None:
    """Raise one ``ValueError`` listing every problem (``None`` entries are no problem).

    Raises
    ------
    ValueError
        ``run-config local-epochs='abc': expected an integer >= 1; alpha=-1: expected ...``.
    """
    found = [p for p in problems if p]
    if found:
        raise ValueError("run-config " + "; ".join(found))


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
    curvature, gram_alpha, gram_ridge
        :attr:`fedfiot_flwr.FedFiOTConfig.curvature` (``diagonal``: the clients' Fisher, the paper;
        ``gram``: their layers' input Grams; ``kfac``: the Grams and each unit's output factor) and
        the Gram's off-diagonal scaling and relative ridge without validation data (with it, the
        sweep tries ``FedFiOTConfig``'s grid of alphas and ridges).
    fisher_rounds
        :attr:`fedfiot_flwr.FedFiOTConfig.fisher_rounds`: -1 the preset's, 0 every round, ``n``
        rounds 1 to ``n`` with the Fisher and FedAvg afterwards.
    round_choice
        :attr:`fedfiot_flwr.FedFiOTConfig.round_choice` (empty: the preset's): ``clients``, the
        clients' evaluation chooses between each round's merge and FedAvg when the run has no
        validation set; ``none``, it does not.
    reprobe_after
        :attr:`fedfiot_flwr.FedFiOTConfig.reprobe_after`: -1 the preset's, 0 the clients' choice
        hands over for good, ``n`` a hand-over lasts ``n`` rounds (twice as long after each probe
        round FedAvg wins).
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
    resume_from
        Go on from the last complete round of this earlier run's directory (or from one round's
        ``checkpoints/round-NNN.pt``), in a new run directory; every setting but those of
        :attr:`RUN_ONLY_KEYS` must equal the earlier run's, and ``num_server_rounds`` (the total)
        must exceed the round it stopped after. Empty: start at round 1.
    """

    RUN_ONLY_KEYS: ClassVar[tuple[str, ...]] = (
        "data-root", "num-server-rounds", "node-wait-s", "node-settle-s", "results-dir", "run-name", "resume-from",
    )
    """Run-config keys a resumed run may change: where things are, how long to wait, how many rounds in all."""

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
    lam: float = DEFAULT_LAM
    rho: float = DEFAULT_RHO
    max_iters: int = DEFAULT_MAX_ITERS
    reference: str = "largest"
    matching: str = "fisher"
    aggregation: str = "fisher"
    fisher_scaling: str = "none"
    curvature: str = "diagonal"
    gram_alpha: float = DEFAULT_GRAM_ALPHA
    gram_ridge: float = DEFAULT_GRAM_RIDGE
    preset: str = "default"
    fallback: str = ""
    fisher_rounds: int = -1
    round_choice: str = ""
    reprobe_after: int = -1
    sweep: bool = True
    server_refine: bool = False
    sweep_rho: str = ",".join(f"{v:g}" for v in DEFAULT_GRID_RHOS)
    sweep_lam: str = ",".join(f"{v:g}" for v in DEFAULT_GRID_LAMS)
    sweep_reference: str = ",".join(DEFAULT_GRID_REFERENCES)
    sweep_fisher_scaling: str = ""
    strategy: str = "fedfiot"
    fisher_kind: str = ""
    fedfisher_steps: int = 2000
    results_dir: str = "results"
    run_name: str = ""
    resume_from: str = ""

    def __post_init__(self) -> None:
        raise_problems([problem(f.name, getattr(self, f.name)) for f in fields(self)])

    @classmethod
    def from_run_config(cls, run_config: Mapping[str, Any]) -> AppConfig:
        """Build from Flower's ``context.run_config``, checking every key before any round runs.

        Raises
        ------
        ValueError
            For unknown keys (with the closest known ones), or one error naming every key whose
            value is of the wrong type or out of range, with the value and what is allowed:
            ``run-config local-epochs='abc': expected an integer >= 1``.
        """
        known = {f.name.replace("_", "-"): f for f in fields(cls)}
        unknown = sorted(set(run_config) - set(known))
        if unknown:
            hints = {k: difflib.get_close_matches(k, list(known), n=1) for k in unknown}
            near = ", ".join(f"{m[0]!r} (for {k!r})" for k, m in hints.items() if m)
            raise ValueError(f"unknown run config keys {unknown}{f' (did you mean {near}?)' if near else ''}; "
                             f"known keys: {sorted(known)}")
        kwargs: dict[str, Any] = {}
        problems: list[str | None] = []
        for key, raw in run_config.items():
            f = known[key]
            try:
                kwargs[f.name] = parse_value(raw, f.default)
            except ValueError:
                problems.append(f"{key}={raw!r}: expected {rules()[f.name].expected}")
                continue
            problems.append(problem(key, kwargs[f.name], shown=raw))
        raise_problems(problems)
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
        """The ``sweep-*`` lists, parsed (``fisher_scalings`` None: the preset's; checked on construction)."""
        return {
            "rhos": parse_float_list(self.sweep_rho, "sweep-rho"),
            "lams": parse_float_list(self.sweep_lam, "sweep-lam"),
            "references": parse_str_list(self.sweep_reference, "sweep-reference"),
            "fisher_scalings": (parse_str_list(self.sweep_fisher_scaling, "sweep-fisher-scaling")
                                if self.sweep_fisher_scaling else None),
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

    def client_round_seed(self, server_round: int, partition_id: int) -> int:
        """Seed of client ``partition_id``'s data order and augmentation in round ``server_round``."""
        return client_round_seed(self.seed, server_round, partition_id)

    def client_init_seed(self, partition_id: int) -> int:
        """Seed of client ``partition_id``'s own random init under ``init = "independent"``."""
        return self.seed * 1000 + 1 + int(partition_id)
