"""The `efflab` command: `efflab compare RUN_A RUN_B` (efflab.tools.compare). The pipeline itself runs through
Snakemake (`snakemake --cores N`) or DVC, and each stage through `python -m efflab.stages.<stage>`."""
from __future__ import annotations

import sys

COMMANDS = {"compare": "what changed between two runs, finding by finding"}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        said = "\n".join(f"  {name}  {what}" for name, what in COMMANDS.items())
        print(f"usage: efflab COMMAND ...\n{said}", file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    from .compare.__main__ import main as compare

    return compare(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
