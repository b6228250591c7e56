"""Debug options, log levels, and the one place that reads ``ORTMODULE_*`` environment variables.

Every other module asks :func:`runtime_options` instead of reading ``os.environ`` itself, so the
whole configuration surface is visible here and can be documented from one file.
"""

from __future__ import annotations

import copy
import difflib
import enum
import json
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from ortrain.capture.memory_optimizer import ALL, COMPROMISE, OFF, RECOMPUTE, RecomputeRequest
from ortrain.ortmodule.fallback import FallbackPolicy, parse_fallback_policy

DEFAULT_OPSET = 18


class LogLevel(enum.IntEnum):
    """Upstream's log levels, ordered from the most to the least verbose."""

    VERBOSE = 0
    DEVINFO = 1
    INFO = 2
    WARNING = 3
    ERROR = 4
    FATAL = 5


_PY_LEVELS = {
    LogLevel.VERBOSE: logging.DEBUG,
    LogLevel.DEVINFO: logging.DEBUG,
    LogLevel.INFO: logging.INFO,
    LogLevel.WARNING: logging.WARNING,
    LogLevel.ERROR: logging.ERROR,
    LogLevel.FATAL: logging.CRITICAL,
}


def python_log_level(level: LogLevel) -> int:
    return _PY_LEVELS[level]


def parse_log_level(name: str) -> LogLevel:
    try:
        return LogLevel[name.strip().upper()]
    except KeyError:
        valid = ", ".join(level.name for level in LogLevel)
        raise ValueError(f"ORTMODULE_LOG_LEVEL={name!r} is not a log level; use one of {valid}") from None


def _env_flag(name: str, default: bool) -> bool:
    value = _env_switch(name)
    return default if value is None else value


def triton_wanted_on_cpu() -> bool:
    """``ORTMODULE_USE_TRITON=1`` or ``TRITON_INTERPRET=1``: keep Triton importable for TorchDynamo
    even without a GPU (:mod:`ortrain.capture.triton_import`)."""
    return _env_flag("ORTMODULE_USE_TRITON", False) or _env_flag("TRITON_INTERPRET", False)


def _env_switch(name: str) -> bool | None:
    """1/0 (true/false, on/off, yes/no) when set, None when unset."""
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return None
    value = raw.strip().lower()
    if value in ("1", "true", "on", "yes"):
        return True
    if value in ("0", "false", "off", "no"):
        return False
    raise ValueError(f"{name}={raw!r} is not a switch; use 1 or 0")


@dataclass
class DebugOptions:
    """What upstream's ``DebugOptions`` offers: saving the ONNX graphs and the log level.

    ``ORTMODULE_LOG_LEVEL`` overrides ``log_level``; ``ORTMODULE_SAVE_ONNX_PATH`` says where the
    graphs go (the working directory by default). Both are read when the ``ORTModule`` is created
    (:meth:`with_environment`), as every other variable is: until wave 53 they were read here,
    and options made before the variables were set (in a config module) ignored them.
    """

    save_onnx: bool = False
    log_level: LogLevel = LogLevel.WARNING
    onnx_prefix: str = ""
    # Set by with_environment(): None on the options as made.
    save_path: Path | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        if not isinstance(self.log_level, LogLevel):
            raise TypeError(f"log_level must be an ortrain.ortmodule.LogLevel, not {self.log_level!r}")
        # Checked here, not when the first graph is saved (wave 44: `save_onnx="no"` wrote the
        # files, and a prefix naming a folder failed steps later, sending the model to PyTorch).
        if not isinstance(self.save_onnx, bool):
            raise TypeError(f"save_onnx must be True or False, not {self.save_onnx!r}")
        if not isinstance(self.onnx_prefix, str):
            raise TypeError(f"onnx_prefix must be a str, not {self.onnx_prefix!r}")
        if any(separator in self.onnx_prefix for separator in ("/", "\\", os.sep)):
            raise ValueError(
                f"onnx_prefix={self.onnx_prefix!r} names a folder; set ORTMODULE_SAVE_ONNX_PATH to "
                "the folder and onnx_prefix to a file name prefix"
            )
        if self.save_onnx and not self.onnx_prefix:
            self.onnx_prefix = "ortmodule"

    def with_environment(self) -> DebugOptions:
        """A copy with ``ORTMODULE_LOG_LEVEL`` and ``ORTMODULE_SAVE_ONNX_PATH`` as they are now:
        what an ``ORTModule`` (or the ``ortrain`` backend) uses, read when it is created. Options
        already read are kept: the graph-break path of an ``ORTModule`` made later passes its
        wrapper's on, which must not read the variables again."""
        if self.save_path is not None:
            return self
        resolved = copy.copy(self)
        env_level = os.environ.get("ORTMODULE_LOG_LEVEL")
        if env_level:
            resolved.log_level = parse_log_level(env_level)
        resolved.save_path = Path(os.environ.get("ORTMODULE_SAVE_ONNX_PATH") or os.getcwd())
        if resolved.save_onnx and resolved.save_path.exists() and not resolved.save_path.is_dir():
            # Found here, not at the first graph saved: there it surfaced as a bare FileExistsError
            # from deep inside the capture.
            raise ValueError(
                f"ORTMODULE_SAVE_ONNX_PATH={str(resolved.save_path)!r} is a file; name a directory "
                "(created if missing) for the ONNX graphs that save_onnx=True writes"
            )
        return resolved


