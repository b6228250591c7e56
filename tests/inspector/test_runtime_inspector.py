"""ORTMODULE_PRINT_INPUT_DENSITY and ORTMODULE_PRINT_MEMORY_STATS: the figures, the tables, the data."""

from __future__ import annotations

import gc
import logging

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from ortrain import ORTModule
from ortrain.inspector.memory_stats import PHASES
from ortrain.inspector.runtime_inspector import input_names
from ortrain.ortmodule.options import runtime_options
from ortrain.ortmodule.schema import flatten

PAD, IGNORE = 0, -1


class ShiftedLM(nn.Module):
    """Embedding with a padding_idx; the labels are shifted inside the model, as HF causal LMs do."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 16, padding_idx=PAD)
        self.head = nn.Linear(16, 50)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        logits = self.head(self.embed(batch["input_ids"]))[:, :-1]
        labels = batch["labels"][:, 1:]
        return F.cross_entropy(logits.reshape(-1, 50), labels.reshape(-1), ignore_index=IGNORE)


def _batch(real_tokens: int, counted_labels: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(1, 50, (2, 8))
    ids.view(-1)[real_tokens:] = PAD
    labels = torch.full((2, 8), IGNORE)
    labels.view(-1)[:counted_labels] = 7
    return {"input_ids": ids, "labels": labels}


def test_input_density_follows_shifts_and_logs_a_table(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("ORTMODULE_PRINT_INPUT_DENSITY", "1")
    monkeypatch.setenv("ORTMODULE_LOG_LEVEL", "INFO")
    torch.manual_seed(0)
    model = ORTModule(ShiftedLM())
    with caplog.at_level(logging.INFO, logger="ortrain"):
        for real, counted in ((16, 16), (8, 4), (12, 0)):
            model(_batch(real, counted)).backward()
        model.inspector.finish()
    records = model.inspector.input_density.records
    figures = [(r.step, r.input_name, r.embedding_density, r.label_density) for r in records]
    assert figures == [
        (1, "batch['input_ids']", 1.0, None),
        (1, "batch['labels']", None, 1.0),
        (2, "batch['input_ids']", 0.5, None),
        (2, "batch['labels']", None, 0.25),
        (3, "batch['input_ids']", 0.75, None),
        (3, "batch['labels']", None, 0.0),
    ]
    text = caplog.text
    assert "input density at step 1" in text
    assert "| step | input | embedding density | label density |" in text
    assert "| 2 | batch['input_ids'] | 50.00% | - |" in text
    assert "| 3 | batch['labels'] | - | 0.00% |" in text
    assert "input density, all steps" in text
    assert model.inspector.memory_stats.records == []  # not asked for


def test_memory_stats_per_phase(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("ORTMODULE_PRINT_MEMORY_STATS", "1")
    monkeypatch.setenv("ORTMODULE_LOG_LEVEL", "INFO")
    torch.manual_seed(0)
    model = ORTModule(ShiftedLM())
    with caplog.at_level(logging.INFO, logger="ortrain"):
        for _ in range(2):
            model(_batch(16, 16)).backward()
    records = model.inspector.memory_stats.records
    assert [(r.step, r.phase) for r in records] == [(s, p) for s in (1, 2) for p in PHASES]
    for r in records:
        assert 0 < r.process_current_mib <= r.process_peak_mib
        assert r.device_current_mib is None  # CPU
    assert "memory at step 2 (MiB)" in caplog.text
    assert "| step | phase | process current | process peak | device current | device peak |" in caplog.text
    assert model.inspector.input_density.records == []


def test_records_keep_a_window_of_steps_and_the_summary_one_row_per_input_and_phase(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Every step was kept, and the end logged one row per step and input: a long run's memory
    and log grew without bound (wave 52's review)."""
    monkeypatch.setenv("ORTMODULE_PRINT_INPUT_DENSITY", "1")
    monkeypatch.setenv("ORTMODULE_PRINT_MEMORY_STATS", "1")
    monkeypatch.setenv("ORTMODULE_LOG_LEVEL", "INFO")
    torch.manual_seed(0)
    model = ORTModule(ShiftedLM())
    model.inspector.input_density.window = model.inspector.memory_stats.window = 2
    with caplog.at_level(logging.INFO, logger="ortrain"):
        for real, counted in ((16, 16), (8, 0), (12, 16), (4, 0)):
            model(_batch(real, counted)).backward()
        model.inspector.finish()
    density = model.inspector.input_density.records
    assert [(r.step, r.input_name) for r in density] == [
        (s, n) for s in (3, 4) for n in ("batch['input_ids']", "batch['labels']")
    ]
    memory = model.inspector.memory_stats.records
    assert [(r.step, r.phase) for r in memory] == [(s, p) for s in (3, 4) for p in PHASES]
    summaries = [r.getMessage() for r in caplog.records if "all steps" in r.getMessage()]
    assert len(summaries) == 2, summaries
    assert summaries[0] == (
        "input density, all steps\n"
        "| input | steps | embedding density, lowest / mean / highest | label density, lowest / mean / "
        "highest |\n"
        "|---|---:|---:|---:|\n"
        "| batch['input_ids'] | 4 | 25.00% / 62.50% / 100.00% | - |\n"
        "| batch['labels'] | 4 | - | 0.00% / 50.00% / 100.00% |"
    )
    head, *rows = summaries[1].splitlines()
    assert head == "memory, all steps: each phase's peak (MiB)"
    assert [row.split(" | ")[:2] for row in rows[2:]] == [[f"| {p}", "4"] for p in PHASES]
    assert "input density up to step 4" in caplog.text  # the steps not logged yet, before it
    model.inspector.finish()  # nothing new: not logged again
    assert len([r for r in caplog.records if "all steps" in r.getMessage()]) == 2


