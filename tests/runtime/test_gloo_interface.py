"""gloo's network interface on a host with several (issue #32): init() sets GLOO_SOCKET_IFNAME to
the interface that reaches the rendezvous host, never over the user's, and a gloo connection
failure names it. Unit tests inject the interface table; one root test gives a network
namespace two interfaces and runs two ranks there."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import pytest

from slipstream.errors import TrainingFailed
from slipstream.process import gloo_interface, runtime
from tests.conftest import require_root
from tests.runtime.test_device_placement import fake_gpus  # noqa: F401 - the fixture

TWO_NICS = {"lo": ("127.0.0.1", "::1"), "eth0": ("192.0.2.2", "fe80::1"), "ib0": ("10.1.0.5",)}


def test_the_interface_that_reaches_the_rendezvous_host_is_chosen():
    assert gloo_interface.choose("10.1.0.5", TWO_NICS) == "ib0"
    assert gloo_interface.choose("192.0.2.2", TWO_NICS) == "eth0"


def test_nothing_is_chosen_when_gloos_own_choice_is_safe_or_nothing_fits():
    one_nic = {"lo": ("127.0.0.1",), "eth0": ("192.0.2.2",), "ifb0": ()}
    assert gloo_interface.choose("192.0.2.2", one_nic) is None  # one interface besides loopback
    assert gloo_interface.choose("127.0.0.1", TWO_NICS) is None  # one node: rendezvous on loopback
    assert gloo_interface.choose(None, TWO_NICS) is None  # rendezvous host unresolvable
    assert gloo_interface.choose("172.16.0.1", TWO_NICS) is None  # a secondary address, not listed


@pytest.fixture
def two_nics(monkeypatch):
    """A host with eth0 and ib0, whose route to 10.1.0.1 leaves from ib0 (10.1.0.5)."""
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "")
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")  # absent now, and restored to absent after the test
    monkeypatch.setattr(gloo_interface, "_GLOO_INTERFACE_NOTE", "")
    monkeypatch.setattr(gloo_interface, "interface_addresses", lambda: TWO_NICS)
    monkeypatch.setattr(gloo_interface, "route_source", lambda host, port: "10.1.0.5" if host == "10.1.0.1" else None)


GLOO_TWO_NODES = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                  "MASTER_ADDR": "10.1.0.1", "MASTER_PORT": "29511"}


def test_init_sets_the_chosen_interface_before_the_group_starts(fake_gpus, two_nics, monkeypatch):
    seen = {}
    calls = fake_gpus(0, GLOO_TWO_NODES)
    monkeypatch.setattr(runtime.dist, "init_process_group",
                        lambda backend, **kw: seen.update(ifname=os.environ.get("GLOO_SOCKET_IFNAME")))
    runtime.init()
    assert seen["ifname"] == "ib0" and "backend" not in calls


def test_a_users_interface_is_never_replaced(fake_gpus, two_nics, monkeypatch):
    fake_gpus(0, GLOO_TWO_NODES)
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth0")
    runtime.init()
    assert os.environ["GLOO_SOCKET_IFNAME"] == "eth0"


def test_a_gloo_connection_failure_names_the_interface_and_the_override(fake_gpus, two_nics, monkeypatch):
    fake_gpus(0, GLOO_TWO_NODES)

    def refused(backend, **kw):
        raise RuntimeError("[gloo/transport/tcp/pair.cc:144] Connection refused")

    monkeypatch.setattr(runtime.dist, "init_process_group", refused)
    with pytest.raises(TrainingFailed) as err:
        runtime.init()
    text = str(err.value)
    assert "Connection refused" in text
    assert "gloo used interface ib0, chosen as the one that reaches the rendezvous host 10.1.0.1" in text
    assert "set GLOO_SOCKET_IFNAME to override" in text


_RANK = """
import os, torch, torch.distributed as dist, slipstream
rt = slipstream.init(backend="gloo", timeout_s=30)
t = torch.ones(1)
dist.all_reduce(t)
print("ifname", os.environ.get("GLOO_SOCKET_IFNAME"), "sum", int(t.item()), flush=True)
slipstream.shutdown(exit_code=0)
"""


def test_two_ranks_on_a_host_with_two_interfaces_use_the_one_towards_the_rendezvous():
    """A network namespace with two interfaces (the ends d1, d2 of one veth pair: this kernel has
    no dummy driver) holding 10.N.1.1 and 10.N.2.1; the rendezvous host is 10.N.2.1, and the
    ranks claim two nodes: gloo must bind d2."""
    require_root()
    tag = uuid.uuid4().hex[:6]
    ns, net = f"ssgl{tag}", 100 + int(tag, 16) % 100
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        def ip(*args: str) -> None:
            subprocess.run(["ip", "-n", ns, *args], check=True)

        ip("link", "set", "lo", "up")
        ip("link", "add", "d1", "type", "veth", "peer", "name", "d2")
        for i in (1, 2):
            ip("addr", "add", f"10.{net}.{i}.1/24", "dev", f"d{i}")
            ip("link", "set", f"d{i}", "up")
        base = {k: v for k, v in os.environ.items() if k != "GLOO_SOCKET_IFNAME"}
        base.update(WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR=f"10.{net}.2.1",
                    MASTER_PORT="29517", OMP_NUM_THREADS="1")
        procs = [subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-c", _RANK],
                                  env={**base, "RANK": str(r)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True) for r in (0, 1)]
        outs = [p.communicate(timeout=120) for p in procs]
        for p, (out, err) in zip(procs, outs):
            assert p.returncode == 0, err[-2000:]
            assert "ifname d2 sum 2" in out, (out, err[-2000:])
    finally:
        subprocess.run(["ip", "netns", "del", ns], check=False)
