"""``torch.distributions``' argument checks off while ortrain traces, and back as the user had them.

TorchDynamo turns them off for the whole process the first time ``torch.compile`` builds anything
(``Distribution.set_default_validate_args(False)``: the checks are data-dependent Python, which a
graph cannot hold), and ortrain's graph-break path builds with ``torch.compile``: after the first
step of such a model a user's *eager* ``Normal(mu, -1.0)`` gave NaN instead of eager's
``ValueError`` (wave 45's review). The whole-graph capture met the same checks and failed on them
("Eq(u0, 1)"), sending a model to the graph-break path. The checks are off while ortrain traces
(the captured graph holds none, as ``torch.compile``'s do not) and restored afterwards.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch.distributions import Distribution


@contextlib.contextmanager
def distribution_checks_off() -> Iterator[None]:
    before = Distribution._validate_args
    Distribution.set_default_validate_args(False)
    try:
        yield
    finally:
        Distribution.set_default_validate_args(before)
