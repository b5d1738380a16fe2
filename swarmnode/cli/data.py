"""`swarmnode data prepare` and `swarmnode data verify`: a token directory a node's `--data` reads."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from swarmnode.util.errors import ConfigError


def add_data_parser(sub: Any) -> None:
    data = sub.add_parser(
        "data", help="prepare a token directory for --data from text, jsonl, parquet, datasets"
    )
    data_sub = data.add_subparsers(dest="data_command", required=True, parser_class=type(data))
    prepare = data_sub.add_parser(
        "prepare", help="tokenize documents into DIR (tokens.bin and manifest.json), streamed and atomic"
    )
    prepare.add_argument(
        "inputs",
        nargs="+",
        type=Path,
        metavar="INPUT",
        help=".txt, .jsonl(.gz/.zst), .parquet, a directory of them, or a datasets save_to_disk directory",
    )
    prepare.add_argument(
        "--tokenizer",
        required=True,
        metavar="TOK",
        help="'bytes', a tokenizers JSON file or a local transformers tokenizer directory",
    )
    prepare.add_argument("--out", required=True, type=Path, metavar="DIR", help="the directory to create")
    prepare.add_argument(
        "--text-field", default="text", metavar="NAME", help="jsonl field / parquet and datasets column"
    )
    prepare.add_argument("--workers", type=int, default=1, metavar="N", help="encoding processes (default 1)")
    prepare.add_argument("--eos", metavar="TOKEN", help="the end-of-text token (default: the tokenizer's)")
    prepare.add_argument("--no-progress", action="store_true", help="no progress bar")
    verify = data_sub.add_parser(
        "verify", help="check a prepared directory's hashes and tokens (exit 1 if bad)"
    )
    verify.add_argument("dir", type=Path, metavar="DIR", help="a directory made by `data prepare`")


def data_command(args: argparse.Namespace) -> int:
    if args.data_command == "prepare":
        return _prepare(args)
    return _verify(args.dir)


def _prepare(args: argparse.Namespace) -> int:
    from swarmnode.core.encoders import load_tokenizer
    from swarmnode.core.prepare import PrepareConfig, prepare

    try:
        spec = load_tokenizer(args.tokenizer, args.eos)
        cfg = PrepareConfig(
            tuple(args.inputs), spec, args.out, args.text_field, args.workers, progress=not args.no_progress
        )
        manifest = prepare(cfg)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    print(
        f"{args.out}: {manifest.documents:,} documents, {manifest.tokens:,} tokens ({manifest.dtype}, "
        f"vocab {manifest.tokenizer.vocab_size}, eos {manifest.tokenizer.eos_id}); digest {manifest.digest()}"
    )
    return 0


def _verify(directory: Path) -> int:
    from swarmnode.core.tokens import load_prepared, verify_prepared

    try:
        problems = verify_prepared(directory)
        prepared = load_prepared(directory, "DIR")
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    for problem in problems:
        print(f"{directory}: {problem}")
    if not problems:
        print(f"{directory}: ok, {prepared.manifest.tokens:,} tokens; digest {prepared.digest}")
    return 1 if problems else 0
