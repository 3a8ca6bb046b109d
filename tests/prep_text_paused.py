"""``python -m tests.prep_text_paused N SECONDS ARGS...``: ``mmtrain-prep text ARGS...`` that sleeps SECONDS after
writing its N-th block, so a test can kill a run mid-write. The pause is patched in here, in the test's own
process, so the production code carries no test-only switch."""

from __future__ import annotations

import sys
import time

from dataprep import cli, text


def main(argv: list[str]) -> int:
    after, seconds, rest = int(argv[0]), float(argv[1]), argv[2:]
    consume = text._Run.consume

    def consume_then_pause(self, item) -> None:
        consume(self, item)
        if self.blocks == after:
            for w in self.writers.values():  # make the partial temporaries really hit the disk
                w._bin.flush()
            time.sleep(seconds)

    text._Run.consume = consume_then_pause
    return cli.main(["text", *rest])


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
