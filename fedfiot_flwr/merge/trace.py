"""Derive a :class:`PermutationSpec` from any torch ``nn.Module``.

The groups of axes that move together come from :mod:`fedfiot_flwr.merge.channel_groups`
(a union-find over the torch.fx graph: residual adds, normalisation layers and their buffers,
depthwise convolutions, flatten, pooling, self-attention's embedding axis). Every group is then
checked numerically: the module, with every float tensor perturbed (so that BatchNorm statistics,
zero biases and unit norm weights are not trivially symmetric), must compute the same outputs
after the group is permuted. A group that fails the check, or that touches an operation the
tracer does not understand, is merged *without* alignment; one log line per layer names it.
A module that cannot be traced or run at all is merged without any alignment (one log line).
torch is imported lazily so that the merge engine itself needs only numpy and scipy.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import logging
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from .spec import AxisEntry, PermutationSpec

logger = logging.getLogger(__name__)

_SLOW_SECONDS = 1.0  # derivations slower than this are logged at INFO
_IMAGE_SIZES = (32, 28, 224, 64, 16, 8, 96, 128, 256)


def _module_of(tensor: str) -> str:
    return tensor.rsplit(".", 1)[0] if "." in tensor else tensor


def _first_layer(module: Any) -> Any:
    from torch import nn

    kinds = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear, nn.Embedding, nn.RNNBase, nn.BatchNorm1d, nn.LayerNorm)
    return next((m for m in module.modules() if isinstance(m, kinds)), None)


def _candidate_inputs(module: Any) -> Iterator[Any]:
    """Batches of two examples that the module plausibly accepts, most likely first (made lazily)."""
    import torch

    first = _first_layer(module)
    params = list(module.parameters())
    dtype = params[0].dtype if params and params[0].is_floating_point() else torch.float32
    device = params[0].device if params else torch.device("cpu")
    gen = torch.Generator().manual_seed(0)
    if first is None:
        return
    for x in _cpu_candidates(module, first, dtype, gen):
        yield x.to(device)


def _cpu_candidates(module: Any, first: Any, dtype: Any, gen: Any) -> Iterator[Any]:
    import torch
    from torch import nn

    if isinstance(first, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
        dims = {nn.Conv1d: 1, nn.Conv2d: 2, nn.Conv3d: 3}[type(first)]
        fixed = getattr(module, "image_size", None)
        sizes = ([int(fixed)] if isinstance(fixed, int) else []) + list(_IMAGE_SIZES)
        sizes += [s for s in range(1, 257) if s not in sizes]
        for s in sizes:
            yield torch.randn((2, first.in_channels) + (s,) * dims, generator=gen, dtype=dtype)
        return
    if isinstance(first, nn.Linear):
        yield torch.randn(2, first.in_features, generator=gen, dtype=dtype)
    elif isinstance(first, nn.Embedding):
        yield torch.randint(0, first.num_embeddings, (2, 8), generator=gen)
    elif isinstance(first, nn.RNNBase):
        shape = (2, 5, first.input_size) if first.batch_first else (5, 2, first.input_size)
        yield torch.randn(shape, generator=gen, dtype=dtype)
    elif isinstance(first, nn.BatchNorm1d):
        yield torch.randn(2, first.num_features, generator=gen, dtype=dtype)
    else:
        yield torch.randn(2, *first.normalized_shape, generator=gen, dtype=dtype)


def guess_example_input(module: Any) -> Any | None:
    """A small batch that ``module`` runs on, guessed from its first layer (None if none works).

    Conv models are tried on square images of common sizes (32, 28, 224, ...), then of every
    size up to 256; MLPs on ``(2, in_features)``; RNNs on 5-step sequences.
    """
    import torch

    was_training = module.training
    module.eval()
    try:
        with torch.no_grad():
            for x in _candidate_inputs(module):
                try:
                    module(x)
                except Exception:  # noqa: BLE001 - a wrong guess, try the next one
                    continue
                return x
    finally:
        module.train(was_training)
    return None


def _outputs(module: Any, example: Any) -> list[Any]:
    import torch
    from torch.utils._pytree import tree_leaves

    args = example if isinstance(example, tuple) else (example,)
    with torch.no_grad():
        out = module(*args)
    return [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _double_example(example: Any) -> Any:
    """``example`` (a tensor or a tuple of them) with its floating-point tensors in float64."""
    if isinstance(example, tuple):
        return tuple(x.double() if x.is_floating_point() else x for x in example)
    return example.double() if example.is_floating_point() else example


def _add_noise(model: Any, seed: int) -> None:
    """Perturb every floating-point tensor of ``model`` in place, seeded (BatchNorm variances scaled)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in model.state_dict(keep_vars=True).items():
            if not t.is_floating_point() or t.numel() == 0:
                continue
            noise = torch.randn(t.shape, generator=gen, dtype=torch.float64).to(t.device, t.dtype)
            if name.endswith("running_var"):
                t.mul_(0.5 + torch.rand(t.shape, generator=gen, dtype=torch.float64).to(t.device, t.dtype))
            else:
                std = float(t.std()) if t.numel() > 1 else 0.0
                t.add_(noise.mul_(0.1 * (std if std > 0 else 1.0)))


