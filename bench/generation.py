"""Generation on one node (generated decoders, ``modelgen.make_tiny_lm``): foreground
chat under background generations, resume overhead, prefix-kept re-prefill, decoder
throughput against a bare ONNX Runtime loop, and generations decoded together."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np

from actors.decoder import DecoderEngine, Generation
from bench import common as bc
from bench.common import Part, RunContext, Summary, Target, deployed, fmt, log, md_table, median
from cluster.client import FleetClient
from edgefleet.config import FleetConfig, parse_config
from edgefleet.errors import EdgeFleetError
from edgefleet.modelgen import make_tiny_lm
from edgefleet.request import GenerateRequest

TITLE = "Generation: foreground chat under background generations, pause/resume, KV trimming"
CHAT_SIZE = {"layers": 8, "heads": 8, "head_dim": 64}
# Wider and shallower, with grouped-query attention: a token's call reads the weights.
BATCH_SIZE = {"layers": 2, "heads": 14, "head_dim": 64, "kv_heads": 2}
SYSTEM = tuple(range(1, 193))  # a 192-token system prompt
FG_TOKENS, BG_TOKENS, BG_CLIENTS, BATCH_GENS = 40, 200, 2, 4
TARGET_TTFT_RATIO = 1.2  # edgefleet p99 TTFT <= 1.2 x alone p99 TTFT + one decode step
TARGET_FIFO_RATIO = 8.0
TARGET_RESUME_EXTRA = 0.05
TARGET_PREFILL_SAVED = 0.60
TARGET_THROUGHPUT = 0.9
TARGET_BATCHED = 2.5
REFERENCE = (
    "foreground latency 1420 ms with FIFO vs 161 ms with the scheduler (about 140 ms "
    "alone); resuming costs about 22 % extra; keeping the system prompt saves 40-60 % "
    "of re-prefill"
)
LATENCY_RUNS = {  # label -> node order, background generations, decode_batch
    "alone": ("priority", False, 4),
    "edgefleet": ("priority", True, 4),
    "FIFO": ("fifo", True, 1),
    "FIFO, decoding together": ("fifo", True, 4),
}


def _config(name: str, model: Path, order: str = "priority", batch: int = 4) -> FleetConfig:
    chat = {"path": str(model), "kind": "decoder", "generation": {"decode_batch": batch}}
    data = {"fleet": {"name": name}, "local": {"nodes": 1}, "models": {"chat": chat}}
    data["node_defaults"] = {"order": order, "queue": {"capacity": 64}}
    return parse_config(data | {"router": {"placement": {"shed": {}}}}, model.parent)


def _prompt(rng: np.random.Generator, turn: int = 32) -> tuple[int, ...]:
    return (*SYSTEM, *(int(t) for t in rng.integers(1, 500, turn)))


def generation(
    engine: DecoderEngine, prompt: tuple[int, ...], n: int, max_context: int | None = None
) -> Generation:
    """A greedy generation of ``n`` tokens for ``engine`` to run."""
    request = GenerateRequest(engine.name, prompt, max_new_tokens=n)
    return Generation(request, n, lambda _: None, max_context=max_context)


def _chats(client: FleetClient, n: int, background: bool) -> tuple[Summary, Summary, int]:
    """``n`` foreground chats one after another (0.1 s apart), with ``BG_CLIENTS``
    keeping background generations running meanwhile when ``background``: time to
    first token, total time, background generations completed."""
    stop, done = threading.Event(), []

    def flood(seed: int) -> None:
        rng, kw = np.random.default_rng(seed), {"max_new_tokens": BG_TOKENS}
        while not stop.is_set():
            try:
                stream = client.generate("chat", _prompt(rng, 64), priority="background", **kw)
                done.append(stream.collect())
            except EdgeFleetError:
                time.sleep(0.05)

    rng, ttft, total = np.random.default_rng(99), [], []
    with ThreadPoolExecutor(BG_CLIENTS) as pool:
        for i in range(BG_CLIENTS if background else 0):
            pool.submit(flood, i)
        time.sleep(1.0 if background else 0.0)  # let the node fill up
        for _ in range(n):
            t0 = time.perf_counter()
            stream = client.generate("chat", _prompt(rng), max_new_tokens=FG_TOKENS)
            next(stream)
            ttft.append(time.perf_counter() - t0)
            stream.collect()
            total.append(time.perf_counter() - t0)
            time.sleep(0.1)
        stop.set()
    return Summary.of(ttft), Summary.of(total), len(done)


def _latency(ctx: RunContext, model: Path, step_s: float) -> Part:
    n, runs = ctx.count(40, 10), {}
    for label, (order, background, batch) in LATENCY_RUNS.items():
        log(f"  (a) {label}: {n} foreground chats")
        name = f"gen-{label.lower().replace(',', '').replace(' ', '-')}"
        with deployed(_config(name, model, order, batch)) as client:
            runs[label] = _chats(client, n, background)
    rows = [[k, *(fmt(x * 1e3) for s in r[:2] for x in (s.p50, s.p99))] for k, r in runs.items()]
    alone, ours, fifo = (runs[k][0].p99 for k in ("alone", "edgefleet", "FIFO"))
    bound = TARGET_TTFT_RATIO * alone + step_s
    measured = (
        f"One node serving a generated decoder ({CHAT_SIZE['layers']} layers, "
        f"{step_s * 1e3:.1f} ms a token). Foreground chats ({len(SYSTEM)}-token system "
        f"prompt plus a 32-token turn, {FG_TOKENS} new tokens), {n} one after another, "
        f"timed by the client; in the other runs {BG_CLIENTS} clients keep background "
        f"generations ({BG_TOKENS} tokens) going. edgefleet pauses them at the next token; "
        "FIFO (`order: fifo`) runs one generation at a time; 'decoding together' lets every "
        "generation join the running decode (`decode_batch: 4`)."
    )
    label = "edgefleet p99 TTFT / (1.2 x alone p99 TTFT + one decode step)"
    targets = [
        Target(f"{label} (bound {bound * 1e3:.1f} ms)", ours / bound, "<=", 1.0),
        Target("FIFO p99 TTFT / edgefleet p99 TTFT", fifo / ours, ">=", TARGET_FIFO_RATIO),
    ]
    done = ", ".join(f"{k.replace(',', '')} {r[2]}" for k, r in runs.items() if k != "alone")
    headers = ["run", "TTFT p50 ms", "TTFT p99 ms", "total p50 ms", "total p99 ms"]
    title = "(a) Foreground chat while background generations saturate the node"
    notes = [f"Background generations completed meanwhile: {done}. Reference (seed): {REFERENCE}."]
    return Part(title, measured, [md_table(headers, rows)], targets, notes)


def _resume(ctx: RunContext, model: Path) -> Part:
    """Engine time of one background generation, uninterrupted vs paused."""
    pairs, rng, got = ctx.count(6, 2), np.random.default_rng(5), []
    with deployed(_config("gen-resume", model)) as client:
        for i in range(pairs):
            gen = partial(client.generate, "chat", _prompt(rng), max_new_tokens=BG_TOKENS)
            plain = gen(priority="background")
            expected, paused = plain.collect(), gen(priority="background")
            next(paused)
            for _ in range(3):  # three foreground chats interrupt it
                client.generate("chat", _prompt(rng, 8), max_new_tokens=8).collect()
                time.sleep(0.05)
            assert paused.collect() == expected, "a paused-and-resumed generation must not change"
            a, b = plain.result, paused.result
            assert a is not None and b is not None
            cpu, wall = b.engine_cpu_s / a.engine_cpu_s - 1, b.engine_s / a.engine_s - 1
            got.append((a.engine_cpu_s * 1e3, b.engine_cpu_s * 1e3, b.pauses, cpu, wall))
            log(f"  (b) pair {i + 1}/{pairs}: {b.pauses} pauses, {cpu:+.1%}")
    plain_ms, paused_ms, pauses, cpu, wall = (median(x) for x in zip(*got, strict=True))
    measured = (
        f"The same background generation ({len(SYSTEM) + 32}-token prompt, {BG_TOKENS} "
        f"tokens, greedy) uninterrupted and with three foreground chats arriving; {pairs} "
        "pairs. Engine time is the node's, summed over every resumption: the engine "
        "thread's CPU time, and the wall time. The outputs are checked to be identical."
    )
    headers = ["uninterrupted CPU ms", "paused CPU ms", "pauses", "extra CPU", "extra wall"]
    row = [fmt(plain_ms), fmt(paused_ms), fmt(pauses, 0), f"{cpu:+.1%}", f"{wall:+.1%}"]
    label = "engine CPU time paused-and-resumed / uninterrupted - 1"
    target = Target(label, cpu, "<=", TARGET_RESUME_EXTRA, 3)
    note = "Reference (seed): resuming a paused task costs about 22 % extra."
    return Part("(b) Resume overhead", measured, [md_table(headers, [row])], [target], [note])


def _reprefill(ctx: RunContext, model: Path) -> Part:
    """Resume cost after the paused cache was trimmed to the system prompt vs dropped."""
    engine, rng, repeats = DecoderEngine("chat", model), np.random.default_rng(11), ctx.count(15, 5)
    times: dict[int, list[float]] = {len(SYSTEM): [], 0: []}  # by prefix kept
    for _ in range(repeats):
        gen = generation(engine, _prompt(rng, 48), 80)
        while len(gen.generated) < 40:  # paused 40 tokens in
            engine.step(gen)
        cache = gen.cache
        assert cache is not None
        for keep, sink in times.items():
            gen.cache = cache.prefix(keep)
            t0 = time.perf_counter()
            engine.step(gen)
            sink.append(time.perf_counter() - t0)
            del gen.tokens[-1]
    context, (kept, full) = len(SYSTEM) + 48 + 40, (median(v) for v in times.values())
    measured = (
        f"A generation paused 40 tokens in (context {context} tokens: a {len(SYSTEM)}-token "
        "system prompt, a 48-token turn, 40 generated). Its cache is trimmed to the system "
        "prompt (as the node does past its KV budget) or dropped; the resume step then "
        f"re-prefills {context - len(SYSTEM)} or {context} tokens. Its time, median of {repeats}."
    )
    rows = [
        ["trim to system prompt", context - len(SYSTEM), fmt(kept * 1e3, 2)],
        ["full drop", context, fmt(full * 1e3, 2)],
    ]
    table = md_table(["resume after", "re-prefilled tokens", "ms (median)"], rows)
    label = "re-prefill time saved by keeping the prefix"
    target = Target(label, 1 - kept / full, ">=", TARGET_PREFILL_SAVED)
    note = "Reference (seed): 40-60 % less re-prefill. The output is unchanged either way (tests)."
    return Part("(c) Re-prefill with the system prompt kept", measured, [table], [target], [note])


Loop = Callable[[], tuple[float, float, list[int]]]  # wall s, thread CPU s, tokens made


def _bare_loop(path: Path, prompt: tuple[int, ...], n: int) -> Loop:
    """The plainest ONNX Runtime greedy decode loop of ``n`` tokens."""
    session = bc.raw_session(path)
    inputs = {i.name: i.shape for i in session.get_inputs()}
    past = [x for x in inputs if x.startswith("past_key_values.")]
    outs = ["logits", *(x.replace("past_key_values.", "present.") for x in past)]
    empty = [np.zeros((1, inputs[x][1], 0, inputs[x][3]), np.float32) for x in past]

    def run() -> tuple[float, float, list[int]]:
        t0, cpu0 = time.perf_counter(), time.thread_time()
        ids, kv, feed_ids = list(prompt), empty, list(prompt)
        for _ in range(n):
            start = len(ids) - len(feed_ids)
            feed = {
                "input_ids": np.array([feed_ids], np.int64),
                "attention_mask": np.ones((1, len(ids)), np.int64),
                "position_ids": np.arange(start, len(ids), dtype=np.int64)[None],
                **dict(zip(past, kv, strict=True)),
            }
            logits, *kv = session.run(outs, feed)
            feed_ids = [int(np.argmax(logits[0, -1]))]
            ids += feed_ids
        return time.perf_counter() - t0, time.thread_time() - cpu0, ids[len(prompt) :]

    return run


def engine_loop(path: Path, prompt: tuple[int, ...], n: int, *, in_place: bool = True) -> Loop:
    """The same generation by edgefleet's DecoderEngine at one thread, as a node runs it;
    ``in_place`` False: its decode steps copy the cache each token (as they did before
    they wrote it in place)."""
    engine = DecoderEngine("m", path, threads=1)
    engine._share_buffer = engine._share_buffer and in_place
    engine.warmup()

    def run() -> tuple[float, float, list[int]]:
        t0, cpu0 = time.perf_counter(), time.thread_time()
        gen = generation(engine, prompt, n, engine.max_context)
        engine.advance(gen)
        return time.perf_counter() - t0, time.thread_time() - cpu0, gen.generated

    return run


@dataclass(frozen=True)
class Speed:
    """A loop's tokens per second of wall and of CPU time (medians over the rounds),
    each round's CPU seconds, and the tokens its warm-up made."""

    wall: float
    cpu: float
    cpu_s: list[float]
    tokens: list[int]


