"""The cost model against the published record (src/slipstream/plan/published.py, docs/plan.md).

The figures pinned here are computed by the model from the stored record; the bounds are the
issue's targets (validation MAE <= 5 points, no case off by more than 10), not the model's own
output."""

from __future__ import annotations

import pytest

from slipstream.plan import costmodel
from slipstream.plan.published import CASES, SPLIT, attribution, errors, evaluate, fit_straggler_cv

# The split as committed before the model was changed (commit 23b2249): it must not drift.
COMMITTED_SPLIT = {
    "horovod-resnet101": "calibration", "horovod-inception3": "calibration", "horovod-vgg16": "calibration",
    "goyal-resnet50": "calibration", "megatron-v1-tp2": "calibration",
    "ddl-resnet50": "validation", "megatron-v1-tp4": "validation", "megatron-v1-tp8": "validation",
    "megatron-8.3b-512": "validation",
}


def test_record_is_cited_and_split_as_committed():
    assert len(CASES) >= 8
    assert SPLIT == COMMITTED_SPLIT
    for c in CASES:
        assert c.source and c.where and c.verified, c.key
        assert 0 < c.published <= 1


def test_straggler_constant_is_the_calibration_fit():
    # The one fitted constant comes from the calibration set, not from a hand-picked value.
    assert costmodel.STRAGGLER_CV == pytest.approx(fit_straggler_cv())


def test_validation_error_meets_the_targets():
    v = errors("validation")
    assert v["n"] >= 4
    assert v["mae_pts"] <= 5.0 and v["max_pts"] <= 10.0, v
    c = errors("calibration")
    assert c["mae_pts"] <= 5.0, c


def test_horovod_cases():
    got = {c.key: (evaluate(c)["predicted"] - c.published) * 100 for c in CASES if c.key.startswith("horovod")}
    assert abs(got["horovod-resnet101"]) <= 5 and abs(got["horovod-inception3"]) <= 5, got
    # VGG-16 is the documented miss (docs/plan.md): optimistic by about 10 points, which the
    # bandwidth term alone cannot close (a ring at 0.85 of 25 Gbit/s moves 553 MB in 0.42 s).
    assert 5 < got["horovod-vgg16"] <= 12, got


def test_attribution_starts_from_the_old_model_and_ends_at_the_prediction():
    vgg = next(c for c in CASES if c.key == "horovod-vgg16")
    rows = attribution(vgg)
    assert rows[0][1] == pytest.approx(0.972, abs=0.005)  # pre-#19 (benchmarks/results/cost-model-validation.md)
    assert rows[-1][1] == pytest.approx(evaluate(vgg)["predicted"])
    assert rows[1][0].startswith("+ measured") and rows[1][1] < 0.80  # measured compute closes most


def test_expected_max_normal_against_the_exact_values():
    # E[max of 2] = 1/sqrt(pi) = 0.564; of 4: 1.029; Blom's approximation within 0.03.
    assert costmodel.expected_max_normal(2) == pytest.approx(0.564, abs=0.03)
    assert costmodel.expected_max_normal(4) == pytest.approx(1.029, abs=0.03)
