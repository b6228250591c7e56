"""torch.onnx's op registry, each operator's translations built the first time it is looked up.

``ONNXRegistry.from_torchlib()`` builds an entry for each of torchlib's ~560 functions before it
answers anything: it parses each function's source to read its domain (onnxscript's
``get_torchlib_ops``) and infers its ONNX signature. That took 0.6-0.8 s of a cold first step
(2-core AMD EPYC) to answer questions about the 20-80 operators a model uses. This registry lists
the same operators up front from torchlib's own tables (which functions translate which operator,
milliseconds) and builds an operator's entries, exactly as ``from_torchlib`` does, when the
partitioner or the translator first asks for it. Iterating all its entries (``functions.items()``,
as ``torch.onnx.export`` does with the copy ortrain hands it) builds them all.

``tests/export/test_lazy_op_registry.py`` checks that it holds the same operators, with equal
entries in the same order, as ``from_torchlib`` for each opset. Were torchlib to gain a function
whose entry fails to build (``from_torchlib`` logs and skips those), this registry would name its
operator but give no translation for it: the export would then fail, and the node run in PyTorch.

torch.onnx's private exporter API is used in this file (and the other files of ``export/``) only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch.onnx._internal.exporter import _registration
from torch.onnx._internal.exporter._torchlib import _torchlib_registry

logger = logging.getLogger("ortrain.export")

# What from_torchlib gives the entries it builds for onnxscript's functions.
_DEFAULT_OPSET_INTRODUCED: int = _registration.OnnxDecompMeta.__dataclass_fields__["opset_introduced"].default


def _key(target: Any) -> Any:
    """The key ``ONNXRegistry._register`` files ``target`` under."""
    return target.name() if isinstance(target, torch._ops.OpOverload) else target


class _Pending:
    """One of onnxscript's torchlib functions for an operator, its entry not built yet."""

    __slots__ = ("function", "is_complex", "qualified_name", "target")

    def __init__(self, qualified_name: str, function: Any, target: Any, is_complex: bool) -> None:
        self.qualified_name = qualified_name
        self.function = function
        self.target = target
        self.is_complex = is_complex

    @property
    def opset_introduced(self) -> int:
        return _DEFAULT_OPSET_INTRODUCED

    @property
    def fx_target(self) -> Any:
        return self.target

    def build(self) -> Any:
        """The entry ``from_torchlib`` builds, or None where it logs and skips the function."""
        try:
            return _registration.OnnxDecompMeta(
                onnx_function=self.function,
                fx_target=self.target,
                signature=None,
                is_custom=False,
                is_complex=self.is_complex,
            )
        except Exception:  # from_torchlib skips a function whose entry fails, so does this
            logger.exception("Failed to register '%s'. Skipped", self.qualified_name)
            return None


class _LazyFunctions(Mapping[Any, list[Any]]):
    """``ONNXRegistry.functions`` whose lists are built on first access."""

    def __init__(self, candidates: dict[Any, list[Any]], opset_version: int) -> None:
        # key -> the entries (built or _Pending) in from_torchlib's order that its opset clean-up
        # keeps: those of the highest opset_introduced not above the registry's opset.
        self._candidates = {}
        for key, entries in candidates.items():
            usable = [e for e in entries if e.opset_introduced <= opset_version]
            if usable:
                newest = max(e.opset_introduced for e in usable)
                self._candidates[key] = [e for e in usable if e.opset_introduced == newest]
        self._built: dict[Any, list[Any]] = {}

    def __getitem__(self, key: Any) -> list[Any]:
        built = self._built.get(key)
        if built is None:
            entries = self._candidates[key]  # KeyError: not registered
            built = [e.build() if isinstance(e, _Pending) else e for e in entries]
            built = self._built[key] = [e for e in built if e is not None]
        if not built:
            raise KeyError(key)
        return built

    def __contains__(self, key: object) -> bool:
        try:
            self[key]
        except (KeyError, TypeError):
            return False
        return True

    def __iter__(self) -> Iterator[Any]:
        return (key for key in self._candidates if key in self)

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def targets(self) -> list[Any]:
        """The operator of each entry, without building any: what
        ``_decomp.get_onnx_implemented_overloads`` returns for the built registry."""
        return [entries[0].fx_target for entries in self._candidates.values()]


class LazyTorchlibRegistry(_registration.ONNXRegistry):
    """An ``ONNXRegistry`` equal to ``from_torchlib(opset_version)``'s, built as it is read."""

    functions: Any  # a _LazyFunctions, read through get_decomps / is_registered like the dict

    def __init__(self, opset_version: int) -> None:
        super().__init__()
        self._opset_version = opset_version
        self.functions = _LazyFunctions(_candidates(), opset_version)

    def implemented_targets(self) -> list[Any]:
        return self.functions.targets()


def _candidates() -> dict[Any, list[Any]]:
    """Each operator's entries in the order from_torchlib registers them: torch's own torchlib
    first, then onnxscript's (the real overloads of each function, then the complex ones)."""
    from onnxscript.function_libs.torch_lib import ops, registration  # registers the functions

    del ops
    candidates: dict[Any, list[Any]] = {}
    for meta in _torchlib_registry.get_torchlib_ops():
        candidates.setdefault(_key(meta.fx_target), []).append(meta)
    resolved: dict[str, Any] = {}
    for qualified_name, overloaded in registration.default_registry.items():
        if qualified_name.startswith("internal::"):
            continue
        functions: list[tuple[Callable[..., Any], bool]] = [(f, False) for f in overloaded.overloads]
        functions += [(f, True) for f in overloaded.complex]
        for function, is_complex in functions:
            if qualified_name not in resolved:
                resolved[qualified_name] = _overload(qualified_name)
            target = resolved[qualified_name]
            if target is not None:
                pending = _Pending(qualified_name, function, target, is_complex)
                candidates.setdefault(_key(target), []).append(pending)
    return candidates


def _overload(qualified_name: str) -> Any:
    try:
        return _registration._get_overload(qualified_name)
    except Exception:
        logger.exception("Failed to register '%s'. Skipped", qualified_name)
        return None
