"""Python's own random numbers (``random``, ``numpy.random``) drawn inside ``forward``.

A captured graph holds what one trace of the forward did: ``if random.random() < p:`` (LayerDrop,
stochastic depth) or ``np.random.uniform(...)`` is drawn once, while tracing, and every later step
repeats that draw, the same layers dropped at every step. Tracing also advanced the user's
generators, so the numbers later drawn outside the model moved too. TorchDynamo calls such
functions at every run of its graphs, in eager's order.

Besides the process-wide generators, a model keeps its own: ``self.rng =
np.random.default_rng(seed)`` for a reproducible augmentation, a ``random.Random`` in the module that
defines it. Those the forward can reach are watched too: generators held by a submodule (or by an
object it holds), and those in the globals or closures of its class's methods.

So capture and ortrain's eager error check run with these generators saved and put back, and a
capture during which they moved is refused with :class:`PythonRandomnessError`: the model then
trains through TorchDynamo's graph breaks.
"""

from __future__ import annotations

import contextlib
import random
import sys
import types
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from ortrain.capture.generator_resets import in_user_forward
from ortrain.capture.held_objects import attributes as held_attributes
from ortrain.capture.held_objects import held_objects


class PythonRandomnessError(RuntimeError):
    """The forward drew from Python's ``random`` or ``numpy.random`` while it was captured."""


def _generator_kinds() -> tuple[type, ...]:
    kinds: list[type] = [random.Random]
    numpy = sys.modules.get("numpy")  # a model holding NumPy generators has imported it
    if numpy is not None:
        kinds += [numpy.random.Generator, numpy.random.RandomState, numpy.random.BitGenerator]
    return tuple(kinds)


def _state_access(generator: Any) -> tuple[Callable[[], Any], Callable[[Any], None]] | None:
    """(read the state, write it back) of one generator; None where it has none to read
    (``random.SystemRandom`` draws from the operating system)."""
    if isinstance(generator, random.SystemRandom):
        return None
    if isinstance(generator, random.Random):
        return generator.getstate, generator.setstate
    if hasattr(generator, "bit_generator"):  # numpy.random.Generator
        bits = generator.bit_generator
        return (lambda: bits.state), (lambda state: setattr(bits, "state", state))
    if hasattr(generator, "get_state"):  # numpy.random.RandomState
        return generator.get_state, generator.set_state
    return (lambda: generator.state), (lambda state: setattr(generator, "state", state))  # BitGenerator


def _cell_contents(function: types.FunctionType) -> list[Any]:
    contents = []
    for cell in function.__closure__ or ():
        with contextlib.suppress(ValueError):  # a cell not yet filled
            contents.append(cell.cell_contents)
    return contents


def reachable_generators(module: nn.Module, kinds: tuple[type, ...] | None = None) -> list[Any]:
    """The model's own generators (of ``kinds``, Python's and NumPy's by default): held by a
    submodule or by an object it holds (:mod:`ortrain.capture.held_objects`), or found in the
    globals and closures of the submodules' classes' methods."""
    kinds = kinds or _generator_kinds()
    found: dict[int, Any] = {}
    seen_namespaces: set[int] = set()

    def consider(values: Iterable[Any]) -> None:
        found.update((id(value), value) for value in values if isinstance(value, kinds))

    for submodule in module.modules():
        named = list(vars(submodule).items())
        consider(value for _, value in named)
        for _, held in held_objects(named):
            consider(held_attributes(held).values())
        for cls in type(submodule).__mro__:
            if cls in (nn.Module, object):
                break
            for function in vars(cls).values():
                if not isinstance(function, types.FunctionType):
                    continue
                if id(function.__globals__) not in seen_namespaces:
                    seen_namespaces.add(id(function.__globals__))
                    consider(list(function.__globals__.values()))
                consider(_cell_contents(function))
    return list(found.values())


