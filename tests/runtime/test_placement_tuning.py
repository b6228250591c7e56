"""Op tuning's parts alone: placements, the online race between them (on a fake clock), the time
bound, the results file. With ORTModule: tests/ortmodule/test_op_tuning.py."""

from __future__ import annotations

import logging
import statistics
from typing import Any

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from ortrain.runtime import placement_tuning
from ortrain.runtime.executors.ort import OnnxRuntimeExecutor
from ortrain.runtime.executors.torch import TorchExecutor
from ortrain.runtime.graph_executor import build_graph_executor
from ortrain.runtime.placement import DEFAULT, Placement, candidates
from ortrain.runtime.placement_tuning import TunedRunner, TuningSettings


@pytest.fixture(autouse=True)
def _fresh_choices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(placement_tuning, "_chosen_in_process", {})


# ---- placements ---------------------------------------------------------------------------------


def test_placement_names_round_trip() -> None:
    for placement in (DEFAULT, Placement(all_torch=True), Placement(frozenset({"matmul", "fused"}))):
        assert Placement.from_name(placement.name) == placement
    with pytest.raises(ValueError, match="unknown placement 'convolution-in-torch'"):
        Placement.from_name("convolution-in-torch")


def test_candidates_follow_the_graph() -> None:
    def graph_of(fn: Any, *args: torch.Tensor) -> torch.fx.GraphModule:
        from torch.fx.experimental.proxy_tensor import make_fx

        return make_fx(fn)(*args)

    relu_only = graph_of(lambda x: torch.relu(x) * 2, torch.randn(3))
    assert [p.name for p in candidates(relu_only)] == ["onnxruntime", "all-torch"]
    both = graph_of(lambda x, w: torch.nn.functional.gelu(x @ w), torch.randn(3, 4), torch.randn(4, 5))
    assert [p.name for p in candidates(both)] == [
        "onnxruntime",
        "all-torch",
        "matmul-in-torch",
        "fused-in-torch",
        "fused+matmul-in-torch",
    ]


def test_a_declined_group_runs_in_torch_without_a_refusal_warning(caplog: pytest.LogCaptureFixture) -> None:
    from torch.fx.experimental.proxy_tensor import make_fx

    graph = make_fx(lambda x, w: (torch.relu(x @ w) + 1,))(torch.randn(3, 4), torch.randn(4, 5))
    with caplog.at_level(logging.WARNING, logger="ortrain"):
        runner = build_graph_executor(
            graph,
            name="forward",
            opset_version=18,
            passes=[],
            saver=None,
            device=torch.device("cpu"),
            placement=Placement(frozenset({"matmul"})),
        )
    owners = {
        str(n.target): type(step.executor)
        for step in runner.plan.steps
        for n in step.nodes
        if n.op == "call_function"
    }
    assert owners["aten.mm.default"] is TorchExecutor
    assert owners["aten.relu.default"] is OnnxRuntimeExecutor
    assert not [r for r in caplog.records if "cannot run" in r.getMessage()]
    x, w = torch.randn(3, 4), torch.randn(4, 5)
    torch.testing.assert_close(runner([x, w])[0], torch.relu(x @ w) + 1)


# ---- the race (a fake clock: each runner "takes" its own time) --------------------------------


