"""The server's one decoder: every reply is decoded and validated here, once (numpy + flwr only).

:func:`decode_reply` reads a reply with the codec of its kind (:mod:`fedfiot_flwr.wire.q16`,
:mod:`fedfiot_flwr.wire.psd8`), which checks every bound of :mod:`fedfiot_flwr.reply_limits` while it
decodes: each quantisation scale is the magnitude bound of its tensor, each factor is bounded as it is
rebuilt. What it returns is finite, within the bounds and, given the broadcast model's shapes,
laid out as that model, so nothing downstream validates it again.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from flwr.app import RecordDict

from fedfiot_flwr.reply_limits import MAX_FISHER_MAGNITUDE
from fedfiot_flwr.wire.psd8 import unpack_curvature_reply
from fedfiot_flwr.wire.q16 import unpack_reply
from fedfiot_flwr.wire.records import CURVATURE_RECORD, REPLY_KINDS, ClientUpload, CurvatureUpload

__all__ = ["decode_reply"]


def decode_reply(
    content: RecordDict,
    kind: str,
    *,
    client: str,
    expected_shapes: Mapping[str, tuple[int, ...]] | None,
    buffers: Collection[str] = (),
    fisher_kind: str | None = None,
    fisher_bound: float | None = MAX_FISHER_MAGNITUDE,
) -> ClientUpload | CurvatureUpload:
    """Unpack, dequantize and validate one reply, once, for a strategy that needs ``kind``.

    Parameters
    ----------
    content : RecordDict
        The reply's content.
    kind : {"fisher", "kfac", "gram", "gram-output", "weights"}
        What the strategy merges: diagonal Fishers (FedFiOT, FedFisher diag), K-FAC factors,
        input Grams (RegMean), input Grams with every layer's output factor (FedFiOT's K-FAC
        curvature), or only the weights of any of these replies.
    client : str
        Who sent it (named in every error).
    expected_shapes : mapping of str to tuple of int, optional
        The broadcast model's state-dict shapes; names and shapes must match exactly.
    buffers : collection of str
        State-dict entries that carry no Fisher (BatchNorm statistics).
    fisher_kind : str, optional
        K-FAC only: the Fisher kind the factors must declare.
    fisher_bound : float or None
        Largest accepted diagonal Fisher entry. The default,
        :data:`~fedfiot_flwr.reply_limits.MAX_FISHER_MAGNITUDE`, is for a server that merges the
        Fishers as uploaded; ``None`` accepts any finite Fisher, for a server that caps them
        (:func:`fedfiot_flwr.reply_limits.fisher_bound_for`). Non-finite and negative Fishers are
        always rejected.

    Returns
    -------
    ClientUpload or CurvatureUpload
        ``ClientUpload`` for ``"fisher"`` (and ``"weights"`` on a FedFiOT reply), else
        ``CurvatureUpload``. Every float entry is finite and within
        :data:`~fedfiot_flwr.reply_limits.MAX_WEIGHT_MAGNITUDE`, every Fisher in
        ``[0, fisher_bound]``, every integer buffer within
        :data:`~fedfiot_flwr.reply_limits.MAX_INTEGER_BUFFER`, every factor fits its layer and is
        within :data:`~fedfiot_flwr.reply_limits.MAX_CURVATURE_MAGNITUDE`.

    Raises
    ------
    ValueError
        Naming the client and the tensor or factor, on anything malformed or out of bounds.
    """
    if kind not in REPLY_KINDS:
        raise ValueError(f"unknown reply kind {kind!r}; choose one of {REPLY_KINDS}")
    curvature = isinstance(content, RecordDict) and CURVATURE_RECORD in content
    if kind == "fisher" or (kind == "weights" and not curvature):
        parameters = None
        if expected_shapes is not None and kind == "fisher":
            parameters = [k for k in expected_shapes if k not in buffers]
        up = unpack_reply(content, expected_shapes, client, parameters=parameters, fisher_bound=fisher_bound)
        if kind == "fisher" and not up.fisher:
            raise ValueError(f"client {client}: reply carries no Fisher")
        return up
    cup = unpack_curvature_reply(content, expected_shapes, client)
    method = "gram" if kind == "gram-output" else kind
    if kind != "weights" and cup.method != method:
        raise ValueError(f"client {client}: sent a {cup.method!r} upload, this strategy needs {method!r}")
    if kind == "gram-output":
        missing = [m for m, g in cup.grams.items() if g.output is None]
        if missing:
            raise ValueError(f"client {client}: Gram reply without the output factors of {missing}; the K-FAC "
                             "curvature needs every layer's")
    if fisher_kind is not None and kind == "kfac" and cup.fisher_kind != fisher_kind:
        raise ValueError(f"client {client}: K-FAC factors of the {cup.fisher_kind!r} Fisher, "
                         f"this strategy expects {fisher_kind!r}")
    return cup