def tokens_per_s(
    loops: dict[str, Loop], rounds: int, label: str, budget_s: float = 0.0, most: int = 0
) -> dict[str, Speed]:
    """Each loop's speed over rounds of one run of every loop in turn, each calm:
    ``rounds`` of them, or as many as fit in about ``budget_s`` of the first loop's runs
    (at most ``most``), after a warm-up run of each."""
    first = {k: loop() for k, loop in loops.items()}
    took, made = first[next(iter(loops))][0], len(first[next(iter(loops))][2])
    if budget_s > 0:
        rounds = max(rounds, min(most, math.ceil(budget_s / max(took, 1e-6))))

    def once(loop: Loop) -> Callable[[], tuple[float, float]]:
        return lambda: loop()[:2]

    runs = bc.alternating({k: once(loop) for k, loop in loops.items()}, rounds, label)
    return {
        k: Speed(
            made / median([r[0] for r in v]),
            made / median([r[1] for r in v]),
            [float(r[1]) for r in v],
            first[k][2],
        )
        for k, v in runs.items()
    }


def paired_ratio(slow: Speed, fast: Speed) -> float:
    """``fast`` against ``slow`` in tokens per CPU-second: the median of the rounds'
    ratios (each round measures both back to back, so a drift of the machine's speed
    between rounds cancels out)."""
    return median([s / f for s, f in zip(slow.cpu_s, fast.cpu_s, strict=True)])


