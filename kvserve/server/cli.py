"""`kvserve serve`: an OpenAI-compatible HTTP server over one engine."""
from __future__ import annotations

import argparse
import os
import signal
import sys

from kvserve.config import parse_size
from kvserve.engine.cli import add_engine_args, engine_config_from_args
from kvserve.engine.tool_parsers import PARSER_NAMES
from kvserve.server.async_engine import DEFAULT_MAX_WAITING
from kvserve.server.body import DEFAULT_MAX_BODY_BYTES
from kvserve.server.hosts import parse_allowed_hosts


def add_parser(subparsers) -> argparse.ArgumentParser:
    """The `serve` parser with its server and engine flags; kvserve/scaleout/cli.py adds Ray Serve's."""
    serve = subparsers.add_parser("serve", help="OpenAI-compatible server (/v1/completions, /v1/chat/completions)")
    g = serve.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    g.add_argument("--port", type=int, default=8000, help="port to listen on; 0 picks a free one (default 8000)")
    g.add_argument("--api-key", default=os.environ.get("KVSERVE_API_KEY"),
                   help="require 'Authorization: Bearer <key>' on every route but /health and /metrics "
                        "(default: $KVSERVE_API_KEY, else none; an empty key is refused)")
    g.add_argument("--served-model-name", default=None,
                   help="model name clients must use (default: the model's own, e.g. smollm2-135m)")
    g.add_argument("--max-waiting", type=int, default=DEFAULT_MAX_WAITING,
                   help=f"a request finding this many queued for the engine gets 503 (default {DEFAULT_MAX_WAITING})")
    g.add_argument("--max-body-size", default=DEFAULT_MAX_BODY_BYTES, type=parse_size, dest="max_body_bytes",
                   help=f"a request body larger than this gets 413, e.g. 8MiB (default {DEFAULT_MAX_BODY_BYTES >> 20}MiB)")
    g.add_argument("--shutdown-timeout", type=float, default=30.0, dest="shutdown_timeout_s",
                   help="seconds running requests get to finish on Ctrl-C / SIGTERM before they are aborted")
    g.add_argument("--no-access-log", dest="access_log", action="store_false", help="do not log every request")
    g.add_argument("--allowed-hosts", type=parse_allowed_hosts, default=[], metavar="NAMES",
                   help="Host header names served besides localhost, *.localhost and loopback addresses when listening "
                        "on a loopback address without --api-key (against DNS rebinding): comma-separated, "
                        "'*.example.com' for a domain's names, '*' for any")
    g.add_argument("--chat-content-special-tokens", action="store_true",
                   help="parse special-token text in chat message content as special tokens, as kvserve did before "
                        "(a message can then forge role markers); by default content is plain text")
    t = serve.add_argument_group("tool calling")
    t.add_argument("--tool-call-parser", default="auto", choices=PARSER_NAMES,
                   help="the format tool calls are written and parsed in: 'auto' (default) the one the model's chat "
                        "template writes (hermes for Qwen's <tool_call>, llama3_json, deepseek_v3), else kvserve's "
                        "default, hermes-style, written into the system turn")
    t.add_argument("--enable-auto-tool-choice", action=argparse.BooleanOptionalAction, default=True,
                   dest="auto_tool_choice",
                   help="serve tool_choice 'auto' (OpenAI's default with tools; on by default, the flag is "
                        "accepted as vLLM's); --no-enable-auto-tool-choice answers it with a 400, as vLLM does "
                        "without the flag")
    add_engine_args(serve)
    serve.set_defaults(func=run)
    return serve


def run(args: argparse.Namespace) -> int:
    from kvserve.engine.llm import _ensure_log_handler
    from kvserve.engine.llm_engine import LLMEngine
    from kvserve.server.app import build_app
    from kvserve.server.launch import bind_socket

    try:
        _check(args)
        sock = bind_socket(args.host, args.port)  # before loading the model: a busy port fails fast
    except (ValueError, OSError) as exc:
        print(f"kvserve serve: {exc.strerror if isinstance(exc, OSError) else exc}", file=sys.stderr)
        return 2 if isinstance(exc, ValueError) else 1
    _ensure_log_handler()
    try:
        engine = LLMEngine(engine_config_from_args(args))
    except (ValueError, FileNotFoundError) as exc:
        print(f"kvserve serve: {exc}", file=sys.stderr)
        return 1
    try:
        app = build_app(engine, args.served_model_name, args.api_key, args.max_waiting, args.max_body_bytes,
                        args.allowed_hosts, args.chat_content_special_tokens, tool_call_parser=args.tool_call_parser,
                        auto_tool_choice=args.auto_tool_choice)
    except ValueError as exc:  # a tool-call format this model's chat template cannot render
        print(f"kvserve serve: {exc}", file=sys.stderr)
        return 2
    host, port = sock.getsockname()[:2]
    print(f"Serving {args.served_model_name or engine.model_name} on http://{_url_host(host)}:{port}/v1 "
          f"(OpenAI-compatible; /health, /metrics, KV cache dashboard on /dashboard; Ctrl-C to stop)", file=sys.stderr)
    _serve(app, sock, args)
    return 0


def _check(args: argparse.Namespace) -> None:
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    if args.max_waiting < 1:
        raise ValueError(f"--max-waiting must be at least 1, got {args.max_waiting}")
    if args.shutdown_timeout_s < 0:
        raise ValueError(f"--shutdown-timeout must be >= 0, got {args.shutdown_timeout_s}")
    if args.api_key is not None and not args.api_key.strip():
        # Refused rather than read as "no key": someone who set the variable meant to require one.
        raise ValueError("the API key is empty (--api-key or KVSERVE_API_KEY); give a key, or unset it to serve "
                         "without one")


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _serve(app, sock, args: argparse.Namespace) -> None:
    from kvserve.server.launch import server_for

    server = server_for(app, args.shutdown_timeout_s, args.access_log)
    # uvicorn handles Ctrl-C / SIGTERM itself (stop accepting, drain, abort), then re-raises the signal to the
    # handler it found: ignore it then, so the process exits 0 instead of dying by the signal mid-teardown.
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda signum, frame: None if server.should_exit else sys.exit(128 + signum))
    server.run(sockets=[sock])
