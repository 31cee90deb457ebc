"""`kvserve` command line: each subcommand lives beside the code it drives."""
from __future__ import annotations

import argparse
import importlib
import sys

from kvserve import __version__

# subcommand name -> module that defines add_parser(subparsers); imported lazily so `kvserve plan` stays light
SUBCOMMANDS = {
    "generate": "kvserve.engine.cli",
    "chat": "kvserve.engine.cli",
    "plan": "kvserve.planner.cli",
    "serve": "kvserve.scaleout.cli",
    "bench": "kvserve.bench.cli",
    "eval": "kvserve.eval.cli",
}


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvserve", description="LLM serving built around its KV cache")
    parser.add_argument("--version", action="version", version=f"kvserve {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True)
    wanted = [a for a in argv if a in SUBCOMMANDS][:1] or list(SUBCOMMANDS)
    for module_name in dict.fromkeys(SUBCOMMANDS[name] for name in wanted):
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                raise
            continue
        module.add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
