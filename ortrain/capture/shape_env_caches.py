"""After a capture, PyTorch's memo caches of symbolic-shape reasoning forget the shape environments.

Fifteen methods of ``ShapeEnv`` (``simplify``, ``replace``, ``_maybe_evaluate_static``, ...) are
memoized by class-level caches whose keys hold ``self``: every shape environment a capture made
stayed alive for the rest of the process, with its symbols, guards and sympy expressions, after
the graphs that used it were freed (wave 46's review: 0.35 MiB and about 2,800 objects per
capture, without bound, in a loop that evaluates a ``copy.deepcopy`` of the model every few
steps, each copy capturing graphs of its own). The caches are memoization only: a later capture,
or a size check of a live graph, computes again what it asks for.
"""

from __future__ import annotations

from torch.fx.experimental import symbolic_shapes


def release_shape_env_caches() -> None:
    """Clear the memo caches of ``ShapeEnv``'s methods."""
    for value in vars(symbolic_shapes.ShapeEnv).values():
        clear = getattr(value, "cache_clear", None)
        if callable(clear):
            clear()
