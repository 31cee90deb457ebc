"""`kvserve serve --replicas N` / `--ray-address ADDR`: the same server, scaled out on Ray Serve."""
from __future__ import annotations

import argparse
import signal
import sys
import threading

from kvserve.scaleout.config import DEFAULT_IMBALANCE_THRESHOLD, ROUTER_NAMES, ScaleOutConfig, ray_missing
from kvserve.server import cli as server_cli


def add_parser(subparsers) -> None:
    """`kvserve serve`: the one-engine server's flags and Ray Serve's; Ray runs only when they ask for it."""
    serve = server_cli.add_parser(subparsers)
    add_scale_out_args(serve)
    serve.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    return run_on_ray(args) if wants_ray(args) else server_cli.run(args)


def add_scale_out_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("scale-out on Ray Serve (pip install -e \".[ray]\"; see docs/scale-out.md)")
    g.add_argument("--replicas", type=int, default=None,
                   help="serve through Ray Serve with this many engine replicas, each with its own KV cache")
    g.add_argument("--ray-address", default=None,
                   help="join this Ray cluster ('auto': the one on this node) instead of starting Ray here")
    g.add_argument("--router", default="prefix", choices=ROUTER_NAMES,
                   help="replica choice: prefix (longest cached prefix), pow2 (less loaded of two), round-robin")
    g.add_argument("--router-imbalance-threshold", type=int, default=DEFAULT_IMBALANCE_THRESHOLD,
                   dest="imbalance_threshold",
                   help="prefix router: past this many more ongoing requests on the busiest replica than on the "
                        "idlest, route to the least loaded instead (default %(default)s)")
    g.add_argument("--replica-cpus", type=float, default=1.0,
                   help="Ray CPUs per replica, also its torch threads (default %(default)s)")
    g.add_argument("--replica-gpus", type=float, default=0.0, help="Ray GPUs per replica (with --device cuda)")


def wants_ray(args: argparse.Namespace) -> bool:
    return args.replicas is not None or args.ray_address is not None


def config_from_args(args: argparse.Namespace) -> ScaleOutConfig:
    from kvserve.engine.cli import engine_config_from_args

    return ScaleOutConfig(
        engine=engine_config_from_args(args), replicas=1 if args.replicas is None else args.replicas,
        router=args.router, imbalance_threshold=args.imbalance_threshold, replica_cpus=args.replica_cpus,
        replica_gpus=args.replica_gpus, ray_address=args.ray_address, host=args.host, port=args.port,
        api_key=args.api_key, served_model_name=args.served_model_name, max_waiting=args.max_waiting,
        shutdown_timeout_s=args.shutdown_timeout_s, access_log=args.access_log, max_body_bytes=args.max_body_bytes,
        allowed_hosts=tuple(args.allowed_hosts), chat_content_special_tokens=args.chat_content_special_tokens,
        tool_call_parser=args.tool_call_parser, auto_tool_choice=args.auto_tool_choice,
    )


def run_on_ray(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
    except ValueError as exc:
        print(f"kvserve serve: {exc}", file=sys.stderr)
        return 2
    if missing := ray_missing():
        print(f"kvserve serve: --replicas: {missing}", file=sys.stderr)
        return 1
    from kvserve.engine.llm import _ensure_log_handler
    from kvserve.scaleout.cluster import RayEndpoint, ReplicaStartError

    _ensure_log_handler()
    endpoint = RayEndpoint(config)
    try:
        endpoint.start()
    except (ValueError, FileNotFoundError, ReplicaStartError) as exc:
        print(f"kvserve serve: {exc}", file=sys.stderr)
        return 1
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda signum, frame: stop.set())
    try:
        where = "a local Ray" if endpoint.owns_ray else f"the Ray cluster at {config.ray_address}"
        print(f"Serving on {endpoint.url}/v1 through {where}: {config.replicas} engine replicas, {config.router} "
              "routing (OpenAI-compatible; /health and /metrics cover every replica; Ctrl-C to stop)",
              file=sys.stderr, flush=True)
        stop.wait()
        print("Stopping: draining requests, then stopping Ray Serve" + (" and Ray" if endpoint.owns_ray else ""),
              file=sys.stderr, flush=True)
    finally:
        endpoint.stop()
    return 0
