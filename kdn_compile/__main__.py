"""Command line: ``kdn-compile demo`` (train, then report) and ``kdn-compile check``."""

from __future__ import annotations

import argparse


def main(argv: list[str] | None = None) -> int:
    from kdn_compile import check, demo

    parser = argparse.ArgumentParser(
        prog="kdn-compile",
        description="Gated DeltaNet, KDA and Diag-KDN under torch.compile and torch.export.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    demo.add_arguments(commands.add_parser("demo", help="train a small character LM and report"))
    check.add_arguments(commands.add_parser("check", help="capture report for every kdn op"))
    args = parser.parse_args(argv)
    if args.command == "demo":
        demo.run(args)
        return 0
    return check.run(args)


if __name__ == "__main__":
    raise SystemExit(main())