@dataclass(frozen=True)
class RuntimeOptions:
    """The environment, read once when an ``ORTModule`` is created."""

    opset_version: int
    fallback_policy: FallbackPolicy
    enable_custom_autograd: bool
    allow_autograd_checkpoint: bool
    enable_compute_optimizer: bool
    cache_dir: Path | None
    graph_cache_size: int = 8
    # Guidelines §2.1 sparsity and inspector switches (their passes: see the README's sections).
    enable_sparse_optimizer: bool = True
    enable_embedding_sparse_optimizer: bool = False
    print_input_density: bool = False
    print_memory_stats: bool = False
    # ORTMODULE_MEMORY_OPT_LEVEL and ORTMODULE_MEMORY_OPT_CONFIG (see ortrain.capture.memory_optimizer).
    memory_opt_level: int = 0
    memory_opt_config: tuple[RecomputeRequest, ...] = ()
    # Guidelines §6 Triton and op tuning.
    use_triton: bool = False
    # None: automatic (see ortrain.runtime.placement_tuning); 1/0 force op tuning on or off.
    enable_tuning: bool | None = None
    max_tuning_duration_ms: int | None = None
    tuning_results_path: Path | None = None
    triton_debug: bool = False
    # Fully qualified names (module + __qualname__) of Functions to trace inline, not as python ops.
    skipped_autograd_functions: frozenset[str] = frozenset()
    # ORTMODULE_CACHE_CAPTURE: with ORTMODULE_CACHE_DIR, a later process also skips the capture.
    cache_capture: bool = True
    # ORTMODULE_BACKWARD_SEGMENTS: the backward graph runs as up to this many consecutive ONNX
    # Runtime sessions, so that saved activations are freed as the run goes (1: one session).
    backward_segments: int = 4
    # ORTMODULE_FUSE_LINEAR_CROSS_ENTROPY: a linear layer feeding cross-entropy computes loss and
    # gradients in the forward, in chunks (ortrain.passes.linear_cross_entropy; with the compute
    # optimizer on).
    fuse_linear_cross_entropy: bool = True
    # ORTMODULE_REUSE_FREED_MEMORY: raise glibc malloc's thresholds so that freed activations are
    # reused, not faulted in again at each step (ortrain.runtime.freed_memory_reuse).
    reuse_freed_memory: bool = True


_MEMORY_OPT_LEVELS = (0, 1, 2)


def parse_memory_opt_level(raw: str) -> int:
    text = raw.strip()
    if text not in {str(level) for level in _MEMORY_OPT_LEVELS}:
        raise ValueError(
            f"ORTMODULE_MEMORY_OPT_LEVEL={raw!r} is not a level; use one of 0, 1, 2: 0 (only the plans of "
            "ORTMODULE_MEMORY_OPT_CONFIG), 1 (recompute cheap subgraphs in each layer) or 2 (1 plus "
            "compromise and matmul plans)"
        )
    return int(text)


def _parse_plan(entry: str) -> RecomputeRequest:
    parts = entry.strip().split(":")
    bad = (
        f"ORTMODULE_MEMORY_OPT_CONFIG entry {entry.strip()!r} is not pattern:type:count "
        "(type 0 = off, 1 = recompute, 2 = recompute with compromise; count -1 = all occurrences "
        "or a positive number), e.g. Gelu+:1:-1"
    )
    if len(parts) != 3 or not parts[0].strip():
        raise ValueError(bad)
    pattern, kind_text, count_text = (p.strip() for p in parts)
    try:
        kind, count = int(kind_text), int(count_text)
    except ValueError:
        raise ValueError(bad) from None
    if kind not in (OFF, RECOMPUTE, COMPROMISE) or (count != ALL and count < 1):
        raise ValueError(bad)
    return RecomputeRequest(pattern, kind, count)


