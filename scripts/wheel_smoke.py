"""Smoke test of an installed fedfiot-flwr wheel without extras: one real FedFiOT round.

Run by ``scripts/check_wheel.sh`` in a fresh virtual environment holding only the wheel and
its core dependencies, from a directory outside the repository, so that the installed package
is what is imported. Uses the installed package, flwr, torch and numpy only.
"""

from __future__ import annotations

import importlib.util
import logging
import sys
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import fedfiot_flwr
from fedfiot_flwr import FedFiOT, FedFiOTConfig, fisher_reply

# The check means something only if the extras really are absent.
NOT_INSTALLED = ("curvlinops", "matplotlib", "ray", "datasets", "flwr_datasets", "sklearn", "torchvision", "tqdm")


class Net(nn.Module):
    """A tiny MLP: 4 inputs, two hidden layers, 3 classes."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.fc2 = nn.Linear(8, 6)
        self.fc3 = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


class TwoNodeGrid:
    """The one Grid method a strategy's sampling calls: the connected node ids."""

    def __init__(self, node_ids: Iterable[int]) -> None:
        self.node_ids = list(node_ids)

    def get_node_ids(self) -> list[int]:
        return list(self.node_ids)


def _set_task_identity() -> None:
    """Messages need the identity of the running task (Flower sets it inside a real ServerApp)."""
    try:
        from flwr.supercore.task_identity import TaskIdentity
    except ImportError:  # flwr releases without it build messages without one
        return
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1


def _client_reply(instruction: Message, seed: int, n: int) -> Message:
    """A client's round: load the broadcast model, train briefly on its own data, reply."""
    model = Net()
    model.load_state_dict(instruction.content["arrays"].to_torch_state_dict())
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=gen)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    loader = DataLoader(TensorDataset(x, y), batch_size=16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for xb, yb in loader:
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(xb), yb).backward()
        optimizer.step()
    content = fisher_reply(model, loader, {"num-examples": n}, device="cpu")
    return Message(content=content, reply_to=instruction)


def main() -> int:
    here = Path(fedfiot_flwr.__file__).resolve()
    assert "site-packages" in here.parts, f"fedfiot_flwr imported from {here}, not from the installed wheel"
    present = [m for m in NOT_INSTALLED if importlib.util.find_spec(m) is not None]
    assert not present, f"optional modules installed, the check would mean nothing: {present}"

    logging.getLogger("flwr").setLevel(logging.WARNING)  # one line of output: the summary below
    _set_task_identity()
    torch.manual_seed(0)
    net = Net()
    strategy = FedFiOT(model=net)  # no server data: the paper's merge rule
    assert isinstance(strategy.fedfiot_config, FedFiOTConfig)
    initial = ArrayRecord(net.state_dict())
    instructions = list(strategy.configure_train(1, initial, ConfigRecord(), TwoNodeGrid([101, 202])))
    assert sorted(m.metadata.dst_node_id for m in instructions) == [101, 202], instructions
    replies = [_client_reply(m, seed=i, n=48 + 16 * i) for i, m in enumerate(instructions)]
    arrays, _ = strategy.aggregate_train(1, replies)

    assert arrays is not None, "aggregate_train returned no model"
    merged = arrays.to_torch_state_dict()
    assert list(merged) == list(net.state_dict()), (list(merged), list(net.state_dict()))
    assert all(bool(torch.isfinite(t).all()) for t in merged.values()), "non-finite merged weights"
    assert all(tuple(merged[k].shape) == tuple(v.shape) for k, v in net.state_dict().items())
    assert int(strategy.server_metrics[1]["num-valid"]) == len(replies), dict(strategy.server_metrics[1])
    assert any(not torch.equal(merged[k], v) for k, v in net.state_dict().items()), "the merge returned the init"
    total = sum(int(np.prod(t.shape)) for t in merged.values())
    print(f"wheel smoke: fedfiot-flwr {fedfiot_flwr.__version__} from {here.parent}: FedFiOT merged "
          f"{len(replies)} fisher_reply uploads into {len(merged)} tensors ({total} finite values) "
          f"with torch {torch.__version__}, no extras installed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
