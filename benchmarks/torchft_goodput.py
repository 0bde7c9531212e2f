"""Goodput under repeated replica kills with torchft's fault tolerance: the peer of ``benchmarks/goodput.py``.

Question it answers: on the GPT of ``examples/train_gpt.py`` (``--layers 2`` as goodput.py runs it;
AdamW lr 3e-3, weight decay 0.01, warm-up over steps/20 then cosine; ``SlipstreamLoader`` over the
packed stdlib corpus, rank = replica index, world size = replicas), with a random replica
SIGKILLed every ``--period-s`` seconds, what goodput does torchft (pytorch/torchft 0.2.0) keep?

torchft's model: W replica groups (``--replicas``) of one process each, a
``torchft.coordination.LighthouseServer`` forming the quorum (started through
``benchmarks/torchft_diloco_gpt.py --lighthouse``), and per replica its own TCPStore, a
``torchft.Manager`` with torchft's reconfigurable gloo group (``ProcessGroupGloo``),
the gradients flattened into one bucket and averaged through ``Manager.allreduce`` (what
``torchft.ddp.DistributedDataParallel``'s comm hook does per bucket; that wrapper itself is not
used: in torchft 0.2.0 its hook asserts when the all-reduce fails, ``assert fut._fut`` in
``ddp.py``, because ``_ManagedWork.wait`` returns before setting the future, so the survivor
crashes on exactly the failure it should ride out) and ``torchft.optim.OptimizerWrapper`` (``zero_grad`` starts the quorum, ``step`` steps AdamW only
if ``Manager.should_commit()``). The quorum is synchronous (a replacement heals inside
``zero_grad`` and takes part in that very step) and ``min_replica_size`` is ``--min-replicas``,
by default W: every committed step is a full W-replica batch, as every step of a Slipstream run
is. With ``--min-replicas 1`` survivors go on at a smaller global batch while the replacement
starts (torchft's headline mode; a counted step is then less data). Even then the next quorum
waits until the lighthouse stops counting the dead replica as heartbeating (about 5 s here with
the lighthouse's defaults, which ``torchft_diloco_gpt.py --lighthouse`` keeps).

This script is its own orchestrator, as torchft expects one (torchx, Kubernetes) to be: each
replica runs in a restart loop, a killed replica's process group is SIGKILLed and the replica
started again at once (a fresh store port, a fresh Manager id); it heals from a live peer over
torchft's HTTP checkpoint transport (model, AdamW, LR schedule and the loader's global data
position, all from the peer). The survivors keep their processes: the all-reduce that lost its
peer fails, ``should_commit`` votes no, and the next quorum re-forms the gloo group. A survivor
that is not the dead replica's neighbour in gloo's ring sees no closed connection: it waits out
the group's timeout (``--pg-timeout-s``, 5 s as in torchft's ``train_ddp.py``), so from 3
replicas on that timeout is part of fault-to-next-step.

How it differs from Slipstream's ``--heal`` (survivors keep their processes there too): torchft
never rolls back. When ``should_commit`` returns False the optimizer step is skipped and the
committed step count (``Manager.current_step()``) does not advance, but the batch of that failed
iteration is not redone: the loop has already consumed it and the next iteration takes the next
batch (``torchft/manager.py``: should_commit only decides whether to step; nothing rewinds data).
Slipstream ``--heal`` restores the newest snapshot every rank holds and rewinds the loader, so
the failed step runs again on the same data (bitwise the run without failures). So here "steps
redone" is 0 by construction (a replacement heals to the peers' step, a survivor's step counter
never goes back); what a failure costs is the failed iteration, the wait for the replacement's
start, quorum and heal, and the skipped batch (less data, not less time: not in goodput).

Measured as goodput.py does, per run: goodput (committed steps counted x the run's median step
time, over the wall time from the first committed step to the last), steps redone per failure
(highest committed step logged before the kill minus the step training resumed from),
fault-to-next-step (the kill to the first committed step of an iteration that began after the
kill, from any replica) and failures. A replica is killed every ``--period-s`` seconds counted
from the first committed step and from the first committed step after each recovery. Each
replica appends one JSON line per iteration to ``replica<R>.jsonl`` (committed step after the
iteration, whether it committed, wall times, participants); arrivals are the times the highest
committed step over all replicas goes up (logged wall time, not poll time). The checkpoint phase
is n/a: torchft saves nothing per step (a peer's state is copied only when one heals).

    python -m benchmarks.torchft_goodput --replicas 2,4 --period-s 30 --steps 1000 --json torchft_goodput.json
    python -m benchmarks.torchft_goodput --replicas 2 --period-s 10 --steps 150     # about 1-2 minutes
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve()
DILOCO = REPO / "benchmarks" / "torchft_diloco_gpt.py"  # its --lighthouse mode serves the quorum
sys.path.insert(0, str(HERE.parent))
from goodput import records  # run as a script or a module

RECOVERS_FROM = "torchft (peer heal, survivors keep processes)"


def new_lines(path: Path, offset: int) -> tuple[list[dict], int]:
    """The complete JSON lines written to ``path`` after byte ``offset``, and the offset after them."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read()
    except FileNotFoundError:
        return [], offset
    end = data.rfind(b"\n") + 1  # a line being written waits for the next call
    out = []
    for line in data[:end].splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out, offset + end


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------- one replica (a child process)


