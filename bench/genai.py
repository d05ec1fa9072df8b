"""Greedy tokens/s of edgefleet's decoder engine against ONNX Runtime GenAI's own
``Generator``, side by side on the same GenAI folders (``modelgen.make_genai_lm``, and
its int4 build ``make_genai_int4``), both on one intra-op thread."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from actors.decoder import DecoderEngine, Generation
from bench.common import RunContext, Section, Target, calm, fmt, log, md_table, median
from edgefleet.modelgen import make_genai_int4, make_genai_lm
from edgefleet.request import GenerateRequest

TITLE = "Generation against ONNX Runtime GenAI's Generator: tokens/s, one thread"
# The default tiny build, and one of about 40 M parameters (16 k vocabulary, hidden
# 512, 10 layers, grouped-query attention with 4 K/V heads).
SIZES: dict[str, dict[str, int]] = {
    "tiny": {},
    "40M": {
        "heads": 8,
        "kv_heads": 4,
        "head_dim": 64,
        "layers": 10,
        "vocab": 16000,
        "max_context": 1024,
    },
}
PROMPT = tuple(range(3, 35))  # 32 tokens
TARGET_RATIO = 1.0  # engine tokens/s at least the Generator's
MIN_RUN_S = 0.5


def _parameters(folder: Path) -> int:
    """Parameters of a GenAI folder's float32 model, from its genai_config.json."""
    model = json.loads((folder / "genai_config.json").read_text())["model"]
    d = model["decoder"]
    hidden, kv = d["hidden_size"], d["num_key_value_heads"] * d["head_size"]
    layer = 2 * hidden * hidden + 2 * hidden * kv + 6 * hidden * hidden + 2 * hidden
    return 2 * model["vocab_size"] * hidden + d["num_hidden_layers"] * layer + hidden


Run = Callable[[], tuple[float, float, list[int]]]  # wall s, CPU s, tokens


def _generator_loop(og: Any, folder: Path, n: int) -> Run:
    """A greedy generation by ONNX Runtime GenAI's Generator at one thread."""
    config = og.Config(str(folder))
    one_thread = {"session_options": {"intra_op_num_threads": 1, "inter_op_num_threads": 1}}
    config.overlay(json.dumps({"model": {"decoder": one_thread}}))
    model = og.Model(config)

    def run() -> tuple[float, float, list[int]]:
        t0, cpu0 = time.perf_counter(), time.thread_time()
        params = og.GeneratorParams(model)
        params.set_search_options(do_sample=False, max_length=len(PROMPT) + n)
        generator = og.Generator(model, params)
        generator.append_tokens(np.array([PROMPT], dtype=np.int32))
        tokens = []
        while not generator.is_done():
            generator.generate_next_token()
            tokens.append(int(generator.get_next_tokens()[0]))
        return time.perf_counter() - t0, time.thread_time() - cpu0, tokens

    return run


def _engine_loop(folder: Path, n: int, *, in_place: bool = True) -> Run:
    """The same generation by edgefleet's DecoderEngine at one thread; ``in_place``
    False: its decode steps copy the cache each token (as before they wrote it in place)."""
    engine = DecoderEngine("m", folder / "model.onnx", threads=1)
    engine._share_buffer = engine._share_buffer and in_place
    engine.warmup()

    def run() -> tuple[float, float, list[int]]:
        t0, cpu0 = time.perf_counter(), time.thread_time()
        request = GenerateRequest("m", PROMPT, max_new_tokens=n)
        gen = Generation(request, limit=n, emit=lambda t: None, max_context=engine.max_context)
        engine.advance(gen)
        return time.perf_counter() - t0, time.thread_time() - cpu0, gen.generated

    return run


def _repeated(loop: Run, times: int) -> tuple[float, float]:
    """Wall and CPU seconds of ``times`` generations."""
    wall = cpu = 0.0
    for _ in range(times):
        w, c, _tokens = loop()
        wall, cpu = wall + w, cpu + c
    return wall, cpu


