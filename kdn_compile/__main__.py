"""Command line: ``kdn-compile demo`` (train, then report), ``kdn-compile check`` (capture
report) and ``kdn-compile bench`` (time the kernels and layers on a CUDA GPU)."""

from __future__ import annotations

import argparse


def main(argv: list[str] | None = None) -> int:
    from kdn_compile import capture_report, demo
    from kdn_compile.bench import cli as bench

    parser = argparse.ArgumentParser(
        prog="kdn-compile",
        description="Gated DeltaNet, KDA and Diag-KDN under torch.compile and torch.export.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    sub = {
        "demo": commands.add_parser("demo", help="train a small character LM and report"),
        "check": commands.add_parser("check", help="capture report of the public functions"),
        "bench": commands.add_parser(
            "bench", help="time the ops and layers on a CUDA GPU (needs CUDA), optionally "
                          "against FLA",
            description="Time the ops and layers on a CUDA GPU, optionally against FLA. "
                        "Needs a CUDA device: without one it exits with status 2."),
    }
    demo.add_arguments(sub["demo"])
    capture_report.add_arguments(sub["check"])
    bench.add_arguments(sub["bench"])
    args, unknown = parser.parse_known_args(argv)
    command = sub[args.command]  # errors print the subcommand's usage, not the top level's
    if unknown:
        command.error(f"unrecognized arguments: {' '.join(unknown)}")
    device = getattr(args, "device", None)
    if device is not None:
        import torch

        try:
            kind = torch.device(device).type
        except RuntimeError as error:
            command.error(f"--device: {error}")
        if kind == "cuda" and not torch.cuda.is_available():
            command.error("--device cuda: this torch sees no CUDA device")
    if args.command == "demo":
        demo.run(args)
        return 0
    if args.command == "bench":
        return bench.run(args)
    return capture_report.run(args)


if __name__ == "__main__":
    raise SystemExit(main())
