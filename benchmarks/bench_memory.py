"""A bigger batch in the same memory: eager, torch.compile and ortrain at memory optimizer levels 0/1/2.

For each competitor, in fresh child processes:

- the largest batch of a GPT-style model (the tiny GPT at sequence length 512) that trains a few
  steps under a fixed memory cap. The cap is enforced without cgroups: a watchdog thread in the
  child polls its resident set and kills the process past the cap, and the kernel's high-water
  mark (``VmHWM``) is checked at the end so that a spike between two polls also counts as a miss;
- at one common batch: median step time (ortrain: after op tuning has chosen its placements; the
  race's steps count towards the peak and the cap, not the time), peak RSS, and the activation
  bytes saved for backward (ortrain: what the forward graph stashes, from the memory optimizer's
  report; eager and torch.compile: what autograd saves, through
  ``torch.autograd.graph.saved_tensors_hooks``).

    python benchmarks/bench_memory.py [--cap-mib 3072] [--batch 8] [--steps 4] [--quick] [--no-search]

``--no-search`` measures the common batch only (step time, peak, saved activations: one child
per competitor). ``--quick`` shrinks everything (seq 64, 2 layers, small cap) to check that the script works.
Print ``lscpu``'s model with the figures: CPUs differ.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time

import torch

COMPETITORS = ("eager", "compile", "ortrain-0", "ortrain-1", "ortrain-2")
_OVER_CAP = 3  # the child's exit status when the watchdog stopped it


def _status_mib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) // 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _watchdog(cap_mib: int) -> None:
    def watch() -> None:
        while True:
            if _status_mib("VmRSS") > cap_mib:
                os._exit(_OVER_CAP)
            time.sleep(0.002)

    threading.Thread(target=watch, daemon=True).start()


def _model(quick: bool) -> tuple[torch.nn.Module, int, int]:
    from ortrain.models.tiny_gpt import GPTConfig, TinyGPT

    torch.manual_seed(0)
    if quick:
        config = GPTConfig(vocab_size=512, block_size=64, n_layer=2, n_head=4, d_model=64)
    else:
        config = GPTConfig(vocab_size=8000, block_size=512, n_layer=4, n_head=4, d_model=256)
    return TinyGPT(config), config.vocab_size, config.block_size


def run_child(competitor: str, batch: int, steps: int, quick: bool, cap_mib: int) -> dict[str, float]:
    if cap_mib:
        _watchdog(cap_mib)
    model, vocab, seq = _model(quick)
    if competitor.startswith("ortrain"):
        # The options module reads the level when the ORTModule is created.
        os.environ["ORTMODULE_MEMORY_OPT_LEVEL"] = competitor.split("-")[1]
        from ortrain import ORTModule

        model = ORTModule(model)
    elif competitor == "compile":
        model = torch.compile(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(0)
    idx = torch.randint(0, vocab, (batch, seq), generator=generator)
    targets = torch.roll(idx, -1, dims=1)

    def train_step() -> None:
        optimizer.zero_grad(set_to_none=True)
        model(idx, targets)[1].backward()
        optimizer.step()

    train_step()  # captures (ortrain) or compiles: not timed
    if competitor.startswith("ortrain"):
        # Op tuning's race runs both placements; its memory counts against the cap, its time not.
        from ortrain.bench import train_while_tuning

        train_while_tuning(model, train_step)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        train_step()
        times.append(time.perf_counter() - start)
    saved = 0 if competitor.startswith("ortrain") else _saved_activation_bytes(model, idx, targets)
    result = {
        "step_ms": statistics.median(times) * 1000,
        "peak_mib": float(_status_mib("VmHWM")),
        "saved_mib": saved / 2**20,
    }
    if competitor.startswith("ortrain"):
        from ortrain.ortmodule.memory_reports import memory_reports

        (report,) = memory_reports(model)  # type: ignore[arg-type]
        result["saved_mib"] = report.stashed_bytes / 2**20
        result["saved_level0_mib"] = report.stashed_bytes_before / 2**20
    return result


def _saved_activation_bytes(model: torch.nn.Module, idx: torch.Tensor, targets: torch.Tensor) -> int:
    params = {p.data_ptr() for p in model.parameters()} | {idx.data_ptr(), targets.data_ptr()}
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.data_ptr() not in params:
            storage = tensor.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(idx, targets)[1]
    loss.backward()
    return sum(storages.values())


def _child(competitor: str, batch: int, args: argparse.Namespace, cap_mib: int) -> dict[str, float] | None:
    command = [sys.executable, __file__, "--child", competitor, str(batch), "--steps", str(args.steps)]
    command += ["--cap-mib", str(cap_mib)] + (["--quick"] if args.quick else [])
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        if done.returncode not in (_OVER_CAP, -9):  # killed for memory is an answer, a crash is not
            raise RuntimeError(f"{competitor} at batch {batch} failed:\n{done.stderr[-3000:]}")
        return None
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return result if not cap_mib or result["peak_mib"] <= cap_mib else None


def largest_batch(competitor: str, args: argparse.Namespace) -> int:
    """Doubling, then bisection, over batches that train under the cap."""
    fits, fails = 0, None
    batch = args.start_batch
    while fails is None and batch <= args.max_batch:
        if _child(competitor, batch, args, args.cap_mib) is None:
            fails = batch
        else:
            fits, batch = batch, batch * 2
    if fails is None:
        return fits
    while fails - fits > max(1, fits // 8):  # within 12.5%: each probe is a whole capture
        middle = (fits + fails) // 2
        if _child(competitor, middle, args, args.cap_mib) is None:
            fails = middle
        else:
            fits = middle
    return fits


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cap-mib", type=int, default=3072)
    parser.add_argument("--batch", type=int, default=8, help="the common batch for step time and peak")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--start-batch", type=int, default=4)
    parser.add_argument("--max-batch", type=int, default=256)
    parser.add_argument("--competitors", default=",".join(COMPETITORS))
    parser.add_argument("--quick", action="store_true", help="tiny sizes, to check that the script runs")
    parser.add_argument("--no-search", action="store_true", help="skip the largest-batch search")
    parser.add_argument("--child", nargs=2, metavar=("COMPETITOR", "BATCH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        result = run_child(args.child[0], int(args.child[1]), args.steps, args.quick, args.cap_mib)
        print(json.dumps(result))
        return
    if args.quick:
        args.cap_mib, args.batch, args.steps, args.start_batch, args.max_batch = 1100, 4, 2, 8, 16
    competitors = args.competitors.split(",")
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; cap {args.cap_mib} MiB; "
        f"common batch {args.batch}{' (quick)' if args.quick else ''}"
    )
    rows = {}
    for competitor in competitors:
        at_batch = _child(competitor, args.batch, args, 0)
        assert at_batch is not None
        rows[competitor] = (0 if args.no_search else largest_batch(competitor, args), at_batch)
    eager_batch, eager = rows.get("eager", next(iter(rows.values())))
    print(
        f"{'competitor':10} {'max batch':>9} {'vs eager':>8} {'step ms':>8} {'vs eager':>8} "
        f"{'peak MiB':>8} {'saved act. MiB':>14}"
    )
    for competitor, (batch, r) in rows.items():
        print(
            f"{competitor:10} {batch:9d} {batch / max(eager_batch, 1):8.2f} {r['step_ms']:8.1f} "
            f"{r['step_ms'] / eager['step_ms']:8.2f} {r['peak_mib']:8.0f} {r['saved_mib']:14.1f}"
        )
    if "ortrain-1" in rows and "ortrain-0" in rows:
        level0, level1 = rows["ortrain-0"][1], rows["ortrain-1"][1]
        # Level 0 recomputes SDPA's attention probabilities as eager's fused kernel does; the
        # saving is given against stashing everything (no recompute plan) and against level 0.
        saved = 1 - level1["saved_mib"] / level1["saved_level0_mib"]
        saved_vs_level0 = 1 - level1["saved_mib"] / level0["saved_mib"]
        slower = level1["step_ms"] / level0["step_ms"] - 1
        line = (
            f"level 1: {saved:.0%} less activation memory than without recompute (target >= 40%), "
            f"{saved_vs_level0:.0%} less than level 0; {slower:+.0%} step time against level 0 "
            "(target <= +15%)"
        )
        if not args.no_search:
            ratio = rows["ortrain-1"][0] / max(eager_batch, 1)
            line += f"; largest batch {ratio:.2f}x eager's (target >= 1.5x)"
        print(line)


if __name__ == "__main__":
    main()
