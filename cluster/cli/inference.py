"""`edgefleet infer` and `generate`: one request to a running fleet."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from cluster.cli.common import (
    RawHelpFormatter,
    Subparsers,
    add_fleet_options,
    err,
    fleet_client,
    priority,
    say,
)
from edgefleet.errors import InvalidInput

if TYPE_CHECKING:
    from edgefleet.messages import GenerationResult


def add_parser(sub: Subparsers) -> None:
    _add_infer_parser(sub)
    _add_generate_parser(sub)


def _add_infer_parser(sub: Subparsers) -> None:
    infer = sub.add_parser(
        "infer",
        help="run one inference on a running fleet",
        description="Run one inference on a running fleet. The inputs are an .npz of arrays\n"
        "named as the model's inputs (`edgefleet models show CONFIG MODEL` lists them\n"
        "and prints a numpy line that writes one), or an .npy for a single-input model.",
        epilog="examples:\n"
        '  python -c "import numpy as np; '
        "np.savez('frame.npz', images=np.zeros((1, 3, 32, 32), 'float32'))\"\n"
        "  edgefleet infer classifier --input frame.npz --priority inline "
        "--deadline-ms 200 --out result.npz",
        formatter_class=RawHelpFormatter,
    )
    infer.add_argument("model", metavar="MODEL")
    infer.add_argument(
        "--input",
        required=True,
        metavar="FILE",
        help="an .npz of named input arrays, or an .npy for a single-input model",
    )
    infer.add_argument(
        "--out", metavar="FILE.npz", help="write the outputs here (default: print them only)"
    )
    infer.add_argument(
        "--deadline-ms", type=float, help="give up if not started by then (default: no deadline)"
    )
    infer.set_defaults(func=cmd_infer)
    _add_request_options(infer)


def _add_generate_parser(sub: Subparsers) -> None:
    generate = sub.add_parser(
        "generate",
        help="stream a generation from a decoder model on a running fleet",
        description="Stream a generation from a decoder model on a running fleet: from token ids,\n"
        "from text (a model with a tokenizer.json beside its file), or a chat (--chat: a\n"
        "model whose tokenizer_config.json has a chat template renders the conversation).",
        epilog="examples:\n  edgefleet generate tiny_lm --prompt-ids 5 17 42 --max-new-tokens 32 "
        "--priority background\n  edgefleet generate phi --prompt 'Describe the scene:'\n"
        "  edgefleet generate phi --chat --system 'Answer in one line.' --prompt 'Why is the "
        "sky blue?'\n  edgefleet generate phi --chat   # a conversation: one turn a line, "
        "Ctrl-D ends it",
        formatter_class=RawHelpFormatter,
    )
    generate.add_argument("model", metavar="MODEL")
    prompt = generate.add_mutually_exclusive_group()
    prompt.add_argument(
        "--prompt-ids",
        type=int,
        nargs="+",
        metavar="ID",
        help="the prompt as token ids of the model's vocabulary",
    )
    prompt.add_argument(
        "--prompt",
        metavar="TEXT",
        help="the prompt as text, for a model with a tokenizer.json beside its file: the "
        "answer prints as text (with --chat: the user's message)",
    )
    generate.add_argument(
        "--chat",
        action="store_true",
        help="render the prompt as a user's message with the model's chat template (its "
        "tokenizer_config.json); without --prompt, a conversation: each line read from "
        "standard input is a turn, its answer printed as it comes, until end of input "
        "(Ctrl-D)",
    )
    generate.add_argument(
        "--system", metavar="TEXT", help="with --chat: the system message (default: none)"
    )
    generate.add_argument(
        "--max-new-tokens", type=int, default=64, help="stop after this many new tokens"
    )
    generate.add_argument(
        "--session",
        help="chat session: later turns reuse its KV cache (default: none; with --chat, a new one)",
    )
    generate.add_argument(
        "--prefix-len",
        type=int,
        default=0,
        help="leading prompt tokens shared by many requests (a system prompt): kept when a "
        "paused generation's cache is trimmed (with --chat: the system message's)",
    )
    generate.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    generate.add_argument("--top-k", type=int, default=0, help="sample among the k best (0: all)")
    generate.add_argument(
        "--seed", type=int, help="sampling seed (default: none, each run samples anew)"
    )
    generate.set_defaults(func=cmd_generate)
    _add_request_options(generate)


def _add_request_options(parser: argparse.ArgumentParser) -> None:
    """``--priority``, ``--fleet`` and ``--address``: the options every request takes."""
    parser.add_argument(
        "--priority", type=priority, default="foreground", help="class name or 0-10"
    )
    add_fleet_options(parser)


def cmd_infer(args: argparse.Namespace) -> int:
    import numpy as np

    from cluster.modelfiles import name_single_input, read_input_file

    arrays = read_input_file(args.input)  # before Ray is even imported: a bad file fails fast
    with fleet_client(args) as client:
        inputs = (
            arrays
            if isinstance(arrays, dict)
            else name_single_input(client.config, args.model, arrays)
        )
        deadline = None if args.deadline_ms is None else args.deadline_ms / 1000
        reply = client.infer_reply(args.model, inputs, priority=args.priority, deadline_s=deadline)
    outputs = reply.unwrap()
    for name, value in outputs.items():
        head = np.array2string(value.ravel()[:8], precision=4)
        say(f"{name}: {value.dtype.name} {list(value.shape)} {head}")
    say(
        f"node {reply.node}: queued {reply.queue_s * 1000:.1f} ms, engine "
        f"{reply.service_s * 1000:.1f} ms, batch of {reply.batch_size}"
    )
    if args.out:
        np.savez(args.out, **outputs)  # type: ignore[arg-type]
        say(f"outputs written to {args.out}")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    _check_generate(args)  # before connecting: a wrong combination fails at once
    if args.chat:
        return _chat(args)
    with fleet_client(args) as client:
        text = args.prompt is not None
        stream = client.generate(
            args.model,
            args.prompt if text else args.prompt_ids,
            session=args.session,
            prefix_len=args.prefix_len,
            **_sampling(args),
        )
        try:
            if text:
                for piece in stream.texts():
                    print(piece, end="", flush=True)
            else:
                for token in stream:
                    print(token, end=" ", flush=True)
        finally:
            print(flush=True)
            stream.close()  # before the end (Ctrl-C): cancels the generation on its node
    assert stream.result is not None
    _finished(stream.result)
    return 0


def _sampling(args: argparse.Namespace) -> dict[str, Any]:
    """What a generation's options say of its length, priority and sampling."""
    return {
        "max_new_tokens": args.max_new_tokens,
        "priority": args.priority,
        "temperature": args.temperature,
        "top_k": args.top_k,
        "seed": args.seed,
    }


