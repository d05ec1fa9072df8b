"""Generation on one node: the on-device LM scenario, resume overhead, prefix-kept
re-prefill, decoder throughput against a bare ONNX Runtime loop, and concurrent
generations decoded together against one at a time.

Models are generated decoders in the Optimum layout (``modelgen.make_tiny_lm``): a
"chat" model of about 3 ms a token on this kind of CPU for the latency parts, and
the default tiny LM (about 0.15 ms a token, where per-token overhead shows most)
beside it for throughput. The batched-decode part uses a wider, shallower model of
about 3 ms a token with grouped-query attention.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from actors.decoder import DecoderEngine, Generation
from bench.common import (
    Part,
    RunContext,
    Section,
    Summary,
    Target,
    calm,
    deployed,
    fmt,
    log,
    md_table,
    median,
    raw_session,
)
from cluster.client import FleetClient
from edgefleet.config import FleetConfig, parse_config
from edgefleet.errors import EdgeFleetError
from edgefleet.modelgen import make_tiny_lm
from edgefleet.request import GenerateRequest

TITLE = "Generation: foreground chat under background generations, pause/resume, KV trimming"
CHAT_SIZE = {"layers": 8, "heads": 8, "head_dim": 64}
SYSTEM = tuple(range(1, 193))  # a 192-token system prompt
FG_TOKENS = 40
BG_TOKENS = 200
BG_CLIENTS = 2
TARGET_TTFT_RATIO = 1.2  # edgefleet p99 TTFT <= 1.2 x alone p99 TTFT + one decode step
TARGET_FIFO_RATIO = 8.0
TARGET_RESUME_EXTRA = 0.05
TARGET_PREFILL_SAVED = 0.60
TARGET_THROUGHPUT = 0.9
# Wider and shallower than the chat model, about 3 ms a token on the reference machine,
# with grouped-query attention (7 query heads share each K/V head) as current decoders
# have it: a token's call is dominated by reading the weights, not its own KV cache.
BATCH_SIZE = {"layers": 2, "heads": 14, "head_dim": 64, "kv_heads": 2}
BATCH_GENS = 4
TARGET_BATCHED = 2.5
REFERENCE = (
    "foreground latency 1420 ms with FIFO vs 161 ms with the scheduler (about 140 ms "
    "alone); resuming costs about 22 % extra; keeping the system prompt saves 40-60 % "
    "of re-prefill"
)


def _config(
    name: str, model: Path, *, order: str = "priority", decode_batch: int = 4
) -> FleetConfig:
    generation = {"decode_batch": decode_batch}
    return parse_config(
        {
            "fleet": {"name": name},
            "local": {"nodes": 1},
            "models": {"chat": {"path": str(model), "kind": "decoder", "generation": generation}},
            "node_defaults": {"order": order, "queue": {"capacity": 64}},
            "router": {"placement": {"shed": {}}},
        },
        model.parent,
    )


def _prompt(rng: np.random.Generator, turn: int = 32) -> tuple[int, ...]:
    return (*SYSTEM, *(int(t) for t in rng.integers(1, 500, turn)))


# ------------------------------------------------------------------ (a) latency


def _foreground_run(client: FleetClient, n: int, with_background: bool) -> dict[str, list[float]]:
    """``n`` foreground chats one after another (0.1 s apart), with background
    generations saturating the node meanwhile when ``with_background``."""
    stop = threading.Event()
    bg_done = [0]

    def background(seed: int) -> None:
        rng = np.random.default_rng(seed)
        while not stop.is_set():
            try:
                stream = client.generate(
                    "chat", _prompt(rng, 64), max_new_tokens=BG_TOKENS, priority="background"
                )
                stream.collect()
                bg_done[0] += 1
            except EdgeFleetError:
                time.sleep(0.05)

    threads = [threading.Thread(target=background, args=(i,)) for i in range(BG_CLIENTS)]
    if with_background:
        for t in threads:
            t.start()
        time.sleep(1.0)  # let the node fill up
    rng = np.random.default_rng(99)
    ttft, total = [], []
    for _ in range(n):
        t0 = time.perf_counter()
        stream = client.generate("chat", _prompt(rng), max_new_tokens=FG_TOKENS)
        next(stream)
        ttft.append(time.perf_counter() - t0)
        stream.collect()
        total.append(time.perf_counter() - t0)
        time.sleep(0.1)
    stop.set()
    for t in threads:
        if t.is_alive():
            t.join()
    return {"ttft": ttft, "total": total, "bg": [float(bg_done[0])]}


def _latency(ctx: RunContext, model: Path, step_s: float) -> Part:
    n = int(ctx.pick(40, 10))
    runs: dict[str, dict[str, list[float]]] = {}
    for label, order, bg, together in (
        ("alone", "priority", False, 4),
        ("edgefleet", "priority", True, 4),
        ("FIFO", "fifo", True, 1),
        ("FIFO, decoding together", "fifo", True, 4),
    ):
        log(f"  (a) {label}: {n} foreground chats")
        name = f"gen-{label.lower().replace(',', '').replace(' ', '-')}"
        with deployed(_config(name, model, order=order, decode_batch=together)) as client:
            runs[label] = _foreground_run(client, n, bg)
    rows = []
    for label, r in runs.items():
        t, tot = Summary.of(r["ttft"]), Summary.of(r["total"])
        rows.append(
            [label, fmt(t.p50 * 1e3), fmt(t.p99 * 1e3), fmt(tot.p50 * 1e3), fmt(tot.p99 * 1e3)]
        )
    alone = Summary.of(runs["alone"]["ttft"]).p99
    ours = Summary.of(runs["edgefleet"]["ttft"]).p99
    fifo = Summary.of(runs["FIFO"]["ttft"]).p99
    bound = TARGET_TTFT_RATIO * alone + step_s
    part = Part(
        "(a) Foreground chat while background generations saturate the node",
        f"One node serving a generated decoder ({CHAT_SIZE['layers']} layers, "
        f"{step_s * 1e3:.1f} ms a token). Foreground chats: a {len(SYSTEM)}-token system "
        f"prompt plus a 32-token turn, {FG_TOKENS} new tokens, {n} one after another, "
        f"measured by the client through the router (time to first token and total). "
        f"During the edgefleet and FIFO runs {BG_CLIENTS} clients keep background "
        f"generations ({BG_TOKENS} tokens) running back to back. edgefleet pauses the "
        "background generation at the next token and resumes it afterwards; FIFO "
        "(`order: fifo`) runs in arrival order, one generation at a time as the seed "
        "measured it; 'FIFO, decoding together' lets every generation join the running "
        "decode (`decode_batch: 4`), so a chat shares each step with background rows "
        "instead of waiting for them to end.",
        tables=[
            md_table(["run", "TTFT p50 ms", "TTFT p99 ms", "total p50 ms", "total p99 ms"], rows)
        ],
        targets=[
            Target(
                f"edgefleet p99 TTFT / (1.2 x alone p99 TTFT + one decode step) "
                f"(bound {bound * 1e3:.1f} ms)",
                ours / bound,
                "<=",
                1.0,
            ),
            Target("FIFO p99 TTFT / edgefleet p99 TTFT", fifo / ours, ">=", TARGET_FIFO_RATIO),
        ],
        notes=[
            f"Background generations completed meanwhile: edgefleet "
            f"{runs['edgefleet']['bg'][0]:.0f}, FIFO {runs['FIFO']['bg'][0]:.0f}, FIFO "
            f"decoding together {runs['FIFO, decoding together']['bg'][0]:.0f}. "
            f"Reference (seed): {REFERENCE}."
        ],
    )
    return part


# ---------------------------------------------------------- (b) resume overhead


def _resume(ctx: RunContext, model: Path) -> Part:
    """Engine time of one background generation, uninterrupted vs paused several times."""
    pairs = int(ctx.pick(6, 2))
    rng = np.random.default_rng(5)
    ratios, wall_ratios, pauses, plain_ms, paused_ms = [], [], [], [], []
    with deployed(_config("gen-resume", model)) as client:
        for i in range(pairs):
            prompt = _prompt(rng)
            plain = client.generate("chat", prompt, max_new_tokens=BG_TOKENS, priority="background")
            expected = plain.collect()
            bg = client.generate("chat", prompt, max_new_tokens=BG_TOKENS, priority="background")
            next(bg)
            for _ in range(3):  # three foreground chats interrupt it
                client.generate("chat", _prompt(rng, 8), max_new_tokens=8).collect()
                time.sleep(0.05)
            tokens = bg.collect()
            assert tokens == expected, "a paused-and-resumed generation must not change"
            assert plain.result is not None and bg.result is not None
            pauses.append(bg.result.pauses)
            plain_ms.append(plain.result.engine_cpu_s * 1e3)
            paused_ms.append(bg.result.engine_cpu_s * 1e3)
            ratios.append(bg.result.engine_cpu_s / plain.result.engine_cpu_s - 1)
            wall_ratios.append(bg.result.engine_s / plain.result.engine_s - 1)
            log(f"  (b) pair {i + 1}/{pairs}: {bg.result.pauses} pauses, {ratios[-1]:+.1%}")
    extra = median(ratios)
    return Part(
        "(b) Resume overhead",
        f"The same background generation ({len(SYSTEM) + 32}-token prompt, {BG_TOKENS} "
        "tokens, greedy) run uninterrupted and then with three foreground chats arriving "
        f"while it runs; {pairs} pairs, alternating. Engine time is the node's measure, "
        "summed over every resumption: the CPU time of the engine thread (the work the "
        "engine did for this generation), and beside it the wall time, which also counts "
        "moments the operating system gave the engine's core to the foreground chats' "
        "router and client. The outputs are checked to be identical.",
        tables=[
            md_table(
                ["uninterrupted CPU ms", "paused CPU ms", "pauses", "extra CPU", "extra wall"],
                [
                    [
                        fmt(median(plain_ms)),
                        fmt(median(paused_ms)),
                        fmt(median(pauses), 0),
                        f"{extra:+.1%}",
                        f"{median(wall_ratios):+.1%}",
                    ]
                ],
            )
        ],
        targets=[
            Target(
                "engine CPU time paused-and-resumed / uninterrupted - 1",
                extra,
                "<=",
                TARGET_RESUME_EXTRA,
                3,
            )
        ],
        notes=["Reference (seed): resuming a paused task costs about 22 % extra."],
    )


# ------------------------------------------------------------ (c) re-prefill


def _reprefill(ctx: RunContext, model: Path) -> Part:
    """Resume cost after the paused cache was trimmed to the system prompt vs dropped."""
    engine = DecoderEngine("chat", model)
    rng = np.random.default_rng(11)
    repeats = int(ctx.pick(15, 5))
    kept: list[float] = []
    full: list[float] = []
    for _ in range(repeats):
        prompt = _prompt(rng, 48)
        gen = Generation(GenerateRequest("chat", prompt, max_new_tokens=80), 80, _ignore)
        while len(gen.generated) < 40:  # paused 40 tokens in
            engine.step(gen)
        cache = gen.cache
        assert cache is not None
        for keep, sink in ((len(SYSTEM), kept), (0, full)):
            gen.cache = cache.prefix(keep)
            t0 = time.perf_counter()
            engine.step(gen)
            sink.append(time.perf_counter() - t0)
            del gen.tokens[-1]
    saved = 1 - median(kept) / median(full)
    context = len(SYSTEM) + 48 + 40
    return Part(
        "(c) Re-prefill with the system prompt kept",
        f"A generation paused {40} tokens in (context {context} tokens: a {len(SYSTEM)}-token "
        "system prompt, a 48-token turn, 40 generated). Its cache is trimmed to the system "
        "prompt (what the node does past its KV budget) or dropped entirely; the resume "
        f"step then re-prefills {context - len(SYSTEM)} or {context} tokens. Engine time "
        f"of that step, median of {repeats}.",
        tables=[
            md_table(
                ["resume after", "re-prefilled tokens", "ms (median)"],
                [
                    ["trim to system prompt", context - len(SYSTEM), fmt(median(kept) * 1e3, 2)],
                    ["full drop", context, fmt(median(full) * 1e3, 2)],
                ],
            )
        ],
        targets=[
            Target("re-prefill time saved by keeping the prefix", saved, ">=", TARGET_PREFILL_SAVED)
        ],
        notes=[
            "Reference (seed): 40-60 % less re-prefill. The output is unchanged either way (tests)."
        ],
    )


# ---------------------------------------------------------------- (d) tokens/s


def _bare_loop(path: Path, prompt: tuple[int, ...], n: int) -> Callable[[], float]:
    """The plainest ONNX Runtime greedy decode loop; returns seconds for ``n`` tokens."""
    session = raw_session(path)
    names = [i.name for i in session.get_inputs()]
    past = [x for x in names if x.startswith("past_key_values.")]
    outs = ["logits", *(x.replace("past_key_values.", "present.") for x in past)]
    shape = {i.name: i.shape for i in session.get_inputs()}
    empty = [np.zeros((1, shape[x][1], 0, shape[x][3]), np.float32) for x in past]

    def run() -> float:
        t0 = time.perf_counter()
        ids = list(prompt)
        kv: list[Any] = empty
        feed_ids = ids
        for _ in range(n):
            start = len(ids) - len(feed_ids)
            feed = {
                "input_ids": np.array([feed_ids], np.int64),
                "attention_mask": np.ones((1, len(ids)), np.int64),
                "position_ids": np.arange(start, len(ids), dtype=np.int64)[None],
                **dict(zip(past, kv, strict=True)),
            }
            logits, *kv = session.run(outs, feed)
            token = int(np.argmax(logits[0, -1]))
            ids.append(token)
            feed_ids = [token]
        return time.perf_counter() - t0

    return run


def _engine_loop(path: Path, prompt: tuple[int, ...], n: int) -> Callable[[], float]:
    engine = DecoderEngine("m", path)

    def run() -> float:
        gen = Generation(GenerateRequest("m", prompt, max_new_tokens=n), n, _ignore)
        t0 = time.perf_counter()
        engine.advance(gen)
        return time.perf_counter() - t0

    return run


def _throughput(ctx: RunContext, models: dict[str, Path]) -> Part:
    n = int(ctx.pick(256, 64))
    rounds = int(ctx.pick(7, 3))
    prompt = tuple(range(1, 33))
    rows, targets = [], []
    for label, path in models.items():
        bare, ours = _bare_loop(path, prompt, n), _engine_loop(path, prompt, n)
        bare(), ours()  # warm up
        b, o = [], []
        for _ in range(rounds):  # alternate, so drift hits both alike
            b.append(calm(bare, f"bare {label}").value)
            o.append(calm(ours, f"engine {label}").value)
        ratio = median(b) / median(o)
        node_tps = _through_node(path, prompt, n, label)
        rows.append(
            [label, fmt(n / median(b), 0), fmt(n / median(o), 0), fmt(ratio, 2), fmt(node_tps, 0)]
        )
        targets.append(
            Target(
                f"{label}: engine tokens/s / bare ONNX Runtime loop", ratio, ">=", TARGET_THROUGHPUT
            )
        )
    return Part(
        "(d) Decoder throughput vs a bare ONNX Runtime loop",
        f"Greedy decoding of {n} tokens after a 32-token prompt, batch 1, one intra-op "
        f"thread. 'bare' is the plainest possible ONNX Runtime loop (numpy feeds, "
        f"present -> past, argmax); 'engine' is edgefleet's DecoderEngine with its "
        f"bookkeeping (stop checks, budget, token callback). Medians of {rounds} "
        "alternating rounds. 'via node' streams the same generation through the router "
        "and a node actor, end to end (for information).",
        tables=[md_table(["model", "bare tok/s", "engine tok/s", "ratio", "via node tok/s"], rows)],
        targets=targets,
    )


# ------------------------------------------------------------ (e) batched decode


def _batch_run(
    engine: DecoderEngine, prompts: list[tuple[int, ...]], n: int, together: bool
) -> tuple[float, float, list[Generation]]:
    """Prefill the prompts one by one (the first token each), then decode them together
    or one after another; return the seconds of both phases and the generations."""
    gens = [
        Generation(GenerateRequest(engine.name, p, max_new_tokens=n), n, _ignore) for p in prompts
    ]
    t0 = time.perf_counter()
    for gen in gens:
        engine.step(gen)
    t1 = time.perf_counter()
    if together:
        engine.advance_batch(gens)
    else:
        for gen in gens:
            engine.advance(gen)
    return t1 - t0, time.perf_counter() - t1, gens


def _batch_seconds(
    engine: DecoderEngine, prompts: list[tuple[int, ...]], n: int, together: bool
) -> tuple[float, float]:
    prefill_s, decode_s, _ = _batch_run(engine, prompts, n, together)
    return prefill_s, decode_s


def _batched(ctx: RunContext, model: Path) -> Part:
    """Tokens/s of concurrent background generations decoded together by
    ``advance_batch`` against one after another by ``advance`` (what a node without
    batched decode does), on the same engine, with short and long prompts."""
    n = int(ctx.pick(BG_TOKENS, 64))
    rounds = int(ctx.pick(5, 2))
    engine = DecoderEngine("bg", model)
    rng = np.random.default_rng(21)
    turns = [[int(t) for t in rng.integers(1, 500, 16 * (i + 1))] for i in range(BATCH_GENS)]
    workloads = {  # prompts of unequal lengths, so rows are padded
        "short prompts": [tuple(t) for t in turns],
        "system prompt": [(*SYSTEM, *t) for t in turns],
    }
    decoded = BATCH_GENS * (n - 1)  # each prefill call makes the first token
    rows, targets = [], []
    for label, prompts in workloads.items():
        _, _, alone = _batch_run(engine, prompts, n, False)  # also the warm-up
        _, _, batched = _batch_run(engine, prompts, n, True)
        assert [g.generated for g in batched] == [g.generated for g in alone], (
            "decoding together must not change any generation's tokens"
        )
        one: list[tuple[float, float]] = []
        many: list[tuple[float, float]] = []
        for _ in range(rounds):  # alternate, so drift hits both alike
            for together, sink in ((False, one), (True, many)):
                measure = partial(_batch_seconds, engine, prompts, n, together)
                mode = "together" if together else "one at a time"
                sink.append(calm(measure, f"{label} {mode}").value)
        one_total = median([p + d for p, d in one])
        many_total = median([p + d for p, d in many])
        one_decode = median([d for _, d in one])
        many_decode = median([d for _, d in many])
        ratio = one_decode / many_decode
        log(f"  (e) {label}: decoding together {ratio:.2f}x the tokens/s of one at a time")
        lengths = sorted(len(p) for p in prompts)
        rows.append(
            [
                label,
                f"{lengths[0]}-{lengths[-1]}",
                fmt(one_decode / decoded * 1e3, 2),
                fmt(BATCH_GENS * n / one_total, 0),
                fmt(BATCH_GENS * n / many_total, 0),
                fmt(one_total / many_total, 2),
                fmt(decoded / one_decode, 0),
                fmt(decoded / many_decode, 0),
                fmt(ratio, 2),
            ]
        )
        targets.append(
            Target(
                f"{label}: decode tokens/s of {BATCH_GENS} generations together / one at a time",
                ratio,
                ">=",
                TARGET_BATCHED,
            )
        )
    node_ratio, node_rates = _batched_on_a_node(model, workloads["short prompts"], n, rounds)
    targets.append(
        Target(
            f"through a node: tokens/s of {BATCH_GENS} concurrent generations, "
            "decode_batch 4 / decode_batch 1",
            node_ratio,
            ">=",
            TARGET_BATCHED,
        )
    )
    size = ", ".join(f"{k} {v}" for k, v in BATCH_SIZE.items())
    return Part(
        f"(e) {BATCH_GENS} concurrent background generations decoded together",
        f"{BATCH_GENS} background generations ({n} tokens each, greedy) on one engine "
        f"(no Ray), one intra-op thread, a generated decoder ({size}). 'one at a time' "
        "runs `advance` on each generation in turn (a node today); 'together' runs "
        "`advance_batch` on all of them, one model call per token for every row still "
        "going. Both first prefill the prompts one by one (the first token each), timed "
        "apart: 'all' counts every token over the whole run, 'decode' the tokens after "
        f"the prefills over the time after them. Prompts of 16 to {16 * BATCH_GENS} "
        f"tokens, alone or after the {len(SYSTEM)}-token system prompt. Medians of "
        f"{rounds} alternating rounds; the outputs are checked to be identical.",
        tables=[
            md_table(
                [
                    "prompts",
                    "prompt tokens",
                    "ms/token alone",
                    "all tok/s one at a time",
                    "all tok/s together",
                    "all ratio",
                    "decode tok/s one at a time",
                    "decode tok/s together",
                    "decode ratio",
                ],
                rows,
            )
        ],
        targets=targets,
        notes=[
            f"Through a node (Ray actor, `FleetClient.generate` from {BATCH_GENS} threads "
            "at once, short prompts, whole runs including prefills and streaming): "
            f"{node_rates[1]:.0f} tokens/s with `decode_batch: 4` against "
            f"{node_rates[0]:.0f} with `decode_batch: 1`, {node_ratio:.2f}x (medians of "
            f"{rounds} alternating rounds; the tokens are checked to be the same).",
            "A shared call reads the weights once for all rows, but each row still copies "
            "and reads its own KV cache (the model's past/present Concat and attention), "
            "so the gain falls as contexts grow: more so on this small model, whose "
            "weights are few next to its KV per token, than on a real LM of the same speed.",
        ],
    )


def _batched_on_a_node(
    model: Path, prompts: list[tuple[int, ...]], n: int, rounds: int
) -> tuple[float, tuple[float, float]]:
    """Tokens/s of concurrent generations through a node decoding them together
    against a node decoding one at a time; (ratio, (one at a time, together))."""

    def run(client: FleetClient) -> tuple[float, list[list[int]]]:
        outputs: list[list[int]] = [[] for _ in prompts]

        def one(i: int) -> None:
            stream = client.generate("chat", prompts[i], max_new_tokens=n, priority="background")
            outputs[i] = stream.collect()

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return len(prompts) * n / (time.perf_counter() - t0), outputs

    with (
        deployed(_config("gen-batch-1", model, decode_batch=1)) as alone,
        deployed(_config("gen-batch-4", model, decode_batch=BATCH_GENS)) as together,
    ):
        rates: dict[str, list[float]] = {"alone": [], "together": []}
        _, expected = run(alone)  # warm-up
        _, outputs = run(together)
        assert outputs == expected, "decoding together must not change any generation's tokens"
        for _ in range(rounds):
            for label, client in (("alone", alone), ("together", together)):
                rates[label].append(calm(partial(run, client), f"node {label}").value[0])
    one, many = median(rates["alone"]), median(rates["together"])
    log(f"  (e) through a node: {many / one:.2f}x the tokens/s of one at a time")
    return many / one, (one, many)


def _through_node(path: Path, prompt: tuple[int, ...], n: int, label: str) -> float:
    with deployed(_config(f"gen-tps-{label}", path)) as client:
        client.generate("chat", prompt, max_new_tokens=n).collect()  # warm up
        t0 = time.perf_counter()
        client.generate("chat", prompt, max_new_tokens=n).collect()
        return n / (time.perf_counter() - t0)


def _ignore(token: int) -> None:
    pass


# ------------------------------------------------------------------------- run


def run(ctx: RunContext) -> Section:
    directory = ctx.models.directory
    chat = make_tiny_lm(directory / "chat_lm.onnx", **CHAT_SIZE)
    tiny = make_tiny_lm(directory / "tiny_lm.onnx")
    batch_lm = make_tiny_lm(directory / "batch_lm.onnx", **BATCH_SIZE)
    engine = DecoderEngine("chat", chat)
    gen = Generation(GenerateRequest("chat", (1, 2, 3), max_new_tokens=64), 64, _ignore)
    engine.advance(gen)
    gen = Generation(GenerateRequest("chat", (1, 2, 3), max_new_tokens=64), 64, _ignore)
    engine.advance(gen)
    step_s = gen.engine_s / 64
    log(f"  chat model: {step_s * 1e3:.2f} ms a token")
    section = Section(
        TITLE,
        "The third seed's on-device language-model workload on one node, and the costs "
        "of pausing, trimming and decoding, each measured side by side in one run.",
    )
    for build in (
        lambda: _latency(ctx, chat, step_s),
        lambda: _resume(ctx, chat),
        lambda: _reprefill(ctx, chat),
        lambda: _throughput(ctx, {"tiny_lm": tiny, "chat": chat}),
        lambda: _batched(ctx, batch_lm),
    ):
        t0 = time.perf_counter()
        part = build()
        part.seconds = time.perf_counter() - t0
        section.parts.append(part)
    return section
