"""``python -m deepep_ascend settings [check]``: the table of environment variables, or a check of the ones set."""

from __future__ import annotations

import argparse
import sys

from . import settings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deepep_ascend", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("settings", help="print the table of environment variables (markdown), or check them")
    p.add_argument("action", nargs="?", choices=["table", "check"], default="table",
                   help="table (default): print docs/configuration.md's table; check: exit 1 naming every "
                        "declared variable set to a value it does not accept")
    args = parser.parse_args(argv)
    if args.action == "check":
        problems = settings.check()
        for problem in problems:
            print(f"deepep_ascend: {problem}", file=sys.stderr)
        return 1 if problems else 0
    sys.stdout.write(settings.markdown_table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
