"""The app's run config: every bad value fails before any round, naming the key, the value and what is allowed."""

from __future__ import annotations

import re
from typing import Any

import pytest

from fedfiot_flwr.app_config import AppConfig, rules

BAD_VALUES: list[tuple[str, Any, str]] = [
    # key, bad value, words of what is allowed
    ("dataset", "mnist", "one of digits, fashion-mnist"),
    ("model", "vgg", "one of fednet, lenet, mlp, resnet20"),
    ("num-partitions", -1, "an integer >= 1, or 0"),
    ("num-partitions", "six", "an integer >= 1, or 0"),
    ("alpha", -1, "a number > 0"),
    ("alpha", 0, "a number > 0"),
    ("alpha", "abc", "a number > 0"),
    ("alpha", float("nan"), "a number > 0"),
    ("partition-seed", -3, "an integer >= 0"),
    ("validation-size", -1, "an integer >= 0"),
    ("augment", "yes", "true or false"),
    ("augment", 2, "true or false"),
    ("local-epochs", "abc", "an integer >= 1"),
    ("local-epochs", 0, "an integer >= 1"),
    ("local-epochs", 2.5, "an integer >= 1"),
    ("local-epochs", True, "an integer >= 1"),
    ("batch-size", 0, "an integer >= 1"),
    ("lr", 0.0, "a number > 0"),
    ("lr", float("inf"), "a number > 0"),
    ("seed", -1, "an integer >= 0"),
    ("init", "random", "one of shared, independent"),
    ("num-server-rounds", 0, "an integer >= 1"),
    ("fraction-train", 0.0, "a number in (0, 1]"),
    ("fraction-train", 1.5, "a number in (0, 1]"),
    ("fraction-evaluate", -0.1, "a number in [0, 1]"),
    ("min-valid-replies", 0, "an integer >= 1"),
    ("node-wait-s", -1.0, "a number of seconds >= 0"),
    ("node-settle-s", "soon", "a number of seconds >= 0"),
    ("lam", 0.0, "a number > 0"),
    ("rho", 0.0, "a number in (0, 1]"),
    ("rho", 2, "a number in (0, 1]"),
    ("max-iters", 0, "an integer >= 1"),
    ("fisher-rounds", -2, "an integer: -1 (the preset's), 0 (every round) or n >= 1"),
    ("reference", "smallest", "one of largest, broadcast or a client index"),
    ("matching", "cosine", "one of fisher, euclidean, none"),
    ("aggregation", "median", "one of fisher, uniform, size"),
    ("fisher-scaling", "big", "one of none, size, normalized, normalized-size"),
    ("curvature", "shampoo", "one of diagonal, gram, kfac"),
    ("gram-alpha", 1.5, "a number in [0, 1]"),
    ("gram-ridge", -0.1, "a finite number >= 0"),
    ("preset", "fast", "one of default, paper"),
    ("fallback", "fedavg", "one of objective, validation, none, or empty"),
    ("round-choice", "server", "one of clients, none, or empty"),
    ("reprobe-after", -2, "an integer: -1 (the preset's), 0 (a hand-over for good) or n >= 1"),
    ("sweep", "maybe", "true or false"),
    ("server-refine", 3, "true or false"),
    ("sweep-rho", "0.2,abc", "comma-separated numbers in (0, 1]"),
    ("sweep-rho", "0.5,1.5", "comma-separated numbers in (0, 1]"),
    ("sweep-rho", "", "comma-separated numbers in (0, 1]"),
    ("sweep-lam", "1e-4,-1", "comma-separated numbers > 0"),
    ("sweep-reference", "largest,smallest", "comma-separated names from: largest, broadcast"),
    ("sweep-fisher-scaling", "none,big", "comma-separated names from: none, size"),
    ("strategy", "fedprox", "one of fedfiot, fedfisher-kfac, fedfisher-diag, regmean"),
    ("fisher-kind", "exact", "one of empirical, true, sampled, or empty"),
    ("fedfisher-steps", -5, "an integer >= 0"),
    ("results-dir", True, "a directory path"),
]


@pytest.mark.parametrize(("key", "value", "allowed"), BAD_VALUES, ids=[f"{k}={v!r}" for k, v, _ in BAD_VALUES])
def test_a_bad_value_names_the_key_the_value_and_what_is_allowed(key: str, value: Any, allowed: str) -> None:
    with pytest.raises(ValueError) as info:
        AppConfig.from_run_config({key: value})
    message = str(info.value)
    assert message.startswith(f"run-config {key}={value!r}: expected "), message
    assert allowed in message, message
    assert "\n" not in message  # one line: the launcher shows the exception's last line


def test_every_key_has_a_rule_and_is_covered_here() -> None:
    keys = set(AppConfig().as_dict())
    assert {name.replace("_", "-") for name in rules()} == keys
    free_text = {"data-root", "run-name", "resume-from"}  # any string is a path or a name
    assert {k for k, _, _ in BAD_VALUES} == keys - free_text


def test_the_two_examples_of_a_new_user_read_as_documented() -> None:
    with pytest.raises(ValueError, match=re.escape("run-config local-epochs='abc': expected an integer >= 1")):
        AppConfig.from_run_config({"local-epochs": "abc"})
    with pytest.raises(ValueError, match=re.escape("run-config alpha=-1: expected a number > 0")):
        AppConfig.from_run_config({"alpha": -1})


def test_every_bad_key_of_a_config_is_in_one_message() -> None:
    with pytest.raises(ValueError) as info:
        AppConfig.from_run_config({"alpha": -1, "dataset": "digits", "local-epochs": "abc", "rho": 7})
    assert str(info.value) == (
        "run-config alpha=-1: expected a number > 0; local-epochs='abc': expected an integer >= 1; "
        "rho=7: expected a number in (0, 1]"
    )


def test_a_config_built_in_code_is_checked_the_same_way() -> None:
    with pytest.raises(ValueError, match=re.escape("run-config alpha=-1: expected a number > 0")):
        AppConfig(alpha=-1)


@pytest.mark.parametrize(
    ("key", "value", "parsed"),
    [
        ("local-epochs", "5", 5),  # a quoted number from the command line
        ("local-epochs", 5.0, 5),
        ("alpha", 1, 1.0),
        ("augment", "true", True),
        ("sweep", 0, False),
        ("reference", 2, "2"),  # a client index written as a TOML integer
        ("dataset", "fmnist", "fmnist"),  # an alias of the data layer
        ("model", "resnet20-w8", "resnet20-w8"),
        ("num-partitions", 0, 0),
        ("fraction-evaluate", 0.0, 0.0),
        ("fallback", "", ""),
        ("fisher-kind", "", ""),
        ("node-wait-s", 0, 0.0),
    ],
)
def test_good_values_are_parsed_to_the_field_type(key: str, value: Any, parsed: Any) -> None:
    got = AppConfig.from_run_config({key: value}).as_dict()[key]
    assert got == parsed and type(got) is type(parsed)


def test_a_misspelt_key_is_rejected_with_the_closest_known_one() -> None:
    with pytest.raises(ValueError, match=re.escape("unknown run config keys ['local-epoch'] (did you mean "
                                                   "'local-epochs' (for 'local-epoch')?)")):
        AppConfig.from_run_config({"local-epoch": 5})