def _throughput(ctx: RunContext, models: dict[str, Path]) -> Part:
    n, rounds, prompt = ctx.count(256, 64), ctx.count(7, 3), tuple(range(1, 33))
    rows, targets = [], []
    for label, path in models.items():
        loops = {"bare": _bare_loop(path, prompt, n), "engine": engine_loop(path, prompt, n)}
        bare, ours = (tps.wall for tps in tokens_per_s(loops, rounds, f"{label} ").values())
        with deployed(_config(f"gen-tps-{label}", path)) as client:
            client.generate("chat", prompt, max_new_tokens=n).collect()  # warm up
            t0 = time.perf_counter()
            client.generate("chat", prompt, max_new_tokens=n).collect()
            node_tps = n / (time.perf_counter() - t0)
        rows.append([label, fmt(bare, 0), fmt(ours, 0), fmt(ours / bare, 2), fmt(node_tps, 0)])
        what = f"{label}: engine tokens/s / bare ONNX Runtime loop"
        targets.append(Target(what, ours / bare, ">=", TARGET_THROUGHPUT))
    measured = (
        f"Greedy decoding of {n} tokens after a 32-token prompt, batch 1, one intra-op "
        "thread: 'bare' is the plainest ONNX Runtime loop (numpy feeds, present -> past, "
        "argmax), 'engine' edgefleet's DecoderEngine with its bookkeeping; medians of "
        f"{rounds} alternating rounds. 'via node' streams the same generation through a node "
        "actor, end to end (for information)."
    )
    table = md_table(["model", "bare tok/s", "engine tok/s", "ratio", "via node tok/s"], rows)
    return Part("(d) Decoder throughput vs a bare ONNX Runtime loop", measured, [table], targets)