def _check_generate(args: argparse.Namespace) -> None:
    if args.chat and args.prompt_ids is not None:
        raise InvalidInput("--chat takes text (--prompt, or turns on standard input), not ids")
    if not args.chat and args.prompt is None and args.prompt_ids is None:
        raise InvalidInput("give the prompt: --prompt-ids, --prompt, or --chat")
    if args.system is not None and not args.chat:
        raise InvalidInput("--system is the system message of a --chat")


def _chat(args: argparse.Namespace) -> int:
    """One turn (``--prompt``), or a conversation read from standard input, a turn a
    line: each answer printed as it comes, the conversation kept under one session."""
    with fleet_client(args) as client:
        chat = client.chat(args.model, system=args.system, session=args.session, **_sampling(args))
        for turn in [args.prompt] if args.prompt is not None else _turns():
            answer = chat.stream(turn)
            try:
                for piece in answer:
                    print(piece, end="", flush=True)
            finally:
                print(flush=True)
                answer.close()  # before the end (Ctrl-C): cancels the generation
            assert chat.last is not None and chat.last.result is not None
            _finished(chat.last.result)
    return 0


def _turns() -> Iterator[str]:
    """The user's turns: the lines of standard input, blank ones skipped, until its end
    (a "> " prompt on stderr when it is a terminal)."""
    while True:
        if sys.stdin.isatty():
            print("> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        if not line:
            return
        if line.strip():
            yield line.rstrip("\n")


def _finished(r: GenerationResult) -> None:
    first = f"{r.first_token_s * 1000:.1f} ms" if r.first_token_s is not None else "-"
    err(
        f"finish: {r.finish_reason} ({len(r.tokens)} tokens on {r.node}; first token {first}, "
        f"total {r.total_s * 1000:.1f} ms, paused {r.pauses}x)"
    )
