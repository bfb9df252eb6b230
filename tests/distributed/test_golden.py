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
"""

import numpy as np
import pytest

from tests.golden.regenerate import RUNS, load_golden, run_golden, summarize
from tests.helpers import BASE

FP32_RTOL = {"loss": 1e-4, "grad_norm": 1e-4, "lr": 1e-9}
BF16_RTOL = {"loss": 1e-4, "grad_norm": 5e-3, "lr": 1e-9}
RTOL = {"single_process": FP32_RTOL, "fsdp2_dp2": FP32_RTOL, "pipeline_1f1b": FP32_RTOL,
        "default_job": BF16_RTOL}


def assert_golden(name, records):
    golden = load_golden(name)["records"]
    assert golden, f"tests/golden/{name}.json holds no records"
    assert records, f"the {name} run logged no records"
    assert [r["step"] for r in records] == [g["step"] for g in golden] == [1, 2, 3, 4, 5]
    for key, rtol in RTOL[name].items():
        np.testing.assert_allclose(
            [r[key] for r in records], [g[key] for g in golden], rtol=rtol,
            err_msg=f"{name}: {key} moved away from tests/golden/{name}.json. Only after a "
                    f"deliberate change of numerics: python -m tests.golden.regenerate {name}")


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


def test_single_process_reference_matches_golden(reference):
    assert_golden("single_process", summarize(reference()))


@pytest.mark.parametrize("name", ["fsdp2_dp2", "pipeline_1f1b", "default_job"])
def test_canonical_run_matches_golden(name, tmp_path):
    assert_golden(name, run_golden(name, tmp_path))
