"""tests/harness.py's weights_difference: what an intermittent bitwise failure prints."""

from __future__ import annotations

import torch

from tests.harness import weights_difference


def test_equal_weights_read_empty_and_a_difference_is_named_with_its_size(tmp_path):
    ref = {"w": torch.ones(3, 4), "b": torch.zeros(4), "h": torch.ones(2, dtype=torch.bfloat16),
           "nan": torch.tensor([float("nan")])}
    torch.save(ref, tmp_path / "ref.pt")
    torch.save({k: v.clone() for k, v in ref.items()}, tmp_path / "same.pt")
    assert weights_difference(tmp_path / "same.pt", tmp_path / "ref.pt") == ""  # NaN equals itself bitwise
    other = {k: v.clone() for k, v in ref.items() if k != "b"}
    other["w"][1, 2] += 1e-6
    other["extra"] = torch.ones(1)
    torch.save(other, tmp_path / "other.pt")
    text = weights_difference(tmp_path / "other.pt", tmp_path / "ref.pt")
    assert text.splitlines()[0] == "1 of 3 shared tensors differ:", text
    assert f"only in {tmp_path / 'other.pt'}: extra" in text and f"only in {tmp_path / 'ref.pt'}: b" in text
    assert "w: 1 of 12 elements differ, max |diff| 9.54e-07 (max |value| 1)" in text, text