def _perturbed_copy(module: Any, example: Any, seed: int) -> tuple[Any, Any]:
    """A float64 (if possible) eval-mode copy whose float tensors all carry random noise."""
    model = copy.deepcopy(module).eval()
    try:
        model = model.double()
        example = _double_example(example)
    except Exception:  # noqa: BLE001 - keep the module's dtype
        pass
    _add_noise(model, seed)
    return model, example


def _same(before: Sequence[Any], after: Sequence[Any]) -> bool:
    import torch

    if len(before) != len(after):
        return False
    for a, b in zip(before, after):
        tol = 1e-7 if a.dtype == torch.float64 else 1e-3
        if a.shape != b.shape or float((a - b).abs().max()) > tol * (1.0 + float(a.abs().max())):
            return False
    return True


def _probe_permutations(spec: PermutationSpec, sizes: Mapping[str, int], seed: int) -> Iterator[tuple[str, np.ndarray]]:
    """One seeded random permutation per group of ``spec``, never the identity."""
    rng = np.random.default_rng(seed)
    for perm in spec.perm_names:
        p = rng.permutation(sizes[perm])
        if np.array_equal(p, np.arange(len(p))):
            p[[0, 1]] = p[[1, 0]]
        yield perm, p


def _failing_permutations_reference(module: Any, spec: PermutationSpec, example: Any, seed: int = 0) -> list[str]:
    """Permutations of ``spec`` that change the perturbed module's outputs (the plain, slow check).

    One full forward pass per permutation on a plain deep copy (the module's own float64
    conversion), on the module's intra-op threads; :func:`_failing_permutations` gives the same
    answer faster.
    """
    model, example = _perturbed_copy(module, example, seed)
    return _changed_outputs(model, example, spec, seed)


def _changed_outputs(model: Any, example: Any, spec: PermutationSpec, seed: int) -> list[str]:
    """The permutations of ``spec`` (one probe each, swapped in and back) that change ``model``'s outputs."""
    reference = _outputs(model, example)
    state = model.state_dict(keep_vars=True)
    sizes = spec.sizes({k: tuple(v.shape) for k, v in state.items()})
    failing = []
    for perm, p in _probe_permutations(spec, sizes, seed):
        saved = _swap_in_permuted(state, spec, {perm: p})
        try:
            if not _same(reference, _outputs(model, example)):
                failing.append(perm)
        finally:
            _swap_back(state, saved)
    return failing


def _double_copy(module: Any) -> Any:
    """``copy.deepcopy(module).eval().double()`` without first copying each tensor in its own dtype.

    Parameters and buffers are converted straight to float64 copies (handed to ``deepcopy``
    through its memo); everything else is deep-copied as usual.
    """
    import torch
    from torch import nn

    memo: dict[int, Any] = {}
    for t in itertools.chain(module.parameters(), module.buffers()):
        if id(t) in memo or not t.is_floating_point():
            continue
        if type(t) is nn.Parameter:
            memo[id(t)] = nn.Parameter(t.detach().to(torch.float64, copy=True), t.requires_grad)
        elif type(t) is torch.Tensor and not t.requires_grad and not t.__dict__:
            memo[id(t)] = t.detach().to(torch.float64, copy=True)
    return copy.deepcopy(module, memo).eval().double()


