"""Recording and replaying autotuning choices (``kdn_compile.bench.fla_choices``) on tuners
of a stand-in module: no GPU, no FLA."""

from __future__ import annotations

import json
import sys
import types

import pytest

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from kdn_compile.bench import fla_choices  # noqa: E402

PREFIX = "kdn_stand_in_tuned"
VERSIONS = {"gpu": "NVIDIA H200", "fla": "flash-linear-attention 0.6.0", "triton": "3.6.0"}


@triton.jit
def _copy(x, y, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y + offs, tl.load(x + offs, mask=offs < n), mask=offs < n)


@triton.jit
def _scale(x, y, n, BLOCK: tl.constexpr, UNUSED: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y + offs, 2 * tl.load(x + offs, mask=offs < n), mask=offs < n)


@pytest.fixture
def stand_in():
    """A module under :data:`PREFIX` holding a plain tuner and one under heuristics."""
    configs = [triton.Config({"BLOCK": b}, num_warps=w) for b in (32, 64) for w in (2, 4)]
    module = types.ModuleType(PREFIX)
    module.plain = triton.autotune(configs, key=["n"])(_copy)
    module.wrapped = triton.heuristics({"UNUSED": lambda args: 1})(
        triton.autotune(configs, key=["n"])(_scale))
    sys.modules[PREFIX] = module
    yield module
    del sys.modules[PREFIX]


def test_choices_round_trip_through_json(stand_in, tmp_path):
    found = fla_choices.tuners(PREFIX)
    assert set(found.values()) == {stand_in.plain, stand_in.wrapped.fn}
    assert sorted(found) == [f"{__name__}:_copy", f"{__name__}:_scale"]
    plain = stand_in.plain
    plain.cache[(4096, "torch.bfloat16")] = triton.Config({"BLOCK": 64}, num_warps=2,
                                                          num_stages=3)
    plain.cache[(128, "torch.float32")] = triton.Config({"BLOCK": 32}, num_warps=4,
                                                        num_stages=1)
    path = tmp_path / "choices.json"
    assert fla_choices.write(path, VERSIONS, PREFIX) == 2
    plain.cache.clear()
    count, why = fla_choices.replay(json.loads(path.read_text()), VERSIONS, PREFIX)
    assert (count, why) == (2, "")
    config = plain.cache[(4096, "torch.bfloat16")]
    assert (config.kwargs, config.num_warps, config.num_stages) == ({"BLOCK": 64}, 2, 3)
    assert plain.cache[(128, "torch.float32")].kwargs == {"BLOCK": 32}


def test_choices_of_other_versions_are_not_replayed(stand_in, tmp_path):
    stand_in.plain.cache[(7,)] = triton.Config({"BLOCK": 32}, num_warps=2)
    recorded = fla_choices.record(VERSIONS, PREFIX)
    stand_in.plain.cache.clear()
    count, why = fla_choices.replay(recorded, {**VERSIONS, "triton": "3.7.1"}, PREFIX)
    assert count == 0 and "3.7.1" in why and not stand_in.plain.cache
    path = tmp_path / "none.json"
    assert "does not exist" in fla_choices.replay_file(path, VERSIONS, PREFIX)
    path.write_text(json.dumps(recorded))
    assert "not replayed" in fla_choices.replay_file(path, {**VERSIONS, "gpu": "x"}, PREFIX)
    assert "runs the 1 autotuning choices" in fla_choices.replay_file(path, VERSIONS, PREFIX)


def test_tuners_that_never_ran_record_nothing(stand_in):
    assert fla_choices.record(VERSIONS, PREFIX) == {"versions": VERSIONS, "tuners": {}}


def test_file_names_follow_the_gpu_name():
    assert fla_choices.file_name("NVIDIA H200") == "NVIDIA_H200.json"
    assert fla_choices.file_name("NVIDIA H100 80GB HBM3") == "NVIDIA_H100_80GB_HBM3.json"
    assert fla_choices.file_name("--") == "unknown_gpu.json"
