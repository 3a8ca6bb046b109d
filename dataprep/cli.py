"""`mmtrain-prep` argument parsing only: one subcommand -> one module.

Each subcommand module exposes ``add_arguments(parser)`` and ``run(args) -> int``. Only the chosen
subcommand's module is imported, so `mmtrain-prep --help` is instant and a heavy import (torch, PyAV)
costs only the command that needs it.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from dataprep.errors import PrepError
from mmtrain.core.chat_tokens import ChatTemplateError
from mmtrain.core.tokenizer import TokenizerError

# name -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "text": ("dataprep.text", "Tokenize JSONL (.jsonl, .gz, .zst), Parquet or datasets save_to_disk folders into "
                               "Megatron-compatible indexed .bin/.idx shards."),
    "sft": ("dataprep.sft", "Chat/instruction JSONL -> chat-template tokens + loss mask (SFT), or preference pairs (DPO)."),
    "train-tokenizer": ("dataprep.tokenizer_train", "Train a SentencePiece BPE/unigram tokenizer from JSONL or Parquet."),
    "merge": ("dataprep.merge", "Concatenate indexed datasets into one."),
    "media": ("dataprep.media", "Pack images, video and audio with their text into energon-ready WebDataset shards."),
    "inspect": ("dataprep.inspect", "Show what an indexed prefix or a media shard folder holds."),
    "verify": ("dataprep.verify", "Check an indexed prefix or a media shard folder against its manifest."),
}


def _selected(argv: list[str]) -> str | None:
    for arg in argv:
        if not arg.startswith("-"):
            return arg
        if arg in ("-h", "--help"):
            return None
    return None


def build_parser(selected: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mmtrain-prep",
        description="Prepare training data for mmtrain: text into indexed shards, media into WebDataset shards.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == selected:
            importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    selected = _selected(argv)
    if selected is not None and selected not in SUBCOMMANDS:
        build_parser().parse_args(argv)  # argparse prints the valid choices and exits 2
    parser = build_parser(selected)
    args = parser.parse_args(argv)
    module = importlib.import_module(SUBCOMMANDS[args.command][0])
    try:
        return int(module.run(args) or 0)
    except (PrepError, TokenizerError, ChatTemplateError) as exc:
        print(f"mmtrain-prep {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"mmtrain-prep {args.command}: interrupted; no complete-looking output was left behind", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