def _perturbed_double_copy(module: Any, example: Any, seed: int) -> tuple[Any, Any]:
    """:func:`_perturbed_copy` with fewer passes over the tensors; the same noise, bit for bit."""
    try:
        model = _double_copy(module)
    except Exception:  # noqa: BLE001 - the plain path keeps the module's dtype (and raises what deepcopy raises)
        return _perturbed_copy(module, example, seed)
    try:
        example = _double_example(example)
    except Exception:  # noqa: BLE001 - keep the example's dtype, as the plain path does
        pass
    _add_noise(model, seed)
    return model, example


def _swap_in_permuted(state: Mapping[str, Any], spec: PermutationSpec,
                      perms: Mapping[str, np.ndarray]) -> dict[str, Any]:
    """Point the tensors that ``perms`` moves at permuted copies; return their original data.

    Swapping ``.data`` (instead of copying into the tensors and back) leaves every module
    holding the same tensor objects, so nothing is copied but the permuted tensors themselves.
    """
    import torch

    saved: dict[str, Any] = {}
    with torch.no_grad():
        for name, entries in spec.axes.items():
            original = state[name].data
            new = original
            for axis, entry in enumerate(entries):
                if entry is not None and entry.perm in perms:
                    index = torch.as_tensor(perms[entry.perm], device=original.device)
                    if entry.block == 1:
                        new = new.index_select(axis, index)
                    else:  # whole blocks at once: the same result as expand_block_permutation's index
                        new = new.unflatten(axis, (-1, entry.block)).index_select(axis, index).flatten(axis, axis + 1)
            if new is not original:
                saved[name] = original
                state[name].data = new
    return saved


def _swap_back(state: Mapping[str, Any], saved: Mapping[str, Any]) -> None:
    for name, original in saved.items():
        state[name].data = original


@contextlib.contextmanager
def _one_intra_op_thread() -> Iterator[None]:
    """Run torch on one intra-op thread inside the block (the previous count is restored).

    The probes are batches of two examples: too small for intra-op parallelism to pay, while on a
    machine whose cores are busy the OpenMP workers wait for one another at every operation and
    burn many times the work itself.
    """
    import torch

    before = torch.get_num_threads()
    if before > 1:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if before > 1:
            torch.set_num_threads(before)


def _failing_permutations(module: Any, spec: PermutationSpec, example: Any, seed: int = 0) -> list[str]:
    """Permutations of ``spec`` that change the perturbed module's outputs.

    The same perturbed copy, permutations and comparison as
    :func:`_failing_permutations_reference`, hence the same answer, with less work per permutation.
    """
    import torch

    with torch.no_grad():
        model, example = _perturbed_double_copy(module, example, seed)
        return _changed_outputs(model, example, spec, seed)


def _log_unaligned(reasons: Mapping[str, set[str]]) -> None:
    for layer, why in reasons.items():
        logger.warning("spec_from_module: merging %s without alignment (%s)", layer, "; ".join(sorted(why)))


def identity_spec(module: Any) -> PermutationSpec:
    """A spec that aligns nothing: every tensor of ``module.state_dict()`` merged as it is."""
    return PermutationSpec({k: (None,) * v.dim() for k, v in module.state_dict().items()})


