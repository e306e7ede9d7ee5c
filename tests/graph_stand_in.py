"""CUDA graphs stood in for on a CPU, so the CUDA-graph path's captured steps run where no device
is: :func:`stand_in` puts :class:`Graph`, :class:`capture` and idle streams in the place of
``torch.cuda``'s own for one test.

A capture on a device records the kernels its code launches and runs none of them; a replay
runs them all again on the addresses they were recorded with, and nothing else: no Python, no
allocation. The stand-in keeps those rules where a test can see them break:

- inside ``torch.cuda.graph(...)`` every aten op is kept with its arguments, tensors by
  reference (a replay reads and writes the very tensors the capture saw, as a graph reads and
  writes their addresses; a tensor the code replaces by a new one after the capture is not
  seen by the replay), and run once so that the next op has its inputs;
- on leaving the capture, what it wrote into tensors that existed before it is put back, the
  global generator's state too (a capture draws nothing), and the tensors it made are filled
  with NaN (the lowest integer, True), since on a device they hold nothing until a replay;
- ``replay`` runs the ops again in order, writing each one's new result into the tensor the
  capture made for it, in-place ops into what they wrote; random ops draw anew each replay, from
  the global generator, in turn, so a captured step draws what an eager one would;
- a read of a value by the host inside a capture (``item``, ``tolist``, ``bool``,
  ``nonzero``, boolean-mask indexing and the other ops whose result's size depends on values)
  raises, as it fails a capture on a device.

What it cannot see: a host-to-device copy inside a capture, the graph's own memory pool, and
kernels a device refuses to capture.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any

import pytest
import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["Graph", "capture", "stand_in"]

_SYNCING = {
    "_local_scalar_dense", "item", "is_nonzero", "equal", "nonzero", "masked_select",
    "_unique2", "unique_consecutive", "unique_dim", "argwhere",
}  # fmt: skip
"""aten ops that read values to the host: each waits on a device, which a capture refuses."""

_READS = {"tolist", "item", "__bool__", "__int__", "__float__", "__index__", "numpy"}
"""Tensor methods that read values to the host without an aten op."""

_CAPTURING: list[capture] = []  # the capture under way, if any
_REPLAYED: list[Graph] = []  # each replay's graph, since :func:`stand_in`


class Graph:
    """Stands in for ``torch.cuda.CUDAGraph``: the ops a :class:`capture` kept, each with its
    arguments and the tensors it made."""

    def __init__(self) -> None:
        self.ops: list[tuple[Any, tuple, dict, list[Tensor]]] = []

    def replay(self) -> None:
        """Runs the kept ops again, in order, into the tensors they wrote at the capture."""
        if _CAPTURING:
            raise RuntimeError("a graph replayed inside a capture")
        with torch.no_grad():
            for op, args, kwargs, made in self.ops:
                out = op(*args, **kwargs)
                for kept, new in zip(made, _made(op, out), strict=True):
                    kept.copy_(new)
        _REPLAYED.append(self)


class capture(contextlib.AbstractContextManager):  # noqa: N801 - stands in for torch.cuda.graph
    """Stands in for ``torch.cuda.graph(graph, ...)``: keeps the ops run inside it in ``graph``
    and takes back their effects on leaving (the module's docstring)."""

    def __init__(self, graph: Graph, **_: Any) -> None:
        self.graph = graph
        self.written: list[tuple[Tensor, Tensor]] = []  # (tensor, its values before the capture)
        self.made: list[Tensor] = []
        self.storages: set[int] = set()  # the data pointers of the tensors the capture made
        self.modes = (_Recording(self), _NoReads())

    def __enter__(self) -> capture:
        if _CAPTURING:
            raise RuntimeError("a capture inside a capture")
        self.rng = torch.random.get_rng_state()
        _CAPTURING.append(self)
        for mode in self.modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> bool:
        for mode in reversed(self.modes):
            mode.__exit__(*exc)
        _CAPTURING.pop()
        with torch.no_grad():
            for tensor, before in reversed(self.written):
                tensor.copy_(before)
            for tensor in self.made:
                tensor.fill_(_nothing(tensor.dtype))
        torch.random.set_rng_state(self.rng)
        return False


class _Recording(TorchDispatchMode):
    """Keeps each aten op of a :class:`capture` in its graph, and what it wrote and made."""

    def __init__(self, owner: capture) -> None:
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        sized = name == "repeat_interleave" and kwargs.get("output_size") is None
        if name in _SYNCING or (sized and isinstance(args[0], Tensor) and args[0].dim() > 0):
            raise RuntimeError(f"operation not permitted when stream is capturing ({func})")
        owner = self.owner
        for tensor in _written(func, args, kwargs):
            if tensor.untyped_storage().data_ptr() not in owner.storages:
                owner.written.append((tensor, tensor.detach().clone()))
        out = func(*args, **kwargs)
        made = _made(func, out)
        owner.made.extend(made)
        owner.storages.update(t.untyped_storage().data_ptr() for t in made)
        owner.graph.ops.append((func, args, kwargs, made))
        return out


class _NoReads(TorchFunctionMode):
    """Refuses a read of a value by the host inside a :class:`capture`."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        masked = name in ("__getitem__", "__setitem__") and any(
            isinstance(i, Tensor) and i.dtype == torch.bool
            for i in (args[1] if isinstance(args[1], tuple) else (args[1],))
        )
        if name in _READS or masked:
            raise RuntimeError(f"operation not permitted when stream is capturing ({name})")
        return func(*args, **(kwargs or {}))


def _written(op, args: tuple, kwargs: dict) -> list[Tensor]:
    """The tensors ``op`` writes in place (its schema's mutable arguments)."""
    tensors = []
    for index, argument in enumerate(op._schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = args[index] if index < len(args) else kwargs.get(argument.name)
        tensors.extend(_tensors(value))
    return tensors


def _made(op, out: Any) -> list[Tensor]:
    """The tensors ``op`` returned that are new (its schema's returns that alias nothing)."""
    returns = op._schema.returns
    outs = out if isinstance(out, (tuple, list)) and len(returns) > 1 else (out,)
    made = []
    for returned, value in zip(returns, outs, strict=True):
        if returned.alias_info is None:
            made.extend(_tensors(value))
    return made


def _tensors(value: Any) -> list[Tensor]:
    if isinstance(value, Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [v for v in value if isinstance(v, Tensor)]
    return []


def _nothing(dtype: torch.dtype) -> Any:
    """What a tensor a capture made holds before a replay, as far as a test can tell."""
    if dtype.is_floating_point or dtype.is_complex:
        return float("nan")
    if dtype == torch.bool:
        return True
    return torch.iinfo(dtype).min


class _Stream:
    """An idle stream: the stand-in runs everything in order on one."""

    def wait_stream(self, other: Any) -> None:
        pass


def stand_in(monkeypatch: pytest.MonkeyPatch) -> list[Graph]:
    """Puts the stand-in in the place of ``torch.cuda``'s graphs and streams for one test, and
    lets :func:`~lightning_troll.engines.graph_decode.graph_decode` serve a model on a CPU.
    Returns the list of replays from now on (each its graph)."""
    from lightning_troll.engines import graph_decode

    replayed: list[Graph] = []
    monkeypatch.setattr(sys.modules[__name__], "_REPLAYED", replayed)
    stream = _Stream()
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "graph", capture)
    monkeypatch.setattr(torch.cuda, "Stream", lambda *a, **k: _Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: stream)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: bool(_CAPTURING))
    serves = graph_decode.cannot_capture
    monkeypatch.setattr(
        graph_decode, "cannot_capture", lambda model, device: serves(model, torch.device("cuda"))
    )
    return replayed
