"""`mmtrain-prep verify TARGET`: a folder is a media shard set, anything else an indexed-dataset prefix.
Exit status 0 when everything checks out, 1 with one line per problem otherwise."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("target", help="indexed dataset PREFIX (without .bin/.idx) or a media shard DIR")
    p.add_argument("--no-checksums", action="store_true", help="skip re-hashing files (sizes and structure only)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")


def run(args: argparse.Namespace) -> int:
    if Path(args.target).is_dir():
        from dataprep.media_tools import verify_media

        return verify_media(args)
    from dataprep.text_tools import verify_text

    return verify_text(args)