def replica(args: argparse.Namespace) -> int:
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    sys.path.insert(0, str(REPO / "examples"))
    from datetime import timedelta

    from torchft.manager import Manager
    from torchft.optim import OptimizerWrapper
    from torchft.process_group import ProcessGroupGloo
    from train_gpt import GPT, loss_fn, stdlib_corpus_shards

    from slipstream.data import ShardedDataset, SlipstreamLoader

    log = open(Path(args.out) / f"replica{args.replica}.jsonl", "a")  # noqa: SIM115 - open for the process's life

    def write(rec: dict) -> None:
        log.write(json.dumps(rec) + "\n")
        log.flush()

    write({"event": "start", "pid": os.getpid(), "time": time.time()})
    torch.manual_seed(args.seed)  # the same initial weights in every replica (init_sync=False relies on it)
    dataset = ShardedDataset(stdlib_corpus_shards(args.data_cache, args.corpus_mb, args.context, 0))
    loader = SlipstreamLoader(dataset, batch_size=args.batch_size, seed=args.seed, drop_last=True,
                              rank=args.replica, world_size=args.replicas)
    model = GPT(vocab=int(dataset.index.meta["vocab_size"]), dim=args.dim, layers=args.layers, context=args.context)
    inner = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    warmup = max(1, args.steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        inner, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / args.steps))))

    def state_dict() -> dict:  # what a healing peer receives (the loader's position is global: rank-free)
        return {"model": model.state_dict(), "inner": inner.state_dict(), "sched": sched.state_dict(),
                "data": loader.state_dict()}

    def load_state_dict(sd: dict) -> None:
        model.load_state_dict(sd["model"])
        inner.load_state_dict(sd["inner"])
        sched.load_state_dict(sd["sched"])
        loader.load_state_dict(sd["data"])  # a running `for b in loader` goes on from there

    _store = torch.distributed.TCPStore(  # the replica group's store: held for the process's life
        args.addr, args.store_port, is_master=True, wait_for_workers=False)
    timeout = timedelta(seconds=args.timeout_s)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=args.pg_timeout_s)), load_state_dict=load_state_dict, state_dict=state_dict,
        min_replica_size=args.min_replicas, use_async_quorum=False, init_sync=False,
        replica_id=f"replica_{args.replica}", store_addr=args.addr, store_port=args.store_port, rank=0,
        world_size=1, lighthouse_addr=args.lighthouse_addr, hostname=args.addr, timeout=timeout,
        quorum_timeout=timeout, connect_timeout=timeout)
    params = [p for p in model.parameters()]  # tied embeddings appear once
    opt = OptimizerWrapper(manager, inner)
    batches = (b for _epoch in iter(int, 1) for b in loader)
    healed_from = None
    while manager.current_step() < args.steps:
        began = time.time()
        before = manager.current_step()
        opt.zero_grad()  # the quorum; a replacement heals here (synchronous quorum)
        if manager.current_step() != before:
            healed_from = before
        tokens = next(batches)[:, : args.context + 1].long()
        loss = loss_fn(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        # One bucket, averaged over the participants; a failed all-reduce reports to the manager
        # (wait() returns False) and should_commit() then votes no.
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        manager.allreduce(flat).wait()
        offset = 0
        for p in params:
            p.grad.copy_(flat[offset: offset + p.numel()].view_as(p.grad))
            offset += p.numel()
        at = manager.current_step()
        opt.step()  # steps AdamW only if should_commit()
        committed = manager.current_step() > at
        if committed:
            sched.step()
        now = time.time()
        rec = {"step": manager.current_step(), "committed": committed, "began": began, "time": now,
               "step_time_s": now - began, "loss": float(loss), "participants": manager.num_participants()}
        if healed_from is not None:
            rec["healed_from"], healed_from = healed_from, None
        write(rec)
    write({"event": "done", "time": time.time(), "step": manager.current_step()})
    log.close()
    manager.shutdown(wait=False)
    os._exit(0)  # no interpreter teardown: torch's gloo can abort in it, and the peers may be gone


# ---------------------------------------------------------------- the benchmark


def replica_argv(args: argparse.Namespace, r: int, world: int, lighthouse: str, out: Path) -> list[str]:
    return [sys.executable, str(HERE), "--replica", str(r), "--replicas", str(world),
            "--min-replicas", str(args.min_replicas or world), "--store-port", str(free_port()),
            "--lighthouse-addr", lighthouse, "--steps", str(args.steps), "--layers", str(args.layers),
            "--timeout-s", str(args.timeout_s), "--pg-timeout-s", str(args.pg_timeout_s), "--seed", str(args.seed), "--out", str(out)]


def killgroup(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # its own session: the replica and anything it started
    except ProcessLookupError:
        pass
    proc.wait()


def run_once(args: argparse.Namespace, world: int, period_s: float, seed: int) -> dict:
    rng = random.Random(seed)
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO), os.environ.get("PYTHONPATH", "")])}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        if args.keep_dir:  # the replicas' logs and stderr, and the lighthouse's, kept for a look
            out = Path(args.keep_dir) / f"W{world}-period{period_s:g}"
            out.mkdir(parents=True, exist_ok=True)
        procs: list[subprocess.Popen] = []
        lighthouse = None
        started = time.monotonic()
        starts = [0] * world  # processes started per replica
        exits: list[tuple[int, int]] = []  # (replica, code) of every process that ended on its own
        crashes: dict[str, str] = {}  # stderr tails of those that ended nonzero
        failures: list[dict] = []
        logs = [out / f"replica{r}.jsonl" for r in range(world)]
        seen = [0] * world  # bytes of each replica's log read so far
        committed: dict[int, float] = {}  # committed step -> earliest wall time any replica logged it
        stalled = False

        def progress(msg: str) -> None:
            print(f"[W={world} +{time.monotonic() - started:.0f}s] {msg}", file=sys.stderr, flush=True)
        try:
            with open(out / "lighthouse.err", "w") as err:
                lighthouse = subprocess.Popen(
                    [sys.executable, str(DILOCO), "--lighthouse", "--replicas", str(args.min_replicas or world),
                     "--port", str(free_port()), "--timeout-s", str(args.timeout_s)],
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True, env=env,
                    start_new_session=True)
            line = lighthouse.stdout.readline()
            if not line.startswith("up "):
                raise RuntimeError(f"the lighthouse did not start: {line!r}")
            address = line.split()[1]

            def launch(r: int) -> subprocess.Popen:
                starts[r] += 1
                err_path = out / f"replica{r}.{starts[r]}.err"
                with open(err_path, "w") as err:
                    p = subprocess.Popen(replica_argv(args, r, world, address, out), cwd=REPO, env=env,
                                         stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
                p.err_path = err_path
                return p

            procs = [launch(r) for r in range(world)]
            next_kill = None
            pending = None  # the kill whose recovery is awaited
            finishing_since = None
            last_progress = time.monotonic()
            while True:
                now_wall, now = time.time(), time.monotonic()
                for r in range(world):
                    recs, seen[r] = new_lines(logs[r], seen[r])
                    for rec in recs:
                        if rec.get("committed"):
                            step = rec["step"]
                            if step not in committed or rec["time"] < committed[step]:
                                committed[step] = rec["time"]
                                last_progress = now
                            if pending is not None and rec["began"] > pending["killed_at"]:
                                pending["fault_to_next_step_s"] = rec["time"] - pending["killed_at"]
                                pending["resumed_from"] = step - 1
                                pending["redone"] = max(0, pending["last_step"] - pending["resumed_from"])
                                failures.append(pending)
                                progress(f"step {step}: committed {pending['fault_to_next_step_s']:.1f} s after the kill")
                                pending = None
                                next_kill = rec["time"] + period_s
                        if "healed_from" in rec and failures:
                            failures[-1].setdefault("healed", []).append(
                                {"replica": r, "from": rec["healed_from"], "to": rec["step"] - int(rec["committed"])})
                if committed and next_kill is None and pending is None and finishing_since is None:
                    next_kill = min(committed.values()) + period_s
                # Replicas that ended on their own: done (exit 0) starts the finish; anything else restarts.
                for r, p in enumerate(procs):
                    code = p.poll()
                    if code is None or getattr(p, "reaped", False):
                        continue
                    p.reaped = True
                    exits.append((r, code))
                    if code != 0:  # its stderr's end (torchft logs every step there) says why
                        crashes[p.err_path.name] = p.err_path.read_text(errors="replace")[-3000:]
                    if code == 0:
                        finishing_since = finishing_since or now
                    elif finishing_since is None:
                        progress(f"replica {r} exited {code} on its own, started again")
                        procs[r] = launch(r)  # a replica that died by itself (a timeout): the orchestrator restarts it too
                if finishing_since is not None:
                    if all(getattr(p, "reaped", False) for p in procs) or now - finishing_since > args.finish_grace_s:
                        break
                elif now - last_progress > args.stall_s:
                    progress(f"no committed step for {args.stall_s:.0f} s: giving up")
                    stalled = True
                    break
                elif next_kill is not None and pending is None and now_wall >= next_kill:
                    r = rng.randrange(world)
                    last = max(committed) if committed else 0
                    victim = procs[r]
                    killed_at = time.time()
                    killgroup(victim)
                    victim.reaped = True
                    procs[r] = launch(r)  # started again at once, as torchft's orchestrator would
                    pending = {"replica": r, "killed_at": killed_at, "last_step": last}
                    progress(f"step {last}: SIGKILL replica {r}, started again")
                    next_kill = None
                time.sleep(0.02)
        finally:
            for p in procs:
                if p.poll() is None:
                    killgroup(p)
            if lighthouse is not None:
                if lighthouse.poll() is None:
                    killgroup(lighthouse)
                lighthouse.stdout.close()
                lighthouse.stdin.close()
        lines = [rec for log in logs for rec in records(log)]
        done = [rec for rec in lines if rec.get("event") == "done"]
        iters = [rec for rec in lines if "committed" in rec]
        step_times = [rec["step_time_s"] for rec in iters if rec["committed"]]
        # Arrivals: the times the highest committed step over all replicas goes up.
        arrivals, top = [], -1
        for step, t in sorted(committed.items(), key=lambda kv: (kv[1], kv[0])):
            if step > top:
                arrivals.append((t, step))
                top = step
        median_step = statistics.median(step_times) if step_times else float("nan")
        window = arrivals[-1][0] - arrivals[0][0] if len(arrivals) > 1 else float("nan")
        counted = arrivals[-1][1] - arrivals[0][1] if arrivals else 0
        own_failures = [code for _r, code in exits if code != 0]
        code = 0 if done and not stalled else (own_failures[-1] if own_failures else 1)
        return {
            "world": world, "period_s": period_s, "steps": args.steps, "min_replicas": args.min_replicas or world,
            "exit_code": code, "stalled": stalled, "wall_s": time.monotonic() - started,
            "failures": len(failures), "kills_without_recovery": int(pending is not None),
            "last_committed_step": max(committed) if committed else 0,
            "goodput": counted * median_step / window if math.isfinite(window) and window > 0 else float("nan"),
            "median_step_s": median_step,
            "iterations_not_committed": sum(1 for rec in iters if not rec["committed"]),
            "processes_started": sum(starts), "replica_exits_on_their_own": own_failures,
            "redone_per_failure": statistics.mean(f["redone"] for f in failures) if failures else 0.0,
            "fault_to_next_step_median_s": statistics.median(f["fault_to_next_step_s"] for f in failures)
            if failures else float("nan"),
            "fault_to_next_step_max_s": max((f["fault_to_next_step_s"] for f in failures), default=float("nan")),
            "checkpoint_phase_median_ms": float("nan"),
            "failure_list": failures, "replica_crashes": crashes,
        }


def table(rows: list[dict]) -> list[str]:
    out = [("| ranks | kill every | recovers from | exit | failures | goodput | steps redone per failure | "
            "fault to next step (median / max) | checkpoint phase per step (median) | step (median) |"),
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        every = f"{r['period_s']:.0f} s" if math.isfinite(r["period_s"]) else "never"
        out.append(f"| {r['world']} | {every} | {RECOVERS_FROM} | {r['exit_code']} | {r['failures']} | "
                   f"{r['goodput']:.2f} | {r['redone_per_failure']:.1f} | {r['fault_to_next_step_median_s']:.1f} / "
                   f"{r['fault_to_next_step_max_s']:.1f} s | n/a | {r['median_step_s'] * 1000:.0f} ms |")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--replicas", default="2", help="comma-separated replica counts W (default 2); one process each")
    p.add_argument("--period-s", default="30", help="comma-separated kill periods in seconds (default 30; 0: no kills)")
    p.add_argument("--steps", type=int, default=600, help="committed steps to train")
    p.add_argument("--min-replicas", type=int, default=None,
                   help="torchft's min_replica_size (default W: every committed step is a full batch)")
    p.add_argument("--layers", type=int, default=2, help="GPT blocks (goodput.py runs the example with 2)")
    p.add_argument("--timeout-s", type=float, default=60.0,
                   help="the Manager's quorum, should_commit, checkpoint and connect timeouts (a replacement's start must fit)")
    p.add_argument("--pg-timeout-s", type=float, default=5.0,
                   help="the gloo group's timeout (torchft's train_ddp.py: 5 s); a survivor that is not the dead "
                        "replica's ring neighbour waits this long in the failed all-reduce")
    p.add_argument("--stall-s", type=float, default=300.0, help="end a run after this long without a committed step")
    p.add_argument("--finish-grace-s", type=float, default=60.0,
                   help="after the first replica finishes, how long the others get before they are killed")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write the rows here")
    p.add_argument("--keep-dir", default=None, help="keep each run's replica logs (and stderr) under this directory")
    # One replica (started by the benchmark):
    p.add_argument("--replica", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--addr", default="127.0.0.1", help=argparse.SUPPRESS)
    p.add_argument("--store-port", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--lighthouse-addr", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    p.add_argument("--batch-size", type=int, default=16, help=argparse.SUPPRESS)
    p.add_argument("--context", type=int, default=64, help=argparse.SUPPRESS)
    p.add_argument("--dim", type=int, default=128, help=argparse.SUPPRESS)
    p.add_argument("--lr", type=float, default=3e-3, help=argparse.SUPPRESS)
    p.add_argument("--corpus-mb", type=float, default=4.0, help=argparse.SUPPRESS)
    p.add_argument("--data-cache", default=os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"),
                                                        "slipstream"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.replica is not None:
        args.replicas = int(args.replicas)
        return replica(args)

    # A SIGTERM (timeout, CI) unwinds through run_once's finally, which kills the replicas' process groups.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    # Pack the corpus once here, so the replicas (and their restarts) only read it.
    sys.path.insert(0, str(REPO / "examples"))
    from train_gpt import stdlib_corpus_shards

    stdlib_corpus_shards(args.data_cache, args.corpus_mb, args.context, 0)
    rows = []
    for world in [int(w) for w in args.replicas.split(",")]:
        for period in [float(t) for t in args.period_s.split(",")]:
            row = run_once(args, world, period if period > 0 else math.inf, args.seed)
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k not in ("failure_list", "replica_crashes")}),
                  flush=True)
    print(f"\nload average at the end: {os.getloadavg()[0]:.1f}\n")
    print("\n".join(table(rows)))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0 if all(r["exit_code"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
