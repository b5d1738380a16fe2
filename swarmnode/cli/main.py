"""The `swarmnode` command. The only module that reads sys.argv and the environment.

Exit codes: 0 done, 2 bad usage or configuration (one line naming the flag and value), 1 other failure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from swarmnode.core.model_choice import check_model_choice
from swarmnode.node.config import FLAG_BY_FIELD, build_run_parser, load_config, parse_flag
from swarmnode.util import faults, threads
from swarmnode.util.errors import ConfigError, StateNotSaved

logger = logging.getLogger("swarmnode")


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports a usage error as one line and exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="swarmnode", description="Peer-to-peer swarm training node (DiLoCo).")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    build_run_parser(
        sub.add_parser(
            "run",
            help="run one swarm node until stopped",
            description="Run one swarm node. Every flag also reads SWARMNODE_<NAME> "
            "from the environment; precedence: flag > env > --config file.",
        )
    )
    status = sub.add_parser("status", help="a node's live state")
    status.add_argument("address", metavar="HOST:GRPC_PORT")
    status.add_argument("--json", action="store_true", help="machine-readable output")
    fetch = sub.add_parser("fetch", help="fetch a node's snapshot, verified against its sha256")
    fetch.add_argument("address", metavar="HOST:GRPC_PORT")
    fetch.add_argument("--snapshot", default="latest", metavar="ID|latest")
    fetch.add_argument("--out", required=True, type=Path, metavar="FILE")
    for client in (status, fetch):
        _add_client_security(client)
    inspect = sub.add_parser("inspect", help="metadata, tensor table and hash check of a snapshot file")
    inspect.add_argument("file", type=Path)
    inspect.add_argument("--json", action="store_true", help="machine-readable output")
    export = sub.add_parser("export", help="write a snapshot's weights as a plain safetensors file")
    export.add_argument("file", type=Path)
    export.add_argument("--out", required=True, type=Path, metavar="FILE")
    export.add_argument(
        "--local",
        action="store_true",
        help="export the node's local weights instead of the swarm's global params",
    )
    sub.add_parser("demo", help="a three-node swarm on loopback: training, a crash and a recovery (~1 min)")
    ledger = sub.add_parser("ledger", help="the receipts ledgers of nodes")
    ledger_sub = ledger.add_subparsers(dest="ledger_command", required=True, parser_class=OneLineParser)
    check = ledger_sub.add_parser(
        "check", help="replay each node's ledger: no batch counted twice or skipped (exit 1 if one was)"
    )
    check.add_argument("dirs", nargs="+", type=Path, metavar="DIR", help="a node's --data-dir")
    check.add_argument("--json", action="store_true", help="machine-readable output")
    plot = sub.add_parser(
        "plot", help="draw nodes' training loss, held-out loss and tokens/s over time into a PNG"
    )
    plot.add_argument("dirs", nargs="+", type=Path, metavar="DATA_DIR", help="a node's --data-dir")
    plot.add_argument("--out", required=True, type=Path, metavar="FILE.png")
    bench = sub.add_parser(
        "bench", help="measure this machine: each figure a ratio against a same-run anchor"
    )
    bench.add_argument(
        "name",
        choices=["snapshot", "fetch", "recovery", "allreduce", "train", "quality", "swarm", "wan"],
        help="which benchmark",
    )
    bench.add_argument(
        "--model",
        type=check_model_choice,
        default="small",
        metavar="tiny|small|base|hf:PATH|py:MOD:FN",
        help="the model to measure (hf:/py: for train, snapshot, fetch and recovery)",
    )
    bench.add_argument("--json", action="store_true", help="machine-readable output")
    bench.add_argument(
        "--rounds",
        type=int,
        help="repetitions (snapshot, fetch, allreduce) or DiLoCo outer steps (train, quality)",
    )
    bench.add_argument(
        "--nodes",
        type=_counts,
        help="all-reduce processes (allreduce), DiLoCo workers (train) or swarm sizes (swarm: 8,16,32)",
    )
    bench.add_argument(
        "--mbit", type=float, help="wan, recovery --peers: each node's link cap, Mbit/s each way (default 50)"
    )
    bench.add_argument(
        "--peers",
        type=int,
        help="recovery: recover from this many peers at once against from one, on a capped bed (root)",
    )
    bench.add_argument("--group-size", type=int, help="swarm: the nodes' --group-size (default 4)")
    bench.add_argument("--workers", type=int, help="quality: DiLoCo workers (DP takes their batches at once)")
    bench.add_argument("--steps", type=int, help="train: timed steps; recovery: steps between snapshots")
    bench.add_argument("--inner-steps", type=int, help="DiLoCo inner steps per outer step (train, quality)")
    bench.add_argument(
        "--plot",
        metavar="FILE.png",
        help="quality: draw the held-out loss curves; swarm: the figures against N",
    )
    bench.add_argument(
        "--sweep",
        action="store_const",
        const=True,
        help="quality: sweep learning rates, outer lr and H first (at the same inner-step budget)",
    )
    bench.add_argument(
        "--swarm",
        action="store_const",
        const=True,
        help="quality: real `swarmnode run` nodes on loopback against the simulated DiLoCo, same flags",
    )
    bench.add_argument(
        "--variants",
        action="store_const",
        const=True,
        help="quality: also the overlapped outer step, the int4 wire and 4 fragments, against blocking",
    )
    bench.add_argument(
        "--no-quality", dest="quality", action="store_const", const=False, help="train: skip DiLoCo vs DP"
    )
    bench.add_argument(
        "--trust",
        action="store_const",
        const=True,
        help="allreduce: the cost of robust aggregation, signatures and mutual TLS vs the plain all-reduce",
    )
    return parser


def _counts(text: str) -> tuple[int, ...]:
    """`--nodes`: one count or a comma-separated list of them."""
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a count or counts like 8,16,32, got {text!r}") from None


CLIENT_SECURITY_FIELDS = ("swarm_token", "tls_cert", "tls_key", "tls_ca")
"""The `swarmnode run` flags a client command (`status`, `fetch`) takes too, to speak to such a swarm."""


def _add_client_security(parser: argparse.ArgumentParser) -> None:
    for name in CLIENT_SECURITY_FIELDS:
        flag = FLAG_BY_FIELD[name]
        parser.add_argument(flag.option, dest=name, metavar=flag.metavar, help=f"{flag.help}; env {flag.env}")


def _configure_client(args: argparse.Namespace) -> None:
    """The `status`/`fetch` commands speak to a node with the swarm's token and TLS, if it has them."""
    from swarmnode.net import rpc
    from swarmnode.net.security import Security

    values: dict[str, Any] = {}
    for name in CLIENT_SECURITY_FIELDS:
        flag, given = FLAG_BY_FIELD[name], getattr(args, name)
        if given is not None:
            values[name] = parse_flag(flag, given, source=flag.option)
        elif os.environ.get(flag.env) is not None:
            values[name] = parse_flag(flag, os.environ[flag.env], source=flag.env)
        else:
            values[name] = None
    try:
        security = Security.from_files(
            values["swarm_token"], values["tls_cert"], values["tls_key"], values["tls_ca"]
        )
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    rpc.configure_client(security)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code = _dispatch(args)
        sys.stdout.flush()  # a reader that went away (`| head`) shows here, inside the try
        return code
    except ConfigError as exc:
        print(f"swarmnode {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except StateNotSaved as exc:
        print(f"swarmnode {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # As the Python docs advise for SIGPIPE: the rest of the output goes nowhere, so the flush at
        # exit cannot fail again, and the command ends with 1 and no traceback.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "run":
        return _run(args)
    if args.command == "inspect":
        from swarmnode.cli.inspect import inspect_command

        return inspect_command(args.file, as_json=args.json)
    if args.command == "export":
        from swarmnode.cli.inspect import export_command

        return export_command(args.file, args.out, local=args.local)
    if args.command in ("status", "fetch"):
        _configure_client(args)
    if args.command == "status":
        from swarmnode.cli.commands import status_command

        return status_command(args.address, as_json=args.json)
    if args.command == "fetch":
        from swarmnode.cli.commands import fetch_command

        snapshot = None if args.snapshot in ("latest", "") else args.snapshot
        return fetch_command(args.address, snapshot, args.out)
    if args.command == "ledger":
        from swarmnode.cli.commands import ledger_check_command

        return _checked(ledger_check_command, args.dirs, args.json)
    if args.command == "plot":
        from swarmnode.cli.plot import plot_command

        return plot_command(args.dirs, args.out)
    if args.command == "demo":
        from swarmnode.cli.demo import run_demo

        return run_demo()
    if args.command == "bench":
        from swarmnode.bench.runner import run_bench

        result = run_bench(args.name, args.model, vars(args))
        print(result.to_json() if args.json else result.table())
        return 0
    raise AssertionError(args.command)


def _run(args: argparse.Namespace) -> int:
    cfg = load_config(vars(args), os.environ, args.config)
    fault_spec = os.environ.get("SWARMNODE_FAULTS")
    _checked(faults.parse, fault_spec or "")
    from swarmnode.node.daemon import build_parts, run_node
    from swarmnode.node.startup import preflight

    if args.dry_run:  # every start-up check a real start makes, and nothing created
        _checked(preflight, cfg)
        print(json.dumps(cfg.redacted(), indent=2, sort_keys=True))
        return 0
    faults.configure(fault_spec)
    threads.check_ownership(os.environ.get("SWARMNODE_CHECK_THREADS") == "1")
    setup_logging(cfg.log_format)
    from swarmnode.node.progress import ProgressReporter

    parts = _checked(build_parts, cfg)  # runs `preflight` first, before anything listens
    return asyncio.run(run_node(parts, ProgressReporter.for_stream(sys.stderr, cfg.log_format)))


def _checked(step: Callable[..., Any], *args: Any) -> Any:
    """`step(*args)`; a ValueError on the way (bad data or model settings) is a ConfigError: exit 2."""
    try:
        return step(*args)
    except ConfigError:
        raise
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def setup_logging(log_format: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if log_format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        formatter = logging.Formatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s", "%H:%M:%S")
        formatter.converter = time.gmtime
        handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(os.environ.get("SWARMNODE_LOG_LEVEL", "INFO").upper())
    for name in filter(None, os.environ.get("SWARMNODE_LOG_DEBUG", "").split(",")):
        logging.getLogger(name.strip()).setLevel(logging.DEBUG)  # e.g. swarmnode.swarm.matchmaking
    # A peer that does not answer a UDP request in time is routine in a swarm; rpcudp logs it as ERROR.
    logging.getLogger("rpcudp").setLevel(logging.CRITICAL)
    for noisy in ("kademlia", "asyncio"):
        logging.getLogger(noisy).setLevel(logging.ERROR)


if __name__ == "__main__":
    sys.exit(main())
