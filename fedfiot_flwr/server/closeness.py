"""How close the clients still are to the model they started from: the alignment's precondition.

Weight-space alignment can only find something to move when the clients' weights have left their
starting point: a client whose weights still have cosine close to 1 with the broadcast model is
in that model's neuron order, and FedFiOT then acts as a Fisher-weighted average. The round
reports the mean cosine per layer; the strategy says so in words when every layer is above
:data:`CLOSE_COSINE`.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

import numpy as np

__all__ = ["CLOSE_COSINE", "broadcast_cosines", "describe_closeness"]

CLOSE_COSINE = 0.95
"""Above this mean cosine with the broadcast model in every layer, the alignment cannot find much."""


def broadcast_cosines(
    weights: Sequence[Mapping[str, np.ndarray]], broadcast: Mapping[str, np.ndarray], names: Collection[str]
) -> dict[str, float]:
    """Mean over clients of the cosine between each client's tensor and the broadcast one, per tensor.

    Parameters
    ----------
    weights : sequence of dict
        The clients' uploaded weights.
    broadcast : dict
        The model the server sent this round.
    names : collection of str
        The tensors to compare (the layers' weight matrices and kernels).

    Returns
    -------
    dict of str to float
        ``name -> mean_k cos(w_k[name], broadcast[name])``, in ``names``' order; a tensor that is
        zero in the broadcast model or in a client is left out.

    Examples
    --------
    >>> w = {"fc.weight": np.array([[1.0, 0.0], [0.0, 1.0]])}
    >>> broadcast_cosines([w, {"fc.weight": -w["fc.weight"]}], w, ["fc.weight"])
    {'fc.weight': 0.0}
    """
    out: dict[str, float] = {}
    for name in names:
        ref = np.asarray(broadcast[name], dtype=np.float64).ravel()
        cosines = []
        for client in weights:
            own = np.asarray(client[name], dtype=np.float64).ravel()
            denom = float(np.linalg.norm(own) * np.linalg.norm(ref))
            if denom > 0:
                cosines.append(float(own @ ref) / denom)
        if cosines:
            out[name] = float(np.mean(cosines))
    return out


def describe_closeness(cosines: Mapping[str, float]) -> str | None:
    """A plain-words sentence when every layer is above :data:`CLOSE_COSINE`, else ``None``."""
    if not cosines or min(cosines.values()) <= CLOSE_COSINE:
        return None
    return (f"every layer of the clients still has cosine {min(cosines.values()):.3f} or more with the broadcast "
            f"model (above {CLOSE_COSINE}): the clients stayed close to the model they started from, so the "
            "alignment has little to find and the merge is a Fisher-weighted average; clients that train "
            "longer, or start from their own initialisations, leave more for it to align")
