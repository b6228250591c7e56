"""Op tuning: measure a graph's candidate placements while it trains and keep the fastest.

ONNX Runtime's kernels are faster than PyTorch's on some CPUs and slower on others, operator by
operator (see :mod:`ortrain.runtime.placement`). The tuner does not guess: it builds each
candidate placement of a captured graph and measures it on the real inputs of the first training
steps, so the crossings between executors, the thread pools and the machine's load are all in
the figure.

How a graph is tuned (online, no work is repeated):

1. All-torch, which exports nothing, runs the first three calls (two warm-ups, then a timing);
   the default placement (ONNX Runtime runs what it can: an export and sessions) is built on the
   fourth call, as without tuning, and warmed up and timed on the next (its first call is a
   warm-up: ONNX Runtime sizes its arena then). So the first step pays capture alone. (Under a
   fallback policy that forbids PyTorch for what ONNX Runtime cannot run, the default is built at
   capture and leads, so that such a graph fails at once.) In the automatic mode only placements
   that need no new export (all-torch) race the default; the mixed ones (matrix products or fused
   ops in PyTorch, the rest in ONNX Runtime) need ``ORTMODULE_ENABLE_TUNING=1``, as their exports
   cost seconds to a minute a graph.
2. Every further call runs the next candidate in turn (interleaved, so drift in the machine's
   load hits all alike): a candidate is built on its first turn, warms up, then gives
   ``SAMPLES`` timings (``QUICK_CALL_SAMPLES`` for a graph whose call takes under
   ``QUICK_CALL_MS``: such timings are noisy, and cheap to repeat). One that measures
   ``PRUNE_RATIO`` times slower than the best so far is dropped after one timing. A race still
   close after those timings (candidates within ``CLOSE_RATIO`` of each other) goes on, up to
   ``CLOSE_CALL_SAMPLES`` timings, for the candidates in it: three timings on a busy machine
   decided such races by noise (wave 33: an MLP's backward went to ONNX Runtime in one run of
   four, measured 6-13 % slower there in the others and 32 % slower step after step).
3. The fastest median wins if it beats the reference's by ``MIN_GAIN``; otherwise the reference
   stays. The reference is all-torch where it is in the race (no sessions, no arena, no
   crossings: the simplest and the leanest), else the default. A dynamic graph's calls come at
   other sizes: each timing is scaled to the first call's size (the product of the size symbols),
   so that a candidate that drew the long batches is not taken for a slow one. The others are
   freed, one INFO line says what was chosen and the measured gain, and
   ``ORTMODULE_TUNING_RESULTS_PATH`` records the choice.

The time spent (building candidates, and the time their calls take beyond the default's) is
bounded by ``ORTMODULE_MAX_TUNING_DURATION_MS``: at the bound, the best measured so far wins.
All placements compute the same function, so training proceeds correctly during tuning.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import sympy
import torch

from ortrain.capture.compile_lock import COMPILE_LOCK
from ortrain.capture.unused_tangents import has_size_symbols, size_symbols
from ortrain.errors import FallbackPolicy
from ortrain.runtime import tuning_results
from ortrain.runtime.full_collections import compile_garbage_collected
from ortrain.runtime.graph_executor import PlanRunner, announce_plan, build_graph_executor
from ortrain.runtime.placement import DEFAULT, Placement, candidates

logger = logging.getLogger("ortrain.runtime")

DEFAULT_MAX_TUNING_MS = 30_000
# Five, not three (wave 33): the first steps of a process are slow (pages, caches), and two slow
# timings of three decided a race.
SAMPLES = 5
# A call under this is mostly fixed per-call cost (binding ONNX Runtime's inputs and outputs
# against running FX nodes), which differs between placements as much as the kernels do: small
# graphs are raced too, with more of their cheap, noisy timings.
QUICK_CALL_MS = 2.0
QUICK_CALL_SAMPLES = 9
PRUNE_RATIO = 1.3
MIN_GAIN = 0.03
# A race this close after SAMPLES timings each is decided on more: a busy machine's noise on a
# 10 ms call is 10-30 %.
CLOSE_RATIO = 1.15
CLOSE_CALL_SAMPLES = 9
LEAD_WARM_UP_CALLS = 2

# Choices made in this process (tuning key -> placement name): a graph captured again (after an
# eviction, or back in training mode) is not tuned again.
_chosen_in_process: dict[str, str] = {}


@dataclass(frozen=True)
class TuningSettings:
    """``enabled``: True (ORTMODULE_ENABLE_TUNING=1), False (=0) or None (automatic, the default)."""

    enabled: bool | None = None
    max_duration_ms: int | None = None
    results_path: Path | None = None

    @classmethod
    def of(cls, options: Any) -> TuningSettings:
        """From :class:`ortrain.ortmodule.options.RuntimeOptions` (the ORTMODULE_*TUNING* variables)."""
        return cls(options.enable_tuning, options.max_tuning_duration_ms, options.tuning_results_path)

    @property
    def bound_s(self) -> float:
        return (self.max_duration_ms or DEFAULT_MAX_TUNING_MS) / 1000


@dataclass
class _Candidate:
    placement: Placement
    runner: PlanRunner | None = None
    warm_up_calls: int = 0  # its calls so far that were warm-ups, not timed
    samples: list[float] = field(default_factory=list)
    dropped: str | None = None  # why it left the race

    @property
    def median(self) -> float:
        return statistics.median(self.samples)


def build_tuned_graph_executor(
    graph: torch.fx.GraphModule, *, name: str, settings: TuningSettings, **build_options: Any
) -> PlanRunner | TunedRunner:
    """:func:`~ortrain.runtime.graph_executor.build_graph_executor`, tuned per ``settings``."""
    device: torch.device = build_options["device"]
    if device.type != "cpu" or (settings.enabled is False and settings.results_path is None):
        return build_graph_executor(graph, name=name, **build_options)
    # Mixed placements export one ONNX region per stretch between PyTorch nodes: seconds to a
    # minute for a transformer (README, "Op tuning"). The automatic mode races only placements
    # that export nothing new; ORTMODULE_ENABLE_TUNING=1 races them all.
    races = _races(graph, settings)
    found, key = races[0] if settings.enabled is True else races[1]  # the race this mode runs
    recorded = _recorded_choice(races, settings)
    if recorded is not None:
        placement, source = recorded
        logger.info("%s graph: placement %s (%s)", name, placement.name, source)
        return build_graph_executor(graph, name=name, placement=placement, **build_options)
    if settings.enabled is False or len(found) == 1:
        return build_graph_executor(graph, name=name, **build_options)

    def build(placement: Placement) -> PlanRunner:
        quiet = {**build_options, "saver": None}
        return build_graph_executor(graph, name=name, placement=placement, announce=False, **quiet)

    def build_default() -> PlanRunner:
        # An export in the middle of a step, like a capture's: one at a time, the user's random
        # generator untouched, and its garbage collected as a capture's (left to Python, it made
        # full collections of the whole process at the next steps: 0.8 s for the tiny GPT).
        with COMPILE_LOCK, torch.random.fork_rng(devices=[]), compile_garbage_collected():
            return build_graph_executor(graph, name=name, **build_options)

    policy = build_options.get("policy")
    # Without a fallback to PyTorch the user asked to learn at once whether ONNX Runtime can run
    # the graph: then the default is built now, as without tuning.
    lazy = policy is None or bool(policy & FallbackPolicy.FALLBACK_UNSUPPORTED_ONNX_MODEL)
    return TunedRunner(
        name,
        build_default if lazy else build_graph_executor(graph, name=name, **build_options),
        found,
        build,
        settings=settings,
        key=key,
        openmp_passive=build_options.get("openmp_passive", True),
        lazy_default=lazy,
        inputs=graph.graph.find_nodes(op="placeholder"),
    )


Race = tuple[list[Placement], str]  # the candidate placements, and the key of a choice among them


def _races(graph: torch.fx.GraphModule, settings: TuningSettings) -> list[Race]:
    """The races whose recorded choice serves this graph under ``settings``, each with its key,
    the graph described and hashed once for all. A choice among every placement
    (ORTMODULE_ENABLE_TUNING=1) serves any mode; one among the automatic mode's few serves all but
    a forced tuning, which must see the mixed placements too. The race this mode runs comes first
    when forced, second otherwise."""
    digest = tuning_results.graph_digest(graph)
    sets = [candidates(graph, mixed=True)]
    if settings.enabled is not True:
        sets.append(candidates(graph, mixed=False))
    return [(found, tuning_results.tuning_key(digest, [p.name for p in found])) for found in sets]


def _recorded_choice(races: list[Race], settings: TuningSettings) -> tuple[Placement, str] | None:
    """A choice made earlier for this graph in one of ``races``, and where it comes from."""
    for found, key in races:
        recorded, source = _chosen_in_process.get(key), "chosen earlier in this process"
        if recorded is None and settings.results_path is not None:
            recorded = tuning_results.load_choice(settings.results_path, key)
            source = f"read from {tuning_results.results_file(settings.results_path)}"
        if recorded is None:
            continue
        try:
            placement = Placement.from_name(recorded)
        except ValueError:
            logger.warning("ignoring the recorded placement %r (%s): not one ortrain knows", recorded, source)
            continue
        if placement in found:
            _chosen_in_process[key] = recorded
            return placement, source
    return None


class TunedRunner:
    """Runs a graph while tuning its placement; after that, the chosen placement's runner alone."""

    def __init__(
        self,
        name: str,
        default: PlanRunner | Callable[[], PlanRunner],
        found: list[Placement],
        build: Callable[[Placement], PlanRunner],
        *,
        settings: TuningSettings,
        key: str,
        openmp_passive: bool = True,
        clock: Callable[[], float] = time.perf_counter,
        lazy_default: bool = False,
        inputs: list[torch.fx.Node] | None = None,
    ) -> None:
        """``inputs``: the graph's placeholders. Where they have symbolic sizes, calls come at other
        sizes (a dynamic capture), and each timing is scaled to the first call's size (the product
        of the size symbols) before the candidates' medians are compared."""
        assert found[0] == DEFAULT
        self.name = name
        self._build = build
        self._settings = settings
        self._key = key
        self._openmp_passive = openmp_passive
        self._clock = clock
        self._candidates = [_Candidate(p) for p in found]
        # A default given as a builder (``lazy_default``) is built when the race first needs it;
        # all-torch, which exports nothing, leads meanwhile, so the first steps pay no export.
        self._build_default: Callable[[], PlanRunner] | None = None
        self._lead = self._candidates[0]
        all_torch = [c for c in self._candidates if c.placement.all_torch]
        if not lazy_default:
            self._candidates[0].runner = default  # type: ignore[assignment]
        elif all_torch:
            self._build_default = default  # type: ignore[assignment]
            self._lead = all_torch[0]
        else:
            self._candidates[0].runner = default()  # type: ignore[operator]
        self._turn = 0
        self._sized_inputs = inputs if inputs and has_size_symbols(inputs) else None
        self._first_size: int | None = None
        self._spent = 0.0  # seconds of tuning: builds, and candidate calls beyond the default's
        self._profile: dict[str, float] | None = None
        self.chosen: PlanRunner | None = None
        self.chosen_placement: Placement | None = None
        self.report: dict[str, float] = {}  # placement name -> median ms, once chosen

    # PlanRunner's surface, for the benchmarks and tests that look at the plan in use.
    @property
    def active(self) -> PlanRunner:
        if self.chosen is not None:
            return self.chosen
        default = self._candidates[0].runner
        return default if default is not None else self._lead.runner  # type: ignore[return-value]

    @property
    def plan(self) -> Any:
        return self.active.plan

    @property
    def runners(self) -> Any:
        return self.active.runners

    @property
    def profile(self) -> dict[str, float] | None:
        return self._profile

    @profile.setter
    def profile(self, value: dict[str, float] | None) -> None:
        self._profile = value
        for candidate in self._candidates:
            if candidate.runner is not None:
                candidate.runner.profile = value

    @property
    def tuning(self) -> bool:
        return self.chosen is None

    def summary(self) -> dict[str, Any]:
        placement = self.chosen_placement.name if self.chosen_placement is not None else None
        return {"graph": self.name, "tuning": self.tuning, "placement": placement, "measured_ms": self.report}

    def __call__(self, args: list[Any]) -> list[Any]:
        if self.chosen is not None:
            return self.chosen(args)
        candidate = self._next()
        if candidate.runner is None and candidate is self._candidates[0]:
            candidate.runner = self._default_runner()  # not tuning's cost: untuned pays it at capture
        if candidate.runner is None:
            start = self._clock()
            try:
                candidate.runner = self._build(candidate.placement)
                candidate.runner.profile = self._profile
            except Exception as error:  # a placement that cannot be built is simply not a candidate
                candidate.dropped = f"could not be built: {type(error).__name__}: {error}"
                logger.debug("%s graph: %s %s", self.name, candidate.placement.name, candidate.dropped)
                candidate = self._candidates[0]
            finally:
                self._spent += self._clock() - start
        scale = self._scale(args)  # before the call: the runner empties ``args``
        all_torch = next(
            (c for c in self._candidates if c.placement.all_torch and c.runner is not None), None
        )
        kept = list(args) if all_torch is not None and candidate is not all_torch else None
        start = self._clock()
        try:
            outputs = candidate.runner(args)  # type: ignore[misc]
        except Exception as error:
            if kept is None or all_torch is None:
                raise
            return self._settle_on(all_torch, kept, candidate, error)
        elapsed = self._clock() - start
        self._record(candidate, elapsed, scale)
        if self._finished():
            self._choose()
        return outputs

    def _settle_on(
        self, all_torch: _Candidate, args: list[Any], failed: _Candidate, error: Exception
    ) -> list[Any]:
        """A candidate that fails at run time ends the race: PyTorch runs the graph from now on.
        (Wave 43: the default placement, built lazily mid-training, failed in ONNX Runtime at a
        ResNet's sixth step with a size of its capture baked into a Reshape, and training
        stopped; built at capture, it ran. Not understood yet: the race stops rather than risk it.)
        Where PyTorch fails on the same input, the input is at fault (the user's own check in the
        forward, ``assert (x.abs() < 100).all()``, on a batch the loop then skips): PyTorch's error
        is raised and the race goes on (wave 50's review: one bad batch ended it for good)."""
        outputs = all_torch.runner(args)  # type: ignore[misc]
        logger.warning(
            "%s graph: placement %s failed at this call (%s: %s); PyTorch runs this graph from now on",
            self.name,
            failed.placement.name,
            type(error).__name__,
            str(error).splitlines()[0][:300],
        )
        failed.dropped = f"failed to run: {type(error).__name__}"
        self.chosen, self.chosen_placement = all_torch.runner, all_torch.placement
        for candidate in self._candidates:
            if candidate is not all_torch:
                candidate.runner = None  # frees its sessions
        return outputs

    def _default_runner(self) -> PlanRunner:
        assert self._build_default is not None
        runner = self._build_default()
        runner.profile = self._profile
        self._build_default = None
        return runner

    def _next(self) -> _Candidate:
        lead, default = self._lead, self._candidates[0]
        if not lead.samples:
            return lead  # the lead's warm-ups and first timing come first
        if not default.samples:
            return default  # then the default's
        live = [c for c in self._candidates if c.dropped is None and len(c.samples) < self._wanted(c)]
        if not live:
            return default
        self._turn = (self._turn + 1) % len(live)
        return live[self._turn]

    def _scale(self, args: list[Any]) -> float:
        """This call's size against the first call's (1 for a graph of fixed sizes)."""
        if self._sized_inputs is None:
            return 1.0
        symbols = size_symbols(self._sized_inputs, args)
        size = math.prod(value for symbol, value in symbols.items() if isinstance(symbol, sympy.Symbol))
        if self._first_size is None:
            self._first_size = max(size, 1)
        return max(size, 1) / self._first_size

    def _record(self, candidate: _Candidate, elapsed: float, scale: float = 1.0) -> None:
        default = self._candidates[0]
        if candidate is not default and default.samples:
            self._spent += max(0.0, elapsed - default.median * scale)
        # The lead's first two calls are warm-ups: its first is the capture's step, and its second
        # still faults in the pages of memory the first kept (wave 33: an all-torch lead's first
        # timing on its second call was 1.6-2x its later ones, on every run of the MLP).
        if candidate.warm_up_calls < (LEAD_WARM_UP_CALLS if candidate is self._lead else 1):
            candidate.warm_up_calls += 1
            return
        elapsed /= scale  # what the call would have taken at the first call's size
        candidate.samples.append(elapsed)
        best = min(c.median for c in self._candidates if c.samples)
        if candidate is not default and len(candidate.samples) == 1 and elapsed > PRUNE_RATIO * best:
            candidate.dropped = f"measured {elapsed * 1e3:.1f} ms against {best * 1e3:.1f} ms"

    def _finished(self) -> bool:
        default = self._candidates[0]
        if not self._lead.samples:
            return False
        if not default.samples:
            return False
        if self._spent >= self._settings.bound_s:
            return True
        return all(c.dropped is not None or len(c.samples) >= self._wanted(c) for c in self._candidates)

    @property
    def _samples(self) -> int:
        """Timings each candidate gives: more for a quick graph (read off the lead's first)."""
        quick = bool(self._lead.samples) and self._lead.samples[0] * 1e3 < QUICK_CALL_MS
        return QUICK_CALL_SAMPLES if quick else SAMPLES

    def _wanted(self, candidate: _Candidate) -> int:
        """Timings ``candidate`` gives: ``_samples``, or ``CLOSE_CALL_SAMPLES`` once it has given
        those while within ``CLOSE_RATIO`` of the best median (the race is close)."""
        samples = self._samples
        if len(candidate.samples) < samples or samples >= CLOSE_CALL_SAMPLES:
            return samples
        rivals = [c for c in self._candidates if c.dropped is None and c.samples and c is not candidate]
        if not rivals:
            return samples
        best = min(c.median for c in rivals)
        # Close to the best of the others, whichever is ahead: both sides of a close race go on.
        close = candidate.median <= CLOSE_RATIO * best and best <= CLOSE_RATIO * candidate.median
        return CLOSE_CALL_SAMPLES if close else samples

    def _choose(self) -> None:
        default = self._candidates[0]
        measured = [c for c in self._candidates if c.samples and c.dropped is None]
        best = min(measured, key=lambda c: c.median)
        # All-torch holds no sessions, no arena and crosses no executors: what beats it within
        # noise is not worth the memory (wave 33; until then the default was the reference).
        reference = next((c for c in measured if c.placement.all_torch), default)
        if best is not reference and best.median > (1 - MIN_GAIN) * reference.median:
            best = reference
        self.report = {c.placement.name: c.median * 1e3 for c in self._candidates if c.samples}
        self.chosen, self.chosen_placement = best.runner, best.placement
        for candidate in self._candidates:
            if candidate is not best:
                candidate.runner = None  # frees its sessions
        tried = ", ".join(
            f"{name} {ms:.1f} ms" for name, ms in self.report.items() if name != best.placement.name
        )
        gain = 1 - best.median / default.median
        logger.info(
            "%s graph: tuned placement %s, %.1f ms a call (%s%.0f%% against onnxruntime); "
            "%.1f s of tuning; others: %s",
            self.name,
            best.placement.name,
            best.median * 1e3,
            "-" if gain >= 0 else "+",
            abs(gain) * 100,
            self._spent,
            tried or "none measured",
        )
        if best is not default:
            announce_plan(best.runner.plan, self.name, openmp_passive=self._openmp_passive)  # type: ignore[union-attr]
        _chosen_in_process[self._key] = best.placement.name
        if self._settings.results_path is not None:
            try:
                tuning_results.save_choice(
                    self._settings.results_path,
                    self._key,
                    best.placement.name,
                    graph=self.name,
                    measured_ms=self.report,
                )
            except OSError as error:  # the choice stands for this run; a later one tunes again
                tuning_results.warn_once(
                    self._settings.results_path, "could not record the tuning choice in %s: %s", error
                )