class _ModeLM(ShiftedLM):
    mode = 0

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return super().forward(batch) * (1.0 + self.mode)  # a Python number: one graph a mode


def test_density_sources_go_with_the_graphs_the_cache_drops(monkeypatch: pytest.MonkeyPatch) -> None:
    """The inspector kept the sources of every graph ever captured, evicted ones too."""
    monkeypatch.setenv("ORTMODULE_PRINT_INPUT_DENSITY", "1")
    monkeypatch.setenv("ORTMODULE_GRAPH_CACHE_SIZE", "1")
    torch.manual_seed(0)
    model = ORTModule(_ModeLM())
    for mode in range(2):
        model.mode = mode
        model(_batch(8, 4)).backward()
    gc.collect()
    assert len(model._ortrain_graphs) == 1
    assert len(model.inspector._sources) == 1
    assert [r.embedding_density for r in model.inspector.input_density.records[::2]] == [0.5] * 2


def test_input_names_from_signature_and_nesting() -> None:
    def forward(input_ids, attention_mask=None, *, labels=None):
        return None

    x = torch.zeros(1)
    _, spec = flatten(((x, {"a": x, "b": [x, x]}), {"labels": x}))
    assert input_names(spec, forward) == ["input_ids", "attention_mask['a']", "attention_mask['b'][0]",
                                          "attention_mask['b'][1]", "labels"]  # fmt: skip


@pytest.mark.parametrize(
    "variable",
    [
        "ORTMODULE_ENABLE_SPARSE_OPTIMIZER",
        "ORTMODULE_ENABLE_EMBEDDING_SPARSE_OPTIMIZER",
        "ORTMODULE_PRINT_INPUT_DENSITY",
        "ORTMODULE_PRINT_MEMORY_STATS",
    ],
)
def test_switches_parse_and_reject_bad_values(monkeypatch: pytest.MonkeyPatch, variable: str) -> None:
    field = variable.removeprefix("ORTMODULE_").lower()
    monkeypatch.setenv(variable, "0")
    assert getattr(runtime_options(), field) is False
    monkeypatch.setenv(variable, "1")
    assert getattr(runtime_options(), field) is True
    monkeypatch.setenv(variable, "maybe")
    with pytest.raises(ValueError, match=variable):
        runtime_options()


def test_defaults_as_upstream(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("SPARSE_OPTIMIZER", "EMBEDDING_SPARSE_OPTIMIZER", "COMPUTE_OPTIMIZER"):
        monkeypatch.delenv(f"ORTMODULE_ENABLE_{name}", raising=False)
    options = runtime_options()
    assert options.enable_sparse_optimizer and options.enable_compute_optimizer
    assert not options.enable_embedding_sparse_optimizer
    assert not options.print_input_density and not options.print_memory_stats


def test_a_memory_window_of_zero_keeps_no_records_but_every_peak(caplog: pytest.LogCaptureFixture) -> None:
    """``window = 0`` (keep nothing for plotting): the record of a step was popped, then the empty
    window indexed (IndexError, and the model went to PyTorch)."""
    from ortrain.inspector.memory_stats import PHASES, MemoryStats

    stats = MemoryStats(window=0)
    with caplog.at_level(logging.INFO, logger="ortrain.inspector"):
        for step in (1, 2):
            for phase in PHASES:
                stats.record(step, phase)
    assert stats.records == [] and set(stats.peaks) == set(PHASES)
    # Each step's table still shows its three phases (it read them back from the kept records).
    tables = [r.getMessage() for r in caplog.records if r.getMessage().startswith("memory at step")]
    assert len(tables) == 2 and all(all(f"| {phase} |" in t for phase in PHASES) for t in tables)
