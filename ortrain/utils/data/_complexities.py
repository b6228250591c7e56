"""Compute and validate the per-sample complexities a load-balancing sampler sorts by."""

from __future__ import annotations

import logging
import numbers
import time
from collections.abc import Callable, Sized
from typing import Any

import numpy as np
import torch

logger = logging.getLogger("ortrain.utils.data")


def _describe(value: object) -> str:
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{type(value).__name__} {text}"


def _is_real_number_type(kind: type) -> bool:
    # numpy registers its integer and floating scalars with numbers.Integral/Real, so this
    # accepts int, float, np.int64, np.float32, ... Booleans are refused: a complexity_fn
    # returning True/False is a predicate passed by mistake, not a cost.
    return issubclass(kind, numbers.Real) and not issubclass(kind, bool | np.bool_)


def _tensor_to_number(index: int, value: torch.Tensor) -> float | int:
    if value.numel() != 1 or value.dtype == torch.bool or value.is_complex():
        raise TypeError(
            f"complexity_fn must return a real number, but for sample {index} it returned a tensor "
            f"of shape {tuple(value.shape)} and dtype {value.dtype}"
        )
    return value.item()


def compute_complexities(dataset: Sized, complexity_fn: Callable[[Any], Any]) -> np.ndarray:
    """Return ``complexity_fn(dataset[i])`` for every sample as a read-only float64 array.

    Accepted results are Python and numpy real numbers and one-element real tensors; anything
    else (strings, booleans, ``None``, sequences, NaN or infinities) raises with the index of
    the first offending sample, so a wrong ``complexity_fn`` fails where the sampler is built
    rather than as a puzzling sort order later.
    """
    start = time.perf_counter()
    n = len(dataset)
    values: list[Any] = [complexity_fn(dataset[i]) for i in range(n)]  # type: ignore[index]

    # Checking the handful of distinct result types is far cheaper than an isinstance test
    # per sample, which matters at millions of samples.
    kinds = set(map(type, values))
    bad_kinds = [k for k in kinds if not _is_real_number_type(k) and not issubclass(k, torch.Tensor)]
    if bad_kinds:
        first = next(i for i, v in enumerate(values) if type(v) in bad_kinds)
        raise TypeError(
            f"complexity_fn must return a real number (int or float) for every sample, but for "
            f"sample {first} it returned {_describe(values[first])}"
        )
    if any(issubclass(k, torch.Tensor) for k in kinds):
        values = [_tensor_to_number(i, v) if isinstance(v, torch.Tensor) else v for i, v in enumerate(values)]

    complexities = np.asarray(values, dtype=np.float64).reshape(n)
    finite = np.isfinite(complexities)
    if not finite.all():
        first = int(np.flatnonzero(~finite)[0])
        raise ValueError(
            f"complexity_fn must return finite numbers, but for sample {first} it returned "
            f"{_describe(values[first])}"
        )
    complexities.flags.writeable = False
    logger.debug("computed %d sample complexities in %.3f s", n, time.perf_counter() - start)
    return complexities
