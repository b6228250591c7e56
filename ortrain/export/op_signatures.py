"""Each ONNX operator's signature made once, not at every node that calls it.

torch.onnx's translator builds the ``OpSignature`` of an ONNX operator from its ``OpSchema``
(``onnx_ir``'s ``OpSignature.from_op_schema``) every time a translation emits a node: 2 600 times
for the tiny GPT's two graphs, 68 distinct operators, 0.1-0.2 s (2-core AMD EPYC). The
translator only reads the signature. ONNX registers one schema per domain, operator name and
version, so while ortrain exports, signatures are kept by that triple and shared (exports are
serialized by ortrain's compile lock).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from onnx_ir import schemas

_SIGNATURES: dict[tuple[str, str, int], Any] = {}


@contextlib.contextmanager
def op_signatures_shared() -> Iterator[None]:
    """While exporting: ``OpSignature.from_op_schema`` answers each schema once."""
    original = schemas.OpSignature.__dict__["from_op_schema"]
    build = original.__func__

    def from_op_schema(cls: type, op_schema: Any) -> Any:
        key = (op_schema.domain, op_schema.name, op_schema.since_version)
        signature = _SIGNATURES.get(key)
        if signature is None or cls is not schemas.OpSignature:
            signature = build(cls, op_schema)
            if cls is schemas.OpSignature:
                _SIGNATURES[key] = signature
        return signature

    schemas.OpSignature.from_op_schema = classmethod(from_op_schema)  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        schemas.OpSignature.from_op_schema = original  # type: ignore[method-assign]
