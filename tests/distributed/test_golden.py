"""Golden values: canonical runs reproduce the losses, gradient norms and learning rates stored
in tests/golden/*.json (written by ``python -m tests.golden.regenerate``).

Parity tests compare a layout with a single-process run of the same code; a bug that moves
both (loss, data, model, optimizer, LR schedule) passes them. These stored numbers catch it.

Tolerances. CPU numerics differ a little between machines (kernel choice by instruction set,
MKL code paths); they were measured on one machine by rerunning each job with
AUTOMODEL_NUM_THREADS=1, 2 and 4 (bit-identical: no effect) and with
ATEN_CPU_CAPABILITY=avx2 / default plus MKL_ENABLE_INSTRUCTIONS=AVX2 / SSE4_2 against AVX-512
(largest relative deviations over the 5 steps):

    fp32 runs (single_process, fsdp2_dp2, pipeline_1f1b): loss <= 6e-7, grad_norm <= 2.3e-6
    default_job (bf16 parameters):                       loss <= 1.1e-5, grad_norm <= 5.7e-4
    lr: identical everywhere (a Python float schedule)

What a real bug does, for scale: a 1% larger learning rate moves the fp32 loss by 2e-4..2.4e-3
(steps 2-5) and the grad norm by up to 1.5e-2; in the bf16 default job the loss by 1.9e-4..5.7e-4
and the grad norm by up to 2.3e-3. A gradient off by 2x moves the grad norm by 1.0.

So fp32: rtol 1e-4 on loss and grad norm (40x the largest measured noise, still below a 1%
learning-rate change); bf16 default job: rtol 1e-4 on the loss (9x the noise) and 5e-3 on the
grad norm (9x the noise; a 2x gradient is 200x that); lr: rtol 1e-9.

The runs (e)-(i) of tests/golden/regenerate.py, measured the same way (AUTOMODEL_NUM_THREADS=1
and 2: bit-identical; ATEN_CPU_CAPABILITY=avx2 with MKL_ENABLE_INSTRUCTIONS=AVX2, and
ATEN_CPU_CAPABILITY=default with MKL_ENABLE_INSTRUCTIONS=SSE4_2, against AVX-512), largest
relative deviations over the 5 steps:

    ddp_dp2:               loss <= 1.7e-7, grad_norm <= 1.6e-6
    tp2_sequence_parallel: loss <= 5.8e-7, grad_norm <= 3.9e-6
    cp2_ring:              loss <= 3.2e-7, grad_norm <= 2.2e-6
    image_text_dp2:        loss <= 4.9e-7, grad_norm <= 1.8e-6
    moe_ep2:               loss <= 3.9e-6, grad_norm <= 2.5e-5, aux_loss <= 3.0e-6

The first four are fp32 runs like the others: FP32_RTOL (>= 25x their noise). A 1% larger
learning rate moves image_text_dp2's loss by 2e-4..2.8e-3 and grad norm by 2.2e-3..4.9e-3
(steps 2-5). The MoE run is noisier (expert routing, sorting and scatter-adds of tokens): rtol
1e-4 on the loss (25x), 3e-4 on the grad norm (12x) and 1e-4 on aux_loss (33x); a 1% larger
learning rate moves them by 1.4e-3..3.1e-3 (loss, steps 3-5), 2.5e-3..5.4e-3 (grad norm, steps
2-5) and 1.8e-4..1.8e-3 (aux_loss, steps 2-5).

Each file records the torch, transformers and python versions and the CPU kernel set it was
generated with (the first four files: torch and transformers only); a failing comparison says
which of them differ from this machine's, or that the versions are the same, so the change is in
the code.
"""

import numpy as np
import pytest

from tests.golden.regenerate import RUNS, environment, load_golden, run_golden, summarize
from tests.helpers import BASE

FP32_RTOL = {"loss": 1e-4, "grad_norm": 1e-4, "lr": 1e-9}
BF16_RTOL = {"loss": 1e-4, "grad_norm": 5e-3, "lr": 1e-9}
RTOL = {"single_process": FP32_RTOL, "fsdp2_dp2": FP32_RTOL, "pipeline_1f1b": FP32_RTOL,
        "default_job": BF16_RTOL, "ddp_dp2": FP32_RTOL, "tp2_sequence_parallel": FP32_RTOL,
        "cp2_ring": FP32_RTOL, "moe_ep2": {**FP32_RTOL, "grad_norm": 3e-4, "aux_loss": 1e-4},
        "image_text_dp2": FP32_RTOL}
# Runs checked by the parity test that already runs exactly that job (the job is not run twice)
CHECKED_BY = {
    "ddp_dp2": "tests/distributed/test_parity.py::"
               "test_two_ranks_match_single_process[ddp-overrides0]",
    "tp2_sequence_parallel": "tests/distributed/test_tensor_parallel.py::"
                             "test_tp_matches_single_process[tp2_sequence_parallel-overrides1]",
    "cp2_ring": "tests/distributed/test_context_parallel.py::"
                "test_context_parallel_matches_single_process[cp2_ring]",
    "moe_ep2": "tests/distributed/test_moe.py::"
               "test_moe_family_matches_single_process[qwen3_moe_tiny-ep2]",
    "image_text_dp2": "tests/distributed/test_image_text.py::"
                      "test_frozen_tower_matches_single_process[root]",
}
VERSIONS = ("torch", "transformers", "python")


