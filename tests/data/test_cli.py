"""``slipstream data pack | prewarm | verify`` through the real CLI entry point."""

from __future__ import annotations

import os

import numpy as np

from slipstream.cli import main
from slipstream.data import ShardedDataset, load_index
from slipstream.data.source import Source


def test_pack_text_dir_then_verify(tmp_path, capsys):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for k in range(5):
        (corpus / f"{k}.txt").write_text(f"document {k} " * 200)
    out = tmp_path / "ds"
    rc = main(["data", "pack", str(corpus), str(out), "--kind", "text", "--tokens-per-sample", "129", "--shard-size-mb", "0.004"])
    assert rc == 0
    assert "samples in" in capsys.readouterr().out
    idx = load_index(Source(str(out)))
    assert len(idx.shards) > 1 and all(s.size_bytes <= int(0.004 * (1 << 20)) for s in idx.shards)
    assert ShardedDataset(str(out))[0].shape == (129,)
    assert main(["data", "verify", str(out)]) == 0

    with open(out / idx.shards[1].file, "r+b") as f:
        f.seek(200)
        f.write(b"\x00\xff\x00")
    rc = main(["data", "verify", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and idx.shards[1].file in err and "slipstream data: error: 1 bad shard" in err


def test_pack_npy_auto(tmp_path):
    np.save(tmp_path / "a.npy", np.arange(40, dtype=np.float64).reshape(10, 4))
    assert main(["data", "pack", str(tmp_path / "a.npy"), str(tmp_path / "ds")]) == 0
    np.testing.assert_array_equal(ShardedDataset(str(tmp_path / "ds"))[3], [12, 13, 14, 15])


def test_errors_are_one_line_exit_2(tmp_path, capsys):
    assert main(["data", "pack", str(tmp_path / "nope"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("slipstream data: error:") and "does not exist" in err and "Traceback" not in err
    assert main(["data", "prewarm", str(tmp_path / "nothing"), "--cache", str(tmp_path / "c")]) == 2
    assert "index.json does not exist" in capsys.readouterr().err
    assert main(["data"]) == 2


def test_prewarm_from_s3_with_progress_and_limit(tmp_path, s3, capsys, monkeypatch):
    url, opts, client = s3
    endpoint = opts["endpoint_url"]
    rows = tmp_path / "r.npy"
    np.save(rows, np.arange(3000, dtype=np.int32).reshape(300, 10))
    ds_url = f"{url}/r"
    assert main(["data", "pack", str(rows), ds_url, "--shard-size-mb", "0.002", "--endpoint-url", endpoint]) == 0
    idx = load_index(Source(ds_url, opts))
    cache = tmp_path / "cache"
    args = ["data", "prewarm", ds_url, "--cache", str(cache), "--workers", "3", "--endpoint-url", endpoint]
    assert main(args) == 0
    out = capsys.readouterr()
    assert f"{len(idx.shards)} downloaded" in out.out and "prewarm" in out.err  # the rich bar on stderr
    assert len(os.listdir(cache / "blobs")) == len(idx.shards)
    assert main(args + ["--no-progress"]) == 0
    assert f"{len(idx.shards)} already cached, 0 downloaded" in capsys.readouterr().out

    # The endpoint can come from the environment, as in the job renderer's init containers.
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    assert main(["data", "prewarm", ds_url, "--cache", str(tmp_path / "env"), "--no-progress"]) == 0
    assert f"{len(idx.shards)} downloaded" in capsys.readouterr().out
    monkeypatch.delenv("AWS_ENDPOINT_URL")

    # A limit smaller than the dataset keeps at most that much.
    limit_gb = 3 * max(s.size_bytes for s in idx.shards) / 1e9
    small = tmp_path / "small"
    assert main(["data", "prewarm", ds_url, "--cache", str(small), "--max-cache-gb", f"{limit_gb:.9f}", "--no-progress", "--endpoint-url", endpoint]) == 0
    assert "does not fit" in capsys.readouterr().out
    used = sum(os.path.getsize(small / "blobs" / f) for f in os.listdir(small / "blobs"))
    assert 0 < used <= limit_gb * 1e9

    # An unreachable store is a one-line error too.
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    rc = main(["data", "prewarm", "s3://no-such-bucket-here/x", "--cache", str(tmp_path / "c2"), "--endpoint-url", endpoint])
    assert rc == 2 and "slipstream data: error:" in capsys.readouterr().err
    dead = tmp_path / "dead-port"
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    rc = main(["data", "prewarm", ds_url, "--cache", str(dead), "--endpoint-url", f"http://127.0.0.1:{port}"])
    err = capsys.readouterr().err
    assert rc == 2 and "cannot read" in err and "EndpointConnectionError" in err and "Traceback" not in err
