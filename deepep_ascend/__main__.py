"""``python -m deepep_ascend settings [check]``: the table of environment variables, or a check of the ones set."""

from __future__ import annotations

import argparse
import sys

from . import settings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deepep_ascend", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("settings", add_help=False, help="the table of environment variables (markdown), or "
                   "'settings check' to check the ones set")
    args, rest = parser.parse_known_args(argv)
    return settings.main(rest)


if __name__ == "__main__":
    sys.exit(main())
