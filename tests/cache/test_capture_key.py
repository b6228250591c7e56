"""The capture key (computed before tracing) misses on every change that can change the trace."""

from __future__ import annotations

import functools
import importlib.util
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from ortrain.cache import capture_key as capture_key_module
from ortrain.cache.capture_key import capture_key
from ortrain.ortmodule.options import RuntimeOptions, runtime_options


class _Config:
    def __init__(self) -> None:
        self.hidden = 8
        self.activation = "gelu"
        self.nested = {"rope": {"theta": 10000.0}}


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.config = _Config()
        self.fc = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.drop = nn.Dropout(0.1)
        self._causal = True
        # Reached outside the module tree: the graph would hold these as constants.
        self.table = [torch.arange(4.0)]
        teacher = nn.Linear(2, 2)
        nn.init.constant_(teacher.weight, 0.5)
        nn.init.zeros_(teacher.bias)
        self.teacher = [teacher]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.norm(self.fc(x)))


def _call(**changes: Any) -> dict[str, Any]:
    call = {"spec": ("tuple", tuple, ()), "inputs": [["torch.float32", [4, 8], "cpu", False]], "dynamic": []}
    call.update(changes)
    return call


def _key(
    model: nn.Module,
    *,
    call: dict[str, Any] | None = None,
    options: RuntimeOptions | None = None,
    env: dict | None = None,
) -> str | None:
    return capture_key(
        model, call or _call(), options=options or runtime_options(), environment=env or {"A": "1"}
    )


def _hook(module: nn.Module, args: Any) -> None:
    return None


def _other_hook(module: nn.Module, args: Any) -> Any:
    return (args[0] * 2,)


CHANGES: dict[str, Callable[[nn.Module], None]] = {
    "dropout p": lambda m: setattr(m.drop, "p", 0.2),
    "layernorm eps": lambda m: setattr(m.norm, "eps", 1e-6),
    "underscore attribute": lambda m: setattr(m, "_causal", False),
    "config attribute": lambda m: setattr(m.config, "activation", "relu"),
    "nested config": lambda m: m.config.nested["rope"].update(theta=500000.0),
    "eval mode": lambda m: m.eval(),
    "submodule eval": lambda m: m.drop.eval(),
    "frozen weight": lambda m: m.fc.weight.requires_grad_(False),
    "dtype": lambda m: m.fc.to(torch.float64),
    "resized": lambda m: setattr(m, "fc", nn.Linear(8, 8, bias=False)),
    "tied": lambda m: setattr(m.norm, "weight", m.fc.bias),
    "new buffer": lambda m: m.register_buffer("scale", torch.ones(8)),
    "hook": lambda m: m.fc.register_forward_pre_hook(_hook),
    "submodule swapped": lambda m: setattr(m, "drop", nn.Identity()),
    "listed tensor's values": lambda m: m.table[0].add_(1),
    "listed module's weights": lambda m: m.teacher[0].bias.data.add_(1),
    "parameter's Python attribute": lambda m: setattr(m.fc.weight, "lr_scale", 2.0),
}


@pytest.fixture
def reference() -> str:
    torch.manual_seed(0)
    key = _key(_Block())
    assert key is not None
    return key


def test_other_weights_hit(reference: str) -> None:
    torch.manual_seed(1)
    assert _key(_Block()) == reference


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_each_model_change_misses(reference: str, change: str) -> None:
    torch.manual_seed(0)
    model = _Block()
    CHANGES[change](model)
    assert _key(model) != reference


def test_hook_code_is_in_the_key() -> None:
    keys = set()
    for hook in (_hook, _other_hook):
        model = _Block()
        model.fc.register_forward_pre_hook(hook)
        keys.add(_key(model))
    assert len(keys) == 2


