"""Helpers memoized with ``functools.lru_cache`` or ``functools.cache`` that the forward calls.

A memoized helper that returns a tensor (a causal mask per length, ALiBi slopes, a rotary table)
keeps what its first call returned. Called while capturing, that is a fake tensor of the trace:
the capture's next trace failed on "Mixing fake modes", and every later call in PyTorch got the
fake tensor back ("Please convert all Tensors to FakeTensors"), the user's own eager model
included: training stopped at its first step (wave 30).

While capturing, the names the forward's code finds these helpers by (module-level functions it
names, :mod:`ortrain.capture.global_reads`, and methods on the model's classes) are bound to the
functions they wrap, as TorchDynamo inlines them; the bindings are put back afterwards, with the
caches as they were.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterable, Iterator, MutableMapping
from typing import Any

from ortrain.capture.global_reads import code_reads
from ortrain.capture.held_objects import is_pytorch_class

_MEMOIZED = functools._lru_cache_wrapper  # the type of what lru_cache and cache return


def _is_memoized(value: Any) -> bool:
    return isinstance(value, _MEMOIZED) and hasattr(value, "__wrapped__")


@contextlib.contextmanager
def memoized_functions_unwrapped(classes: Iterable[type]) -> Iterator[None]:
    """Meanwhile, the memoized helpers the forwards of ``classes`` call run their wrapped function."""
    module_level: list[tuple[MutableMapping[str, Any], str, Any]] = []
    on_classes: list[tuple[type, str, Any]] = []
    seen: set[tuple[int, str]] = set()
    classes = list(classes)
    for cls in classes:
        for _, namespace, name in code_reads(cls):
            value = namespace.get(name)
            if isinstance(namespace, dict) and _is_memoized(value) and (id(namespace), name) not in seen:
                seen.add((id(namespace), name))
                module_level.append((namespace, name, value))
    for klass in {k for cls in classes for k in cls.__mro__ if not is_pytorch_class(k)}:
        on_classes += [(klass, n, v) for n, v in vars(klass).items() if _is_memoized(v)]
    try:
        for namespace, name, memoized in module_level:
            namespace[name] = memoized.__wrapped__
        for klass, name, memoized in on_classes:
            setattr(klass, name, memoized.__wrapped__)
        yield
    finally:
        for namespace, name, memoized in module_level:
            namespace[name] = memoized
        for klass, name, memoized in on_classes:
            setattr(klass, name, memoized)
