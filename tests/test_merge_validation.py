"""Bad input gives a ValueError naming the client and tensor."""

import numpy as np
import pytest

from fedfiot_flwr.merge import MergeOptions, PermutationSpec, merge, prepare_clients

SPEC = PermutationSpec({"w": ("P0", None), "b": ("P0",), "out": (None, "P0")})


def good():
    rng = np.random.default_rng(0)
    models = [{"w": rng.normal(size=(4, 3)), "b": rng.normal(size=4), "out": rng.normal(size=(2, 4))}
              for _ in range(3)]
    fishers = [{k: np.abs(v) for k, v in m.items()} for m in models]
    return models, fishers


def run(models, fishers, spec=SPEC, num_examples=None, buffers=None, client_ids=None, **options):
    """Merge with these options; uploads with buffers or client names go through prepare_clients."""
    opts = MergeOptions(**{"lam": 1e-3, "rho": 0.5, "max_iters": 4, "reference": 0, **options})
    if buffers is None and client_ids is None:
        return merge(models, fishers, spec, opts, num_examples=num_examples)
    clients = prepare_clients(models, fishers, buffers=buffers or (), num_examples=num_examples, client_ids=client_ids)
    return merge(clients, None, spec, opts)


def test_good_input_merges():
    models, fishers = good()
    res = run(models, fishers, client_ids=["a", "b", "c"])
    assert set(res.model) == {"w", "b", "out"}


@pytest.mark.parametrize(
    "corrupt, pattern",
    [
        (lambda m, f: m[1].pop("b"), r"client 'n1'.*missing \['b'\]"),
        (lambda m, f: m[2].__setitem__("w", np.zeros((5, 3))), r"client 'n2', tensor 'w': shape"),
        (lambda m, f: m[1]["w"].__setitem__((0, 0), np.nan), r"client 'n1', tensor 'w'.*finite"),
        (lambda m, f: f[2]["out"].__setitem__((0, 0), -1.0), r"client 'n2', Fisher of tensor 'out'.*negative"),
        (lambda m, f: f[0]["b"].__setitem__(0, np.inf), r"client 'n0', Fisher of tensor 'b'.*NaN or inf"),
        (lambda m, f: f[1].pop("w"), r"client 'n1': Fisher keys.*missing \['w'\]"),
        (lambda m, f: f[1].__setitem__("w", np.ones((3, 3))), r"client 'n1', Fisher of tensor 'w': shape"),
    ],
)
def test_bad_clients_are_named(corrupt, pattern):
    models, fishers = good()
    corrupt(models, fishers)
    with pytest.raises(ValueError, match=pattern):
        run(models, fishers, client_ids=["n0", "n1", "n2"])


@pytest.mark.parametrize("kw, pattern", [
    ({"lam": 0.0}, "lam"), ({"lam": -1.0}, "lam"), ({"lam": float("nan")}, "lam"),
    ({"rho": 0.0}, "rho"), ({"rho": 1.5}, "rho"), ({"max_iters": 0}, "max_iters"),
    ({"matching": "cosine"}, "matching"), ({"aggregation": "median"}, "aggregation"),
    ({"reference": 7}, "out of range"), ({"reference": "largest"}, "num_examples"),
    ({"aggregation": "size"}, "num_examples"), ({"num_examples": [1, 0, 3]}, "client '2'|client '1'"),
])
def test_bad_options(kw, pattern):
    models, fishers = good()
    with pytest.raises(ValueError, match=pattern):
        run(models, fishers, **kw)


def test_spec_naming_a_missing_tensor():
    models, fishers = good()
    spec = PermutationSpec({"w": ("P0", None), "ghost": ("P0",)})
    with pytest.raises(ValueError, match="'ghost'"):
        run(models, fishers, spec=spec)


def test_buffers_are_declared_not_silently_dropped():
    models, fishers = good()
    for f in fishers:
        f.pop("b")
    with pytest.raises(ValueError, match=r"missing \['b'\]"):
        run(models, fishers)
    res = run(models, fishers, buffers=["b"], num_examples=[1, 1, 2])
    assert res.model["b"].shape == (4,)


def test_uploads_checked_by_the_wire_still_have_their_names_checked_against_buffers():
    from fedfiot_flwr.merge import prepare_clients

    models, fishers = good()
    with pytest.raises(ValueError, match=r"buffers \['ghost'\] are not tensors"):
        prepare_clients(models, fishers, buffers=["ghost"], checked=True)
    with pytest.raises(ValueError, match=r"client '0': Fisher keys do not match.*extra \['b'\]"):
        prepare_clients(models, fishers, buffers=["b"], checked=True)
    # shapes and values are the decoder's to check: not looked at again
    models[1]["w"][0, 0] = np.nan
    assert len(prepare_clients(models, fishers, checked=True)) == 3
    with pytest.raises(ValueError, match=r"client '1', tensor 'w'.*finite"):
        prepare_clients(models, fishers)


def test_fisher_scaling_options():
    models, fishers = good()
    with pytest.raises(ValueError, match="fisher_scaling"):
        run(models, fishers, fisher_scaling="log")
    with pytest.raises(ValueError, match="needs num_examples"):
        run(models, fishers, fisher_scaling="size")
    # A uniform scale of every client's Fisher changes nothing under "normalized".
    scaled = [{k: 10.0 * v for k, v in f.items()} for f in fishers]
    a = run(models, fishers, fisher_scaling="normalized", lam=1e-3, rho=1.0)
    b = run(models, scaled, fisher_scaling="normalized", lam=1e-3, rho=1.0)
    for k in a.model:
        np.testing.assert_allclose(a.model[k], b.model[k])


def test_size_scaled_fisher_merge_arithmetic():
    spec = PermutationSpec({"w": ("P", None)})
    models = [{"w": np.array([[0.0], [1.0]])}, {"w": np.array([[4.0], [3.0]])}]
    fishers = [{"w": np.array([[1.0], [2.0]])}, {"w": np.array([[1.0], [1.0]])}]
    res = merge(models, fishers, spec, MergeOptions(lam=1e-12, rho=1.0, reference=0, matching="none",
                                                    aggregation="fisher", fisher_scaling="size"),
                num_examples=[1, 3])
    # weights n_k * F_k: row 0 -> (1*0 + 3*4) / 4 = 3; row 1 -> (2*1 + 3*3) / 5 = 2.2
    np.testing.assert_allclose(res.model["w"].ravel(), [3.0, 2.2])
    res = merge(models, fishers, spec, MergeOptions(lam=1e-12, rho=1.0, reference=0, matching="none",
                                                    aggregation="fisher", fisher_scaling="normalized-size"),
                num_examples=[1, 3])
    # normalized: client 0 / 1.5, client 1 / 1; then * 2 n_k / n = 0.5, 1.5
    w0, w1 = 0.5 / 1.5, 1.5
    np.testing.assert_allclose(res.model["w"].ravel(),
                               [(w0 * 0 + w1 * 4) / (w0 + w1), (2 * w0 * 1 + w1 * 3) / (2 * w0 + w1)])
