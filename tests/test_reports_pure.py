"""What `report()` is given, made into numbers (core/reports.py): nothing a program passes fails it."""

from __future__ import annotations

import math
from decimal import Decimal

import pytest

from launcher.core.reports import clean_report


def test_numbers_in_other_forms_are_read_and_what_is_not_a_number_is_left_out_and_named():
    clean = clean_report(1, 5.0, total="100", loss="abc", tokens="x", lr=Decimal("3e-4"), flops=None)
    assert clean.record == {"iteration": 1, "time": 5.0, "total": 100, "lr": 3e-4}
    assert [d.describe() for d in clean.dropped] == [
        "report(): loss='abc' is not a number: left out of the progress",
        "report(): tokens='x' is not a number: left out of the progress",
    ]


@pytest.mark.parametrize("iteration", [float("nan"), "step-3", -1, 2.5, None, float("inf")])
def test_an_iteration_that_is_not_a_whole_number_leaves_the_report_out(iteration):
    clean = clean_report(iteration, 0.0, loss=1.0)
    assert clean.record is None and [d.field for d in clean.dropped] == ["iteration"]
    assert clean.dropped[0].describe().endswith(": the report is left out")


def test_a_diverged_loss_is_kept_and_counts_must_be_whole():
    clean = clean_report(3.0, 0.0, loss=float("nan"), lr=float("inf"), tokens=8192.0, total=10.5)
    record = clean.record
    assert record["iteration"] == 3 and math.isnan(record["loss"]) and record["tokens"] == 8192
    assert {d.field: d.why for d in clean.dropped} == {
        "lr": "is not a finite number",
        "total": "is not a whole number of 0 or more",
    }


def test_tensors_and_numpy_values_are_read_with_item():
    torch = pytest.importorskip("torch")
    np = pytest.importorskip("numpy")
    loss, total, lr = torch.tensor([2.5]), np.int64(9), np.float32(0.5)
    clean = clean_report(torch.tensor(7), 0.0, loss=loss, total=total, lr=lr)
    assert clean.record == {"iteration": 7, "time": 0.0, "loss": 2.5, "total": 9, "lr": 0.5}
    assert type(clean.record["iteration"]) is int and type(clean.record["loss"]) is float
    many = clean_report(1, 0.0, loss=torch.tensor([1.0, 2.0]))
    assert many.record == {"iteration": 1, "time": 0.0} and many.dropped[0].why == "is not a number"