@pytest.mark.parametrize(
    "call",
    [
        _call(inputs=[["torch.float32", [4, 9], "cpu", False]]),
        _call(inputs=[["torch.float64", [4, 8], "cpu", False]]),
        _call(inputs=[["torch.float32", [4, 8], "cpu", True]]),
        _call(dynamic=[[0, [0]]]),
        _call(spec=("tuple", tuple, (("constant", 3),))),
        _call(training=False),
    ],
)
def test_each_call_change_misses(reference: str, call: dict[str, Any]) -> None:
    assert _key(_Block(), call=call) != reference


def test_options_environment_argv_versions_and_switches_miss(
    reference: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each change in its own context: undo() would also revert the conftest's settings.
    with monkeypatch.context() as patch:
        patch.setenv("ORTMODULE_MEMORY_OPT_LEVEL", "1")
        assert _key(_Block(), options=runtime_options()) != reference
    assert _key(_Block(), env={"A": "2"}) != reference
    with monkeypatch.context() as patch:
        patch.setattr(sys, "argv", [*sys.argv, "--lr=1"])
        assert _key(_Block()) != reference
    with monkeypatch.context() as patch:
        patch.setattr(capture_key_module, "versions", lambda: {"torch": "9.9"})
        assert _key(_Block()) != reference
    torch.set_default_dtype(torch.float64)
    try:
        assert _key(_Block()) != reference
    finally:
        torch.set_default_dtype(torch.float32)
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        assert _key(_Block()) != reference
    finally:
        torch.backends.mha.set_fastpath_enabled(True)
    assert _key(_Block()) == reference


def test_the_rank_and_world_size_miss_and_torchruns_per_launch_variables_hit(
    reference: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A forward may read ``dist.get_rank()`` (contrastive labels ``arange(n) + n * rank``), which
    the graph holds as a constant: ranks started without a ``RANK`` variable (``mp.spawn``) shared
    one key, and rank 1 ran rank 0's capture (wave 46). torchrun's run id, error file and port,
    new at each launch, made every warm restart miss."""
    import torch.distributed as dist

    from ortrain.ortmodule.options import environment_for_cache_key

    torch.manual_seed(0)
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    try:
        assert capture_key_module.process_group() == {"rank": 0, "world size": 1, "backend": "gloo"}
        torch.manual_seed(0)
        rank0 = _key(_Block())
        assert rank0 not in (None, reference)
        with monkeypatch.context() as patch:
            patch.setattr(dist, "get_rank", lambda group=None: 1)
            torch.manual_seed(0)
            assert _key(_Block()) not in (rank0, reference)
    finally:
        dist.destroy_process_group()
    torch.manual_seed(0)
    assert _key(_Block()) == reference
    before = environment_for_cache_key()
    per_launch = ["TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE", "MASTER_PORT"]
    per_launch.append("TORCHELASTIC_RESTART_COUNT")
    for name in per_launch:
        monkeypatch.setenv(name, "launch-2")
    assert environment_for_cache_key() == before
    monkeypatch.setenv("RANK", "1")  # kept: a forward may read it
    assert environment_for_cache_key() != before


def test_installed_distribution_versions_miss(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Code in site-packages is keyed by the name and version of each installed distribution, read
    from the metadata directories' names (a version-less ``.egg-info`` from its metadata)."""
    site = tmp_path / "site"
    (site / "somelib-1.0.dist-info").mkdir(parents=True)
    (site / "devlib.egg-info").mkdir()
    pkg_info = site / "devlib.egg-info" / "PKG-INFO"
    pkg_info.write_text("Metadata-Version: 2.1\nName: devlib\nVersion: 0.3\n")
    monkeypatch.syspath_prepend(str(site))

    def key() -> str | None:
        capture_key_module.installed_distributions.cache_clear()  # read once per process
        return _key(_Block())

    try:
        torch.manual_seed(0)
        before = key()
        listed = capture_key_module.installed_distributions()
        assert f"{site}: somelib-1.0.dist-info" in listed and f"{site}: devlib.egg-info 0.3" in listed
        assert any("torch-" in entry for entry in listed)
        torch.manual_seed(0)
        assert key() == before
        (site / "somelib-1.0.dist-info").rename(site / "somelib-1.1.dist-info")
        torch.manual_seed(0)
        upgraded = key()
        assert upgraded != before
        pkg_info.write_text("Metadata-Version: 2.1\nName: devlib\nVersion: 0.4\n")
        torch.manual_seed(0)
        assert key() not in (before, upgraded)
    finally:
        capture_key_module.installed_distributions.cache_clear()


def _load(path: Path, name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _model_calling_a_helper(tmp_path: Path, name: str, helper_source: str) -> tuple[Any, nn.Module]:
    """A helper module ``name`` written from ``helper_source``, and a Net whose forward calls its
    ``act`` on a linear layer's output, from a file of its own: (the helper module, a Net)."""
    helper = tmp_path / f"{name}.py"
    model_file = tmp_path / f"{name}_model.py"
    helper.write_text(helper_source)
    model_file.write_text(
        textwrap.dedent(
            f"""
            import torch
            import {name} as helpers

            class Net(torch.nn.Module):
                def __init__(self):
                    super().__init__()
                    self.fc = torch.nn.Linear(8, 8)

                def forward(self, x):
                    return helpers.act(self.fc(x))
            """
        )
    )
    return _load(helper, name), _load(model_file, f"{name}_model").Net()


def test_user_code_change_misses(tmp_path: Path) -> None:
    """Code the model calls lives in a file the model classes do not: every loaded file outside
    site-packages is in the key."""
    try:
        relu = "def act(x):\n    return x.relu()\n"
        _, net = _model_calling_a_helper(tmp_path, "ortrain_test_helper", relu)
        before = _key(net)
        assert before is not None and _key(net) == before
        (tmp_path / "ortrain_test_helper.py").write_text("def act(x):\n    return x.sigmoid()\n")
        assert _key(net) != before
    finally:
        sys.modules.pop("ortrain_test_helper", None)
        sys.modules.pop("ortrain_test_helper_model", None)


def test_model_without_source_file_is_not_cached() -> None:
    namespace: dict[str, Any] = {"__name__": "ortrain_test_no_file", "nn": nn}
    exec("class Cell(nn.Module):\n    def forward(self, x):\n        return x * 2\n", namespace)
    sys.modules["ortrain_test_no_file"] = type(sys)("ortrain_test_no_file")
    try:
        assert _key(namespace["Cell"]()) is None
    finally:
        sys.modules.pop("ortrain_test_no_file")


def test_undescribable_attribute_is_not_cached() -> None:
    model = _Block()
    model.lock = __import__("threading").Lock()
    assert _key(model) is None


def _wrapped_forward(module: nn.Module, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    return type(module).forward(module, x) * scale


def test_a_forward_patched_as_a_partial_of_its_module_has_a_key() -> None:
    """accelerate's hooks patch ``module.forward = partial(new_forward, module)``: describing the
    partial described the module again, which held the partial (a RecursionError at capture)."""
    import functools

    model = _Block()
    model.fc.forward = functools.partial(_wrapped_forward, model.fc)
    key = _key(model)
    assert key is not None
    model.fc.forward = functools.partial(_wrapped_forward, model.fc, scale=2.0)
    assert _key(model) not in (None, key)


SHARPNESS = 1.0  # a module-level value the forward reads, set at start-up


class _ReadsGlobal(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * SHARPNESS


def test_a_global_the_forward_reads_misses(monkeypatch: pytest.MonkeyPatch) -> None:
    reference = _key(_ReadsGlobal())
    assert reference is not None and _key(_ReadsGlobal()) == reference
    monkeypatch.setattr(f"{__name__}.SHARPNESS", 2.0)
    assert _key(_ReadsGlobal()) != reference


class _Consts:
    SCALE = 1.0  # set from a data file at start-up


class _Helpers:
    @staticmethod
    def scaled(h: torch.Tensor) -> torch.Tensor:
        return h * _Consts.SCALE


_ACT = functools.partial(torch.nn.functional.leaky_relu, negative_slope=0.1)


class _ReadsGlobalClassesAndPartials(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _ACT(_Helpers.scaled(self.fc(x))) * _Consts.SCALE


@pytest.mark.parametrize(
    "change",
    [
        ("_Consts.SCALE", 3.0),
        ("_ACT", functools.partial(torch.nn.functional.leaky_relu, negative_slope=0.3)),
    ],
    ids=["a global class's attribute", "a global partial's keyword"],
)
def test_global_classes_and_partials_the_forward_reads_miss(monkeypatch: pytest.MonkeyPatch, change) -> None:
    """Until wave 44 a global class was keyed by its name and a global partial by its class: a
    later process with another ``Consts.SCALE`` or slope read from a file loaded the old capture."""
    reference = _key(_ReadsGlobalClassesAndPartials())
    assert reference is not None and _key(_ReadsGlobalClassesAndPartials()) == reference
    monkeypatch.setattr(f"{__name__}.{change[0]}", change[1])
    assert _key(_ReadsGlobalClassesAndPartials()) != reference


class _Scaler:
    def __init__(self, factor: float) -> None:
        self.factor = factor

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor


class _WithCallables(nn.Module):
    SCALE = 1.0  # set from a config at start-up, as scripts do

    def __init__(self, slope: float, factor: float) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.act = lambda h, s=slope: torch.nn.functional.leaky_relu(h, s)
        self.post = _Scaler(factor).apply

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.post(self.act(self.fc(x))) * self.SCALE


def test_state_behind_callables_and_class_attributes_misses() -> None:
    """A default argument of a function attribute, the object a method attribute is bound to, and
    a class attribute set at start-up were not keyed: a later process with other values loaded the
    first one's capture and trained with its numbers (losses 1.023 where eager gave 1.064)."""
    reference = _key(_WithCallables(0.01, 1.0))
    assert reference is not None and _key(_WithCallables(0.01, 1.0)) == reference
    assert _key(_WithCallables(0.5, 1.0)) != reference
    assert _key(_WithCallables(0.01, 3.0)) != reference
    try:
        _WithCallables.SCALE = 2.0
        assert _key(_WithCallables(0.01, 1.0)) != reference
    finally:
        _WithCallables.SCALE = 1.0


class _Scorer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def score(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.proj(h))


class _CallsAnotherModulesMethod(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scorer = _Scorer()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scorer.score(x)


def test_patched_code_misses(monkeypatch: pytest.MonkeyPatch) -> None:
    """A script that patches a class at start-up under a flag no file or argument names runs other
    code with the same key parts otherwise (wave 27)."""
    reference = _key(_Block())
    assert reference is not None and _key(_Block()) == reference

    def halved(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.weight, self.bias) / 2

    with monkeypatch.context() as patch:
        patch.setattr(nn.Linear, "forward", halved)
        patched = _key(_Block())
    assert patched is not None and patched != reference
    assert _key(_Block()) == reference
    # A method another module's forward calls by name (wave 28).
    reference = _key(_CallsAnotherModulesMethod())
    with monkeypatch.context() as patch:
        patch.setattr(_Scorer, "score", lambda self, h: h)
        patched = _key(_CallsAnotherModulesMethod())
    assert patched is not None and patched != reference
    assert _key(_CallsAnotherModulesMethod()) == reference


def test_numbers_of_other_types_are_described_by_type_and_value() -> None:
    """A NumPy scalar or Fraction attribute or argument (wave 36: constants of the graph) is keyed;
    until then the key could not describe one and such a capture was not cached."""
    import fractions

    import numpy as np

    describe = capture_key_module.describe
    assert describe(np.float32(0.5)) == describe(np.float32(0.5))
    assert describe(np.float32(0.5)) not in (
        describe(np.float32(0.25)),
        describe(np.float64(0.5)),
        describe(0.5),
    )
    assert describe(fractions.Fraction(1, 3)) != describe(fractions.Fraction(1, 2))


class _LambdaReadsGlobal(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.act = lambda h: h * SHARPNESS  # the global is read by the lambda, not by forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.fc(x))


class _Settings:
    scale = 1.0  # set on the class at start-up: ``_Settings.scale = cfg["scale"]``


class _ReadsSettings(nn.Module):
    CONFIG = __import__("types").SimpleNamespace(shift=0.0)  # a config object on the class

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.settings = _Settings()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * self.settings.scale + self.CONFIG.shift


def test_globals_of_function_attributes_and_class_level_configs_miss(monkeypatch: pytest.MonkeyPatch) -> None:
    """A global a function attribute reads, a class attribute of an object the model holds, and a
    config object on the model's class: until wave 41 none was keyed, and a later process that
    set another value loaded the first one's capture (loss 0.103 where eager gave 0.335)."""
    reference = _key(_LambdaReadsGlobal())
    assert reference is not None and _key(_LambdaReadsGlobal()) == reference
    monkeypatch.setattr(f"{__name__}.SHARPNESS", 2.0)
    assert _key(_LambdaReadsGlobal()) != reference

    reference = _key(_ReadsSettings())
    assert reference is not None and _key(_ReadsSettings()) == reference
    monkeypatch.setattr(_Settings, "scale", 2.0)
    settings_changed = _key(_ReadsSettings())
    assert settings_changed not in (None, reference)
    monkeypatch.setattr(_ReadsSettings.CONFIG, "shift", 1.0)
    assert _key(_ReadsSettings()) not in (None, reference, settings_changed)


def test_a_helper_called_through_its_module_is_keyed_with_what_it_reads(tmp_path: Path) -> None:
    """``helpers.act(x)``, where ``act`` reads a global of ``helpers`` set from a file at start-up:
    the function and its globals are followed through the module (until wave 41 only the module's
    plain values the forward named were)."""
    source = "SLOPE = 0.5\n\ndef act(x):\n    return x * SLOPE\n"
    try:
        helpers, net = _model_calling_a_helper(tmp_path, "ortrain_test_reads_helper", source)
        before = _key(net)
        assert before is not None and _key(net) == before
        helpers.SLOPE = 0.9  # the file unchanged: a value computed at start-up
        assert _key(net) not in (None, before)
    finally:
        sys.modules.pop("ortrain_test_reads_helper", None)
        sys.modules.pop("ortrain_test_reads_helper_model", None)


class _WithALoggerOnTheClass(nn.Module):
    log = __import__("logging").getLogger("ortrain_test_model")  # not state a forward computes with
    lock = __import__("threading").Lock()

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def test_a_logger_or_lock_on_the_class_leaves_the_model_cacheable() -> None:
    """Wave 41 keyed every value on a model's classes; a class-level logger or lock then made the
    key undescribable, and such a model silently lost its capture cache."""
    reference = _key(_WithALoggerOnTheClass())
    assert reference is not None and _key(_WithALoggerOnTheClass()) == reference


def _scaled_by(factor: float) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    import functools

    def decorate(forward: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(forward)
        def scaled(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
            return forward(self, x) * factor

        return scaled

    return decorate


def _configured_model(slope: float, factor: float) -> nn.Module:
    """A model whose method default and forward decorator come from a configuration."""

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def act(self, h: torch.Tensor, slope: float = slope) -> torch.Tensor:
            return torch.nn.functional.leaky_relu(h, slope)

        @_scaled_by(factor)
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.act(self.fc(x))

    return Block()


def test_method_defaults_and_decorator_values_miss() -> None:
    """Read from a file at start-up and changed between processes: until wave 42 the later
    process loaded the capture made with the old value."""
    reference = _key(_configured_model(0.01, 1.0))
    assert reference is not None and _key(_configured_model(0.01, 1.0)) == reference
    assert _key(_configured_model(0.7, 1.0)) != reference
    assert _key(_configured_model(0.01, 3.0)) != reference


def test_a_pytorch_function_patched_by_the_script_misses(monkeypatch: pytest.MonkeyPatch) -> None:
    reference = _key(_Block())
    gelu = torch.nn.functional.gelu
    with monkeypatch.context() as patch:
        patch.setattr(torch.nn.functional, "gelu", lambda x, approximate="none": 2 * gelu(x))
        assert _key(_Block()) != reference
    with monkeypatch.context() as patch:
        patch.setattr(torch.Tensor, "tanh", lambda self: 2 * torch.tanh(self))
        assert _key(_Block()) != reference
    assert _key(_Block()) == reference


class _Leaky:
    def __call__(self, x: torch.Tensor, inplace: bool = False) -> torch.Tensor:
        return torch.nn.functional.leaky_relu(x, 0.3)


_MUL = torch.Tensor.__mul__


@pytest.mark.parametrize(
    ("space", "name", "value"),
    [
        (torch.nn.functional, "relu", functools.partial(torch.nn.functional.leaky_relu, negative_slope=0.3)),
        (torch, "relu", torch.sigmoid),  # a PyTorch builtin under another name
        (torch.nn.functional, "gelu", torch.nn.functional.silu),
        (torch.nn.functional, "relu", _Leaky()),  # a callable object
        (torch.Tensor, "__mul__", lambda a, b: _MUL(_MUL(a, b), 2.0)),  # a dunder
        (torch.Tensor, "__pos__", torch.Tensor.neg),  # a dunder PyTorch defines, replaced
    ],
    ids=["partial", "builtin", "gelu-is-silu", "callable-object", "dunder", "own-dunder"],
)
def test_any_replaced_pytorch_function_misses(
    monkeypatch: pytest.MonkeyPatch, space: Any, name: str, value: Any
) -> None:
    """Until wave 54 only a plain Python function under a public name was keyed: each of these
    patches (read from a configuration file, say) loaded the unpatched run's capture and trained
    it, with the wrong loss and gradients."""
    reference = _key(_Block())
    with monkeypatch.context() as patch:
        patch.setattr(space, name, value)
        patched = _key(_Block())
        assert patched is not None and patched != reference
    assert _key(_Block()) == reference


def test_replaced_pytorch_functions_are_told_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    keys = set()
    for slope in (0.1, 0.3):
        with monkeypatch.context() as patch:
            patch.setattr(
                torch.nn.functional,
                "relu",
                functools.partial(torch.nn.functional.leaky_relu, negative_slope=slope),
            )
            keys.add(_key(_Block()))
    for builtin in (torch.sigmoid, torch.tanh):
        with monkeypatch.context() as patch:
            patch.setattr(torch, "relu", builtin)
            keys.add(_key(_Block()))
    assert None not in keys and len(keys) == 4


def _model_holding_a_scaler(default: float) -> nn.Module:
    class Scaler:
        def apply(self, h: torch.Tensor, s: float = default) -> torch.Tensor:
            return h * s

    class Held(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.scaler = Scaler()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.scaler.apply(self.fc(x))

    return Held()


def test_a_default_of_a_held_objects_method_misses() -> None:
    reference = _key(_model_holding_a_scaler(1.0))
    assert reference is not None and _key(_model_holding_a_scaler(1.0)) == reference
    assert _key(_model_holding_a_scaler(3.0)) != reference


_HELD_SCALE = 1.0  # read from a file at start-up, in the case this stands for


class _GlobalScaler:
    def apply(self, h: torch.Tensor) -> torch.Tensor:  # also nn.Module.apply's name
        return h * _HELD_SCALE


class _HoldsAGlobalScaler(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.scaler = _GlobalScaler()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scaler.apply(self.fc(x))


def test_a_global_read_by_a_held_objects_method_misses(monkeypatch: pytest.MonkeyPatch) -> None:
    """Until wave 45 a held object's methods were keyed by their code and defaults only: a later
    process with another ``_HELD_SCALE`` loaded the capture made with the first (loss 1.99 where
    eager's was 2.14), where a module's methods had their globals keyed."""
    reference = _key(_HoldsAGlobalScaler())
    assert reference is not None and _key(_HoldsAGlobalScaler()) == reference
    monkeypatch.setattr(sys.modules[__name__], "_HELD_SCALE", 3.0)
    assert _key(_HoldsAGlobalScaler()) != reference
