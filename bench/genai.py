"""Greedy tokens/s of edgefleet's decoder engine against ONNX Runtime GenAI's own
``Generator``, side by side on the same GenAI folders (``modelgen.make_genai_lm``, and
its int4 build ``make_genai_int4``), both on one intra-op thread."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import RunContext, Section, Target, fmt, log, md_table
from bench.generation import Loop, engine_loop, paired_ratio, tokens_per_s
from edgefleet.modelgen import make_genai_int4, make_genai_lm

TITLE = "Generation against ONNX Runtime GenAI's Generator: tokens/s, one thread"
# The default tiny build, and one of about 40 M parameters (16 k vocabulary, hidden
# 512, 10 layers, grouped-query attention with 4 K/V heads).
SIZES: dict[str, dict[str, int]] = {
    "tiny": {},
    "40M": {"heads": 8, "kv_heads": 4, "head_dim": 64, "layers": 10, "vocab": 16000}
    | {"max_context": 1024},
}
PROMPT = tuple(range(3, 35))  # 32 tokens
TARGET_RATIO = 1.0  # engine tokens/s at least the Generator's
# Rounds of one generation of each loop in turn, as many as fit in about this many
# seconds of the Generator's generations, between the given least and MAX_ROUNDS: pairs
# back to back see the same machine, and many of them make a tight median.
ROUND_BUDGET_S = 20.0
MAX_ROUNDS = 101


def _parameters(folder: Path) -> int:
    """Parameters of a GenAI folder's float32 model, from its genai_config.json."""
    model = json.loads((folder / "genai_config.json").read_text())["model"]
    d = model["decoder"]
    hidden, kv = d["hidden_size"], d["num_key_value_heads"] * d["head_size"]
    layer = 2 * hidden * hidden + 2 * hidden * kv + 6 * hidden * hidden + 2 * hidden
    return 2 * model["vocab_size"] * hidden + d["num_hidden_layers"] * layer + hidden


def _generator_loop(og: Any, folder: Path, n: int) -> Loop:
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


def _measure(
    og: Any, label: str, folder: Path, params: int, n: int, rounds: int, budget_s: float
) -> tuple[list[object], list[Target]]:
    """One folder's row of the table (with the rounds measured), and its targets."""
    loops = {
        "generator": _generator_loop(og, folder, n),
        "engine": engine_loop(folder / "model.onnx", PROMPT, n),
        "copying": engine_loop(folder / "model.onnx", PROMPT, n, in_place=False),
    }
    tps = tokens_per_s(loops, rounds, f"{label} ", budget_s, MAX_ROUNDS)
    rounds = len(tps["engine"].cpu_s)
    wall, cpu = ({k: t.wall for k, t in tps.items()}, {k: t.cpu for k, t in tps.items()})
    same = tps["engine"].tokens == tps["generator"].tokens == tps["copying"].tokens
    figures = ", ".join(f"{k} {wall[k]:.0f} tok/s, {cpu[k]:.0f} tok/CPU-s" for k in loops)
    log(f"  {label}: {figures}; same tokens: {same}")
    ratio = wall["engine"] / wall["generator"]
    cpu_ratio = paired_ratio(tps["generator"], tps["engine"])
    cells = [fmt(x, 0) for x in (wall["generator"], wall["engine"])] + [fmt(ratio, 2)]
    cells += [fmt(x, 0) for x in (cpu["generator"], cpu["engine"])] + [fmt(cpu_ratio, 2)]
    row = [label, fmt(params / 1e6, 1), *cells, fmt(cpu["copying"], 0), "yes" if same else "NO"]
    return (
        [*row[:2], rounds, *row[2:]],
        [
            Target(
                f"{label}: engine / Generator tokens per CPU-second", cpu_ratio, ">=", TARGET_RATIO
            ),
            Target(f"{label}: same tokens as the Generator (1: yes)", float(same), ">=", 1, 0),
        ],
    )


def run(ctx: RunContext) -> Section:
    try:
        import onnxruntime_genai as og
    except ImportError:
        missing = "Not run: onnxruntime-genai is not installed (pip install -e '.[dev]')."
        return Section(TITLE, missing)
    n, rounds, root = ctx.count(192, 48), ctx.count(11, 2), ctx.models.directory / "genai"
    budget_s = ctx.pick(ROUND_BUDGET_S, 0.5)
    rows, targets = [], []
    for size, kw in SIZES.items():
        t0 = time.perf_counter()
        fp32 = make_genai_lm(root / f"{size}-fp32", **kw).parent
        int4 = make_genai_int4(fp32, root / f"{size}-int4").parent
        params = _parameters(fp32)
        log(f"  {size}: {params / 1e6:.1f} M parameters, built in {time.perf_counter() - t0:.0f} s")
        for label, folder in ((f"{size} fp32", fp32), (f"{size} int4", int4)):
            row, more = _measure(og, label, folder, params, n, rounds, budget_s)
            rows.append(row)
            targets += more
    measured = (
        f"Greedy generation of {n} tokens after a {len(PROMPT)}-token prompt (the prefill "
        "included), batch 1, one intra-op thread in both: ONNX Runtime GenAI's Generator "
        "(its session options overlaid with intra_op_num_threads 1) and edgefleet's "
        "DecoderEngine (advance, as a node runs it), on the same folders, in rounds of one "
        "generation of each in turn: as many rounds as fit in about "
        f"{budget_s:g} s of the Generator's generations ({rounds} at least, {MAX_ROUNDS} at "
        "most). Tokens/s on the wall clock and per second of the calling thread's CPU time "
        "(medians), which other processes disturb less; the CPU ratio (the target) is the "
        "median of the rounds' ratios, each round's runs back to back. int4: MatMulNBits, "
        "block 32, accuracy_level 4 (as the GenAI builder makes for the CPU). 'copying': "
        "the engine's decode steps copying the whole cache each token (present to past), "
        "as before they wrote it in place."
    )
    header = ["model", "M params", "rounds", "Generator tok/s", "engine tok/s", "ratio"]
    header += ["Generator tok/CPU-s", "engine tok/CPU-s", "CPU ratio", "copying tok/CPU-s"]
    return Section(TITLE, measured, [md_table([*header, "same tokens"], rows)], targets)
