"""Print command N (1-based) of the README's Quick start: the first ```shell block after '## Quick start'.

.ci/run executes command 2 from here, so CI can only ever run what the README tells users to run.
"""

import re
import sys
from pathlib import Path


def quickstart_commands(readme: str) -> list[str]:
    section = readme.split("## Quick start", 1)[1]
    block = re.search(r"```(?:shell|bash|sh)\n(.*?)```", section, re.S).group(1)
    return [line.strip() for line in block.splitlines() if line.strip() and not line.strip().startswith("#")]


if __name__ == "__main__":
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    print(quickstart_commands(readme)[int(sys.argv[1]) - 1])