def _batch_run(
    engine: DecoderEngine, prompts: list[tuple[int, ...]], n: int, together: bool
) -> tuple[float, float, list[list[int]]]:
    """Prefill the prompts one by one (the first token each), then decode them together
    or one after another: the seconds of both phases, and the tokens made."""
    gens = [generation(engine, p, n) for p in prompts]
    t0 = time.perf_counter()
    for gen in gens:
        engine.step(gen)
    t1 = time.perf_counter()
    if together:
        engine.advance_batch(gens)
    else:
        for gen in gens:
            engine.advance(gen)
    return t1 - t0, time.perf_counter() - t1, [g.generated for g in gens]


def _batched_row(
    engine: DecoderEngine, label: str, prompts: list[tuple[int, ...]], n: int, rounds: int
) -> tuple[list[object], float]:
    """The table's row of ``prompts`` decoded together against one at a time."""
    tokens = [_batch_run(engine, prompts, n, k)[2] for k in (False, True)]  # also a warm-up
    assert tokens[0] == tokens[1], "decoding together must not change any generation's tokens"
    measures = {k: partial(_batch_run, engine, prompts, n, k == "True") for k in ("False", "True")}
    runs = bc.alternating(measures, rounds, f"{label} together=").values()
    total = [median([p + d for p, d, _ in r]) for r in runs]
    decode = [median([d for _, d, _ in r]) for r in runs]
    ratio = decode[0] / decode[1]
    log(f"  (e) {label}: decoding together {ratio:.2f}x the tokens/s of one at a time")
    lengths = sorted(len(p) for p in prompts)
    decoded = BATCH_GENS * (n - 1)  # each prefill call makes the first token
    row = [label, f"{lengths[0]}-{lengths[-1]}", fmt(decode[0] / decoded * 1e3, 2)]
    row += [*(fmt(BATCH_GENS * n / t, 0) for t in total), fmt(total[0] / total[1], 2)]
    return [*row, *(fmt(decoded / t, 0) for t in decode), fmt(ratio, 2)], ratio


