"""`mmtrain-prep inspect TARGET`: a folder is a media shard set, anything else an indexed-dataset prefix."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("target", help="indexed dataset PREFIX (without .bin/.idx) or a media shard DIR")
    p.add_argument("--doc", type=int, action="append", default=[], metavar="K",
                   help="text: decode document K (repeatable); needs the tokenizer recorded in the manifest")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer to decode with (text --doc, media chat samples; default: the manifest's)")
    p.add_argument("--samples", type=int, default=3, metavar="N", help="media: show the first N samples")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")


def run(args: argparse.Namespace) -> int:
    if Path(args.target).is_dir():
        from dataprep.media_tools import inspect_media

        return inspect_media(args)
    from dataprep.text_tools import inspect_text

    return inspect_text(args)
