"""``slipstream data pack`` on JSON Lines and Parquet: round trips, a tokenizer, bad input, no partial output."""

from __future__ import annotations

import json
import os
import re
import sys

import numpy as np
import pytest

from slipstream.cli import main
from slipstream.data import ShardedDataset, ShardWriter, load_index, pack
from slipstream.data.source import Source
from slipstream.errors import ConfigError, UsageError
from slipstream.extras import pip_install_hint

try:  # in the data extra, which `bash scripts/install.sh test` installs: fail loudly, never skip
    import pyarrow as pa
    import pyarrow.parquet as pq
except ImportError:  # pragma: no cover
    pa = pq = None


@pytest.fixture(autouse=True)
def _pyarrow_is_installed(request):
    if pa is None and "parquet" in request.node.name and "without_pyarrow" not in request.node.name:
        pytest.fail("pyarrow is missing: pip install 'slipstream[data]' (bash scripts/install.sh test)")

DOCS = [f"document {i}: " + "päck me " * (3 + i) for i in range(40)]


def _byte_stream(docs: list[str]) -> np.ndarray:
    out = []
    for d in docs:
        out.extend(d.encode())
        out.append(256)
    return np.array(out, dtype=np.uint16)


def _samples(out) -> np.ndarray:
    ds = ShardedDataset(str(out))
    return np.stack([ds[i] for i in range(len(ds))])


def _write_jsonl(path, docs, field="text"):
    with open(path, "w") as f:
        for i, d in enumerate(docs):
            f.write(json.dumps({"id": i, field: d}) + "\n")


def _published(out) -> list[str]:
    """What a reader could see: everything but the writer's hidden staging directories."""
    return sorted(n for n in os.listdir(out) if not n.startswith(".pack-")) if os.path.isdir(out) else []


def test_jsonl_round_trip_through_the_cli(tmp_path, capsys):
    _write_jsonl(tmp_path / "train.jsonl", DOCS, field="body")
    out = tmp_path / "ds"
    rc = main(["data", "pack", str(tmp_path / "train.jsonl"), str(out), "--field", "body", "--tokens-per-sample", "33",
               "--shard-size-mb", "0.002"])
    assert rc == 0, capsys.readouterr().err
    idx = load_index(Source(str(out)))
    assert len(idx.shards) > 1 and idx.meta["source_format"] == "jsonl" and idx.meta["tokenizer"] == "bytes+eot"
    stream = _byte_stream(DOCS)
    n = len(stream) // 33
    np.testing.assert_array_equal(_samples(out), stream[: n * 33].reshape(n, 33))
    assert _published(out) == sorted(["index.json", *(s.file for s in idx.shards)])
    assert [n for n in os.listdir(out) if n.startswith(".pack-")] == []


def test_parquet_text_and_binary_round_trips(tmp_path):
    pq.write_table(pa.table({"text": DOCS, "n": list(range(len(DOCS)))}), tmp_path / "t.parquet", row_group_size=7)
    pack(str(tmp_path / "t.parquet"), str(tmp_path / "text"), tokens_per_sample=17)
    stream = _byte_stream(DOCS)
    n = len(stream) // 17
    np.testing.assert_array_equal(_samples(tmp_path / "text"), stream[: n * 17].reshape(n, 17))

    blobs = [bytes([i]) * (i + 1) + b"\x00\xff" for i in range(30)]
    pq.write_table(pa.table({"jpeg": pa.array(blobs, type=pa.binary())}), tmp_path / "b.parquet", row_group_size=8)
    assert main(["data", "pack", str(tmp_path / "b.parquet"), str(tmp_path / "bin"), "--field", "jpeg"]) == 0
    ds = ShardedDataset(str(tmp_path / "bin"))
    assert [ds[i] for i in range(len(ds))] == blobs