@pytest.fixture(autouse=True)
def _fake_plans_are_not_announced(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(placement_tuning, "announce_plan", lambda *args, **kwargs: None)


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _FakeRunner:
    def __init__(self, clock: _Clock, seconds: float) -> None:
        self.clock, self.seconds, self.calls, self.profile = clock, seconds, 0, None
        self.plan = f"plan taking {seconds}"

    def __call__(self, args: list[Any]) -> list[Any]:
        self.calls += 1
        self.clock.now += self.seconds
        return [a * 2 for a in args]


def _race(
    seconds: dict[str, float], *, settings: TuningSettings, build_seconds: float = 0.0, calls: int = 40
) -> tuple[TunedRunner, _Clock, dict[str, _FakeRunner]]:
    clock = _Clock()
    built: dict[str, _FakeRunner] = {}
    found = [Placement.from_name(n) for n in seconds]

    def build(placement: Placement) -> Any:
        clock.now += build_seconds
        built[placement.name] = _FakeRunner(clock, seconds[placement.name])
        return built[placement.name]

    default = _FakeRunner(clock, seconds["onnxruntime"])
    built["onnxruntime"] = default
    runner = TunedRunner(
        "backward",
        default,
        found,
        build,
        settings=settings,
        key="k",
        clock=clock,  # type: ignore[arg-type]
    )
    for _ in range(calls):
        assert runner([1.0]) == [2.0]  # every call, tuning or not, computes the graph
    return runner, clock, built


def test_the_fastest_placement_wins_and_the_others_are_freed() -> None:
    times = {"onnxruntime": 0.100, "all-torch": 0.090, "matmul-in-torch": 0.070, "fused-in-torch": 0.300}
    runner, _, built = _race(times, settings=TuningSettings(enabled=True))
    assert runner.chosen_placement == Placement(frozenset({"matmul"}))
    assert runner.plan == "plan taking 0.07"
    # fused-in-torch measured 3x the best once and was dropped; the others gave 3 timings each
    assert built["fused-in-torch"].calls == 2
    assert set(runner.report) == set(times)
    calls_after = built["matmul-in-torch"].calls
    runner([1.0])
    assert built["matmul-in-torch"].calls == calls_after + 1
    assert all(c.runner is None for c in runner._candidates if c.placement.name != "matmul-in-torch")


def test_a_gain_within_noise_keeps_all_torch_or_else_the_default() -> None:
    """All-torch holds no sessions and crosses no executors: ONNX Runtime (or a mixed placement)
    must beat it by MIN_GAIN; without all-torch in the race, the default is the one to beat."""
    for times in ({"onnxruntime": 0.100, "all-torch": 0.099}, {"onnxruntime": 0.098, "all-torch": 0.100}):
        runner, _, _ = _race(times, settings=TuningSettings(enabled=True))
        assert runner.chosen_placement == Placement(all_torch=True), times
    runner, _, _ = _race({"onnxruntime": 0.090, "all-torch": 0.100}, settings=TuningSettings(enabled=True))
    assert runner.chosen_placement == DEFAULT
    no_torch = {"onnxruntime": 0.100, "matmul-in-torch": 0.099}
    runner, _, _ = _race(no_torch, settings=TuningSettings(enabled=True))
    assert runner.chosen_placement == DEFAULT


class _NoisyRunner(_FakeRunner):
    """Takes ``seconds``, but ``slow_seconds`` for the calls in ``slow`` (counted from 1)."""

    def __init__(self, clock: _Clock, seconds: float, slow: set[int], slow_seconds: float) -> None:
        super().__init__(clock, seconds)
        self.slow, self.slow_seconds = slow, slow_seconds

    def __call__(self, args: list[Any]) -> list[Any]:
        self.calls += 1
        self.clock.now += self.slow_seconds if self.calls in self.slow else self.seconds
        return [a * 2 for a in args]


@pytest.mark.parametrize("enabled", [None, True], ids=["automatic", "forced"])
def test_a_close_race_is_decided_on_more_timings(enabled: bool | None) -> None:
    """Timings 2-4 of all-torch's first five caught a busy machine: ONNX Runtime then led by 4 %
    and would have won on five timings each (two of three decided wave 32's MLP backward for ONNX
    Runtime, 32 % slower step after step). Within 15 % of each other, both go on to nine timings,
    and the faster placement wins."""
    clock = _Clock()
    default = _FakeRunner(clock, 0.100)
    # all-torch: a warm-up call, then timings at 0.090 s but for calls 3-5 at 0.104 s
    all_torch = _NoisyRunner(clock, 0.090, slow={3, 4, 5}, slow_seconds=0.104)
    runner = TunedRunner(
        "backward", default, [DEFAULT, Placement(all_torch=True)], lambda placement: all_torch,
        settings=TuningSettings(enabled=enabled), key="k", clock=clock,  # type: ignore[arg-type]
    )  # fmt: skip
    for _ in range(40):
        assert runner([1.0]) == [2.0]
    assert runner.chosen_placement == Placement(all_torch=True)
    assert [len(c.samples) for c in runner._candidates] == [placement_tuning.CLOSE_CALL_SAMPLES] * 2
    # A clear race stops at three timings each.
    clear, _, _ = _race({"onnxruntime": 0.100, "all-torch": 0.050}, settings=TuningSettings(enabled=enabled))
    assert [len(c.samples) for c in clear._candidates] == [placement_tuning.SAMPLES] * 2


@pytest.mark.parametrize("enabled", [None, True], ids=["automatic", "forced"])
def test_quick_graphs_are_raced_too_with_more_timings(enabled: bool | None) -> None:
    """Under 2 ms a call, what differs between placements is mostly their per-call cost, and a
    timing is noisy: the race runs with nine timings a candidate instead of three."""
    times = {"onnxruntime": 0.0010, "all-torch": 0.0004}
    runner, _, built = _race(times, settings=TuningSettings(enabled=enabled))
    assert runner.chosen_placement == Placement(all_torch=True)
    assert all(len(c.samples) == placement_tuning.QUICK_CALL_SAMPLES for c in runner._candidates)
    # two warm-ups (the default leads this race: its first call is the capture's step), 9 timings
    assert built["onnxruntime"].calls == 2 + 9
    slow, _, _ = _race({"onnxruntime": 0.020, "all-torch": 0.010}, settings=TuningSettings(enabled=enabled))
    assert all(len(c.samples) == placement_tuning.SAMPLES for c in slow._candidates)


def test_tuning_stops_at_its_time_bound() -> None:
    times = {"onnxruntime": 0.100, "all-torch": 0.090, "matmul-in-torch": 0.050, "fused-in-torch": 0.040}
    # Each build costs 2 s against a bound of 3 s: the third candidate is never built.
    runner, _, built = _race(
        times, settings=TuningSettings(enabled=True, max_duration_ms=3000), build_seconds=2.0
    )
    assert runner.chosen is not None
    assert "fused-in-torch" not in built
    assert runner._spent < 3.0 + 2.0 + 0.1  # at most one build past the bound


def test_a_candidate_that_cannot_be_built_drops_out() -> None:
    clock = _Clock()
    default = _FakeRunner(clock, 0.1)

    def build(placement: Placement) -> Any:
        raise RuntimeError("no")

    runner = TunedRunner(
        "forward", default, [DEFAULT, Placement(all_torch=True)], build,  # type: ignore[arg-type]
        settings=TuningSettings(enabled=True), key="k", clock=clock,
    )  # fmt: skip
    for _ in range(10):
        assert runner([3.0]) == [6.0]
    assert runner.chosen_placement == DEFAULT
    assert "could not be built: RuntimeError: no" in (runner._candidates[1].dropped or "")


def _lazy_race(seconds: dict[str, float], calls: int) -> tuple[TunedRunner, list[str]]:
    """A race whose default is built when first needed; returns the placements in call order."""
    clock = _Clock()
    built: dict[str, _FakeRunner] = {}
    order: list[str] = []

    def build(placement: Placement) -> Any:
        built[placement.name] = _FakeRunner(clock, seconds[placement.name])
        return built[placement.name]

    runner = TunedRunner(
        "forward", lambda: build(DEFAULT), [DEFAULT, Placement(all_torch=True)], build,
        settings=TuningSettings(enabled=None), key="k", clock=clock, lazy_default=True,  # type: ignore[arg-type]
    )  # fmt: skip
    for _ in range(calls):
        before = {name: r.calls for name, r in built.items()}
        assert runner([1.0]) == [2.0]
        order.extend(name for name, r in built.items() if r.calls != before.get(name, 0))
    return runner, order


def test_a_lazy_default_is_built_on_its_turn_after_all_torch_leads() -> None:
    """The first steps run all-torch, which exports nothing; the default (ONNX Runtime: an export
    and sessions) is built on the fourth call (after all-torch's two warm-ups and first timing),
    and the race then goes on as with an eager default."""
    runner, order = _lazy_race({"onnxruntime": 0.100, "all-torch": 0.050}, calls=20)
    assert order[:5] == ["all-torch"] * 3 + ["onnxruntime"] * 2
    assert runner.chosen_placement == Placement(all_torch=True)
    assert set(runner.report) == {"onnxruntime", "all-torch"}
    slow_torch, _ = _lazy_race({"onnxruntime": 0.050, "all-torch": 0.100}, calls=20)
    assert slow_torch.chosen_placement == DEFAULT


class _FailingRunner(_FakeRunner):
    def __call__(self, args: list[Any]) -> list[Any]:
        args.clear()  # as a boxed runner does, before it fails
        raise RuntimeError("cannot be reshaped to the requested shape")


def test_a_placement_failing_at_run_time_hands_the_graph_to_pytorch(caplog: pytest.LogCaptureFixture) -> None:
    """Wave 43: the lazily built default failed in ONNX Runtime at a ResNet's sixth step, and the
    error ended training; the race now stops on all-torch, which has run the graph since."""
    clock = _Clock()
    built: dict[str, _FakeRunner] = {}

    def build(placement: Placement) -> Any:
        kind = _FakeRunner if placement.all_torch else _FailingRunner
        built[placement.name] = kind(clock, 0.01)
        return built[placement.name]

    runner = TunedRunner(
        "backward", lambda: build(DEFAULT), [DEFAULT, Placement(all_torch=True)], build,
        settings=TuningSettings(enabled=None), key="k", clock=clock, lazy_default=True,  # type: ignore[arg-type]
    )  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="ortrain"):
        for _ in range(10):
            assert runner([1.0]) == [2.0]
    assert runner.chosen_placement == Placement(all_torch=True)
    assert caplog.text.count("placement onnxruntime failed at this call") == 1


