"""`edgefleet models make` and `models show`: the built-in test models, and what a
model takes and gives."""

from __future__ import annotations

import argparse
from pathlib import Path

from cluster.cli.common import RawHelpFormatter, Subparsers, err, say
from edgefleet.errors import EdgeFleetError

# The built-in models, named for help without importing edgefleet.modelgen: it imports
# ONNX, which takes seconds, on every command (a test checks these are modelgen's).
BUILTIN = ("classifier", "detector", "stateful", "slow", "heavy", "tiny_lm")


def add_parser(sub: Subparsers) -> None:
    models = sub.add_parser(
        "models", help="generate the built-in test models; show a model's inputs and outputs"
    )
    models_sub = models.add_subparsers(dest="models_command", required=True, metavar="ACTION")
    builtin = ", ".join(BUILTIN)
    make = models_sub.add_parser(
        "make",
        help="write deterministic small ONNX models into DIR",
        description=f"Write the built-in test models ({builtin}) into DIR as NAME.onnx. "
        "A fleet file naming a missing NAME.onnx gets it written by `up` and `demo`.",
        epilog="example: edgefleet models make configs/models --only classifier slow",
    )
    make.add_argument("dir", metavar="DIR")
    make.add_argument(
        "--only", nargs="+", metavar="NAME", help=f"only these models (default: all: {builtin})"
    )
    make.set_defaults(func=cmd_models_make)
    show = models_sub.add_parser(
        "show",
        help="show a model's inputs and outputs (names, dtypes, shapes): what to put in an .npz",
        description="Load each model as a node would and print its inputs and outputs,\n"
        "with a numpy line that writes an .npz of inputs it takes (for `edgefleet infer`).",
        epilog="examples:\n"
        "  edgefleet models show configs/local.yaml classifier detector\n"
        "  edgefleet models show configs/models/classifier.onnx\n"
        "then, in Python, an .npz of named arrays for `edgefleet infer --input`:\n"
        "  import numpy as np\n"
        "  np.savez('frame.npz', images=np.zeros((1, 3, 32, 32), 'float32'))",
        formatter_class=RawHelpFormatter,
    )
    show.add_argument("target", metavar="CONFIG|FILE.onnx", help="a fleet YAML or a model file")
    show.add_argument(
        "models", nargs="*", metavar="MODEL", help="models of CONFIG to show (default: all)"
    )
    show.set_defaults(func=cmd_models_show)


def cmd_models_make(args: argparse.Namespace) -> int:
    from edgefleet.modelgen import BUILTIN_MODELS

    names = args.only or list(BUILTIN_MODELS)
    unknown = [n for n in names if n not in BUILTIN_MODELS]
    if unknown:
        err(f"unknown model(s): {', '.join(unknown)}; built-in: {', '.join(BUILTIN_MODELS)}")
        return 2
    directory = Path(args.dir)
    for i, name in enumerate(names, 1):
        spec = BUILTIN_MODELS[name]
        path = spec(directory / spec.filename)
        say(f"[{i}/{len(names)}] {name:<11} {path} ({path.stat().st_size / 1024:.0f} KiB)")
    return 0


def cmd_models_show(args: argparse.Namespace) -> int:
    from cluster.modelfiles import model_signature, signature_lines
    from edgefleet.config import ModelConfig, load_config

    target = Path(args.target)
    if target.suffix == ".onnx":
        if args.models:
            err("MODEL names go with a fleet YAML; for an .onnx file, give the file alone")
            return 2
        models = {target.stem: ModelConfig(path=target.absolute())}
    else:
        config = load_config(target)
        unknown = [n for n in args.models if n not in config.models]
        if unknown:
            known = ", ".join(config.models)
            err(f"unknown model(s): {', '.join(unknown)}; {target} has: {known}")
            return 2
        models = {n: config.models[n] for n in args.models or config.models}
    failed = 0
    for name, model in models.items():
        try:
            sig = model_signature(name, model)
        except EdgeFleetError as exc:
            err(f"error: {exc}")
            failed += 1
            continue
        say("\n".join(signature_lines(name, model, sig)) + "\n")
    say("(a name or N in a shape is a dynamic dimension: any size; one name, one size)")
    return 2 if failed else 0
