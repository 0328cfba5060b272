"""FLA's autotuning choices, recorded on one GPU and replayed by ``kdn-compile bench --quick``.

FLA's kernels are ``triton.autotune`` kernels: the first call at each autotuning key compiles
and times every candidate config, which on a cold machine takes most of a ``--quick`` run (on
an H200 with Triton 3.6: 34 s for FLA's GDN forward, 98 s for its forward+backward, 67 s for
its KDA forward). Its timings, though, use only the config each tuner chose. So a ``--quick``
run writes the choices of every FLA tuner it used to ``fla_choices.json`` in its output folder
(:func:`record`), and a later run on the same GPU with the same FLA and Triton versions puts
them back into the tuners before timing (:func:`replay`), compiling one config per key
instead of all of them. FLA then runs the configs its own autotuning picked on that GPU.

The recorded files live in :data:`FOLDER`, one per GPU, named by :func:`file_name`.
"""

from __future__ import annotations

import importlib
import json
import re
import sys
from pathlib import Path

FOLDER = Path(__file__).parent / "fla_choices"
"""the recorded choices shipped with the package: ``<GPU name>.json``"""


def file_name(gpu: str) -> str:
    """``"NVIDIA_H200.json"`` for ``"NVIDIA H200"``: the GPU name, runs of anything but
    letters and digits as ``_``."""
    return (re.sub(r"[^0-9A-Za-z]+", "_", gpu).strip("_") or "unknown_gpu") + ".json"


def tuners(prefix: str = "fla") -> dict[str, object]:
    """Every ``triton.autotune`` tuner defined in the imported modules under ``prefix``,
    by ``"module:function"`` of the JIT function it tunes (through ``triton.heuristics``
    wrappers)."""
    from triton.runtime.autotuner import Autotuner

    found = {}
    for name, module in list(sys.modules.items()):
        if module is None or not (name == prefix or name.startswith(prefix + ".")):
            continue
        for value in list(vars(module).values()):
            # unwrap heuristics and other wrappers down to the tuner, if any
            for _ in range(4):
                if isinstance(value, Autotuner) or not hasattr(value, "fn"):
                    break
                value = value.fn
            if isinstance(value, Autotuner):
                fn = value.fn
                while hasattr(fn, "fn"):
                    fn = fn.fn
                found[f"{fn.__module__}:{fn.__qualname__}"] = value
    return found


def _plain(value):
    """JSON's lists back into the tuples of a tuner's keys."""
    return tuple(_plain(v) for v in value) if isinstance(value, list) else value


def record(versions: dict[str, str], prefix: str = "fla") -> dict:
    """The choices of every tuner under ``prefix`` that has tuned something:
    ``{"versions": versions, "tuners": {"module:function": [{"key": [...], "config":
    {"kwargs", "num_warps", "num_stages", "num_ctas", "maxnreg"}}]}}``. ``versions``:
    what the choices depend on (GPU, FLA, Triton), compared by :func:`replay`."""
    chosen = {}
    for name, tuner in sorted(tuners(prefix).items()):
        entries = []
        for key, config in tuner.cache.items():
            entries.append({"key": list(key), "config": {
                "kwargs": dict(config.kwargs), "num_warps": config.num_warps,
                "num_stages": config.num_stages, "num_ctas": getattr(config, "num_ctas", 1),
                "maxnreg": getattr(config, "maxnreg", None)}})
        if entries:
            chosen[name] = entries
    return {"versions": dict(versions), "tuners": chosen}


def write(path: str | Path, versions: dict[str, str], prefix: str = "fla") -> int:
    """Writes :func:`record` to ``path``; returns the number of choices written."""
    recorded = record(versions, prefix)
    Path(path).write_text(json.dumps(recorded, indent=1, sort_keys=True) + "\n")
    return sum(len(v) for v in recorded["tuners"].values())


def replay(recorded: dict, versions: dict[str, str], prefix: str = "fla") -> tuple[int, str]:
    """Puts ``recorded`` (as :func:`record` returns) into the tuners under ``prefix``, importing
    the modules it names; returns ``(choices replayed, why none were)``. Nothing is replayed
    when ``versions`` differ from the recorded ones: other versions may tune differently."""
    import triton

    if recorded.get("versions") != versions:
        return 0, (f"recorded for {recorded.get('versions')}, this run is {versions}")
    for name in recorded.get("tuners", {}):
        module = name.split(":")[0]
        if module == prefix or module.startswith(prefix + "."):
            importlib.import_module(module)
    found, count = tuners(prefix), 0
    for name, entries in recorded.get("tuners", {}).items():
        tuner = found.get(name)
        if tuner is None:
            continue
        for entry in entries:
            c = entry["config"]
            tuner.cache[_plain(entry["key"])] = triton.Config(
                c["kwargs"], num_warps=c["num_warps"], num_stages=c["num_stages"],
                num_ctas=c.get("num_ctas", 1), maxnreg=c.get("maxnreg"))
            count += 1
    return count, "" if count else "none of its tuners exist in this FLA"


def replay_file(path: str | Path, versions: dict[str, str], prefix: str = "fla") -> str:
    """:func:`replay` of the file at ``path``; returns the line a run prints about it."""
    path = Path(path)
    if not path.exists():
        return f"FLA autotunes: no recorded choices for this GPU ({path} does not exist)"
    count, why = replay(json.loads(path.read_text()), versions, prefix)
    if not count:
        return f"FLA autotunes: {path} not replayed ({why})"
    return f"FLA runs the {count} autotuning choices recorded in {path}"