def environment_note(recorded: dict, installed: dict) -> str:
    """Which installed versions differ from those a golden file was generated with."""
    def shown(env, key):
        return env.get(key, "not recorded")

    moved = [f"{k} {shown(recorded, k)} (golden) -> {shown(installed, k)} (installed)"
             for k in VERSIONS if shown(recorded, k) != shown(installed, k)]
    if moved:
        note = ("Installed versions differ from those the golden file was generated with: "
                + "; ".join(moved) + ". If the numbers moved with the upgrade (the same "
                "change without it reproduces them), regenerate and say so in the commit.")
    else:
        note = ("torch, transformers and python are the versions the golden file was generated "
                f"with ({', '.join(f'{k} {installed[k]}' for k in VERSIONS)}): the change is in "
                "the code.")
    cpu = "cpu_capability"
    if shown(recorded, cpu) != shown(installed, cpu):
        note += (f" (CPU kernels: {shown(recorded, cpu)} (golden), {shown(installed, cpu)} "
                 "here; the tolerances cover the difference measured between instruction sets.)")
    return note


def compare_with_golden(name, records, stored, rtol, installed):
    """Assert ``records`` match the golden file's content ``stored``; on a mismatch the message
    also says which installed versions (``installed``) differ from the recorded ones."""
    golden = stored["records"]
    assert golden, f"tests/golden/{name}.json holds no records"
    assert records, f"the {name} run logged no records"
    assert [r["step"] for r in records] == [g["step"] for g in golden] == [1, 2, 3, 4, 5]
    for key, key_rtol in rtol.items():
        try:
            np.testing.assert_allclose(
                [r[key] for r in records], [g[key] for g in golden], rtol=key_rtol,
                err_msg=f"{name}: {key} moved away from tests/golden/{name}.json. Only after a "
                        f"deliberate change of numerics: python -m tests.golden.regenerate "
                        f"{name}")
        except AssertionError as err:
            note = environment_note(stored.get("generated_with", {}), installed)
            raise AssertionError(f"{err}\n{note}") from None


def assert_golden(name, records, overrides=None):
    """The run's records match tests/golden/<name>.json. ``overrides``: what a test that runs
    the job itself passed to tests.helpers.train (base BASE); they must be the golden run's."""
    stored = load_golden(name)
    if overrides is not None:
        assert list(BASE) + list(overrides) == stored["overrides"], (
            f"this test's overrides are no longer those of the golden run {name!r} "
            f"(tests/golden/regenerate.py RUNS): change both together and regenerate")
    compare_with_golden(name, records, stored, RTOL[name], environment())


@pytest.mark.fast
def test_golden_files_match_the_runs_they_claim():
    # Changing a canonical run without regenerating its file must fail here, not look like a
    # numerics change; and (a) is exactly the conftest `reference()` run.
    assert set(RTOL) == set(RUNS)
    assert RUNS["single_process"] == (BASE, ["parallelism=none"])
    for name, (base, overrides) in RUNS.items():
        stored = load_golden(name)
        assert stored["overrides"] == list(base) + list(overrides), name
        assert len(stored["records"]) == 5, name
        assert set(RTOL[name]) | {"step"} == set(stored["records"][0]), name
        # (python and the CPU kernel set: recorded since the runs (e)-(i) were added)
        assert {"torch", "transformers"} <= set(stored["generated_with"]), name
    for name, test in CHECKED_BY.items():  # (and those tests pass their overrides to
        assert RUNS[name][0] == BASE, name  # assert_golden, which compares them)
        path, func = test.split("::")
        source = open(path, encoding="utf-8").read()
        assert f"def {func.split('[')[0]}(" in source and f'"{name}"' in source, test


@pytest.mark.fast
def test_a_mismatch_names_the_versions_that_differ():
    stored = load_golden("moe_ep2")
    installed = dict(stored["generated_with"])
    moved = [dict(r, grad_norm=r["grad_norm"] * 1.01) for r in stored["records"]]
    compare_with_golden("moe_ep2", stored["records"], stored, RTOL["moe_ep2"], installed)

    def message(installed):
        with pytest.raises(AssertionError) as err:
            compare_with_golden("moe_ep2", moved, stored, RTOL["moe_ep2"], installed)
        return str(err.value)

    same = message(installed)
    assert "grad_norm moved away from tests/golden/moe_ep2.json" in same
    assert "the change is in the code" in same and "differ" not in same.split("\n")[-1]
    upgraded = message(dict(installed, torch="9.9.9", python="3.99.0"))
    last = upgraded.split("\n")[-1]
    assert f"torch {installed['torch']} (golden) -> 9.9.9 (installed)" in last
    assert f"python {installed['python']} (golden) -> 3.99.0 (installed)" in last
    assert "transformers" not in last and "the change is in the code" not in last
    unrecorded = dict(stored, generated_with={"torch": installed["torch"]})
    with pytest.raises(AssertionError, match="transformers not recorded .golden. -> "):
        compare_with_golden("moe_ep2", moved, unrecorded, RTOL["moe_ep2"], installed)
    other_cpu = message(dict(installed, cpu_capability="AVX2"))
    assert f"CPU kernels: {installed['cpu_capability']} (golden), AVX2 here" in other_cpu


def test_single_process_reference_matches_golden(reference):
    assert_golden("single_process", summarize(reference()))


@pytest.mark.parametrize("name", ["fsdp2_dp2", "pipeline_1f1b", "default_job"])
def test_canonical_run_matches_golden(name, tmp_path):
    assert_golden(name, run_golden(name, tmp_path))
