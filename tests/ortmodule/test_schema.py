"""flatten/unflatten round trips and the spec as a cache key."""

from __future__ import annotations

import collections
import copy
import dataclasses
import re
import threading
from collections import OrderedDict
from typing import NamedTuple

import pytest
import torch

from ortrain.ortmodule import ORTModuleIOError
from ortrain.ortmodule.schema import flatten, flatten_inputs, flatten_outputs, unflatten


class Point(NamedTuple):
    x: torch.Tensor
    label: str


@dataclasses.dataclass
class Record:
    values: list[torch.Tensor]
    scale: float = 1.0


def test_round_trip_keeps_structure_types_and_constants() -> None:
    a, b, c = torch.ones(1), torch.zeros(2), torch.arange(3)
    value = (
        [a, None, 3, 2.5, True, "s", torch.float16],
        {"p": Point(b, "lbl"), "r": Record([c], 0.5)},
        OrderedDict(z=a),
    )
    tensors, spec = flatten(value)
    assert [t is x for t, x in zip(tensors, (a, b, c, a), strict=True)] == [True] * 4
    rebuilt = unflatten(spec, tensors)
    assert rebuilt[0][1:] == [None, 3, 2.5, True, "s", torch.float16]
    assert isinstance(rebuilt[1]["p"], Point) and rebuilt[1]["p"].label == "lbl"
    assert isinstance(rebuilt[1]["r"], Record) and rebuilt[1]["r"].scale == 0.5
    assert isinstance(rebuilt[2], OrderedDict)
    assert rebuilt[1]["r"].values[0] is c


def test_spec_is_hashable_and_changes_with_constants_not_tensor_values() -> None:
    _, spec1 = flatten(((torch.ones(2),), {"n": 1}))
    _, spec2 = flatten(((torch.zeros(5),), {"n": 1}))
    _, spec3 = flatten(((torch.ones(2),), {"n": 2}))
    assert hash(spec1) == hash(spec2) and spec1 == spec2
    assert spec1 != spec3
    # 1 and True compare equal in Python; as arguments they are different programs.
    assert flatten((1,))[1] != flatten((True,))[1]


def test_unsupported_leaf_is_an_io_error_naming_the_type() -> None:
    class Opaque:
        def __init__(self) -> None:
            self.lock = threading.Lock()

    with pytest.raises(ORTModuleIOError, match=re.escape("cannot pass value [0][0].lock (a lock)")):
        flatten(([Opaque()],))


def test_an_object_of_the_users_class_round_trips_by_its_attributes() -> None:
    class Batch:
        def __init__(self, x: torch.Tensor) -> None:
            self.x = x
            self.names = ["a", "b"]

    batch = Batch(torch.ones(2))
    tensors, spec = flatten((batch,))
    assert tensors == [batch.x]
    rebuilt = unflatten(spec, tensors)[0]
    assert type(rebuilt) is Batch and rebuilt.x is batch.x and rebuilt.names == ["a", "b"]


def test_return_types_named_tuples_and_nesting_keep_their_types() -> None:
    x = torch.randn(3, 4)
    value = {"min": torch.min(x, dim=0), "pair": [torch.sort(x), Point(x, "p")], "top": (torch.topk(x, 2),)}
    tensors, spec = flatten(value)
    assert len(tensors) == 7
    rebuilt = unflatten(spec, tensors)
    assert type(rebuilt["min"]) is torch.return_types.min
    assert rebuilt["min"].indices is value["min"].indices
    assert type(rebuilt["pair"][0]) is torch.return_types.sort
    assert type(rebuilt["pair"][1]) is Point and rebuilt["pair"][1].label == "p"
    assert type(rebuilt["top"][0]) is torch.return_types.topk


@pytest.mark.parametrize(
    ("args", "kwargs", "where"),
    [
        ((torch.ones(1), {"mask": object()}), {}, "input [1].mask"),
        ((), {"batch": {"mask": object()}}, "input 'batch.mask'"),
        ((), {"batch": [torch.ones(1), Point(object(), "x")]}, "input 'batch[1].x'"),
        ((), {"batch": {3: object()}}, "input 'batch[3]'"),
    ],
)
def test_unsupported_input_error_names_its_place(args: tuple, kwargs: dict, where: str) -> None:
    with pytest.raises(ORTModuleIOError, match=re.escape(f"cannot pass {where} (a object)")):
        flatten_inputs(args, kwargs)


@pytest.mark.parametrize(
    ("value", "where"),
    [
        ((torch.ones(1), object()), "output [1]"),
        ({"logits": torch.ones(1), "extra": [object()]}, "output 'extra[0]'"),
        (object(), "the output"),
    ],
)
def test_unsupported_output_error_names_its_place(value: object, where: str) -> None:
    with pytest.raises(ORTModuleIOError, match=re.escape(f"cannot pass {where} (a object)")):
        flatten_outputs(value)