class _CheckingRunner(_FakeRunner):
    """Runs the user's own check on the data, as the captured graph does: a negative input fails."""

    def __call__(self, args: list[Any]) -> list[Any]:
        if args[0] < 0:
            args.clear()
            raise RuntimeError("out of range")
        return super().__call__(args)


def test_an_input_that_fails_in_pytorch_too_raises_and_leaves_the_race_on() -> None:
    """One bad batch (an assert on the data in the forward, a batch the loop skips) failed the
    ONNX Runtime candidate mid-race and ended the race for good (wave 50's review): it is the
    input's error, raised as PyTorch raises it, and the race goes on."""
    clock = _Clock()

    def build(placement: Placement) -> Any:
        return _CheckingRunner(clock, 0.01 if placement.all_torch else 0.005)

    runner = TunedRunner(
        "forward", lambda: build(DEFAULT), [DEFAULT, Placement(all_torch=True)], build,
        settings=TuningSettings(enabled=None), key="k", clock=clock, lazy_default=True,  # type: ignore[arg-type]
    )  # fmt: skip
    for call in range(30):
        if call == 4:  # on the ONNX Runtime candidate's turn
            with pytest.raises(RuntimeError, match="out of range"):
                runner([-1.0])
        assert runner([1.0]) == [2.0]
    assert runner.chosen_placement == DEFAULT


