"""Check CUDA and TensorRT selection on a machine with an NVIDIA GPU and
``onnxruntime-gpu``: ``python -m bench.gpu_check [--model FILE.onnx]``.

Opens the model (default: the built-in detector, written to a temporary folder) as a
node does, once per provider list, strict (no graph node may fall back to the CPU),
and prints what each session runs on. Exit 0 when CUDA and TensorRT were both
selected, 1 when one was not (with the reason), 2 when this ONNX Runtime build has
neither (not a GPU machine). Not part of the test suite: no GPU there.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from actors.engine import available_providers, open_planned
from edgefleet.errors import EdgeFleetError
from edgefleet.modelgen import make_detector
from edgefleet.providers import CPU, ProviderConfig, plan_session

CHECKS = {"cuda": ["cuda"], "tensorrt": ["tensorrt", "cuda"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__)
    parser.add_argument("--model", type=Path, help="an ONNX file (default: the detector)")
    args = parser.parse_args(argv)
    available = available_providers()
    print(f"this ONNX Runtime build has: {', '.join(available)}")
    if not {"CUDAExecutionProvider", "TensorrtExecutionProvider"} & set(available):
        print("neither CUDA nor TensorRT: not a GPU build (install onnxruntime-gpu)")
        return 2
    path = args.model or make_detector(Path(tempfile.mkdtemp()) / "detector.onnx")
    failed = 0
    for name, names in CHECKS.items():
        wanted = [ProviderConfig(name=n) for n in names] + [CPU]
        try:
            plan = plan_session(path.stem, path, wanted, available, strict=True)
            _, use = open_planned(path.stem, plan, 1)
        except EdgeFleetError as exc:
            print(f"{name}: NOT selected: {exc}")
            failed += 1
            continue
        ok = use.runs_on == name
        failed += not ok
        print(
            f"{name}: {'selected' if ok else 'NOT selected'}; the session runs on {use.describe()}"
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