@pytest.mark.parametrize(
    ("tensor", "kind"),
    [
        (torch.nested.nested_tensor([torch.ones(2, 3), torch.ones(4, 3)]), "a nested tensor (torch.nested)"),
        (torch.eye(3).to_sparse_csr(), "a sparse_csr tensor"),
    ],
    ids=["nested", "csr"],
)
def test_an_input_no_capture_can_trace_is_named_with_what_to_pass(tensor: torch.Tensor, kind: str) -> None:
    """The fallback's cause was PyTorch's internal error ("NestedTensorImpl doesn't support sizes.
    Please file an issue")."""
    expected = re.escape(f"cannot capture input 'batch', {kind}: pass padded")
    with pytest.raises(ORTModuleIOError, match=expected):
        flatten_inputs((), {"batch": tensor})


class _Image(torch.Tensor):
    """A subclass that only names what it holds (``class Image(torch.Tensor): pass``)."""


class _Logged(torch.Tensor):
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        return super().__torch_function__(func, types, args, kwargs or {})


def test_a_tensor_subclass_that_overrides_nothing_trains_as_a_plain_tensor() -> None:
    """Until wave 33 it failed inside the graph's run ("Multiple dispatch failed for
    aten.detach.default") and sent the model to PyTorch."""
    from ortrain import ORTModule

    torch.manual_seed(0)
    eager = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh())
    wrapped = ORTModule(copy.deepcopy(eager))
    for _ in range(3):
        base = torch.randn(3, 4)
        grads = []
        for model in (eager, wrapped):
            model.zero_grad()
            x = base.clone().as_subclass(_Image).requires_grad_()
            model(x).pow(2).mean().backward()
            grads.append([x.grad, *(p.grad for p in model.parameters())])
        for got, expected in zip(grads[1], grads[0], strict=True):
            torch.testing.assert_close(got, expected)
    flat, _ = flatten_inputs((base.as_subclass(_Image),), {})
    assert type(flat[0]) is torch.Tensor
    assert type(flatten_inputs((torch.nn.Parameter(base),), {})[0][0]) is torch.nn.Parameter


def test_an_input_of_a_plain_subclass_gives_outputs_of_its_class_as_in_eager() -> None:
    from ortrain import ORTModule

    torch.manual_seed(0)
    eager = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh())
    wrapped = ORTModule(copy.deepcopy(eager))
    for x in (torch.randn(3, 4).as_subclass(_Image), torch.randn(3, 4)):
        expected, got = eager(x), wrapped(x)
        assert type(got) is type(expected)
        torch.testing.assert_close(got.as_subclass(torch.Tensor), expected.as_subclass(torch.Tensor))
    # nn.Parameter turns __torch_function__ off: results of operators on one are plain tensors.
    assert type(wrapped(torch.nn.Parameter(torch.randn(3, 4)))) is torch.Tensor


