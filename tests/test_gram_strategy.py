"""FedFiOT with the Gram curvature through Flower's Message API: the train config asks for Grams, the clients'
``fisher_reply`` sends them within FedAvg's bytes, the round is the engine's Gram merge of the decoded uploads,
a reply with the wrong curvature or a broken Gram is excluded naming the client, and one inflated Gram is capped."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import Array
from torch.utils.data import DataLoader, TensorDataset

from _fedfiot_helpers import SPEC, answer, configure_round, one_torch_thread, task_identity, tiny_mlp  # noqa: F401
from fedfiot_flwr import FedFiOT, FedFiOTConfig, FedFiOTLegacy, fisher_reply
from fedfiot_flwr.merge import MergeOptions, merge
from fedfiot_flwr.options import CURVATURE_CONFIG_KEY, DEFAULT_GRAM_RIDGE
from fedfiot_flwr.psd import InputGram
from fedfiot_flwr.server.outcome import RoundContext
from fedfiot_flwr.server.selection import sweep_candidates
from fedfiot_flwr.server.uploads import CollectedUploads
from fedfiot_flwr.wire import ARRAYS_RECORD, decode_reply
from fedfiot_flwr.wire.sizes import fedavg_payload_bytes, payload_bytes


def _client(seed: int) -> tuple[torch.nn.Module, DataLoader]:
    torch.manual_seed(seed)
    model = tiny_mlp()
    x = torch.randn(30 + 10 * seed, 4) + 0.2 * seed
    loader = DataLoader(TensorDataset(x, torch.randint(0, 3, (len(x),))), batch_size=16)
    return model, loader


def _replies(sent: dict, edit: dict | None = None) -> list:
    """Every sampled node's reply to its instruction, from fisher_reply with the round's train config."""
    out = []
    for k, node in enumerate(sorted(sent)):
        model, loader = _client(k)
        content = fisher_reply(model, loader, {"train-loss": 1.0}, config=sent[node].content["config"])
        out.append(answer(sent[node], (edit or {}).get(k, lambda c: c)(content)))
    return out


def _strategy(**changes: object) -> FedFiOT:
    config = FedFiOTConfig.default(curvature="gram", fisher_rounds=None, max_iters=3, gram_growth=None, **changes)
    return FedFiOT(spec=SPEC, config=config, min_valid_replies=2)


def test_a_gram_round_asks_for_grams_and_returns_the_engines_gram_merge_of_the_uploads() -> None:
    strategy = _strategy()
    sent = configure_round(strategy, [1, 2, 3])
    assert {msg.content["config"][CURVATURE_CONFIG_KEY] for msg in sent.values()} == {"gram"}
    replies = _replies(sent)
    for msg in replies:  # within FedAvg's float32 bytes
        model, _ = _client(0)
        assert payload_bytes(msg.content)["total"] <= fedavg_payload_bytes(model.state_dict())
    arrays, _ = strategy.aggregate_train(1, replies)
    decoded = [decode_reply(m.content, "gram", client=str(i), expected_shapes=None) for i, m in enumerate(replies)]
    expected = merge([d.weights for d in decoded], [d.grams for d in decoded], SPEC,
                     MergeOptions(curvature="gram", gram_alpha=0.9, gram_ridge=DEFAULT_GRAM_RIDGE, max_iters=3),
                     num_examples=[d.num_examples for d in decoded])
    got = {k: v.numpy() for k, v in arrays.items()}
    for name, value in expected.model.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-6, atol=1e-7, err_msg=name)
    assert strategy.server_metrics[1]["fisher-used"] == 1
    assert "gram-alpha" in strategy.server_metrics[1]


def test_a_reply_with_the_wrong_curvature_or_a_broken_gram_is_excluded_naming_the_client() -> None:
    strategy = _strategy()
    sent = configure_round(strategy, [1, 2, 3, 4])
    nodes = sorted(sent)
    fisher_instead = fisher_reply(*_client(9), {"train-loss": 1.0})  # the diagonal Fisher, not asked for

    def nan_gram(content):  # noqa: ANN001, ANN202
        arrays = content.array_records[ARRAYS_RECORD]
        key = next(k for k in arrays if k.startswith("curvature/"))
        arr = arrays[key]  # float32 column scales, then int8 codes
        arrays[key] = Array(dtype=arr.dtype, shape=tuple(arr.shape), stype=arr.stype,
                            data=np.float32(np.nan).tobytes() + arr.data[4:])
        return content

    replies = _replies(sent, {0: lambda c: fisher_instead, 1: nan_gram})
    arrays, _ = strategy.aggregate_train(1, replies)
    assert arrays is not None  # the round goes on with the two valid replies
    rejected = {r["client"]: r["reason"] for r in strategy.reports[0]["rejected"]}
    assert set(rejected) == {str(nodes[0]), str(nodes[1])}
    assert "curvature" in rejected[str(nodes[0])] or "gram" in rejected[str(nodes[0])].lower()
    assert "curvature/" in rejected[str(nodes[1])]
    assert strategy.server_metrics[1]["num-valid"] == 2


def _uploads(inflate: float | None) -> list:
    out = []
    for k in range(4):
        model, loader = _client(k)
        content = fisher_reply(model, loader, {}, config={CURVATURE_CONFIG_KEY: "gram"})
        d = decode_reply(content, "gram", client=str(k), expected_shapes=None)
        grams = dict(d.grams)
        if inflate is not None and k == 3:
            grams = {l: InputGram(g.weight, g.bias, g.gram * inflate) for l, g in grams.items()}
        out.append((d.weights, grams, d.num_examples))
    return out


@pytest.mark.parametrize("inflate", [1e3, 1e6, float(np.finfo(np.float32).max) / 1e3])
def test_one_inflated_gram_is_capped_to_the_other_clients_median(inflate: float) -> None:
    def merged(uploads: list, cap: float | None) -> dict:
        collected = CollectedUploads(client_ids=[str(i) for i in range(4)], weights=[u[0] for u in uploads],
                                     num_examples=[u[2] for u in uploads], grams=[u[1] for u in uploads])
        config = FedFiOTConfig.default(curvature="gram", gram_cap=cap, gram_growth=None).without_validation()
        return sweep_candidates(collected, SPEC, config, RoundContext(server_round=1)).model

    honest = merged(_uploads(None), 100.0)
    capped = merged(_uploads(inflate), 100.0)
    uncapped = merged(_uploads(inflate), None)

    def distance(a: dict, b: dict) -> float:
        return float(np.sqrt(sum(np.sum((a[n] - b[n]) ** 2) for n in a)))

    assert distance(capped, honest) < 0.25 * distance(uncapped, honest)


def test_the_legacy_strategy_runs_the_same_gram_round() -> None:
    from test_legacy import Proxy

    from flwr.common import Code, FitRes, Status, ndarrays_to_parameters, parameters_to_ndarrays
    from flwr.server.client_manager import SimpleClientManager

    from fedfiot_flwr.server.legacy_envelope import reply_to_ndarrays

    model = tiny_mlp()
    legacy = FedFiOTLegacy(model=model, config=FedFiOTConfig.default(curvature="gram", max_iters=3, gram_growth=None),
                           min_fit_clients=3, min_available_clients=3)
    manager = SimpleClientManager()
    for cid in ("a", "b", "c"):
        manager.register(Proxy(cid))
    params = ndarrays_to_parameters([v.numpy() for v in model.state_dict().values()])
    sampled = legacy.configure_fit(1, params, manager)
    assert {ins.config[CURVATURE_CONFIG_KEY] for _, ins in sampled} == {"gram"}
    results, contents = [], []
    for k, (proxy, ins) in enumerate(sorted(sampled, key=lambda s: s[0].cid)):
        content = fisher_reply(*_client(k), {}, config=ins.config)
        contents.append(content)
        results.append((proxy, FitRes(Status(Code.OK, ""), ndarrays_to_parameters(reply_to_ndarrays(content)),
                                      30 + 10 * k, {})))
    out, _ = legacy.aggregate_fit(1, results, [])
    decoded = [decode_reply(c, "gram", client=str(i), expected_shapes=None) for i, c in enumerate(contents)]
    expected = merge([d.weights for d in decoded], [d.grams for d in decoded], SPEC,
                     MergeOptions(curvature="gram", gram_alpha=0.9, gram_ridge=DEFAULT_GRAM_RIDGE, max_iters=3),
                     num_examples=[d.num_examples for d in decoded])
    for got, (name, value) in zip(parameters_to_ndarrays(out), expected.model.items()):
        np.testing.assert_allclose(got, value, rtol=1e-6, atol=1e-7, err_msg=name)


def test_with_validation_data_the_gram_sweep_tries_every_alpha_and_ridge_and_keeps_the_best_merge() -> None:
    uploads = _uploads(None)
    collected = CollectedUploads(client_ids=[str(i) for i in range(4)], weights=[u[0] for u in uploads],
                                 num_examples=[u[2] for u in uploads], grams=[u[1] for u in uploads])
    config = FedFiOTConfig.default(curvature="gram", max_iters=3, fedavg_candidate=False, gram_growth=None)
    grid = config.sweep
    assert grid is not None and len(grid.gram_ridges) >= 2

    def smallest_weights(model: dict) -> dict[str, float]:  # prefers the most regularised merge
        return {"accuracy": -float(sum(np.sum(np.asarray(v, np.float64) ** 2) for v in model.values()))}

    out = sweep_candidates(collected, SPEC, config.for_server(True),
                           RoundContext(server_round=1, validate=smallest_weights))
    tried = {(t["gram_alpha"], t["gram_ridge"]) for t in out.trials}
    assert {(float(a), float(r)) for a in grid.gram_alphas for r in grid.gram_ridges} <= tried
    best = max(t["validation"]["accuracy"] for t in out.trials if t["validation"] is not None)
    assert smallest_weights(out.model)["accuracy"] == pytest.approx(best)
    chosen = out.chosen
    expected = merge([u[0] for u in uploads], [u[1] for u in uploads], SPEC,
                     MergeOptions(curvature="gram", gram_alpha=chosen["gram_alpha"], gram_ridge=chosen["gram_ridge"],
                                  max_iters=3, reference=chosen["reference"]),
                     num_examples=[u[2] for u in uploads])
    kept = expected.model if chosen["variant"] == "aligned" else expected.identity_model
    for name, value in kept.items():
        np.testing.assert_allclose(out.model[name], value, rtol=1e-9, atol=1e-12, err_msg=name)
    assert out.metrics["gram-ridge"] == chosen["gram_ridge"] == max(grid.gram_ridges)