def parse_memory_opt_config(raw: str) -> tuple[RecomputeRequest, ...]:
    """``pattern:type:count`` entries separated by commas, or the path of a JSON list of them."""
    text = raw.strip()
    if not text:
        return ()
    entries: list[str]
    if text.endswith(".json") or os.path.isfile(text):
        if not os.path.isfile(text):
            raise ValueError(
                f"ORTMODULE_MEMORY_OPT_CONFIG={raw!r}: no such JSON file; give a file or plans "
                "'pattern:type:count,...'"
            )
        try:
            loaded = json.loads(Path(text).read_text())
        except (OSError, json.JSONDecodeError) as error:
            raise ValueError(
                f"ORTMODULE_MEMORY_OPT_CONFIG={raw!r}: cannot read a JSON list of plans from it: {error}"
            ) from None
        if not isinstance(loaded, list) or not all(isinstance(e, str) for e in loaded):
            raise ValueError(
                f"ORTMODULE_MEMORY_OPT_CONFIG={raw!r} must hold a JSON list of strings "
                '"pattern:type:count", e.g. ["Gelu+:1:-1"]'
            )
        entries = loaded
    else:
        entries = text.split(",")
    plans = tuple(_parse_plan(e) for e in entries if e.strip())
    # Two plans for one pattern contradict each other (wave 46's review: "Gelu+:1:-1,Gelu+:0:-1"
    # was taken without a word, one of them silently winning).
    seen: set[str] = set()
    for plan in plans:
        if plan.pattern in seen:
            raise ValueError(
                f"ORTMODULE_MEMORY_OPT_CONFIG={raw!r} gives pattern {plan.pattern!r} more than one "
                "plan; give each pattern once"
            )
        seen.add(plan.pattern)
    return plans


def ortmodule_variables_set() -> list[str]:
    """The names of the ``ORTMODULE_*`` variables set in this process, sorted (``ortrain doctor``)."""
    return sorted(name for name in os.environ if name.startswith("ORTMODULE_"))


# Every ``ORTMODULE_*`` variable ortrain reads (README, "Options and environment variables").
KNOWN_VARIABLES = frozenset(
    f"ORTMODULE_{name}"
    for name in (
        "ALLOW_AUTOGRAD_CHECKPOINT",
        "BACKWARD_SEGMENTS",
        "CACHE_CAPTURE",
        "CACHE_DIR",
        "ENABLE_COMPUTE_OPTIMIZER",
        "ENABLE_CUSTOM_AUTOGRAD",
        "ENABLE_EMBEDDING_SPARSE_OPTIMIZER",
        "ENABLE_SPARSE_OPTIMIZER",
        "ENABLE_TUNING",
        "FALLBACK_POLICY",
        "FUSE_LINEAR_CROSS_ENTROPY",
        "GRAPH_CACHE_SIZE",
        "LOG_LEVEL",
        "MAX_TUNING_DURATION_MS",
        "MEMORY_OPT_CONFIG",
        "MEMORY_OPT_LEVEL",
        "ONNX_OPSET_VERSION",
        "PRINT_INPUT_DENSITY",
        "PRINT_MEMORY_STATS",
        "REUSE_FREED_MEMORY",
        "SAVE_ONNX_PATH",
        "SKIPPED_AUTOGRAD_FUNCTIONS",
        "TRITON_DEBUG",
        "TUNING_RESULTS_PATH",
        "USE_TRITON",
    )
)


def unknown_variable_messages() -> dict[str, str]:
    """Each ``ORTMODULE_*`` variable set that ortrain does not read → what to say about it (wave
    46's review: ``ORTMODULE_ENABLE_TUNNING=0`` left op tuning on without a word, and ``ortrain
    doctor`` listed it as "ok"). Upstream's variables that ortrain has no use for land here too."""
    messages = {}
    for name in ortmodule_variables_set():
        if name in KNOWN_VARIABLES:
            continue
        close = difflib.get_close_matches(name, sorted(KNOWN_VARIABLES), n=1, cutoff=0.8)
        hint = f"did you mean {close[0]}? " if close else ""
        messages[name] = (
            f"{name} is set, but ortrain reads no such variable and ignores it; {hint}the variables "
            "it reads are listed in the README (Options and environment variables)"
        )
    return messages