def test_a_tokenizer_by_module_and_name(tmp_path, monkeypatch, capsys):
    (tmp_path / "toy_tok.py").write_text("def encode(s):\n    return [70000 + len(w) for w in s.split()]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    docs = ["a bb ccc", "dddd", "ee f"]
    (tmp_path / "in").mkdir()
    _write_jsonl(tmp_path / "in" / "a.jsonl", docs[:2])
    _write_jsonl(tmp_path / "in" / "b.jsonl", docs[2:])
    rc = main(["data", "pack", str(tmp_path / "in"), str(tmp_path / "ds"), "--kind", "jsonl", "--tokenizer", "toy_tok:encode",
               "--eot-token", "9", "--tokens-per-sample", "3"])
    assert rc == 0
    got = _samples(tmp_path / "ds")
    assert got.dtype == np.uint32  # ids past uint16 are kept
    np.testing.assert_array_equal(got.reshape(-1), [70001, 70002, 70003, 9, 70004, 9, 70002, 70001, 9])
    assert load_index(Source(str(tmp_path / "ds"))).meta["tokenizer"] == "toy_tok:encode"
    capsys.readouterr()
    assert main(["data", "pack", str(tmp_path / "in"), str(tmp_path / "x"), "--kind", "jsonl", "--tokenizer", "toy_tok"]) == 2
    assert "MODULE:CALLABLE" in capsys.readouterr().err


def test_a_malformed_jsonl_line_is_named_and_nothing_is_published(tmp_path, capsys):
    path = tmp_path / "bad.jsonl"
    _write_jsonl(path, DOCS)
    lines = path.read_text().splitlines(keepends=True)
    lines[25] = '{"text": "cut off\n'
    path.write_text("".join(lines))
    out = tmp_path / "ds"
    rc = main(["data", "pack", str(path), str(out), "--tokens-per-sample", "9", "--shard-size-mb", "0.001"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and f"{path}:26: not valid JSON" in err and len(err.splitlines()) == 1, err
    assert _published(out) == []  # shards were sealed before line 26, none of them is visible

    path.write_text("".join(lines[:25]) + lines[26][:-9])  # a file that ends inside a record
    rc = main(["data", "pack", str(path), str(out), "--tokens-per-sample", "9"])
    err = capsys.readouterr().err
    assert rc == 2 and f"{path}:26: not valid JSON" in err and "truncated?" in err, err
    assert _published(out) == []

    _write_jsonl(path, DOCS, field="body")
    with pytest.raises(ConfigError, match=r"bad.jsonl:1: no field 'text' \(the record has: body, id"):
        pack(str(path), str(out))


def test_a_failure_leaves_the_previous_dataset_intact(tmp_path):
    good = tmp_path / "good.jsonl"
    _write_jsonl(good, DOCS)
    out = tmp_path / "ds"
    pack(str(good), str(out), tokens_per_sample=9, shard_size_bytes=1024)
    before = {n: (out / n).read_bytes() for n in _published(out)}
    bad = tmp_path / "bad.jsonl"
    bad.write_text(good.read_text() + "not json\n")
    with pytest.raises(ConfigError, match=r"bad.jsonl:41: not valid JSON"):
        pack(str(bad), str(out), tokens_per_sample=5, shard_size_bytes=512, overwrite=True)
    assert {n: (out / n).read_bytes() for n in _published(out)} == before
    assert [n for n in os.listdir(out) if n.startswith(".pack-")] == []
    assert len(ShardedDataset(str(out))) == load_index(Source(str(out))).num_samples

    # An overwrite that succeeds with fewer shards removes the old ones.
    pack(str(good), str(out), tokens_per_sample=9, shard_size_bytes=1 << 20, overwrite=True)
    assert _published(out) == ["index.json", "shard-00000.slp"]


def test_a_truncated_parquet_file_is_named(tmp_path, capsys):
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"text": DOCS}), path, row_group_size=10)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    rc = main(["data", "pack", str(path), str(tmp_path / "ds")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and str(path) in err and "Parquet" in err and len(err.splitlines()) == 1, err
    assert _published(tmp_path / "ds") == []

    # A damaged row group (footer intact) names the rows it holds.
    pq.write_table(pa.table({"text": DOCS}), path, row_group_size=10, compression="none")
    meta = pq.ParquetFile(path).metadata
    col = meta.row_group(2).column(0)
    start = col.data_page_offset
    damaged = bytearray(path.read_bytes())
    damaged[start : start + col.total_compressed_size] = b"\xff" * col.total_compressed_size
    path.write_bytes(bytes(damaged))
    with pytest.raises(ConfigError, match=r"t.parquet: row 20 \(rows 20..29, row group 2\)"):
        pack(str(path), str(tmp_path / "ds"), tokens_per_sample=5, shard_size_bytes=256)
    assert _published(tmp_path / "ds") == []


def test_parquet_without_pyarrow_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(UsageError, match=f"^{re.escape('reading Parquet needs pyarrow: ' + pip_install_hint('data'))}$"):
        pack(str(tmp_path / "t.parquet"), str(tmp_path / "ds"))


def test_a_null_parquet_row_and_a_wrong_column(tmp_path):
    path = tmp_path / "n.parquet"
    pq.write_table(pa.table({"text": ["a" * 50, None], "x": [1, 2]}), path)
    with pytest.raises(ConfigError, match=r"n.parquet: row 1: column 'text' is null"):
        pack(str(path), str(tmp_path / "ds"), tokens_per_sample=5)
    with pytest.raises(ConfigError, match=r"column 'x' is int64"):
        pack(str(path), str(tmp_path / "ds"), field="x")
    with pytest.raises(ConfigError, match=r"no column 'body'"):
        pack(str(path), str(tmp_path / "ds"), field="body")


def test_a_writer_killed_midway_publishes_nothing(tmp_path):
    w = ShardWriter(str(tmp_path / "ds"), shard_size_bytes=256)
    for i in range(20):
        w.write(bytes([i]) * 40)
    # a process that dies here leaves only its hidden staging directory
    assert _published(tmp_path / "ds") == []
    w.abort()
    assert os.listdir(tmp_path / "ds") == []


def test_an_overwrite_at_a_url_never_leaves_an_index_naming_replaced_shards(tmp_path, s3):
    url, opts, client = s3
    good = tmp_path / "good.jsonl"
    _write_jsonl(good, DOCS)
    pack(str(good), f"{url}/ds", tokens_per_sample=9, shard_size_bytes=1024, storage_options=opts)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(good.read_text() + "not json\n")
    with pytest.raises(ConfigError, match=r"bad.jsonl:41: not valid JSON"):
        pack(str(bad), f"{url}/ds", tokens_per_sample=5, shard_size_bytes=512, storage_options=opts, overwrite=True)
    assert not Source(f"{url}/ds", opts).exists("index.json")  # new shards were uploaded: the old index is gone
    idx = pack(str(good), f"{url}/ds", tokens_per_sample=9, storage_options=opts, overwrite=True)
    assert load_index(Source(f"{url}/ds", opts)).num_samples == idx.num_samples