def spec_from_module(
    module: Any,
    perm_prefix: str = "P_",
    example_input: Any = None,
    verify: bool = True,
) -> PermutationSpec:
    """Derive ``module``'s permutation spec from its torch.fx graph.

    Parameters
    ----------
    module : torch.nn.Module
        Any module (residual, normalised, depthwise, attention, recurrent, ...).
    perm_prefix : str
        Prefix of the permutation names (``P_<module name>`` of the group's first weight).
    example_input : torch.Tensor or tuple, optional
        A batch the module runs on; guessed from its first layer when omitted
        (:func:`guess_example_input`).
    verify : bool
        Check every permutation numerically and drop the ones that change the outputs.

    Returns
    -------
    PermutationSpec
        Keys equal ``module.state_dict()``'s keys. Axes that cannot be shown to be safely
        permutable get ``None`` (merged without alignment); one warning per such layer.
        Never raises for a module that runs: if tracing fails, nothing is aligned.

    Notes
    -----
    The probe passes run on one torch intra-op thread (the thread count is restored on return).
    A derivation that takes longer than a second is logged at INFO, with the module's class.
    """
    start = time.perf_counter()
    with _one_intra_op_thread():
        spec = _derive_spec(module, perm_prefix, example_input, verify)
    seconds = time.perf_counter() - start
    if seconds > _SLOW_SECONDS:
        logger.info("spec_from_module: tracing %s took %.1f s", type(module).__name__, seconds)
    return spec


def _derive_spec(module: Any, perm_prefix: str, example_input: Any, verify: bool,
                 reference: bool = False) -> PermutationSpec:
    """The body of :func:`spec_from_module`; ``reference=True`` checks with the plain, slow path."""
    from .channel_groups import BOUNDARY_REASONS, derive_channel_groups

    params = {n for n, _ in module.named_parameters()}
    example = example_input if example_input is not None else guess_example_input(module)
    if example is None:
        logger.warning("spec_from_module: merging %s without alignment (no example input found; pass "
                       "example_input=)", type(module).__name__)
        return identity_spec(module)
    try:
        found = derive_channel_groups(module, example)
    except Exception as err:  # noqa: BLE001 - an untraceable model is merged without alignment
        logger.warning("spec_from_module: merging %s without alignment (torch.fx cannot trace it: %s)",
                       type(module).__name__, str(err).splitlines()[0] if str(err) else type(err).__name__)
        return identity_spec(module)

    state = module.state_dict()
    axes: dict[str, list[AxisEntry]] = {k: [None] * v.dim() for k, v in state.items()}
    unaligned: dict[str, set[str]] = {}
    names: dict[str, str] = {}
    position = {k: i for i, k in enumerate(state)}
    for gid, members in found.groups.items():
        neurons = [n for n, a in members if a == 0 and n in params]
        if not neurons:  # acts on no weight's leading axis: nothing for the engine to align
            for n, a in members:
                if n in params:
                    unaligned.setdefault(_module_of(n), set()).add("no weight has these units as outputs")
            continue
        first = min(neurons, key=position.__getitem__)
        name = f"{perm_prefix}{_module_of(first)}"
        while name in names.values():
            name += "_"
        names[gid] = name
        for n, a in members:
            axes[n][a] = name
    for (n, a), (gid, block) in found.blocks.items():
        if gid in names:
            axes[n][a] = (names[gid], block)
    for (n, a), why in found.fixed.items():
        if a == 0 and n in params and why - BOUNDARY_REASONS:
            unaligned.setdefault(_module_of(n), set()).update(why - BOUNDARY_REASONS)
    try:
        spec = PermutationSpec({k: tuple(v) for k, v in axes.items()})
        check = _failing_permutations_reference if reference else _failing_permutations
        failing = check(module, spec, example) if verify and spec.perm_names else []
    except Exception as err:  # noqa: BLE001 - inconsistent groups: merge without alignment rather than fail
        logger.warning("spec_from_module: merging %s without alignment (its derived groups are inconsistent: %s)",
                       type(module).__name__, err)
        return identity_spec(module)
    if failing:
        for perm in failing:
            unaligned.setdefault(perm[len(perm_prefix):], set()).add("permuting it changed the outputs")
        drop = set(failing)
        spec = PermutationSpec({
            k: tuple(None if e is not None and e.perm in drop else e for e in v) for k, v in spec.axes.items()
        })
    _log_unaligned(unaligned)
    return spec


__all__ = ["guess_example_input", "identity_spec", "spec_from_module"]
