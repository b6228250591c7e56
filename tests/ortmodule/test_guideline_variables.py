"""Every ``ORTMODULE_*`` variable of the training guidelines: accepted, rejected, or explained."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import _functions_a
import _functions_b
import onnx
import pytest
import torch
from _parity import assert_same_state, train_side_by_side
from torch import nn

from ortrain.capture.memory_optimizer import RecomputeRequest
from ortrain.ortmodule import DebugOptions, ORTModule, inactive_options
from ortrain.ortmodule.fallback import FallbackPolicy
from ortrain.ortmodule.options import KNOWN_VARIABLES, runtime_options

# Every variable the guidelines (and the memory optimizer's page) name, with a value that must be
# accepted, the RuntimeOptions field it lands in, and what the field must then hold.
ACCEPTED = [
    ("ORTMODULE_ONNX_OPSET_VERSION", "20", "opset_version", 20),
    ("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE", "fallback_policy", FallbackPolicy.FALLBACK_DISABLE),
    ("ORTMODULE_ENABLE_CUSTOM_AUTOGRAD", "0", "enable_custom_autograd", False),
    ("ORTMODULE_ALLOW_AUTOGRAD_CHECKPOINT", "1", "allow_autograd_checkpoint", True),
    ("ORTMODULE_ENABLE_COMPUTE_OPTIMIZER", "0", "enable_compute_optimizer", False),
    ("ORTMODULE_ENABLE_SPARSE_OPTIMIZER", "0", "enable_sparse_optimizer", False),
    ("ORTMODULE_ENABLE_EMBEDDING_SPARSE_OPTIMIZER", "1", "enable_embedding_sparse_optimizer", True),
    ("ORTMODULE_PRINT_INPUT_DENSITY", "1", "print_input_density", True),
    ("ORTMODULE_PRINT_MEMORY_STATS", "1", "print_memory_stats", True),
    ("ORTMODULE_CACHE_DIR", "/tmp/ortrain-cache", "cache_dir", Path("/tmp/ortrain-cache")),
    ("ORTMODULE_MEMORY_OPT_LEVEL", "1", "memory_opt_level", 1),
    ("ORTMODULE_MEMORY_OPT_CONFIG", "Gelu+:1:-1,Cast+Where+Softmax+:2:3", "memory_opt_config",
     (RecomputeRequest("Gelu+", 1, -1), RecomputeRequest("Cast+Where+Softmax+", 2, 3))),
    ("ORTMODULE_USE_TRITON", "1", "use_triton", True),
    ("ORTMODULE_ENABLE_TUNING", "1", "enable_tuning", True),
    ("ORTMODULE_MAX_TUNING_DURATION_MS", "9999", "max_tuning_duration_ms", 9999),
    ("ORTMODULE_TUNING_RESULTS_PATH", "/tmp/tuned", "tuning_results_path", Path("/tmp/tuned")),
    ("ORTMODULE_TRITON_DEBUG", "1", "triton_debug", True),
    ("ORTMODULE_SKIPPED_AUTOGRAD_FUNCTIONS", "a.b.Gelu, d.e.func.<locals>.Gelu", "skipped_autograd_functions",
     frozenset({"a.b.Gelu", "d.e.func.<locals>.Gelu"})),
]  # fmt: skip

# A wrong value for each variable that validates, and words the error must contain (the variable,
# and the values it accepts).
REJECTED = [
    ("ORTMODULE_ONNX_OPSET_VERSION", "twelve", "18 or newer"),
    ("ORTMODULE_FALLBACK_POLICY", "FALLBACK_SOMETIMES", "FALLBACK_DISABLE"),
    ("ORTMODULE_ENABLE_CUSTOM_AUTOGRAD", "sure", "1 or 0"),
    ("ORTMODULE_ALLOW_AUTOGRAD_CHECKPOINT", "2", "1 or 0"),
    ("ORTMODULE_ENABLE_COMPUTE_OPTIMIZER", "maybe", "1 or 0"),
    ("ORTMODULE_ENABLE_SPARSE_OPTIMIZER", "yes please", "1 or 0"),
    ("ORTMODULE_ENABLE_EMBEDDING_SPARSE_OPTIMIZER", "x", "1 or 0"),
    ("ORTMODULE_PRINT_INPUT_DENSITY", "loud", "1 or 0"),
    ("ORTMODULE_PRINT_MEMORY_STATS", "-1", "1 or 0"),
    ("ORTMODULE_MEMORY_OPT_LEVEL", "3", "0, 1, 2"),
    ("ORTMODULE_MEMORY_OPT_LEVEL", "high", "0, 1, 2"),
    ("ORTMODULE_MEMORY_OPT_CONFIG", "Gelu+:5:1", "pattern:type:count"),
    ("ORTMODULE_MEMORY_OPT_CONFIG", "/no/such/plans.json", "no such JSON file"),
    ("ORTMODULE_MEMORY_OPT_CONFIG", "Gelu+:1:-1,Gelu+:0:-1", "pattern 'Gelu+' more than one plan"),
    ("ORTMODULE_USE_TRITON", "triton", "1 or 0"),
    ("ORTMODULE_ENABLE_TUNING", "on-the-fly", "1 or 0"),
    ("ORTMODULE_MAX_TUNING_DURATION_MS", "soon", "positive whole number of milliseconds"),
    ("ORTMODULE_MAX_TUNING_DURATION_MS", "0", "positive whole number of milliseconds"),
    ("ORTMODULE_TRITON_DEBUG", "verbose", "1 or 0"),
    ("ORTMODULE_SKIPPED_AUTOGRAD_FUNCTIONS", "Gelu", "fully qualified"),
]


@pytest.mark.parametrize(("name", "value", "field", "expected"), ACCEPTED, ids=[a[0] for a in ACCEPTED])
def test_each_guideline_variable_is_accepted(monkeypatch, name, value, field, expected) -> None:
    monkeypatch.setenv(name, value)
    assert getattr(runtime_options(), field) == expected


@pytest.mark.parametrize(("name", "value", "accepted"), REJECTED, ids=[f"{r[0]}={r[1]}" for r in REJECTED])
def test_a_wrong_value_is_an_error_naming_the_variable_and_accepted_values(
    monkeypatch, name, value, accepted
) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=re.escape(name)) as error:
        ORTModule(nn.Linear(2, 2))
    assert accepted in str(error.value)


def test_the_readme_table_documents_every_variable() -> None:
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    assert {a[0] for a in ACCEPTED} | {"ORTMODULE_LOG_LEVEL", "ORTMODULE_SAVE_ONNX_PATH"} <= KNOWN_VARIABLES
    for name in KNOWN_VARIABLES:
        assert f"| `{name}` |" in readme, name


def test_a_variable_ortrain_does_not_read_is_warned_about_once_with_the_likely_name(
    monkeypatch, caplog
) -> None:
    """``ORTMODULE_ENABLE_TUNNING=0`` (a typo) left op tuning on without a word; upstream's
    ``ORTMODULE_DEEPCOPY_BEFORE_MODEL_EXPORT`` is not read here either (wave 46's review)."""
    monkeypatch.setattr(inactive_options, "_announced", set())
    monkeypatch.setenv("ORTMODULE_ENABLE_TUNNING", "0")
    monkeypatch.setenv("ORTMODULE_DEEPCOPY_BEFORE_MODEL_EXPORT", "0")
    with caplog.at_level(logging.WARNING, logger="ortrain"):
        ORTModule(nn.Linear(2, 2))
        ORTModule(nn.Linear(2, 2))
    messages = [r.getMessage() for r in caplog.records if r.name == "ortrain.ortmodule"]
    typo = [m for m in messages if m.startswith("ORTMODULE_ENABLE_TUNNING is set")]
    assert len(typo) == 1 and "did you mean ORTMODULE_ENABLE_TUNING?" in typo[0], messages
    upstream = [m for m in messages if m.startswith("ORTMODULE_DEEPCOPY_BEFORE_MODEL_EXPORT is set")]
    assert len(upstream) == 1 and "did you mean" not in upstream[0], messages
    assert not [m for m in messages if "ORTMODULE_FALLBACK_POLICY is set" in m]  # the conftest's: read
    from ortrain.doctor import variables_checks

    ok = [c.detail for c in variables_checks() if c.ok]
    assert ok and not [d for d in ok if "TUNNING" in d]  # doctor said "ok  set: ORTMODULE_ENABLE_TUNNING"


INACTIVE = {
    "ORTMODULE_USE_TRITON": ("1", "NVIDIA GPU"),
    "ORTMODULE_TRITON_DEBUG": ("1", "no triton_debug folder"),
}


def test_variables_that_cannot_act_here_say_why_once(monkeypatch, caplog) -> None:
    monkeypatch.setattr(inactive_options, "_announced", set())
    monkeypatch.setattr(inactive_options, "_nvidia_gpu", lambda: False)
    for name, (value, _) in INACTIVE.items():
        monkeypatch.setenv(name, value)
    x = torch.randn(3, 2)
    with caplog.at_level(logging.WARNING, logger="ortrain"):
        model = ORTModule(nn.Linear(2, 2))
        ORTModule(nn.Linear(2, 2))
        model(x).sum().backward()  # the model still trains, on ONNX Runtime
    messages = [r.getMessage() for r in caplog.records if r.name == "ortrain.ortmodule"]
    for name, (_, why) in INACTIVE.items():
        said = [m for m in messages if m.startswith(name)]
        assert len(said) == 1, (name, messages)
        assert why in said[0] and "no effect" in said[0]


def test_unset_or_off_variables_say_nothing(monkeypatch) -> None:
    monkeypatch.setenv("ORTMODULE_USE_TRITON", "0")
    assert inactive_options.inactive_option_messages(runtime_options()) == {}


def _two_gelus(h: torch.Tensor) -> torch.Tensor:
    return _functions_a.Gelu.apply(h) * _functions_b.Gelu.apply(h)


class _TwoGelus(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _two_gelus(self.linear(x)).sum()


def test_skipped_autograd_functions_are_traced_inline_by_fully_qualified_name(tmp_path, monkeypatch) -> None:
    # Two Functions named Gelu: skipping one by its full name leaves the other a python op.
    monkeypatch.setenv("ORTMODULE_SKIPPED_AUTOGRAD_FUNCTIONS", "_functions_a.Gelu")
    monkeypatch.setenv("ORTMODULE_SAVE_ONNX_PATH", str(tmp_path))
    torch.manual_seed(0)
    batches = [torch.randn(4, 6) for _ in range(3)]
    model = _TwoGelus()
    losses_ort, losses_eager, eager, wrapped = train_side_by_side(model, batches, lambda m, x: m(x))
    torch.testing.assert_close(losses_ort, losses_eager, rtol=1e-5, atol=1e-6)
    assert_same_state(wrapped, eager)

    saved = ORTModule(_TwoGelus(), DebugOptions(save_onnx=True, onnx_prefix="skip"))
    saved(torch.randn(4, 6)).backward()
    graph = onnx.load(tmp_path / "skip_forward_exported_training.onnx").graph
    ops = [n for n in graph.node if n.op_type == "PythonOp"]
    names = [onnx.helper.get_attribute_value(n.attribute[0]).decode() for n in ops]
    assert names == ["_functions_b.Gelu"]


def test_what_cannot_act_here_is_said_at_the_log_level() -> None:
    """``ORTMODULE_LOG_LEVEL=ERROR`` silences the "no effect" warnings too; until wave 41 they were
    printed before ortrain's log output was set up, by Python's last-resort handler, at any level
    (a fresh process: pytest's own log handlers hide that handler)."""
    import os
    import subprocess
    import sys

    code = "from torch import nn; from ortrain import ORTModule; ORTModule(nn.Linear(2, 2))"
    env = {
        **os.environ,
        "ORTMODULE_USE_TRITON": "1",
        "ORTMODULE_LOG_LEVEL": "ERROR",
        "CUDA_VISIBLE_DEVICES": "",
    }
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "ORTMODULE_USE_TRITON" not in done.stderr


def test_a_skipped_name_no_function_carries_is_warned_about_once(monkeypatch, caplog) -> None:
    """A misspelt name used to be ignored without a word: the Function it meant stayed a python op."""
    from ortrain.capture import function_calls

    monkeypatch.setattr(function_calls, "_unmatched_names_warned", set())
    monkeypatch.setenv("ORTMODULE_SKIPPED_AUTOGRAD_FUNCTIONS", "_functions_a.Gelu,_functions_a.Geluu")
    with caplog.at_level(logging.WARNING, logger="ortrain"):
        for _ in range(2):
            ORTModule(_TwoGelus())(torch.randn(4, 6)).backward()
    said = [r.getMessage() for r in caplog.records if "SKIPPED_AUTOGRAD_FUNCTIONS" in r.getMessage()]
    assert len(said) == 1, said
    assert "_functions_a.Geluu" in said[0] and "_functions_b.Gelu" in said[0]
    assert "names _functions_a.Gelu," not in said[0]
