"""``ortrain doctor``: versions, usable execution providers, optional extras, and a training check.

A provider is "usable" when ONNX Runtime creates a session with it and runs a one-node graph; the
training check trains a tiny model for a few steps on ONNX Runtime (a fallback fails it) and
compares every loss with eager PyTorch's.
"""

from __future__ import annotations

import copy
import importlib.metadata
import importlib.util
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

# Optional extras: (distribution, what it enables, extra to install).
EXTRAS = (
    ("transformers", "ortrain.transformers (ORTTrainer), Hugging Face models", "transformers"),
    ("accelerate", "the Hugging Face Trainer", "transformers"),
    ("deepspeed", "DeepSpeed ZeRO with FP16_Optimizer", "deepspeed"),
    ("triton", "Triton kernels (NVIDIA GPUs)", "triton"),
    ("matplotlib", "the PNG chart of ortrain bench", "bench"),
)


@dataclass
class Check:
    name: str
    ok: bool
    detail: str


def provider_checks() -> list[Check]:
    import numpy as np
    import onnx
    import onnxruntime
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])],
        "doctor",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = min(model.ir_version, onnx.IR_VERSION, 10)
    checks = []
    for provider in onnxruntime.get_available_providers():
        try:
            session = onnxruntime.InferenceSession(model.SerializeToString(), providers=[provider])
            (y,) = session.run(None, {"x": np.array([-1.0, 2.0], dtype=np.float32)})
            used = session.get_providers()[0]
            ok = used == provider and y.tolist() == [0.0, 2.0]
            checks.append(Check(provider, ok, "runs a graph" if ok else f"session fell back to {used}"))
        except Exception as error:  # a provider listed but not loadable (missing CUDA libraries, ...)
            checks.append(Check(provider, False, f"{type(error).__name__}: {str(error).splitlines()[0]}"))
    return checks


def extra_checks() -> list[Check]:
    checks = []
    for dist, enables, extra in EXTRAS:
        if importlib.util.find_spec(dist) is None:
            checks.append(Check(dist, False, f'not installed ({enables}): pip install "ortrain[{extra}]"'))
            continue
        version = importlib.metadata.version(dist)
        detail = f"{version} ({enables})"
        if dist == "triton" and not torch.cuda.is_available():
            detail += "; no NVIDIA GPU here, so its kernels do not run"
        checks.append(Check(dist, True, detail))
    return checks


def variables_checks() -> list[Check]:
    """The ``ORTMODULE_*`` variables as an ``ORTModule`` reads them: a bad value is a finding here,
    not a traceback (as it was until wave 42), and so is each variable ortrain does not read (a
    typo). Every finding is listed: until wave 53 a bad value hid the typos, and a typo alone
    showed under "none set (defaults)"."""
    from ortrain.ortmodule.options import (
        KNOWN_VARIABLES,
        DebugOptions,
        ortmodule_variables_set,
        runtime_options,
        unknown_variable_messages,
    )

    bad_value = None
    try:
        runtime_options()
        DebugOptions().with_environment()  # ORTMODULE_LOG_LEVEL
    except ValueError as error:
        bad_value = Check("variables", False, str(error))
    unread = [Check(name, False, message) for name, message in unknown_variable_messages().items()]
    checks = ([bad_value] if bad_value else []) + unread
    names = [n for n in ortmodule_variables_set() if n in KNOWN_VARIABLES]
    if bad_value is None and (names or not unread):  # no "none set" beside a typo's finding
        detail = f"set: {', '.join(names)}" if names else "none set (defaults)"
        checks.append(Check("variables", True, detail))
    return checks


def cache_check() -> Check | None:
    """Whether ``ORTMODULE_CACHE_DIR`` (when set) can hold the cache: ORTModule runs uncached, with
    one warning, where it cannot. (Until wave 45 a path naming a file passed as "set" here, and the
    warning came only from the training check.)"""
    import os

    from ortrain.ortmodule.options import cache_directory

    directory = cache_directory()
    if directory is None:
        return None
    name = f"ORTMODULE_CACHE_DIR={directory}"
    if directory.exists() and not directory.is_dir():
        return Check("cache", False, f"{name} is not a directory: ORTModule runs uncached; name a directory")
    if directory.is_dir() and not os.access(directory, os.W_OK | os.X_OK):
        return Check("cache", False, f"{name} is not writable: entries there load, new ones are not kept")
    detail = "a directory" if directory.is_dir() else "not there yet: made at the first capture"
    return Check("cache", True, f"{name}: {detail}")