def cache_directory() -> Path | None:
    """``ORTMODULE_CACHE_DIR`` alone: ``ortrain cache`` reads nothing else, so that a bad value of
    another variable does not stop a user from listing or clearing the cache."""
    raw = os.environ.get("ORTMODULE_CACHE_DIR")
    return Path(raw) if raw else None


def runtime_options() -> RuntimeOptions:
    opset_raw = os.environ.get("ORTMODULE_ONNX_OPSET_VERSION")
    if opset_raw:
        try:
            opset = int(opset_raw)
        except ValueError:
            raise ValueError(
                f"ORTMODULE_ONNX_OPSET_VERSION={opset_raw!r} is not an integer; use an opset of 18 or newer"
            ) from None
        if opset < 18:
            # torch.onnx's dynamo exporter emits opset 18 and newer only.
            raise ValueError(
                f"ORTMODULE_ONNX_OPSET_VERSION={opset} is too old; ortrain exports opset 18 or newer"
            )
        import onnx  # here, not at import: only a process that sets the variable pays for it

        newest = onnx.defs.onnx_opset_version()
        if opset > newest:
            # Until wave 41 such a request was dropped by the version conversion, without a word.
            raise ValueError(
                f"ORTMODULE_ONNX_OPSET_VERSION={opset} is newer than the installed onnx knows "
                f"(opset {newest}); use an opset from 18 to {newest}"
            )
    else:
        opset = DEFAULT_OPSET
    policy_raw = os.environ.get("ORTMODULE_FALLBACK_POLICY")
    cache_raw = os.environ.get("ORTMODULE_CACHE_DIR")
    tuning_path_raw = os.environ.get("ORTMODULE_TUNING_RESULTS_PATH", "").strip()
    enable_tuning = _env_switch("ORTMODULE_ENABLE_TUNING")
    tuning_results_path = Path(tuning_path_raw) if tuning_path_raw else None
    # Only where the cache directory can be one: a regular file there is said once (the cache's
    # own warning), not again for the tuning file under it (wave 41).
    cache_path = Path(cache_raw) if cache_raw else None
    cache_usable = cache_path is not None and not any(p.is_file() for p in (cache_path, *cache_path.parents))
    if tuning_results_path is None and cache_usable and enable_tuning is not False:
        # The placements chosen on this machine are part of what the cache keeps: a warm process
        # then builds only the chosen one (no ONNX Runtime session for an all-torch graph).
        from ortrain.runtime.tuning_results import FILE_NAME

        tuning_results_path = Path(cache_raw) / FILE_NAME
    return RuntimeOptions(
        opset_version=opset,
        fallback_policy=parse_fallback_policy(policy_raw) if policy_raw else FallbackPolicy.default(),
        enable_custom_autograd=_env_flag("ORTMODULE_ENABLE_CUSTOM_AUTOGRAD", True),
        allow_autograd_checkpoint=_env_flag("ORTMODULE_ALLOW_AUTOGRAD_CHECKPOINT", False),
        enable_compute_optimizer=_env_flag("ORTMODULE_ENABLE_COMPUTE_OPTIMIZER", True),
        cache_dir=Path(cache_raw) if cache_raw else None,
        enable_sparse_optimizer=_env_flag("ORTMODULE_ENABLE_SPARSE_OPTIMIZER", True),
        enable_embedding_sparse_optimizer=_env_flag("ORTMODULE_ENABLE_EMBEDDING_SPARSE_OPTIMIZER", False),
        print_input_density=_env_flag("ORTMODULE_PRINT_INPUT_DENSITY", False),
        print_memory_stats=_env_flag("ORTMODULE_PRINT_MEMORY_STATS", False),
        memory_opt_level=parse_memory_opt_level(os.environ.get("ORTMODULE_MEMORY_OPT_LEVEL") or "0"),
        memory_opt_config=parse_memory_opt_config(os.environ.get("ORTMODULE_MEMORY_OPT_CONFIG", "")),
        use_triton=_env_flag("ORTMODULE_USE_TRITON", False),
        enable_tuning=enable_tuning,
        max_tuning_duration_ms=_env_positive_int("ORTMODULE_MAX_TUNING_DURATION_MS"),
        tuning_results_path=tuning_results_path,
        triton_debug=_env_flag("ORTMODULE_TRITON_DEBUG", False),
        skipped_autograd_functions=_skipped_autograd_functions(),
        graph_cache_size=_env_int("ORTMODULE_GRAPH_CACHE_SIZE", 8, minimum=1),
        cache_capture=_env_flag("ORTMODULE_CACHE_CAPTURE", True),
        backward_segments=_env_int("ORTMODULE_BACKWARD_SEGMENTS", 4, minimum=1),
        fuse_linear_cross_entropy=_env_flag("ORTMODULE_FUSE_LINEAR_CROSS_ENTROPY", True),
        reuse_freed_memory=_env_flag("ORTMODULE_REUSE_FREED_MEMORY", True),
    )


