"""Shard format: round trips, shard sizes, packers, and bad data (checksum, truncation)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from slipstream.data import (
    DataIntegrityError,
    ShardedDataset,
    ShardReader,
    ShardWriter,
    SlipstreamLoader,
    load_index,
    pack,
    pack_files,
    pack_text,
    verify_dataset,
)
from slipstream.data.format import FOOTER_BYTES, HEADER_BYTES, file_sha256, shard_name
from slipstream.data.source import Source
from slipstream.errors import ConfigError


def test_bytes_round_trip_with_fixed_size_shards(tmp_path):
    rng = np.random.default_rng(0)
    samples = [rng.bytes(int(rng.integers(0, 300))) for _ in range(500)]
    out = str(tmp_path / "ds")
    with ShardWriter(out, shard_size_bytes=4096) as w:
        for s in samples:
            w.write(s)
    idx = w.index
    assert idx.num_samples == 500 and len(idx.shards) > 10
    for info in idx.shards:
        assert os.path.getsize(os.path.join(out, info.file)) == info.size_bytes <= 4096
    ds = ShardedDataset(out)
    assert len(ds) == 500
    assert [ds[i] for i in range(500)] == samples


def test_sample_larger_than_shard_gets_its_own_shard(tmp_path):
    out = str(tmp_path / "ds")
    with ShardWriter(out, shard_size_bytes=256) as w:
        w.write(b"a" * 10)
        w.write(b"b" * 1000)
        w.write(b"c" * 10)
    assert [s.num_samples for s in w.index.shards] == [1, 1, 1]
    ds = ShardedDataset(out)
    assert ds[1] == b"b" * 1000 and ds[2] == b"c" * 10


def test_record_fields_round_trip(tmp_path):
    out = str(tmp_path / "ds")
    fields = [("x", "float32", (3, 4)), ("y", "int64", ())]
    rng = np.random.default_rng(1)
    xs = rng.standard_normal((50, 3, 4)).astype(np.float32)
    with ShardWriter(out, shard_size_bytes=1024, fields=fields) as w:
        for i in range(50):
            w.write({"x": xs[i], "y": np.int64(i * 7)})
    ds = ShardedDataset(out)
    for i in (0, 17, 49):
        s = ds[i]
        np.testing.assert_array_equal(s["x"], xs[i])
        assert int(s["y"]) == i * 7 and s["x"].flags.writeable
    with pytest.raises(ConfigError, match=r"outside uint16"):
        with ShardWriter(str(tmp_path / "tok"), fields=[("t", "uint16", (2,))]) as w3:
            w3.write(np.array([5, 70000]))
    with pytest.raises(ConfigError, match="dtype"):
        with ShardWriter(str(tmp_path / "tok2"), fields=[("t", "int32", (2,))]) as w4:
            w4.write(np.array([0.5, 1.5]))
    with ShardWriter(str(tmp_path / "tok3"), fields=[("t", "uint16", (2,))]) as w5:
        w5.write(np.array([5, 65535], dtype=np.int64))  # fits: accepted
    with pytest.raises(ConfigError, match="shape"):
        with ShardWriter(str(tmp_path / "bad"), fields=fields) as w2:
            w2.write({"x": np.zeros((4, 3), np.float32), "y": 1})


def test_writer_refuses_to_overwrite(tmp_path, numbered):
    with pytest.raises(ConfigError, match="already exists"):
        ShardWriter(numbered)


def test_pack_files_keys_and_contents(tmp_path):
    root = tmp_path / "in"
    (root / "sub").mkdir(parents=True)
    files = {"a.bin": b"\x00\x01" * 100, "sub/b.txt": b"hello", "z.dat": os.urandom(3000)}
    for name, data in files.items():
        (root / name).write_bytes(data)
    idx = pack_files(str(root), str(tmp_path / "out"), shard_size_bytes=2048)
    assert idx.keys == sorted(files)
    ds = ShardedDataset(str(tmp_path / "out"))
    assert {ds.key(i): ds[i] for i in range(len(ds))} == files
    idx2 = pack_files(str(root), str(tmp_path / "out2"), exclude_dirs=("sub",))
    assert idx2.keys == ["a.bin", "z.dat"]


def test_pack_text_byte_tokens(tmp_path):
    root = tmp_path / "corpus"
    root.mkdir()
    (root / "1.txt").write_text("hello world\n")
    (root / "2.txt").write_text("second document, a little longer\n")
    idx = pack_text(str(root), str(tmp_path / "out"), tokens_per_sample=8, shard_size_bytes=256)
    stream = list(b"hello world\n") + [256] + list(b"second document, a little longer\n") + [256]
    n = len(stream) // 8
    assert idx.num_samples == n and idx.meta["vocab_size"] == 257
    ds = ShardedDataset(str(tmp_path / "out"))
    got = np.concatenate([ds[i] for i in range(n)])
    assert got.dtype == np.uint16 and got.tolist() == stream[: n * 8]


def test_pack_npz_and_auto_kind(tmp_path):
    x = np.arange(60, dtype=np.float32).reshape(20, 3)
    y = np.arange(20, dtype=np.int16)
    np.savez(tmp_path / "t.npz", x=x, y=y)
    idx = pack(str(tmp_path / "t.npz"), str(tmp_path / "out"), shard_size_bytes=200)
    assert idx.meta["kind"] == "arrays" and len(idx.shards) > 1
    ds = ShardedDataset(str(tmp_path / "out"))
    np.testing.assert_array_equal(ds[13]["x"], x[13])
    assert int(ds[13]["y"]) == 13


def _reference(ds_dir):
    ds = ShardedDataset(ds_dir)
    return [ds[i] for i in range(len(ds))]


def test_corrupt_sample_names_shard_and_offset(numbered):
    idx = load_index(Source(numbered))
    shard_path = os.path.join(numbered, idx.shards[3].file)
    reader = ShardReader(shard_path, idx.shards[3])
    off, length = reader.byte_range(5)
    del reader
    with open(shard_path, "r+b") as f:
        f.seek(off + length // 2)
        b = f.read(1)
        f.seek(off + length // 2)
        f.write(bytes([b[0] ^ 0x40]))
    ds = ShardedDataset(numbered)
    bad = int(idx.starts()[3]) + 5
    ds[bad - 1]  # the neighbours are fine
    with pytest.raises(DataIntegrityError) as ei:
        ds[bad]
    msg = str(ei.value)
    assert shard_path in msg and f"byte offset {off}" in msg and "crc32" in msg
    assert ei.value.shard == shard_path and ei.value.offset == off
    errors = verify_dataset(numbered)
    assert len(errors) == 2  # the shard's sha256 and the sample's crc
    assert all(idx.shards[3].file in str(e) for e in errors)


def test_truncated_shard_names_shard_and_offset(numbered):
    idx = load_index(Source(numbered))
    shard_path = os.path.join(numbered, idx.shards[2].file)
    cut = idx.shards[2].size_bytes - 100
    with open(shard_path, "r+b") as f:
        f.truncate(cut)
    ds = ShardedDataset(numbered)
    with pytest.raises(DataIntegrityError) as ei:
        ds[int(idx.starts()[2])]
    assert shard_path in str(ei.value) and f"byte offset {cut}" in str(ei.value) and "truncated" in str(ei.value)
    assert ei.value.offset == cut


def test_overwritten_footer_detected_even_with_right_size(numbered):
    idx = load_index(Source(numbered))
    shard_path = os.path.join(numbered, idx.shards[0].file)
    size = idx.shards[0].size_bytes
    with open(shard_path, "r+b") as f:
        f.seek(size - FOOTER_BYTES - 10)  # inside the sample table
        f.write(b"\xff" * 4)
    with pytest.raises(DataIntegrityError, match=r"sample table at byte offset \d+ fails its crc32"):
        ShardedDataset(numbered)[0]
    with open(shard_path, "r+b") as f:
        f.seek(0)
        f.write(b"NOTSHARD")
    with pytest.raises(DataIntegrityError, match="bad header magic at byte offset 0"):
        ShardedDataset(numbered)[0]
    assert HEADER_BYTES == 32


def test_missing_shard_is_an_error(numbered):
    os.remove(os.path.join(numbered, shard_name(1)))
    ds = ShardedDataset(numbered)
    with pytest.raises(DataIntegrityError, match="missing"):
        ds[int(ds.index.starts()[1])]


def test_skip_mode_counts_and_never_returns_wrong_samples(numbered):
    ref = _reference(numbered)
    idx = load_index(Source(numbered))
    # corrupt one sample of shard 1, truncate shard 4
    p1 = os.path.join(numbered, idx.shards[1].file)
    r = ShardReader(p1, idx.shards[1])
    off, _ = r.byte_range(2)
    del r
    with open(p1, "r+b") as f:
        f.seek(off)
        f.write(b"\x99\x99")
    with open(os.path.join(numbered, idx.shards[4].file), "r+b") as f:
        f.truncate(50)
    bad = {int(idx.starts()[1]) + 2} | set(range(int(idx.starts()[4]), int(idx.starts()[5])))
    ds = ShardedDataset(numbered, on_error="skip")
    seen_errors = []
    loader = SlipstreamLoader(ds, batch_size=7, shuffle=False, rank=0, world_size=1, on_skip=seen_errors.append)
    got = []
    for batch in loader:
        got.extend(batch.tolist())
    assert loader.skipped_total == len(bad) == len(seen_errors)
    good = [i for i in range(len(ref)) if i not in bad]
    assert got == [ref[i].tolist() for i in good]
    assert any(idx.shards[4].file in e and "truncated" in e for e in seen_errors)
    assert any(idx.shards[1].file in e and f"byte offset {off}" in e for e in seen_errors)
    # and in the default mode the same data raises
    with pytest.raises(DataIntegrityError):
        list(SlipstreamLoader(ShardedDataset(numbered), batch_size=7, shuffle=False, rank=0, world_size=1))


def test_every_single_byte_corruption_is_caught_or_harmless(tmp_path):
    """Flip each byte of a shard in turn: reading either raises or returns the exact originals."""
    samples = [bytes([i]) * (i % 7 + 1) for i in range(12)]
    out = str(tmp_path / "ds")
    with ShardWriter(out, shard_size_bytes=1 << 20) as w:
        for s in samples:
            w.write(s)
    info = w.index.shards[0]
    path = os.path.join(out, info.file)
    pristine = open(path, "rb").read()
    caught = harmless = 0
    for pos in range(len(pristine)):
        damaged = bytearray(pristine)
        damaged[pos] ^= 0x5A
        with open(path, "wb") as f:
            f.write(damaged)
        try:
            r = ShardReader(path, info)
            got = [bytes(r.sample(i)) for i in range(r.num_samples)]
        except DataIntegrityError as exc:
            assert exc.shard == path and exc.offset is not None
            caught += 1
            continue
        assert got == samples, f"byte {pos} changed a sample silently"
        harmless += 1
    # only alignment padding and reserved header/table/footer words may be harmless
    assert caught > 0.7 * len(pristine), (caught, harmless)


def test_file_url_is_a_local_path(numbered):
    assert int(ShardedDataset("file://" + numbered)[7][0]) == 7


@pytest.mark.parametrize("field,value", [("file", "../../etc/passwd"), ("file", "a/b.slp"), ("sha256", "../x"), ("sha256", "AB" * 32)])
def test_index_with_unsafe_names_is_refused(numbered, field, value):
    import json

    p = os.path.join(numbered, "index.json")
    d = json.load(open(p))
    d["shards"][0][field] = value
    with open(p, "w") as f:
        json.dump(d, f)
    with pytest.raises(DataIntegrityError, match="unsafe shard entry"):
        ShardedDataset(numbered)


def test_file_sha256_is_the_digest_of_the_whole_file_whatever_the_chunk_size(tmp_path):
    import hashlib

    blob = os.urandom(100_003)
    path = tmp_path / "blob"
    path.write_bytes(blob)
    want = hashlib.sha256(blob).hexdigest()
    assert file_sha256(path) == want
    assert file_sha256(str(path), chunk_bytes=4096) == want  # many reads, a short last one
    (tmp_path / "empty").write_bytes(b"")
    assert file_sha256(tmp_path / "empty") == hashlib.sha256(b"").hexdigest()