def training_check(steps: int = 4) -> Check:
    """Train a tiny MLP on ONNX Runtime (a fallback to PyTorch fails it); compare losses with eager's."""
    from ortrain.ortmodule import ORTModule

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 1))
    eager = copy.deepcopy(model)
    wrapped = ORTModule(model)
    x, y = torch.randn(32, 8), torch.randn(32, 1)
    losses: dict[str, list[float]] = {"ortrain": [], "eager": []}
    try:
        for name, module in (("ortrain", wrapped), ("eager", eager)):
            optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
            for _ in range(steps):
                optimizer.zero_grad()
                loss = nn.functional.mse_loss(module(x), y)
                loss.backward()
                optimizer.step()
                losses[name].append(loss.item())
    except Exception as error:
        return Check("training", False, f"{type(error).__name__}: {str(error).splitlines()[0]}")
    if wrapped._ortrain_fallback.active:  # the default policy trained on in PyTorch (warning above)
        return Check("training", False, "ortrain fell back to PyTorch; the warning above names the cause")
    worst = max(
        abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses["ortrain"], losses["eager"], strict=True)
    )
    trained = losses["ortrain"][-1] < losses["ortrain"][0]
    ok = worst < 1e-4 and trained
    detail = (
        f"tiny MLP, {steps} SGD steps on ONNX Runtime: loss {losses['ortrain'][0]:.4f} → "
        f"{losses['ortrain'][-1]:.4f}, largest relative difference from eager {worst:.1e}"
    )
    return Check("training", ok, detail)


def run_doctor(report: Callable[[str], None]) -> bool:
    """Print the checks; True when the providers, the training check (and so ortrain) work and
    every ``ORTMODULE_*`` variable set is one ortrain reads, with a value it accepts."""
    import onnx
    import onnxruntime
    import onnxscript

    import ortrain

    for name, version in (
        ("ortrain", ortrain.__version__),
        ("python", sys.version.split()[0]),
        ("torch", torch.__version__),
        ("onnx", onnx.__version__),
        ("onnxscript", onnxscript.__version__),
        ("onnxruntime", onnxruntime.__version__),
    ):
        report(f"{name:12} {version}")
    report("execution providers:")
    providers = provider_checks()
    for check in providers:
        report(f"  {'ok ' if check.ok else 'NO '} {check.name}: {check.detail}")
    report("optional extras:")
    for check in extra_checks():
        report(f"  {'ok ' if check.ok else '-  '} {check.name}: {check.detail}")
    report("ORTMODULE_* variables:")
    variables = variables_checks()
    for check in variables:
        report(f"  {'ok ' if check.ok else 'NO '} {check.detail}")
    if any(c.name == "variables" and not c.ok for c in variables):
        return False  # a bad value: every ORTModule would raise the same error, nothing to train
    # Said above: the training check's ORTModule must not warn about them again on stderr.
    from ortrain.ortmodule.inactive_options import mark_announced

    mark_announced(c.name for c in variables if not c.ok)
    cache = cache_check()
    if cache is not None:  # a finding, not a failure: training runs uncached
        report(f"capture cache:\n  {'ok ' if cache.ok else 'NO '} {cache.detail}")
    training = training_check()
    report(f"training:\n  {'ok ' if training.ok else 'NO '} {training.detail}")
    from ortrain.runtime import freed_memory_reuse

    report(f"freed memory reuse (ORTMODULE_REUSE_FREED_MEMORY): {freed_memory_reuse.describe()}")
    cpu_ok = any(c.ok and c.name == "CPUExecutionProvider" for c in providers)
    # A variable ortrain ignores is a setting that does not act: the exit status says so too.
    return cpu_ok and training.ok and all(c.ok for c in variables)
