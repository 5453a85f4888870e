"""digitsapp: a Flower / PyTorch app."""

import json

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from digitsapp.task import Net, load_centralized_dataset, test

# Create ServerApp
app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Main entry point for the ServerApp."""

    # Read run config
    fraction_train: float = context.run_config["fraction-train"]
    num_rounds: int = context.run_config["num-server-rounds"]
    lr: float = context.run_config["lr"]

    # Load global model
    torch.manual_seed(context.run_config["seed"])
    global_model = Net()
    arrays = ArrayRecord(global_model.state_dict())

    # Initialize FedAvg strategy
    strategy = FedAvg(fraction_train=fraction_train)

    # Start strategy, run FedAvg for `num_rounds`
    result = strategy.start(
        grid=grid,
        initial_arrays=arrays,
        train_config=ConfigRecord({"lr": lr}),
        num_rounds=num_rounds,
        evaluate_fn=global_evaluate,
    )

    # Save the final metrics to disk
    if context.run_config["results-file"]:
        final = {str(r): dict(m) for r, m in result.evaluate_metrics_serverapp.items()}
        with open(context.run_config["results-file"], "w", encoding="utf-8") as fh:
            json.dump(final, fh)


def global_evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
    """Evaluate model on central data."""

    model = Net()
    model.load_state_dict(arrays.to_torch_state_dict())
    test_loss, test_acc = test(model, load_centralized_dataset(), torch.device("cpu"))
    return MetricRecord({"accuracy": test_acc, "loss": test_loss})