def _on_a_node(model: Path, prompts: list[tuple[int, ...]], n: int, rounds: int) -> list[float]:
    """Tokens/s of generations sent at once to a node decoding one at a time, and to
    one decoding them together."""

    def run(client: FleetClient) -> tuple[float, list[list[int]]]:
        kw = {"max_new_tokens": n, "priority": "background"}
        t0 = time.perf_counter()
        with ThreadPoolExecutor(len(prompts)) as pool:
            out = list(pool.map(lambda p: client.generate("chat", p, **kw).collect(), prompts))
        return len(prompts) * n / (time.perf_counter() - t0), out

    with (
        deployed(_config("gen-batch-1", model, batch=1)) as alone,
        deployed(_config("gen-batch-4", model, batch=BATCH_GENS)) as together,
    ):
        assert run(alone)[1] == run(together)[1], "decoding together must not change tokens"
        runs = {"alone": partial(run, alone), "together": partial(run, together)}
        rates = [median([r[0] for r in v]) for v in bc.alternating(runs, rounds, "node ").values()]
    log(f"  (e) through a node: {rates[1] / rates[0]:.2f}x the tokens/s of one at a time")
    return rates


def _batched(ctx: RunContext, model: Path) -> Part:
    """Tokens/s of concurrent background generations decoded together by
    ``advance_batch`` against one after another by ``advance``, on the same engine."""
    n, rounds = ctx.count(BG_TOKENS, 64), ctx.count(5, 2)
    engine, rng = DecoderEngine("bg", model), np.random.default_rng(21)
    turns = [tuple(int(t) for t in rng.integers(1, 500, 16 * (i + 1))) for i in range(BATCH_GENS)]
    rows, targets = [], []
    for label, prompts in (
        ("short prompts", turns),
        ("system prompt", [(*SYSTEM, *t) for t in turns]),
    ):
        row, ratio = _batched_row(engine, label, prompts, n, rounds)
        rows.append(row)
        what = f"{label}: decode tokens/s of {BATCH_GENS} generations together / one at a time"
        targets.append(Target(what, ratio, ">=", TARGET_BATCHED))
    one, many = _on_a_node(model, turns, n, rounds)
    what = f"through a node: tokens/s of {BATCH_GENS} concurrent generations, decode_batch 4 / "
    targets.append(Target(what + "decode_batch 1", many / one, ">=", TARGET_BATCHED))
    size = ", ".join(f"{k} {v}" for k, v in BATCH_SIZE.items())
    measured = (
        f"{BATCH_GENS} background generations ({n} tokens each, greedy) on one engine (no "
        f"Ray), one intra-op thread, a generated decoder ({size}): `advance` on each in turn "
        "('one at a time') or `advance_batch` on all ('together'), after prefilling the "
        "prompts one by one, timed apart ('all': every token over the whole run; 'decode': "
        f"after the prefills). Prompts of 16 to {16 * BATCH_GENS} tokens, alone or after the "
        f"system prompt. Medians of {rounds} alternating rounds; the outputs are checked equal."
    )
    headers = ["prompts", "prompt tokens", "ms/token alone", "all tok/s one at a time"]
    headers += ["all tok/s together", "all ratio", "decode tok/s one at a time"]
    headers += ["decode tok/s together", "decode ratio"]
    note = (
        f"Through a node (`FleetClient.generate` from {BATCH_GENS} threads at once, short "
        f"prompts, whole runs): {many:.0f} tokens/s with `decode_batch: 4` against "
        f"{one:.0f} with `decode_batch: 1`, {many / one:.2f}x (medians of {rounds} "
        "alternating rounds; the tokens are checked to be the same). Each row still reads its "
        "own KV cache, so the gain falls as contexts grow."
    )
    title = f"(e) {BATCH_GENS} concurrent background generations decoded together"
    return Part(title, measured, [md_table(headers, rows)], targets, [note])


def run(ctx: RunContext) -> bc.Section:
    directory = ctx.models.directory
    chat = make_tiny_lm(directory / "chat_lm.onnx", **CHAT_SIZE)
    tiny = make_tiny_lm(directory / "tiny_lm.onnx")
    batch_lm = make_tiny_lm(directory / "batch_lm.onnx", **BATCH_SIZE)
    engine = DecoderEngine("chat", chat)
    for _ in range(2):  # the second run is timed
        gen = generation(engine, (1, 2, 3), 64)
        engine.advance(gen)
    step_s = gen.engine_s / 64
    log(f"  chat model: {step_s * 1e3:.2f} ms a token")
    parts = [
        bc.timed(partial(_latency, ctx, chat, step_s)),
        bc.timed(partial(_resume, ctx, chat)),
        bc.timed(partial(_reprefill, ctx, chat)),
        bc.timed(partial(_throughput, ctx, {"tiny_lm": tiny, "chat": chat})),
        bc.timed(partial(_batched, ctx, batch_lm)),
    ]
    measured = (
        "The third seed's on-device language-model workload on one node, and the costs "
        "of pausing, trimming and decoding, each measured side by side in one run."
    )
    return bc.Section(TITLE, measured, parts=parts)
