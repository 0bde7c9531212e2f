"""Fixtures for the data tests: datasets on disk and an S3-compatible server on loopback.

The object store is moto's server (ThreadedMotoServer), bound to 127.0.0.1 on
a free port for the whole session; each test gets its own bucket. s3fs talks
to it through ``endpoint_url``; nothing leaves the machine.
"""

from __future__ import annotations

import os
import socket
import uuid

import numpy as np
import pytest

from tests.conftest import need_module


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def s3_endpoint():
    need_module("s3fs", "in the 'data' extra: bash scripts/install.sh test")
    need_module("moto.server", "a test tool: bash scripts/install.sh test")
    from moto.server import ThreadedMotoServer

    for k, v in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        os.environ.setdefault(k, v)
    port = _free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    yield f"http://127.0.0.1:{port}"
    server.stop()


@pytest.fixture
def s3(s3_endpoint):
    """A fresh bucket: (url prefix 's3://bucket', storage_options, boto3 client)."""
    import boto3

    client = boto3.client(
        "s3", endpoint_url=s3_endpoint, aws_access_key_id="testing", aws_secret_access_key="testing", region_name="us-east-1"
    )
    bucket = f"test-{uuid.uuid4().hex[:12]}"
    client.create_bucket(Bucket=bucket)
    opts = {"endpoint_url": s3_endpoint, "key": "testing", "secret": "testing", "skip_instance_cache": True}
    return f"s3://{bucket}", opts, client


def numbered_arrays(path: str, n: int = 200, width: int = 64) -> np.ndarray:
    """An .npy whose row i is full of the value i: every sample says who it is."""
    a = np.repeat(np.arange(n, dtype=np.int64)[:, None], width, axis=1)
    np.save(path, a)
    return a


@pytest.fixture
def numbered(tmp_path):
    """A local packed dataset of 200 samples (row i == i), ~16 shards of 12 samples."""
    from slipstream.data import pack_arrays

    src = str(tmp_path / "rows.npy")
    numbered_arrays(src)
    out = str(tmp_path / "ds")
    pack_arrays(src, out, shard_size_bytes=12 * 512 + 400)
    return out
