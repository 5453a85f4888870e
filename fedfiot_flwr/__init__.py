"""FedFiOT for Flower: Fisher-weighted optimal-transport model merging."""

__version__ = "0.1.0"
