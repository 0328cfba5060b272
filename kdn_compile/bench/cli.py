"""The ``kdn-compile bench`` command: arguments, refusals, and the run over families."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys

from kdn_compile.bench import DEFAULT_OPS, FAMILIES
from kdn_compile.bench.timing import CheckFailed, parse_shapes

NO_CUDA = 2  # exit code when the command cannot run here (no CUDA, FLA asked for but absent)
USAGE = 2  # exit code of options that do not go together (argparse's own for bad options)
EPILOG = ("Exit status: 0 done (with --quick: no case SLOWER); 1 a correctness check failed; "
          "2 cannot run here (no CUDA; --against fla without FLA) or options that do not go "
          "together; 3 (--quick) one of our times is SLOWER, more than 5% above its row "
          "recorded in docs/benchmarks.md.")


def _ops(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in FAMILIES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown op family {', '.join(unknown) or '(none)'}; choose from {', '.join(FAMILIES)}")
    return names


def _shapes(text: str):
    try:
        return parse_shapes(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ops", type=_ops, default=list(DEFAULT_OPS),
                        help=f"comma-separated op families out of {','.join(FAMILIES)} "
                             f"(default {','.join(DEFAULT_OPS)})")
    parser.add_argument("--shapes", type=_shapes, default=None,
                        help="comma-separated BxTxH (batch x length x heads); default: each "
                             "family's own")
    parser.add_argument("--against", choices=["fla"], default=None,
                        help="also time flash-linear-attention (must be importable as fla)")
    parser.add_argument("--profile", action="store_true",
                        help="also break each shape's forward+backward down by GPU kernel "
                             "(torch.profiler) into profile.md, for the families that "
                             "support it (gdn, kda, kdn, layers, qat)")
    parser.add_argument("--quick", action="store_true",
                        help="speed guard, a 3-minute budget from empty caches: GDN, KDA and "
                             "Diag-KDN forward and forward+backward at 8x4096x16, GDN and KDA "
                             "decode over float32 pools at 256x1x32 (CUDA-graph replays), FLA "
                             "beside ours where installed, each compared with its row in "
                             "docs/benchmarks.md: ok, or SLOWER (more than 5%% above it, exit "
                             "status 3); takes no --ops, --shapes or --profile")
    parser.add_argument("--recorded", default=None, metavar="PATH",
                        help="with --quick: the page of recorded rows (default: the "
                             "checkout's docs/benchmarks.md)")
    parser.add_argument("--out", default="bench-results",
                        help="folder for rows.json, results.md and the plots "
                             "(default ./bench-results)")
    parser.epilog = EPILOG


def _refusal(args: argparse.Namespace) -> str | None:
    import torch

    if not torch.cuda.is_available():
        return ("kdn-compile bench: needs a CUDA GPU (torch.cuda.is_available() is False); "
                "the kernels it times run on CUDA only")
    if args.against == "fla" and importlib.util.find_spec("fla") is None:
        return ("kdn-compile bench: --against fla needs flash-linear-attention "
                "(pip install flash-linear-attention), and `import fla` fails here")
    return None


def reproducing_command(args: argparse.Namespace) -> str:
    """The command line that repeats this run (every option spelled out)."""
    if getattr(args, "quick", False):
        return " ".join(["kdn-compile bench --quick",
                         *([f"--against {args.against}"] if args.against else []),
                         *([f"--recorded {args.recorded}"] if args.recorded else [])])
    shapes = ",".join(map(str, args.shapes)) if args.shapes else None
    return " ".join(["kdn-compile bench", f"--ops {','.join(args.ops)}",
                     *([f"--shapes {shapes}"] if shapes else []),
                     *([f"--against {args.against}"] if args.against else []),
                     *(["--profile"] if getattr(args, "profile", False) else [])])


def _profile(family, shape, against: bool) -> list[tuple]:
    """``(title, shape, impl, kernels)`` for each forward+backward step of ``family`` at
    ``shape``, printed as it is measured."""
    from kdn_compile.bench import report
    from kdn_compile.bench.timing import kernel_times

    sections = []
    for impl, step in family.profile_steps(shape, against).items():
        kernels = kernel_times(step)
        sections.append((family.TITLE, str(shape), impl, kernels))
        print(f"\n{impl}, {shape}, GPU time per forward+backward by kernel:\n"
              f"{report.kernel_table(kernels)}\n", flush=True)
    return sections


def run(args: argparse.Namespace) -> int:
    """Check, time and report every family of ``args.ops``; returns the exit code: 0, 1
    when a correctness check failed (nothing of that family is timed), ``NO_CUDA`` when
    the command cannot run here; with ``--quick``, :func:`kdn_compile.bench.quick.run`'s."""
    if getattr(args, "quick", False) and (args.ops != list(DEFAULT_OPS) or args.shapes
                                          or args.profile):
        print("kdn-compile bench: --quick times its own cases; it takes no --ops, --shapes "
              "or --profile", file=sys.stderr)
        return USAGE
    refusal = _refusal(args)
    if refusal:
        print(refusal, file=sys.stderr)
        return NO_CUDA
    if getattr(args, "quick", False):
        from kdn_compile.bench import quick

        return quick.run(args, reproducing_command(args))
    from kdn_compile.bench import report
    from kdn_compile.bench.timing import run_metadata

    meta = run_metadata()
    against = args.against == "fla"
    command = reproducing_command(args)
    print(report.describe(meta, command), flush=True)
    done, profiles, failed = [], [], False
    for name in args.ops:
        family = importlib.import_module(FAMILIES[name])
        try:
            errors = family.check(against)
        except CheckFailed as error:
            print(f"{name}: CHECK FAILED, not timed: {error}", flush=True)
            failed = True
            continue
        if errors:
            print(f"{name}: checked against the reference: "
                  + ", ".join(f"{k} {v:.1e}" for k, v in errors.items()), flush=True)
        rows = []
        try:
            for shape in args.shapes or family.DEFAULT_SHAPES:
                for row in family.measure(shape, against):
                    rows.append({"family": name, **row, "batch": shape.batch,
                                 "length": shape.length, "heads": shape.heads})
                if args.profile and hasattr(family, "profile_steps"):
                    profiles += _profile(family, shape, against)
                print(f"{name} {shape}: done", flush=True)
        except CheckFailed as error:
            print(f"{name}: CHECK FAILED: {error}", flush=True)
            failed = True
            continue
        done.append((name, family.TITLE, rows))
        print(f"\n### {family.TITLE}\n\n{report.table(rows)}\n", flush=True)
        # written after every family: a run stopped later keeps what it finished
        paths = report.write(args.out, [(title, rows) for _, title, rows in done], meta, command)
        paths += report.plot(args.out, name, rows, getattr(family, "PLOT_IMPLS", None))
        if profiles:
            paths.append(report.write_profile(args.out, profiles, meta, command))
        print("wrote " + ", ".join(paths), flush=True)
    return 1 if failed else 0
