"""Permutation specs: builders, tracing, and function preservation on real torch models."""

import numpy as np
import pytest
import torch
from torch import nn

from fedfiot_flwr.merge import PermutationSpec, apply_permutations, cnn_spec, mlp_spec, spec_from_module
from fedfiot_flwr.merge.spec import AxisPerm, expand_block_permutation, invert_permutation


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(12, 16), nn.Linear(16, 8), nn.Linear(8, 5)

    def forward(self, x):
        return self.fc3(torch.tanh(self.fc2(torch.relu(self.fc1(x)))))


class CNN(nn.Module):
    def __init__(self, bn: bool = False):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 3)
        self.bn1 = nn.BatchNorm2d(6) if bn else nn.Identity()
        self.conv2 = nn.Conv2d(6, 4, 3, bias=not bn)
        self.bn2 = nn.BatchNorm2d(4) if bn else nn.Identity()
        self.pool = nn.MaxPool2d(2)
        self.fc1 = nn.Linear(4 * 2 * 2, 10)
        self.drop = nn.Dropout(0.5)
        self.fc2 = nn.Linear(10, 3)

    def forward(self, x):
        x = self.pool(torch.relu(self.bn1(self.conv1(x))))
        x = torch.relu(self.bn2(self.conv2(x)))
        x = torch.flatten(self.pool(x), 1)
        return self.fc2(self.drop(torch.relu(self.fc1(x))))


class Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x):
        h = torch.relu(self.fc1(x)) + x
        return self.fc2(h)


def random_perms(spec, shapes, seed=0):
    rng = np.random.default_rng(seed)
    return {p: rng.permutation(n) for p, n in spec.sizes(shapes).items()}


def assert_function_preserved(model, spec, x, seed=0):
    model.eval()
    state = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    perms = random_perms(spec, {k: v.shape for k, v in state.items()}, seed)
    assert all((p != np.arange(len(p))).any() for p in perms.values())
    permuted = apply_permutations(state, spec, perms)
    with torch.no_grad():
        before = model(x)
        model.load_state_dict({k: torch.as_tensor(v) for k, v in permuted.items()})
        after = model(x)
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)
    changed = [k for k in state if not np.array_equal(state[k], permuted[k])]
    assert changed, "the permutation must actually move tensors"


def randomise_bn(model):
    for mod in model.modules():
        if isinstance(mod, nn.BatchNorm2d):
            with torch.no_grad():
                mod.running_mean.normal_()
                mod.running_var.uniform_(0.5, 2.0)
                mod.weight.normal_()
                mod.bias.normal_()


def test_mlp_function_preserved_builder_and_traced():
    torch.manual_seed(0)
    model = MLP()
    spec = mlp_spec(["fc1", "fc2", "fc3"])
    assert spec_from_module(model) == spec
    assert_function_preserved(model, spec, torch.randn(7, 12))


def test_cnn_with_flatten_function_preserved():
    torch.manual_seed(1)
    model = CNN()
    spec = spec_from_module(model)
    assert spec == cnn_spec(["conv1", "conv2"], ["fc1", "fc2"], flatten_block=4)
    assert spec.axes["fc1.weight"][1].block == 4
    assert_function_preserved(model, spec, torch.randn(5, 3, 14, 14))


def test_cnn_with_batchnorm_function_preserved():
    torch.manual_seed(2)
    model = CNN(bn=True)
    randomise_bn(model)
    spec = spec_from_module(model)
    assert list(spec.names) == list(model.state_dict())
    assert spec.axes["bn1.running_var"][0].perm == "P_conv1"
    assert spec.axes["bn2.num_batches_tracked"] == ()
    built = cnn_spec(["conv1", "conv2"], ["fc1", "fc2"], flatten_block=4, norms=["bn1", "bn2"], bias=True)
    assert built.axes["bn2.weight"] == spec.axes["bn2.weight"]
    assert_function_preserved(model, spec, torch.randn(5, 3, 14, 14), seed=3)


def test_sequential_with_flatten_module_is_traced():
    torch.manual_seed(3)
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.AvgPool2d(2), nn.Flatten(), nn.Linear(4 * 9, 6),
                          nn.ReLU(), nn.Linear(6, 2))
    spec = spec_from_module(model)
    assert spec.axes["4.weight"][1].block == 9
    assert_function_preserved(model, spec, torch.randn(3, 1, 8, 8))


class InnerResidual(nn.Module):
    """A residual stream that starts at a hidden layer (so it may be permuted)."""

    def __init__(self):
        super().__init__()
        self.fc0, self.fc1, self.fc2 = nn.Linear(3, 4), nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x):
        x = self.fc0(x)
        h = torch.relu(self.fc1(x)) + x
        return self.fc2(h)


def test_residual_add_on_the_input_fixes_the_stream_instead_of_raising():
    spec = spec_from_module(Residual())
    assert spec.perm_names == []  # the stream is the model's input: nothing may move
    assert set(spec.names) == set(Residual().state_dict())


