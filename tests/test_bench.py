"""``ortrain bench`` and ``ortrain doctor``."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from ortrain import bench
from ortrain.cli import main


def test_bench_quick_writes_table_json_and_chart(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib", reason="the PNG chart needs the bench extra")
    assert main(["bench", "--quick", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| MLP |")]
    labels = ["eager", "eager, ortrain's malloc", "torch.compile", "ortrain"]
    assert [row.split("|")[2].strip() for row in rows] == labels
    eager_row = rows[0].split("|")
    assert eager_row[4].strip() == "1.00" and eager_row[8].strip() == "1.00"  # ratios to eager
    assert rows[2].split("|")[5].strip() == "1.00"  # torch.compile against itself
    payload = json.loads((tmp_path / "ortrain-bench.json").read_text())
    assert payload["environment"]["torch"] == torch.__version__
    assert {r["competitor"] for r in payload["results"]} == {"eager", "eager-malloc", "compile", "ortrain"}
    for result in payload["results"]:
        assert result["step_ms"] > 0 and result["peak_mib"] > 100 and result["first_s"] > 0
    png = (tmp_path / "ortrain-bench.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 5000


def test_sft_model_scores_half_the_labels_and_trains() -> None:
    _, (_, targets) = bench.build_model("sft", bench.QUICK)
    assert (targets == -100).float().mean().item() == 0.5
    result = bench.run_competitor("sft", "eager", steps=2, sizes=bench.QUICK)
    assert result["step_ms"] > 0
    assert result["faults"] >= 0 and result["system_ms"] >= 0  # per steady step, from getrusage


def test_user_model_by_module_and_factory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "my_bench_model.py").write_text(
        textwrap.dedent(
            """
            import torch

            class Net(torch.nn.Module):
                def __init__(self):
                    super().__init__()
                    self.linear = torch.nn.Linear(4, 1)

                def forward(self, x, y):
                    return {"loss": torch.nn.functional.mse_loss(self.linear(x), y)}

            def build():
                return Net(), {"x": torch.randn(8, 4), "y": torch.randn(8, 1)}
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    for competitor in ("eager", "ortrain"):
        assert bench.run_competitor("my_bench_model:build", competitor, steps=2)["step_ms"] > 0
    with pytest.raises(ValueError, match="module:factory"):
        bench.build_model("resnet")


def test_a_model_in_a_package_of_the_working_directory_is_found_by_the_parent_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``python benchmarks/bench_ortmodule.py --models benchmarks.hf_models:t5`` from the
    repository root: the children (``python -m``) found the package, the parent (its path starts
    at ``benchmarks/``) failed when it timed the GEMMs, after every child had run (wave 50)."""
    package = tmp_path / "my_benchmarks"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "models.py").write_text(
        "import torch\n\ndef build():\n    return torch.nn.Linear(4, 1), (torch.randn(8, 4),)\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    model, batch = bench.build_model("my_benchmarks.models:build")
    assert isinstance(model, torch.nn.Linear) and batch[0].shape == (8, 4)
    with pytest.raises(bench.ModelFactoryError, match=r"cannot import module 'no_such_package\.models'"):
        bench.build_model("no_such_package.models:build")


def test_chart_without_matplotlib_says_what_to_install(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    result = bench.BenchResult("mlp", "eager", step_ms=1.0, first_s=0.1, peak_mib=300.0)
    with pytest.raises(ImportError, match=r'pip install "ortrain\[bench\]"'):
        bench.write_chart([result], tmp_path / "x.png")


def test_doctor_checks_providers_extras_and_a_training_run(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "ok  CPUExecutionProvider: runs a graph" in out
    for extra in ("transformers", "deepspeed", "triton"):
        assert f" {extra}: " in out
    assert "ok  tiny MLP, 4 SGD steps on ONNX Runtime" in out
    assert "freed memory reuse (ORTMODULE_REUSE_FREED_MEMORY): " in out


def test_gemm_speed_records_the_steps_products_and_times_both_libraries() -> None:
    from ortrain.gemm_speed import gemm_gflops, product_shapes

    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    x = torch.randn(4, 16)
    shapes = product_shapes(lambda: model(x).sum().backward())
    # forward: two addmm; backward: each layer's weight gradient, and the second layer's input gradient
    assert shapes[(0, 4, 16, 32)] == 1 and shapes[(0, 4, 32, 8)] == 1
    assert sum(shapes.values()) == 5
    speed = gemm_gflops(shapes, repeats=2)
    assert set(speed) == {"torch", "onnxruntime"} and all(v > 0 for v in speed.values())


def test_ortrain_breakdown_names_onnx_operators(tmp_path: Path) -> None:
    from ortrain.runtime.ort_profile import profiling

    with profiling(tmp_path):  # tuning off (tests/conftest.py): everything stays in ONNX Runtime
        result = bench.run_competitor("gpt-softmax", "ortrain", steps=2, sizes=bench.QUICK, breakdown=True)
    assert result["placements"] == {} and result["tuning_steps"] == 0
    breakdown = result["breakdown_ms"]
    assert {"onnxruntime MatMul", "onnxruntime Softmax"} <= set(breakdown)
    assert all(ms >= 0 for ms in breakdown.values())
    assert list(tmp_path.glob("ortrain_session*.json"))  # ONNX Runtime's own profiles


def test_details_show_the_profiled_runs_own_step_beside_its_breakdown() -> None:
    run = {"placements": {"forward": "onnxruntime", "backward": "onnxruntime"}}
    result = bench.BenchResult("gpt", "ortrain", step_ms=147.0, first_s=1.0, peak_mib=800.0, runs=[run])
    result.breakdown_ms = {"onnxruntime MatMul": 90.0, "onnxruntime Mul": 9.5, "torch (regions)": 2.0}
    result.profiled_step_ms = 157.0
    (line,) = [x for x in bench.format_details([result], top=2) if "per step" in x]
    expected = "(profiled step 157.0 ms): onnxruntime MatMul 90.0, onnxruntime Mul 9.5, other 2.0"
    assert line == f"  ortrain ms per step {expected}"


@pytest.mark.parametrize("name", ["lstm", "cnn"])
def test_lstm_and_cnn_models_train_under_ortrain_like_eager(name: str) -> None:
    import copy

    from ortrain import ORTModule

    model, batch = bench.build_model(name, bench.QUICK)
    eager = copy.deepcopy(model)
    wrapped = ORTModule(model)
    losses: dict[str, list[float]] = {"eager": [], "ortrain": []}
    for label, module in (("eager", eager), ("ortrain", wrapped)):
        optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
        for _ in range(3):
            optimizer.zero_grad()
            loss = module(*batch)
            loss.backward()
            optimizer.step()
            losses[label].append(loss.item())
    torch.testing.assert_close(losses["ortrain"], losses["eager"], rtol=1e-4, atol=1e-5)
    assert losses["eager"][-1] < losses["eager"][0]