def _models(ctx: RunContext) -> list[tuple[str, Path, int]]:
    """The GenAI folders, float32 and int4 of each size: label, folder, parameters."""
    root = ctx.models.directory / "genai"
    folders = []
    for size, kw in SIZES.items():
        t0 = time.perf_counter()
        fp32 = make_genai_lm(root / f"{size}-fp32", **kw).parent
        int4 = make_genai_int4(fp32, root / f"{size}-int4").parent
        params = _parameters(fp32)
        log(f"  {size}: {params / 1e6:.1f} M parameters, built in {time.perf_counter() - t0:.0f} s")
        folders += [(f"{size} fp32", fp32, params), (f"{size} int4", int4, params)]
    return folders


def run(ctx: RunContext) -> Section:
    try:
        import onnxruntime_genai as og
    except ImportError:
        return Section(
            TITLE, "Not run: onnxruntime-genai is not installed (pip install -e '.[dev]')."
        )
    n, rounds = ctx.count(192, 48), ctx.count(7, 2)
    rows, targets = [], []
    for label, folder, params in _models(ctx):
        loops = {
            "generator": _generator_loop(og, folder, n),
            "engine": _engine_loop(folder, n),
            "copying": _engine_loop(folder, n, in_place=False),
        }
        first = {k: loop() for k, loop in loops.items()}  # warm up; the tokens made
        tokens = {k: r[2] for k, r in first.items()}
        # A measurement is at least MIN_RUN_S of generations: a tiny model's one is a
        # few ms, which a scheduler tick of another process would swamp.
        times = max(1, math.ceil(MIN_RUN_S / first["generator"][0]))
        runs: dict[str, list[tuple[float, float]]] = {k: [] for k in loops}
        for _ in range(rounds):  # alternate, so drift hits both alike
            for k, loop in loops.items():
                runs[k].append(calm(partial(_repeated, loop, times), f"{k} {label}").value)
        made = len(tokens["generator"]) * times
        wall = {k: made / median([r[0] for r in v]) for k, v in runs.items()}
        cpu = {k: made / median([r[1] for r in v]) for k, v in runs.items()}
        same = tokens["engine"] == tokens["generator"] == tokens["copying"]
        figures = ", ".join(f"{k} {wall[k]:.0f} tok/s, {cpu[k]:.0f} tok/CPU-s" for k in loops)
        log(f"  {label}: {figures}; same tokens: {same}")
        ratio, cpu_ratio = wall["engine"] / wall["generator"], cpu["engine"] / cpu["generator"]
        rows.append(
            [label, fmt(params / 1e6, 1), fmt(wall["generator"], 0), fmt(wall["engine"], 0)]
            + [fmt(ratio, 2), fmt(cpu["generator"], 0), fmt(cpu["engine"], 0)]
            + [fmt(cpu_ratio, 2), fmt(cpu["copying"], 0), "yes" if same else "NO"]
        )
        what = f"{label}: engine / Generator tokens per CPU-second"
        targets.append(Target(what, cpu_ratio, ">=", TARGET_RATIO))
        targets.append(
            Target(f"{label}: same tokens as the Generator (1: yes)", float(same), ">=", 1, 0)
        )
    measured = (
        f"Greedy generation of {n} tokens after a {len(PROMPT)}-token prompt (the prefill "
        "included), batch 1, one intra-op thread in both: ONNX Runtime GenAI's Generator "
        "(its genai_config.json's session options overlaid with intra_op_num_threads 1) and "
        "edgefleet's DecoderEngine (advance, as a node runs it), on the same folders. "
        f"Medians of {rounds} alternating rounds (each of at least {MIN_RUN_S:g} s of "
        "generations): tokens/s on the wall clock, and tokens per "
        "second of the calling thread's CPU time (both run there), which other processes "
        "on a shared machine disturb less; the target is on the latter. int4: MatMulNBits, "
        "block 32, accuracy_level 4 (ONNX Runtime's quantizer, as the GenAI builder does for "
        "the CPU). 'copying': the engine with its decode steps copying the whole cache "
        "each token (present to past), as before they wrote it in place."
    )
    header = ["model", "M params", "Generator tok/s", "engine tok/s", "ratio"]
    header += ["Generator tok/CPU-s", "engine tok/CPU-s", "CPU ratio", "copying tok/CPU-s"]
    header += ["same tokens"]
    return Section(TITLE, measured, [md_table(header, rows)], targets)
