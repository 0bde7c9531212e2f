"""The conformance matrix (issue #32): every accepted configuration trains, every other is refused up front.

* Refusals, pure and in-process: every row of the full cross product of the axes
  (tests/conformance/matrix.py) is checked by the product's own validation; a
  refused row gets one line that names its combination, and ``slipstream run``
  (flags -> worker environment) refuses exactly the rows keywords do, with the
  same message, before any worker starts.
* Training: a pairwise covering array of the accepted rows (allpairspy, filtered
  by the same validation) trains at 2 ranks on gloo, in one process group for
  all rows where none fails; each row's final loss must be finite and within the
  documented bound of its reference (matrix.tolerance).

The full cross product's training is benchmarks/conformance_matrix.py --full.
"""

from __future__ import annotations

import re
import time

import pytest
import torch
from torch import nn

import slipstream
from slipstream.config import TrainConfig
from slipstream.errors import ConfigError
from tests.conformance import matrix
from tests.conformance.matrix import Row


def _named(row: Row, message: str) -> list[str]:
    """The row's own values (those not at their default) that the message names."""
    tokens = []
    if row.sync != "allreduce":
        tokens.append(rf"'?\b{re.escape(row.sync)}\b'?")
    tokens += [rf"\b{k}\b" for k in matrix.LAYOUTS[row.layout] if k != "zero_stage"]
    if row.precision != "fp32":
        tokens.append(rf"precision {row.precision}\b")
    if matrix.ACCUM_CLIP[row.accum_clip][0] > 1:
        tokens.append(r"\baccumulate_steps\b")
    if row.param_dtype != "fp32":
        tokens.append(rf"parameter dtype {row.param_dtype}\b")
    return [t for t in tokens if re.search(t, message)]


def test_every_refused_row_is_refused_up_front_in_one_line_naming_it():
    keyword_rows = [r for r in matrix.all_rows() if r.config_via == "keywords"]
    refused = {}
    for row in keyword_rows:
        why = matrix.refusal(row)
        if why is not None:
            refused[row] = why
            assert "\n" not in why, f"{row.name}: refusal is not one line: {why!r}"
            assert _named(row, why), f"{row.name}: refusal names none of the row's values: {why}"
    assert refused and len(refused) < len(keyword_rows)
    # The rules the matrix found (each names the combination, the rule, what to use instead).
    reasons = set(refused.values())
    assert any("is a DDP gradient hook" in r for r in reasons)
    assert any("accumulate_steps(2) with pp(2)" in r for r in reasons)
    assert any(r.startswith("parameter dtype fp16 with precision") for r in reasons)
    assert any(r.startswith("parameter dtype bf16 with precision fp16") for r in reasons)


def test_slipstream_run_refuses_what_keywords_refuse_with_the_same_line():
    # Every combination of the axes a refusal depends on (checkpoints cannot make one).
    started = time.perf_counter()
    for row in matrix.all_rows():
        if row.config_via != "slipstream run" or row.checkpoint != "async":
            continue
        by_flags = matrix.refusal(row)
        by_keywords = matrix.refusal(Row(**{**matrix.asdict(row), "config_via": "keywords"}))
        if by_keywords is None:
            assert by_flags is None, f"{row.name}: slipstream run refuses what keywords accept: {by_flags}"
        else:
            # The parameter dtype is the model's: accelerate() refuses it, before it builds anything.
            prefix = "" if by_keywords.startswith("parameter dtype") else "invalid training flag: "
            assert by_flags == prefix + by_keywords, (row.name, by_flags, by_keywords)
    print(f"checked in {time.perf_counter() - started:.1f} s")


@pytest.fixture()
def single_process():
    slipstream.init()
    yield
    slipstream.shutdown()


@pytest.mark.parametrize("dtype,precision", [(torch.float16, "fp32"), (torch.float16, "bf16"),
                                             (torch.float16, "fp16"), (torch.bfloat16, "fp16")])
def test_accelerate_refuses_parameter_dtypes_before_building(single_process, dtype, precision):
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)).to(dtype)
    name = {torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]
    with pytest.raises(ConfigError, match=rf"^parameter dtype {name} with precision {precision} is not supported"):
        slipstream.accelerate(model, torch.optim.AdamW(model.parameters()), precision=precision, progress=False)


def test_accepted_parameter_dtypes_pass_the_check():
    from slipstream.config import check_parameter_dtype

    for dtype, precision in (("fp32", "fp16"), ("bf16", "bf16"), ("bf16", "fp32")):
        check_parameter_dtype(TrainConfig(precision=precision), dtype)


ROWS = matrix.pairwise_rows()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    started = time.perf_counter()
    out = matrix.run_rows(ROWS, str(tmp_path_factory.mktemp("conformance")), timeout_s=600)
    meta = out.pop(None)
    print(f"\nconformance matrix: {len(ROWS)} rows in {time.perf_counter() - started:.0f} s, "
          f"{meta['launches']} launch(es)")
    return out


def test_the_covering_array_covers_every_accepted_pair():
    from itertools import combinations

    axes = matrix.axes()
    covered = {(a, va, b, vb) for row in ROWS for (a, va), (b, vb) in combinations(matrix.asdict(row).items(), 2)}
    for (a, values_a), (b, values_b) in combinations(axes.items(), 2):
        for va in values_a:
            for vb in values_b:
                if matrix.refusal(Row(**{a: va, b: vb})) is None:
                    assert (a, va, b, vb) in covered, f"pair {a}={va}, {b}={vb} accepted but in no row"


@pytest.mark.distributed
@pytest.mark.parametrize("row", ROWS, ids=[r.name for r in ROWS])
def test_row_trains(trained, row):
    result = trained[row]
    assert result["status"] == "trained", f"{row.name}: {result['reason']}\n{result.get('traceback', '')[-2000:]}"
