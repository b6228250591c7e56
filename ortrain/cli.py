"""The ``ortrain`` command: ``ortrain demo`` trains a small GPT; ``ortrain doctor`` shows the setup."""

from __future__ import annotations

import argparse
import sys


def _doctor() -> int:
    import onnx
    import onnxruntime
    import onnxscript
    import torch

    import ortrain

    print(f"ortrain      {ortrain.__version__}")
    print(f"python       {sys.version.split()[0]}")
    print(f"torch        {torch.__version__}")
    print(f"onnx         {onnx.__version__}")
    print(f"onnxscript   {onnxscript.__version__}")
    print(f"onnxruntime  {onnxruntime.__version__} ({', '.join(onnxruntime.get_available_providers())})")
    try:
        import triton

        print(f"triton       {triton.__version__}")
    except ImportError:
        print("triton       not installed (Triton kernels are used on NVIDIA GPUs only)")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ortrain", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="train a small GPT on text shipped with ortrain")
    demo.add_argument("--steps", type=int, default=300)
    commands.add_parser("doctor", help="print versions and available execution providers")
    args = parser.parse_args(argv)
    if args.command == "doctor":
        return _doctor()
    from ortrain.demo import DemoSettings, run_demo

    result = run_demo(DemoSettings(steps=args.steps), report=print)
    return 0 if result.last_loss < result.first_loss else 1


if __name__ == "__main__":
    sys.exit(main())
