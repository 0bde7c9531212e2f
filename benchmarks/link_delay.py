"""Links with a round trip and loss (``--link RATE,RTT,LOSS``), measured: what the forwarder delivers and costs.

For each link, on a 2-node emulated cluster (root):

* round trip: TCP ping-pong of 32-byte messages between the nodes, median of N;
* bulk: one TCP stream of about 2 s at the rate, node 0 to node 1: goodput over
  the rate, and the forwarder's CPU over the stream's wall time (its own cost,
  on the cores the ranks share);
* gloo: all-reduce of MIB MiB between the nodes, bus bandwidth over the rate,
  and the latency and bandwidth ``auto``'s probe fits (slipstream.sync.probe).

The workers are the link tests' (tests/cluster/scripts_pingpong.py,
scripts_allreduce_bw.py). Usage::

    sudo PYTHONPATH=src:. python -m benchmarks.link_delay --links 100mbit,2ms 100mbit,20ms 1gbit,4ms
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PINGPONG = str(REPO / "tests" / "cluster" / "scripts_pingpong.py")
ALLREDUCE = str(REPO / "tests" / "cluster" / "scripts_allreduce_bw.py")


def measure(link: str, samples: int, mib: float, repeats: int) -> dict:
    from slipstream.launch.emulate import EmulatedCluster

    with EmulatedCluster(2, link=link) as c:
        addr1 = c.node_list[1].addr
        doc: dict = {"link": c.link, "rtt_set_s": c.link_spec.rtt_s, "bits_per_s": c.link_bits_per_s}

        def server(mode: str, port: int) -> subprocess.Popen:
            p = subprocess.Popen(c.exec_argv(1, [sys.executable, PINGPONG, mode, addr1, str(port)]),
                                 stdout=subprocess.PIPE, text=True)
            assert p.stdout.readline().strip() == "up"
            return p

        srv = server("serve", 29555)
        ping = subprocess.run(c.exec_argv(0, [sys.executable, PINGPONG, "ping", addr1, "29555", str(samples)]),
                              capture_output=True, text=True, timeout=600)
        srv.kill()
        srv.wait()
        doc["rtt_median_s"] = float(ping.stdout)

        bulk_mib = (c.link_bits_per_s or 10**9) / 8 * 2 / 2**20
        sink = server("sink", 29556)
        cpu0 = c.forwarder_cpu_s()
        subprocess.run(c.exec_argv(0, [sys.executable, PINGPONG, "send", addr1, "29556", f"{bulk_mib:.1f}", "1"]),
                       capture_output=True, timeout=600, check=True)
        _, nbytes, seconds = sink.communicate(timeout=60)[0].split()
        # the sink's clock: first byte to the end of the stream (no process start-up in it)
        doc["bulk_goodput_bits_per_s"] = int(nbytes) * 8 / float(seconds)
        doc["forwarder_cpu_fraction_of_a_core"] = (c.forwarder_cpu_s() - cpu0) / float(seconds)

        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "bw.json"
            addr0 = c.node_list[0].addr
            procs = [subprocess.Popen(c.exec_argv(i, [sys.executable, ALLREDUCE, addr0, "29600", str(i), "2", str(mib),
                                                      str(repeats), str(out)]),
                                      env=c.node_env(i), stderr=subprocess.DEVNULL) for i in range(2)]
            if [p.wait(timeout=600) for p in procs] == [0, 0]:
                doc["gloo"] = json.loads(out.read_text())
        if c.link_bits_per_s and "gloo" in doc:
            doc["busbw_over_rate"] = doc["gloo"]["busbw_bytes_per_s"] * 8 / c.link_bits_per_s
        doc["forwarder_counts"] = c.forwarder_counts()
    return doc


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.link_delay", description=__doc__.splitlines()[0])
    p.add_argument("--links", nargs="+", default=["100mbit,2ms", "100mbit,20ms", "100mbit,40ms", "1gbit,4ms"])
    p.add_argument("--samples", type=int, default=100, help="ping-pong round trips per link")
    p.add_argument("--mib", type=float, default=8, help="all-reduce buffer (MiB)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "link_delay.json"))
    args = p.parse_args(argv)
    from slipstream.launch.emulate import missing_privileges

    why = missing_privileges()
    if why:
        p.error(f"the emulated cluster cannot be built here: {why}")
    rows = []
    for link in args.links:
        r = measure(link, args.samples, args.mib, args.repeats)
        rows.append(r)
        g = r.get("gloo", {})
        print(f"{r['link']:>22}: rtt set {r['rtt_set_s'] * 1e3:6.2f} ms, measured {r['rtt_median_s'] * 1e3:6.2f} ms; "
              f"bulk {r['bulk_goodput_bits_per_s'] / 1e6:7.1f} Mbit/s, forwarder {r['forwarder_cpu_fraction_of_a_core']:.1%} "
              f"of a core; busbw/rate {r.get('busbw_over_rate', float('nan')):.3f}; probe alpha "
              f"{g.get('probe_alpha_s', float('nan')) * 1e3:.1f} ms, hop {g.get('probe_hop_latency_s', float('nan')) * 1e3:.1f} ms",
              flush=True)
    Path(args.out).write_text(json.dumps({"command": "python -m benchmarks.link_delay " + " ".join(argv or sys.argv[1:]),
                                          "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
