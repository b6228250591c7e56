"""Debug options, log levels, and the one place that reads ``ORTMODULE_*`` environment variables.

Every other module asks :func:`runtime_options` instead of reading ``os.environ`` itself, so the
whole configuration surface is visible here and can be documented from one file.
"""

from __future__ import annotations

import enum
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

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
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
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
    graphs go (the working directory by default).
    """

    save_onnx: bool = False
    log_level: LogLevel = LogLevel.WARNING
    onnx_prefix: str = ""
    save_path: Path = field(init=False)

    def __post_init__(self) -> None:
        if not isinstance(self.log_level, LogLevel):
            raise TypeError(f"log_level must be an ortrain.ortmodule.LogLevel, not {self.log_level!r}")
        env_level = os.environ.get("ORTMODULE_LOG_LEVEL")
        if env_level:
            self.log_level = parse_log_level(env_level)
        self.save_path = Path(os.environ.get("ORTMODULE_SAVE_ONNX_PATH") or os.getcwd())
        if self.save_onnx and not self.onnx_prefix:
            self.onnx_prefix = "ortmodule"


@dataclass(frozen=True)
class RuntimeOptions:
    """The environment, read once when an ``ORTModule`` is created."""

    opset_version: int
    fallback_policy: FallbackPolicy
    enable_custom_autograd: bool
    allow_autograd_checkpoint: bool
    enable_compute_optimizer: bool
    cache_dir: Path | None
    # Issue 12: sparsity optimizers and the runtime inspector (guidelines §2.1).
    enable_sparse_optimizer: bool = True
    enable_embedding_sparse_optimizer: bool = False
    print_input_density: bool = False
    print_memory_stats: bool = False


def runtime_options() -> RuntimeOptions:
    opset_raw = os.environ.get("ORTMODULE_ONNX_OPSET_VERSION")
    if opset_raw:
        try:
            opset = int(opset_raw)
        except ValueError:
            raise ValueError(f"ORTMODULE_ONNX_OPSET_VERSION={opset_raw!r} is not an integer") from None
        if opset < 18:
            # torch.onnx's dynamo exporter emits opset 18 and newer only.
            raise ValueError(
                f"ORTMODULE_ONNX_OPSET_VERSION={opset} is too old; ortrain exports opset 18 or newer"
            )
    else:
        opset = DEFAULT_OPSET
    policy_raw = os.environ.get("ORTMODULE_FALLBACK_POLICY")
    cache_raw = os.environ.get("ORTMODULE_CACHE_DIR")
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
    )


def openmp_wait_policy() -> str:
    """``OMP_WAIT_POLICY`` as PyTorch's OpenMP runtime read it when the process started."""
    return os.environ.get("OMP_WAIT_POLICY", "").strip().upper()