_MALLOC_VARIABLES = (
    "MALLOC_MMAP_THRESHOLD_",
    "MALLOC_TRIM_THRESHOLD_",
    "MALLOC_TOP_PAD_",
    "MALLOC_MMAP_MAX_",
)
_PRELOADED_ALLOCATORS = ("jemalloc", "tcmalloc", "mimalloc")


def user_malloc_setting() -> str | None:
    """The user's own configuration of the process's malloc, which ortrain leaves alone: glibc's
    ``MALLOC_*_`` variables or ``glibc.malloc`` tunables, or another allocator preloaded."""
    for name in _MALLOC_VARIABLES:
        if os.environ.get(name, "").strip():
            return f"{name} is set"
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    if "glibc.malloc." in tunables:
        return "GLIBC_TUNABLES sets glibc.malloc"
    preload = os.environ.get("LD_PRELOAD", "")
    for allocator in _PRELOADED_ALLOCATORS:
        if allocator in preload:
            return f"LD_PRELOAD loads {allocator}"
    return None


def _env_int(name: str, default: int, *, minimum: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer; use a whole number >= {minimum}") from None
    if value < minimum:
        raise ValueError(f"{name}={value} is too small; use a whole number >= {minimum}")
    return value


def _env_positive_int(name: str) -> int | None:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value <= 0:
        raise ValueError(f"{name}={raw!r} is not a duration; use a positive whole number of milliseconds")
    return value


def _skipped_autograd_functions() -> frozenset[str]:
    name = "ORTMODULE_SKIPPED_AUTOGRAD_FUNCTIONS"
    raw = os.environ.get(name, "")
    names = frozenset(part.strip() for part in raw.split(",") if part.strip())
    for qualified in names:
        if "." not in qualified or any(c.isspace() for c in qualified):
            raise ValueError(
                f"{name}: {qualified!r} is not a fully qualified Function name; use module path and "
                "class name, comma-separated (pkg.layers.Gelu, pkg.model.build.<locals>.Gelu)"
            )
    return names


# Set by shells, terminals and schedulers per session or job; no model reads them, and keeping
# them would make every job miss the capture cache.
_VOLATILE_VARIABLES = frozenset(
    {
        "_",
        "PWD",
        "OLDPWD",
        "SHLVL",
        "COLUMNS",
        "LINES",
        "DISPLAY",
        "WINDOWID",
        "TMUX",
        "TMUX_PANE",
        "STY",
        "WINDOW",
        "PYTEST_CURRENT_TEST",
        "SLURM_JOB_ID",
        "SLURM_JOBID",
        "SLURM_TASK_PID",
        "SLURM_STEP_ID",
        "SLURM_STEPID",
        "PBS_JOBID",
        "LSB_JOBID",
        "XDG_SESSION_ID",
        "INVOCATION_ID",
        "JOURNAL_STREAM",
        # torchrun's per launch: a fresh run id, error file and (standalone) port each start, so
        # that no warm restart ever hit (wave 46). The rank is keyed by the process group itself.
        "TORCHELASTIC_RUN_ID",
        "TORCHELASTIC_ERROR_FILE",
        "TORCHELASTIC_RESTART_COUNT",
        "MASTER_PORT",
    }
)
_VOLATILE_PREFIXES = ("SSH_", "TERM", "VSCODE_", "XDG_RUNTIME", "KITTY_", "ITERM_")


def environment_for_cache_key() -> dict[str, str]:
    """The environment that a stored capture must match (``ortrain.cache.capture_key``): every
    variable but those a shell or scheduler sets per session."""
    return {
        name: value
        for name, value in sorted(os.environ.items())
        if name not in _VOLATILE_VARIABLES and not name.startswith(_VOLATILE_PREFIXES)
    }


def model_environment(names: Iterable[str]) -> tuple[tuple[str, str | None], ...]:
    """The values now (None: unset) of the environment variables a model's forward read: not
    ortrain's options, but what its graphs are kept under (``GraphKey.environment``)."""
    return tuple((name, os.environ.get(name)) for name in names)


def openmp_wait_policy() -> str:
    """``OMP_WAIT_POLICY`` as PyTorch's OpenMP runtime read it when the process started."""
    return os.environ.get("OMP_WAIT_POLICY", "").strip().upper()
