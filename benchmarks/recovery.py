"""Recovery cost on the GPT example: kill-to-first-step time, work lost, checkpoint blocking time.

Part 1 (recovery): `slipstream run -n 2 --max-restarts 1` trains the GPT example
with a checkpoint every K steps; once rank 1 has logged step S, the benchmark
SIGKILLs rank 1's process and measures the wall time from the kill to the
first step logged after the resume, and how many steps were redone. Each trial
runs twice, side by side in time (one after the other): disk checkpoints only,
and with in-memory snapshots every step (``--snapshot-every-steps 1``).

Part 2 (blocking): one process trains a larger GPT for N steps with a
checkpoint every K steps, synchronous against asynchronous (staged to CPU
memory, written in a background thread), and reports the median time each
save held the training loop, next to the median step time; and the same with
an in-memory snapshot every step (the time each snapshot held the loop).

Part 3 (``--peer-stall``, root): the cost of the snapshots' peer copy on another node. On an
emulated 2x1 cluster (``slipstream run --emulate 2x1``: two nodes, one rank each, the link
unshaped or ``--link``), the larger GPT trains N steps, three ways in turn per trial: no
snapshots, a snapshot every step without the peer copy (``--no-snapshot-peer-copy``), and with
it. Reported per way, medians over the trials of rank 0's medians: the step time, the time each
snapshot held the loop (the local copy, plus any wait for the previous peer copy to travel) and
of that the wait, and the time each peer copy took in its background thread.

    python benchmarks/recovery.py            # parts 1 and 2, about 2 minutes on 2 cores
    sudo python benchmarks/recovery.py --peer-stall --trials 3      # part 3
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GPT = str(REPO / "examples" / "train_gpt.py")


def descendants(pid: int) -> set[int]:
    """Process ids of every descendant of ``pid`` (from the parent ids in /proc/*/stat)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])  # after the command name, which may hold spaces
        children.setdefault(ppid, []).append(int(entry))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def worker_pid(agent_pid: int, rank: int) -> int | None:
    """The worker process of ``rank`` among the agent's descendants (from /proc).

    Only the agent's own tree: a job beside this one (another benchmark's GPT workers on the same
    machine) has workers of the same script and ranks, and must never be the one killed.
    """
    for pid in sorted(descendants(agent_pid)):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"train_gpt.py" in cmdline and f"RANK={rank}".encode() in environ and b"TORCHELASTIC_RUN_ID" in b" ".join(environ):
            return pid
    return None


def read_steps(path: Path) -> list[int]:
    if not path.exists():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()]


def recovery(every: int, kill_at: int, steps: int, snapshots: bool = False) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        run_dir, ckpt = Path(tmp) / "run", Path(tmp) / "ckpt"
        cmd = [sys.executable, "-m", "slipstream", "run", "-n", "2", "--max-restarts", "1", "--run-dir", str(run_dir),
               "--log-every-steps", "1", *(["--snapshot-every-steps", "1"] if snapshots else []), GPT, "--steps", str(steps), "--layers", "2",
               "--checkpoint-dir", str(ckpt), "--checkpoint-every-steps", str(every)]
        agent = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        log = run_dir / "metrics" / "rank1.jsonl"
        while not read_steps(log) or read_steps(log)[-1] < kill_at:
            time.sleep(0.02)
            if agent.poll() is not None:
                raise RuntimeError("training ended before the kill")
        done_before = read_steps(log)[-1]
        pid = worker_pid(agent.pid, 1)
        killed_at = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        seen = len(read_steps(log))
        first_after = None
        while first_after is None:
            steps_now = read_steps(log)
            if len(steps_now) > seen:
                first_after = time.monotonic()
                resumed_step = steps_now[seen] - 1
            time.sleep(0.01)
        agent.wait(timeout=300)
        return {"every": every, "snapshots": snapshots, "killed_after_step": done_before, "resumed_from_step": resumed_step,
                "steps_lost": done_before - resumed_step, "kill_to_first_step_s": first_after - killed_at,
                "exit_code": agent.returncode}


def blocking(async_save: bool, steps: int, every: int, snapshots: bool = False) -> dict:
    code = f"""
import sys, time, statistics, torch
sys.path.insert(0, {str(REPO / 'examples')!r})
import train_gpt, slipstream
rt = slipstream.init()
torch.manual_seed(0)
corpus = train_gpt.load_corpus(1 << 20)
model = train_gpt.GPT(dim=256, layers=6, context=64)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
run = slipstream.accelerate(model, opt, checkpoint_dir={tempfile.mkdtemp()!r}, checkpoint_every_steps={every},
                            checkpoint_async={async_save}, progress=False, run_dir={tempfile.mkdtemp()!r},
                            snapshot_every_steps={1 if snapshots else None})
times = []
while run.step_count < {steps}:
    t = time.perf_counter()
    x, y = train_gpt.batch_for(run.step_count, 0, corpus, 8, 64, 0)
    logits = run.model(x)
    run.backward(torch.nn.functional.cross_entropy(logits.view(-1, 256), y.view(-1)))
    run.step()
    times.append(time.perf_counter() - t)
blocks = run.checkpoints.snapshots.stall_s if {snapshots} else run.checkpoints.blocking_s
run.finish()
params = sum(p.numel() for p in model.parameters())
print(statistics.median(blocks), statistics.median(times), params, len(blocks))
"""
    # An in-memory snapshot is taken only where an elastic agent would restart the process.
    with tempfile.TemporaryDirectory(dir="/dev/shm") as shm:
        env = {**os.environ, "TORCHELASTIC_RUN_ID": "recovery-benchmark", "SLIPSTREAM_SNAPSHOT_DIR": shm}
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True,
                             env=env if snapshots else None)
    block_s, step_s, params, saves = out.stdout.split()[-4:]
    return {"async": async_save, "snapshots": snapshots, "median_blocking_s": float(block_s), "median_step_s": float(step_s),
            "params": int(params), "saves": int(saves)}


PEER_WORKER = """
import json, os, statistics, sys, time, torch
sys.path.insert(0, {examples!r})
import train_gpt, slipstream
rt = slipstream.init()
torch.manual_seed(0)
corpus = train_gpt.load_corpus(1 << 20)
model = train_gpt.GPT(dim=256, layers=6, context=64)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
run = slipstream.accelerate(model, opt, checkpoint_dir={ckpt!r}, progress=False, run_dir={run_dir!r})
times = []
while run.step_count < {steps}:
    t = time.perf_counter()
    x, y = train_gpt.batch_for(run.step_count, rt.rank, corpus, 8, 64, 0)
    run.backward(torch.nn.functional.cross_entropy(run.model(x).view(-1, 256), y.view(-1)))
    run.step()
    times.append(time.perf_counter() - t)
snaps = run.checkpoints.snapshots
peer = snaps.peer if snaps is not None else None
med = lambda xs: statistics.median(xs) if xs else 0.0
result = dict(step_s=med(times[3:]), stall_s=med(snaps.stall_s[3:]) if snaps else 0.0,
              waited_s=med(peer.waited_s[3:]) if peer else 0.0, transfer_s=med(peer.transfer_s[3:]) if peer else 0.0,
              params=sum(p.numel() for p in model.parameters()), peer=peer is not None)
run.finish()
if rt.rank == 0:
    with open({out!r}, "w") as fh:
        json.dump(result, fh)
slipstream.shutdown(exit_code=0)
"""

def peer_ways(every: int) -> tuple[tuple[str, list[str]], ...]:
    when = "every step" if every == 1 else f"every {every} steps"
    return (("no snapshots", []),
            (f"snapshot {when}, no peer copy", ["--snapshot-every-steps", str(every), "--no-snapshot-peer-copy"]),
            (f"snapshot {when} + peer copy", ["--snapshot-every-steps", str(every)]))


def peer_stall(way: list[str], steps: int, link: str) -> dict:
    """One 2x1 emulated run of the larger GPT with the flags of ``way``; rank 0's medians."""
    with tempfile.TemporaryDirectory() as tmp:
        out, script = Path(tmp) / "result.json", Path(tmp) / "worker.py"
        script.write_text(PEER_WORKER.format(examples=str(REPO / "examples"), ckpt=str(Path(tmp) / "ckpt"),
                                             run_dir=str(Path(tmp) / "run"), steps=steps, out=str(out)))
        subprocess.run([sys.executable, "-m", "slipstream", "run", "--emulate", "2x1", "--link", link, *way, str(script)],
                       cwd=REPO, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=900)
        return json.loads(out.read_text())


def peer_stall_table(trials: int, steps: int, link: str, every: int) -> None:
    ways = peer_ways(every)
    rows: dict[str, list[dict]] = {name: [] for name, _ in ways}
    for _ in range(trials):  # the ways in turn, so that the machine's load falls on each alike
        for name, way in ways:
            rows[name].append(peer_stall(way, steps, link))
    params = rows[ways[0][0]][0]["params"]
    print(f"emulated 2x1, link {link}, GPT {params / 1e6:.1f}M parameters ({params * 12 / 2**20:.0f} MiB of state "
          f"with AdamW), {steps} steps x {trials} trials; load average at the end {os.getloadavg()[0]:.1f}\n")
    print("| way | step (median) | stall per snapshot | of which waiting for the previous peer copy | "
          "peer copy in the background |")
    print("|---|---:|---:|---:|---:|")
    for name, results in rows.items():
        med = {k: statistics.median(r[k] for r in results) * 1000 for k in ("step_s", "stall_s", "waited_s", "transfer_s")}
        print(f"| {name} | {med['step_s']:.0f} ms | {med['stall_s']:.1f} ms | {med['waited_s']:.1f} ms | "
              f"{med['transfer_s']:.0f} ms |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--peer-stall", action="store_true", help="part 3 only: the peer copy's cost on --emulate 2x1 (root)")
    p.add_argument("--steps", type=int, default=40, help="--peer-stall: steps per run")
    p.add_argument("--link", default="unshaped", help="--peer-stall: the emulated nodes' link (unshaped, 1gbit, ...)")
    p.add_argument("--snapshot-every", type=int, default=1, help="--peer-stall: steps between snapshots")
    args = p.parse_args()
    if args.peer_stall:
        peer_stall_table(args.trials, args.steps, args.link, args.snapshot_every)
        return
    rows = [recovery(every=10, kill_at=25, steps=60, snapshots=snap) for _ in range(args.trials) for snap in (False, True)]
    print(f"load average at the end: {os.getloadavg()[0]:.1f}\n")
    print("| trial | recovers from | killed after step | resumed from | steps redone | kill -> first step after resume |")
    print("|---|---|---|---|---|---|")
    for i, r in enumerate(rows):
        source = "an in-memory snapshot (every step)" if r["snapshots"] else f"disk (checkpoint every {r['every']})"
        print(f"| {i // 2} | {source} | {r['killed_after_step']} | {r['resumed_from_step']} | {r['steps_lost']} | "
              f"{r['kill_to_first_step_s']:.1f} s |")
    for snap in (False, True):
        mine = [r for r in rows if r["snapshots"] == snap]
        print(f"\n{'snapshots' if snap else 'disk only'}: median kill -> first step "
              f"{statistics.median(r['kill_to_first_step_s'] for r in mine):.1f} s, median steps redone "
              f"{statistics.median(r['steps_lost'] for r in mine):g}")
    print("\n| what holds the loop | model parameters | median time the loop was held | median step time |")
    print("|---|---|---|---|")
    for mode, snap in ((False, False), (True, False), (False, True)):
        r = blocking(mode, steps=40, every=5 if not snap else 1000, snapshots=snap)
        what = ("an in-memory snapshot, every step" if snap else
                "an asynchronous save, every 5 steps" if mode else "a synchronous save, every 5 steps")
        print(f"| {what} | {r['params'] / 1e6:.1f}M | {r['median_blocking_s'] * 1000:.1f} ms | "
              f"{r['median_step_s'] * 1000:.0f} ms |")

if __name__ == "__main__":
    main()
