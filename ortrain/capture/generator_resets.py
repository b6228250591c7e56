"""A forward that sets PyTorch's generator: ``torch.manual_seed``, ``torch.set_rng_state``,
``torch.random.fork_rng`` inside ``forward``.

A captured graph holds the forward's random operators, not the Python around them: a forward that
reseeds before its dropout (the same mask at every step), that saves the generator's state and
sets it back to draw one mask twice (reversible layers), or that draws inside ``fork_rng`` (the
numbers drawn there are drawn again after it) did each of these once, while it was traced, and the
graph then drew other masks than eager at every step: the model trained on another function than
the one written, silently. TorchDynamo runs such calls at every step, between its graphs.

So capture runs with these functions watched, and a capture during which the user's forward set
the generator is refused with :class:`GeneratorResetError`: the model then trains through
TorchDynamo's graph breaks. Only calls made while the forward itself runs count
(:func:`user_forward`): AOTAutograd sets the generator back around its traces, ortrain's own
executors do around their trial runs, and an opaque autograd Function runs as itself at every step
(:func:`opaque_code`). Every call still does what it does. (A
forward that calls ``torch.default_generator.manual_seed`` directly is not seen: a C method cannot
be watched, and comparing the generator's state would not see a state set back either.)

A ``torch.Generator`` of the forward's own (``randn(..., generator=self.gen)``) is refused the
same way, at its first draw: its methods are C methods too, so a forward that reseeds it
(``self.gen.manual_seed(11)``: the same mask at every step), sets its state back (one mask drawn
twice) or makes one (``torch.Generator().manual_seed(11)``: fixed noise) cannot be watched, and
its graph did that once and drew on (wave 47's review: losses 0.198 for eager's 0.173, silently).
TorchDynamo runs the calls on it at every step, between its graphs.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

# Each is the same function under torch and torch.random (torch re-exports them).
_SETTERS = ("manual_seed", "seed", "set_rng_state")


class GeneratorResetError(RuntimeError):
    """The forward set PyTorch's generator while it was captured."""


_forward = threading.local()  # depth: how many user forwards this thread is inside


@contextlib.contextmanager
def user_forward() -> Iterator[None]:
    """Marks the user's forward running (in this thread): the calls that count."""
    _forward.depth = getattr(_forward, "depth", 0) + 1
    try:
        yield
    finally:
        _forward.depth -= 1


def in_user_forward() -> bool:
    """Whether this thread is running a user forward (:func:`user_forward`) right now."""
    return getattr(_forward, "depth", 0) > 0


@contextlib.contextmanager
def opaque_code() -> Iterator[None]:
    """Marks code that ortrain runs as itself at every step (an opaque autograd Function, probed
    while capturing: reentrant checkpointing sets the generator back in its backward): its calls
    do not count."""
    depth = getattr(_forward, "depth", 0)
    _forward.depth = 0
    try:
        yield
    finally:
        _forward.depth = depth


def refuse_own_generators(kwargs: dict[str, Any]) -> None:
    """While capturing (a TorchFunctionMode's call): raise :class:`GeneratorResetError` if the
    user's forward draws from a generator of its own (see the module)."""
    if kwargs.get("generator") is not None and in_user_forward():
        raise GeneratorResetError(
            "the forward draws from a torch.Generator of its own (generator=...): a captured graph "
            "would not repeat what the forward does with it (manual_seed, set_state)"
        )


@contextlib.contextmanager
def refusing_generator_resets() -> Iterator[None]:
    """Raise :class:`GeneratorResetError` if a user forward (:func:`user_forward`) run by the body
    set PyTorch's default generator."""
    called: list[str] = []

    def watched(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def call(*args: Any, **kwargs: Any) -> Any:
            if in_user_forward():
                called.append(f"torch.{name}")
            return original(*args, **kwargs)

        return call

    # Both namespaces are watched and put back apart: a script may have replaced one of them
    # (`torch.seed = my_seed`), and that replacement is what its forward calls and keeps after.
    originals = {(space, name): getattr(space, name) for space in (torch.random, torch) for name in _SETTERS}
    for (space, name), original in originals.items():
        setattr(space, name, watched(name, original))
    try:
        yield
    finally:
        for (space, name), original in originals.items():
            setattr(space, name, original)
    if called:
        raise GeneratorResetError(
            f"the forward sets PyTorch's random generator ({', '.join(dict.fromkeys(called))}): a "
            "captured graph would do that once, while it was traced, and draw other numbers than "
            "the forward at every step"
        )