def _watched(module: nn.Module | None) -> list[tuple[Callable[[], Any], Callable[[Any], None]]]:
    """(read the state, write it back) of each generator the forward may draw from."""
    watched: list[tuple[Callable[[], Any], Callable[[Any], None]]] = [(random.getstate, random.setstate)]
    numpy = sys.modules.get("numpy")  # a forward that uses NumPy has imported it
    if numpy is not None:
        watched.append((numpy.random.get_state, numpy.random.set_state))
    for generator in reachable_generators(module) if module is not None else ():
        if (access := _state_access(generator)) is not None:
            watched.append(access)
    return watched


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):  # a NumPy bit generator's state
        return a.keys() == b.keys() and all(_same(a[key], b[key]) for key in a)
    equal = a == b
    return bool(equal.all()) if hasattr(equal, "all") else bool(equal)  # NumPy's key array


@contextlib.contextmanager
def python_generators_kept(module: nn.Module | None = None) -> Iterator[list[bool]]:
    """Put ``random``'s and ``numpy.random``'s states back on exit, and those of the generators
    ``module`` holds; the list it yields holds one flag, set on exit when the body drew from any."""
    # Only generators there before count: importing NumPy while tracing draws nothing.
    before = [(read, write, read()) for read, write in _watched(module)]
    drawn = [False]
    try:
        yield drawn
    finally:
        drawn[0] = any(not _same(state, read()) for read, _, state in before)
        for _, write, state in before:
            write(state)


@contextlib.contextmanager
def _generators_made_watched() -> Iterator[list[str]]:
    """The list it yields names each Python or NumPy generator a user forward makes meanwhile
    (``rng = np.random.default_rng()``, ``random.Random()``): made while traced, it draws once,
    and the graph repeats that draw at every step (wave 47's review: a LayerDrop written so dropped
    the same layers at every step); neither the global generators nor the model's show it."""
    made: list[str] = []
    init = random.Random.__init__

    def watched_init(self: random.Random, *args: Any, **kwargs: Any) -> None:
        if in_user_forward():
            made.append("random.Random()")
        init(self, *args, **kwargs)

    numpy = sys.modules.get("numpy")
    default_rng = numpy.random.default_rng if numpy is not None else None

    def watched_default_rng(*args: Any, **kwargs: Any) -> Any:
        if in_user_forward():
            made.append("numpy.random.default_rng()")
        return default_rng(*args, **kwargs)  # type: ignore[misc]

    random.Random.__init__ = watched_init  # type: ignore[method-assign]
    if numpy is not None:
        numpy.random.default_rng = watched_default_rng
    try:
        yield made
    finally:
        random.Random.__init__ = init  # type: ignore[method-assign]
        if numpy is not None:
            numpy.random.default_rng = default_rng


@contextlib.contextmanager
def refusing_python_randomness(module: nn.Module | None = None) -> Iterator[None]:
    """Raise :class:`PythonRandomnessError` if the body drew from Python's generators or from
    those ``module`` holds (all put back), or made a generator (:func:`_generators_made_watched`)."""
    with python_generators_kept(module) as drawn, _generators_made_watched() as made:
        yield
    if made:
        raise PythonRandomnessError(
            f"the forward makes a Python random generator ({made[0]}): a captured graph would "
            "repeat its draws at every step"
        )
    if drawn[0]:
        raise PythonRandomnessError(
            "the forward draws Python random numbers (random, numpy.random or a generator the "
            "model holds): a captured graph would repeat one draw at every step"
        )


@contextlib.contextmanager
def torch_generators_kept(module: nn.Module) -> Iterator[None]:
    """Put back on exit the states of the ``torch.Generator`` objects ``module`` holds
    (``self.g = torch.Generator().manual_seed(123)``, drawn from by ``randn(..., generator=self.g)``);
    the default generators are :func:`torch.random.fork_rng`'s."""
    generators = reachable_generators(module, (torch.Generator,))
    kept = [(generator, generator.get_state()) for generator in generators]
    try:
        yield
    finally:
        for generator, state in kept:
            generator.set_state(state)
