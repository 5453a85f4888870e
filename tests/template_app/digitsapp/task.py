"""digitsapp: a Flower / PyTorch app."""

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch.utils.data import DataLoader, TensorDataset


class Net(nn.Module):
    """A small CNN for 8x8 digits."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.pool = nn.MaxPool2d(2, 2)
        self.fc1 = nn.Linear(32 * 2 * 2, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = x.flatten(1)
        return self.fc2(F.relu(self.fc1(x)))


def _digits():
    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x / 16.0, dtype=torch.float32).reshape(-1, 1, 8, 8)
    y = torch.tensor(y, dtype=torch.long)
    order = np.random.default_rng(0).permutation(len(y))
    n_test = len(y) // 5
    return (x[order[n_test:]], y[order[n_test:]]), (x[order[:n_test]], y[order[:n_test]])


def _dirichlet_partition(labels, num_partitions, alpha, seed):
    """Label-skewed partition: each class is split over the partitions with Dirichlet(alpha) shares."""
    rng = np.random.default_rng(seed)
    parts = [[] for _ in range(num_partitions)]
    for c in range(10):
        idx = rng.permutation(np.flatnonzero(labels == c))
        shares = rng.dirichlet(alpha * np.ones(num_partitions))
        cuts = (np.cumsum(shares)[:-1] * len(idx)).astype(int)
        for p, chunk in enumerate(np.split(idx, cuts)):
            parts[p].extend(chunk.tolist())
    return [np.sort(np.asarray(p, dtype=int)) for p in parts]


def load_data(partition_id, num_partitions, alpha=0.3, seed=0):
    """This partition's train and test loaders (80/20 of its non-IID share of the training data)."""
    (x, y), _ = _digits()
    idx = _dirichlet_partition(y.numpy(), num_partitions, alpha, seed)[partition_id]
    idx = np.random.default_rng(seed + partition_id).permutation(idx)
    n_train = max(1, int(0.8 * len(idx)))
    gen = torch.Generator().manual_seed(seed + partition_id)
    trainloader = DataLoader(TensorDataset(x[idx[:n_train]], y[idx[:n_train]]), batch_size=32, shuffle=True,
                             generator=gen)
    testloader = DataLoader(TensorDataset(x[idx[n_train:]], y[idx[n_train:]]), batch_size=64)
    return trainloader, testloader


def load_centralized_dataset():
    """The held-out test set, for the server's evaluation."""
    _, (x, y) = _digits()
    return DataLoader(TensorDataset(x, y), batch_size=256)


def train(net, trainloader, epochs, lr, device):
    """Train the model on the training set."""
    net.to(device)
    criterion = torch.nn.CrossEntropyLoss().to(device)
    optimizer = torch.optim.Adam(net.parameters(), lr=lr)
    net.train()
    running_loss = 0.0
    for _ in range(epochs):
        for images, labels in trainloader:
            images, labels = images.to(device), labels.to(device)
            optimizer.zero_grad()
            loss = criterion(net(images), labels)
            loss.backward()
            optimizer.step()
            running_loss += loss.item()
    return running_loss / (epochs * len(trainloader))


def test(net, testloader, device):
    """Validate the model on the test set."""
    net.to(device)
    criterion = torch.nn.CrossEntropyLoss()
    correct, loss = 0, 0.0
    net.eval()
    with torch.no_grad():
        for images, labels in testloader:
            images, labels = images.to(device), labels.to(device)
            outputs = net(images)
            loss += criterion(outputs, labels).item()
            correct += (torch.max(outputs.data, 1)[1] == labels).sum().item()
    accuracy = correct / len(testloader.dataset)
    loss = loss / len(testloader)
    return loss, accuracy
