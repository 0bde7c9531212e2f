"""A rank that cannot join the process group (its peer failed first, or is not there) says so in one line."""

from __future__ import annotations

import os
import socket
import subprocess
import sys


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when this returns: nobody listens there


def test_a_rank_whose_peer_is_gone_exits_1_with_one_line_and_no_traceback():
    env = dict(os.environ, RANK="1", WORLD_SIZE="2", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_closed_port()), SLIPSTREAM_COLLECTIVE_TIMEOUT_S="2")
    proc = subprocess.run([sys.executable, "-c", "import slipstream; slipstream.init()"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("slipstream: error")]
    assert len(lines) == 1 and "rank 1 could not join the process group of 2 ranks (gloo)" in lines[0], proc.stderr[-2000:]
    assert "if another rank failed first, its error is the cause" in lines[0]