def test_residual_stream_shares_one_permutation():
    torch.manual_seed(4)
    model = InnerResidual()
    spec = spec_from_module(model)
    assert spec.perm_names == ["P_fc0"]
    assert [e.perm for e in spec.axes["fc1.weight"]] == ["P_fc0", "P_fc0"]
    assert spec.axes["fc2.weight"][1].perm == "P_fc0"
    assert_function_preserved(model, spec, torch.randn(5, 3))


def test_unsupported_operation_is_merged_without_alignment_and_logged(caplog):
    class Sorted(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2, self.fc3 = nn.Linear(3, 6), nn.Linear(6, 5), nn.Linear(5, 2)

        def forward(self, x):
            h = torch.sort(torch.relu(self.fc1(x)), dim=1).values  # not permutation-equivariant
            return self.fc3(torch.relu(self.fc2(h)))

    with caplog.at_level("WARNING"):
        spec = spec_from_module(Sorted())
    assert spec.perm_names == ["P_fc2"]
    assert spec.axes["fc1.weight"] == (None, None) and spec.axes["fc2.weight"][1] is None
    lines = [r.getMessage() for r in caplog.records if "without alignment" in r.getMessage()]
    assert len(lines) == 1 and "fc1" in lines[0]


def test_a_permutation_that_changes_the_outputs_is_dropped():
    from fedfiot_flwr.merge.trace import _failing_permutations

    model = MLP()
    wrong = PermutationSpec({"fc1.weight": ("A", None), "fc1.bias": ("A",), "fc2.weight": ("B", None),
                             "fc2.bias": ("B",), "fc3.weight": (None, None), "fc3.bias": (None,)})
    assert _failing_permutations(model, wrong, torch.randn(4, 12)) == ["A", "B"]
    assert _failing_permutations(model, spec_from_module(model), torch.randn(4, 12)) == []


def test_spec_validation():
    with pytest.raises(ValueError, match="acts on no tensor's leading axis"):
        PermutationSpec({"w": (None, "P")})
    spec = PermutationSpec({"w": ("P", None), "v": (None, "P")})
    with pytest.raises(ValueError, match="'v'"):
        spec.sizes({"w": (3, 2)})
    with pytest.raises(ValueError, match="neurons elsewhere"):
        spec.sizes({"w": (3, 2), "v": (1, 4)})
    with pytest.raises(ValueError, match="axis entry"):
        PermutationSpec({"w": ("P", 3.5)})


def test_block_and_inverse_permutations():
    p = np.array([2, 0, 1])
    assert expand_block_permutation(p, 2).tolist() == [4, 5, 0, 1, 2, 3]
    assert p[invert_permutation(p)].tolist() == [0, 1, 2]


class GroupedNet(nn.Module):
    """A grouped conv, a GroupNorm with several channels per group, and a depthwise conv with a multiplier."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(2, 8, 3, padding=1)
        self.grouped = nn.Conv2d(8, 8, 3, padding=1, groups=2)
        self.gn = nn.GroupNorm(2, 8)
        self.pre = nn.Conv2d(8, 4, 1)
        self.depthwise = nn.Conv2d(4, 8, 3, padding=1, groups=4)  # two filters per input channel
        self.fc = nn.Linear(8, 3)

    def forward(self, x):
        x = torch.relu(self.gn(self.grouped(torch.relu(self.stem(x)))))
        x = torch.relu(self.depthwise(torch.relu(self.pre(x))))
        return self.fc(x.mean((2, 3)))


def test_grouped_conv_and_groupnorm_are_left_unaligned_and_a_channel_multiplier_moves_blocks(caplog):
    torch.manual_seed(5)
    model = GroupedNet()
    with caplog.at_level("WARNING"):
        spec = spec_from_module(model, example_input=torch.randn(2, 2, 6, 6))
    assert spec.axes["stem.weight"][0] is None and spec.axes["grouped.weight"][0] is None
    assert spec.axes["gn.weight"] == (None,)
    logged = " ".join(r.getMessage() for r in caplog.records)
    assert "grouped convolution" in logged and "GroupNorm" in logged
    assert spec.perm_names == ["P_pre"]
    assert spec.axes["depthwise.weight"][0] == AxisPerm("P_pre", 2)
    assert spec.axes["fc.weight"][1] == AxisPerm("P_pre", 2)
    assert_function_preserved(model, spec, torch.randn(3, 2, 6, 6))


def test_a_model_torch_fx_cannot_trace_is_merged_without_alignment(caplog):
    class Branching(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(3, 4), nn.Linear(4, 2)

        def forward(self, x):
            h = self.fc1(x)
            if float(h.sum()) > 0:  # data-dependent control flow: symbolic tracing fails
                h = -h
            return self.fc2(h)

    with caplog.at_level("WARNING"):
        spec = spec_from_module(Branching())
    assert spec.perm_names == [] and set(spec.names) == set(Branching().state_dict())
    assert sum("cannot trace" in r.getMessage() for r in caplog.records) == 1
