"""Python's generators around a capture: put back, and a draw while tracing refused."""

from __future__ import annotations

import random

import numpy as np
import pytest

from ortrain.ortmodule.python_randomness import (
    PythonRandomnessError,
    python_generators_kept,
    refusing_python_randomness,
)


def test_generators_are_put_back_and_a_draw_is_reported() -> None:
    random.seed(1)
    np.random.seed(1)
    with python_generators_kept() as drawn:
        random.random()
        np.random.rand()
    assert drawn == [True]
    assert (random.random(), np.random.rand()) == (random.Random(1).random(), np.random.RandomState(1).rand())
    with python_generators_kept() as drawn:
        pass
    assert drawn == [False]


def test_a_draw_while_capturing_is_refused_and_undone() -> None:
    np.random.seed(3)
    with pytest.raises(PythonRandomnessError, match=r"numpy\.random"), refusing_python_randomness():
        np.random.uniform()
    assert np.random.rand() == np.random.RandomState(3).rand()
    with refusing_python_randomness():  # nothing drawn: nothing raised
        sum(range(3))