class _Tags(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        tagged = self.linear(x).as_subclass(_Image)
        return {
            "tagged": tagged,
            "derived": tagged.softmax(-1),
            "plain": tagged.as_subclass(torch.Tensor) * 2,
        }


def test_outputs_made_with_as_subclass_keep_their_class_and_gradients(monkeypatch) -> None:
    """Wave 33 found the capture failing on them ("Attempting to use FunctionalTensor on its own"):
    the model trained in PyTorch for good."""
    from ortrain import ORTModule

    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")
    torch.manual_seed(0)
    eager = _Tags()
    wrapped = ORTModule(copy.deepcopy(eager))
    for step in range(2):
        x = torch.randn(5, 4, generator=torch.Generator().manual_seed(step))
        outputs = []
        for model in (eager, wrapped):
            model.zero_grad()
            out = model(x)
            (out["tagged"].sum() + out["derived"].pow(2).sum() + out["plain"].mean()).backward()
            outputs.append(out)
        expected, got = outputs
        assert {k: type(v) for k, v in got.items()} == {
            "tagged": _Image,
            "derived": _Image,
            "plain": torch.Tensor,
        }
        for key in expected:
            torch.testing.assert_close(
                got[key].as_subclass(torch.Tensor), expected[key].as_subclass(torch.Tensor)
            )
        for p, q in zip(eager.parameters(), wrapped.parameters(), strict=True):
            torch.testing.assert_close(q.grad, p.grad)


def test_a_subclass_with_its_own_operators_made_in_the_forward_is_named_in_the_refusal(monkeypatch) -> None:
    from ortrain import ORTModule
    from ortrain.errors import ORTModuleTorchModelException

    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")

    class Makes(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return (x * 2).as_subclass(_Logged)

    with pytest.raises(ORTModuleTorchModelException, match="makes a _Logged with as_subclass"):
        ORTModule(Makes())(torch.randn(2, 2, requires_grad=True))


def test_a_tensor_subclass_with_its_own_operators_is_refused_with_what_to_pass() -> None:
    x = torch.randn(3, 4).as_subclass(_Logged)
    message = "input 'x', a _Logged: a torch.Tensor subclass with its own __torch_function__"
    with pytest.raises(ORTModuleIOError, match=re.escape(message)) as raised:
        flatten_inputs((), {"x": x})
    assert "pass tensor.as_subclass(torch.Tensor)" in str(raised.value)
    assert flatten_outputs((x,))[0][0] is x  # a graph's outputs are not inputs: left as they are


@dataclasses.dataclass
class _NormalizedBatch:
    pixels: torch.Tensor
    weight: float = dataclasses.field(init=False, default=1.0)

    def __post_init__(self) -> None:
        self.pixels = self.pixels / 255.0  # must run once, when the user builds the batch


def test_a_dataclass_comes_back_as_it_was_without_its_init_again() -> None:
    """Rebuilt with ``cls(**fields)`` until wave 45: ``__post_init__`` normalized the pixels again,
    a field with ``init=False`` set after building came back as its default, an extra attribute
    was lost."""
    batch = _NormalizedBatch(torch.full((2,), 255.0))
    batch.weight = 10.0
    batch.note = "kept"  # type: ignore[attr-defined]
    tensors, spec = flatten(batch)
    rebuilt = unflatten(spec, tensors)
    assert type(rebuilt) is _NormalizedBatch
    torch.testing.assert_close(rebuilt.pixels, torch.ones(2))
    assert rebuilt.weight == 10.0 and rebuilt.note == "kept"


def test_a_defaultdict_keeps_its_factory_and_one_spec() -> None:
    """``cls(pairs)`` took the pairs for the factory: every call failed (wave 45's review)."""
    value = collections.defaultdict(list, {"a": torch.ones(1)})
    tensors, spec = flatten(value)
    rebuilt = unflatten(spec, tensors)
    assert isinstance(rebuilt, collections.defaultdict) and rebuilt["missing"] == []
    assert flatten(collections.defaultdict(list, {"a": torch.zeros(1)}))[1] == spec


def test_numbers_are_held_exactly_and_handed_back_plain() -> None:
    """``-0.0`` after ``0.0`` reused the graph of ``0.0``; a NaN compared unequal to itself and
    captured at every call (wave 45's review)."""
    assert flatten(0.0)[1] != flatten(-0.0)[1]
    assert flatten(float("nan"))[1] == flatten(float("nan"))[1]
    assert flatten(1)[1] != flatten(True)[1]
    for value in (-0.0, True, 2.5):
        rebuilt = unflatten(flatten(value)[1], [])
        assert type(rebuilt) is type(value) and repr(rebuilt) == repr(value)


def test_inputs_in_a_cycle_are_refused_with_advice() -> None:
    """A RecursionError at every call until wave 45 (a tree whose nodes link to their parents)."""
    node: dict[str, object] = {"value": torch.ones(1)}
    node["parent"] = {"child": node}
    with pytest.raises(ORTModuleIOError, match="refer back to themselves"):
        flatten_inputs((node,), {})


def test_numpy_floats_and_dict_keys_are_held_exactly() -> None:
    """``np.float64(-0.0)`` after ``0.0`` and ``{True: t}`` after ``{1: t}`` reused the first
    graph; a NumPy NaN captured at every call (wave 45's second look)."""
    import numpy as np

    assert flatten(np.float64(0.0))[1] != flatten(np.float64(-0.0))[1]
    assert flatten(np.float32(float("nan")))[1] == flatten(np.float32(float("nan")))[1]
    rebuilt = unflatten(flatten(np.float32(-0.0))[1], [])
    assert type(rebuilt) is np.float32 and np.signbit(rebuilt)
    t = torch.ones(1)
    assert flatten({1: t})[1] != flatten({True: t})[1]
    assert flatten({0.0: t})[1] != flatten({-0.0: t})[1]
    tensors, spec = flatten({True: t, -0.0: t})
    assert [type(k) for k in unflatten(spec, tensors)] == [bool, float]


@dataclasses.dataclass(slots=True)
class _SlottedBatch:
    x: torch.Tensor
    weight: float = dataclasses.field(init=False)  # set by some collators only


def test_a_slotted_dataclass_with_an_unset_field_passes() -> None:
    tensors, spec = flatten(_SlottedBatch(torch.ones(2)))
    rebuilt = unflatten(spec, tensors)
    assert type(rebuilt) is _SlottedBatch and not hasattr(rebuilt, "weight")


def test_every_model_output_keeps_its_dict_and_fields() -> None:
    """``CausalLMOutputWithCrossAttentions`` (no "Output" at the end of its name) went through the
    dataclass path, which builds without ``__init__``: a ModelOutput must not be built so."""
    outputs = pytest.importorskip("transformers.modeling_outputs")
    value = outputs.CausalLMOutputWithCrossAttentions(loss=torch.ones(()), logits=torch.zeros(2))
    tensors, spec = flatten(value)
    rebuilt = unflatten(spec, tensors)
    assert type(rebuilt) is type(value) and list(rebuilt.keys()) == ["loss", "logits"]
    assert rebuilt["loss"] is rebuilt.loss and rebuilt.to_tuple()[1] is rebuilt.logits
