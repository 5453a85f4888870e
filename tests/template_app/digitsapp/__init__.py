"""digitsapp: a Flower / PyTorch app."""