def test_a_quick_graph_with_a_lazy_default_is_raced_like_any() -> None:
    runner, order = _lazy_race({"onnxruntime": 0.001, "all-torch": 0.0005}, calls=30)
    assert order[:5] == ["all-torch"] * 3 + ["onnxruntime"] * 2
    assert runner.chosen_placement == Placement(all_torch=True)
    assert order.count("onnxruntime") == 1 + placement_tuning.QUICK_CALL_SAMPLES
    quick_onnx, _ = _lazy_race({"onnxruntime": 0.0005, "all-torch": 0.001}, calls=30)
    assert quick_onnx.chosen_placement == DEFAULT


@pytest.mark.parametrize("enabled", [None, True, False])
def test_a_graph_is_described_once_and_its_choice_found_again(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any, enabled: bool | None
) -> None:
    """The graph is described and hashed once for all the keys it is looked up under (up to three),
    and the key a forced tuning saves its choice under is one the next capture looks up."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from ortrain.runtime import tuning_results

    graph = make_fx(lambda x, w: (torch.relu(x @ w) + 1,))(torch.randn(3, 4), torch.randn(4, 5))
    described: list[object] = []
    describe = tuning_results.graph_description
    monkeypatch.setattr(tuning_results, "graph_description", lambda g: described.append(g) or describe(g))
    settings = TuningSettings(enabled, None, tmp_path / "tuning.json")
    cpu = torch.device("cpu")
    options: dict[str, Any] = {"opset_version": 18, "passes": [], "saver": None, "device": cpu}
    first = placement_tuning.build_tuned_graph_executor(graph, name="forward", settings=settings, **options)
    assert len(described) == 1
    if enabled is not True:
        return
    assert isinstance(first, TunedRunner)
    while first.tuning:
        first([torch.randn(3, 4), torch.randn(4, 5)])
    monkeypatch.setattr(placement_tuning, "_chosen_in_process", {})  # a new process: the file alone
    again = placement_tuning.build_tuned_graph_executor(graph, name="forward", settings=settings, **options)
    assert len(described) == 2
    assert not isinstance(again, TunedRunner)  # the recorded choice, built at once


class _SizedFakeRunner(_FakeRunner):
    """Takes its time per row of its input; records the row counts it saw."""

    def __init__(self, clock: _Clock, seconds: float) -> None:
        super().__init__(clock, seconds)
        self.rows: list[int] = []

    def __call__(self, args: list[Any]) -> list[Any]:
        self.rows.append(args[0].shape[0])
        self.clock.now += self.seconds * args[0].shape[0]
        self.calls += 1
        return [a * 2 for a in args]


def test_a_dynamic_graph_compares_placements_at_one_size() -> None:
    """Calls of a dynamic graph come at other sizes: each timing is scaled to the first call's size,
    so a placement that happened to get the large batches is not taken for the slower one."""
    traced = make_fx(lambda x: x * 2, tracing_mode="symbolic")(torch.randn(4, 3))
    inputs = traced.graph.find_nodes(op="placeholder")
    clock = _Clock()
    default = _SizedFakeRunner(clock, 0.010)  # ONNX Runtime: 10 ms a row
    built: dict[str, _SizedFakeRunner] = {}

    def build(placement: Placement) -> Any:
        built[placement.name] = _SizedFakeRunner(clock, 0.008)  # PyTorch: 8 ms a row
        return built[placement.name]

    found = [Placement.from_name(n) for n in ("onnxruntime", "all-torch")]
    runner = TunedRunner(
        "forward", default, found, build, settings=TuningSettings(enabled=True), key="k",
        clock=clock, inputs=inputs,  # type: ignore[arg-type]
    )  # fmt: skip
    for call in range(16):
        runner([torch.ones(10 if call % 2 == 1 else 1, 3)])
    # The default (the lead) gave two warm-ups, all-torch one, then five timings each; PyTorch's
    # fell on larger batches, so its raw median (what the race compared before the scaling) is
    # the slower one.
    raw = {
        "onnxruntime": statistics.median(default.rows[2:7]) * 0.010,
        "all-torch": statistics.median(built["all-torch"].rows[1:6]) * 0.008,
    }
    assert raw["all-torch"] > raw["onnxruntime"]
    assert runner.chosen_placement == Placement(all_torch=True)
    assert runner.report["all-torch"] == pytest.approx(0.8 * runner.report["onnxruntime"])
