"""torchft's DiLoCo on the GPT example: the peer that ``benchmarks/low_comm.py`` runs beside ``--sync diloco``.

Question it answers: what does torchft (pytorch/torchft 0.2.0, ``torchft.local_sgd.DiLoCo``)
cost in bytes, time and loss on the same model, data order and emulated nodes as
Slipstream's DiLoCo?

It trains ``examples/train_gpt.py``'s GPT with that script's optimizer (AdamW, lr 3e-3,
weight decay 0.01, linear warm-up over steps/20 then cosine) on the same data order
(``SlipstreamLoader`` over the packed stdlib corpus, rank = replica index, world size =
replicas: the split ``slipstream run`` gives data-parallel rank ``r``), with the paper's outer
optimizer as ``--sync diloco``'s defaults (SGD, lr 0.7, no momentum; ``--outer-momentum 0.9`` for the
paper's Nesterov momentum).

torchft's process model differs from torchrun's: each replica group is a job of its own
with its own TCPStore and Manager server, and a lighthouse forms the quorum of groups.
Here one emulated node is one replica group of one rank:

* ``--lighthouse``: run a ``torchft.coordination.LighthouseServer`` (the Rust server the
  ``torchft_lighthouse`` console script also starts) until stdin closes; prints ``up ADDRESS``;
* otherwise one replica: a TCPStore on the node's address, a ``Manager`` with torchft's
  reconfigurable gloo group (``torchft.process_group.ProcessGroupGloo``, which binds to
  ``GLOO_SOCKET_IFNAME`` like torch's), synchronous quorum (DiLoCo requires it) and
  ``init_sync=False`` (every replica builds the same weights from the same seed), and
  ``DiLoCo(manager, [model], inner, outer, sync_every=H)``, whose optimizer hooks run the
  outer step every H inner steps.

Each replica writes ``OUT/rank<R>.jsonl`` (every ``--log-every`` steps: step, seconds since
the loop started, mean training loss of the window) and ``OUT/result-<R>.json``; replica 0
writes ``OUT/model.pt`` (the state_dict ``benchmarks/heldout_gpt.py`` scores). Started by
``benchmarks.low_comm`` inside the emulated nodes; by hand (two shells, one machine)::

    python benchmarks/torchft_diloco_gpt.py --lighthouse --replicas 2 --port 29510
    python benchmarks/torchft_diloco_gpt.py --replica 0 --replicas 2 --addr 127.0.0.1 --store-port 29520 \\
        --lighthouse-addr http://127.0.0.1:29510 --steps 100 --inner-steps 50 --out /tmp/ft
    python benchmarks/torchft_diloco_gpt.py --replica 1 ... --store-port 29521 --out /tmp/ft
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def serve_lighthouse(args: argparse.Namespace) -> int:
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(bind=f"[::]:{args.port}", min_replicas=args.replicas,
                              join_timeout_ms=int(args.timeout_s * 1000))
    print(f"up {server.address()}", flush=True)
    try:
        sys.stdin.read()  # until the benchmark closes our stdin (or exits)
    finally:
        server.shutdown()
    return 0


def train(args: argparse.Namespace) -> int:
    import torch

    sys.path.insert(0, str(REPO / "examples"))
    from train_gpt import GPT, loss_fn, stdlib_corpus_shards  # noqa: E402

    from torchft.local_sgd import DiLoCo
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo

    from slipstream.data import ShardedDataset, SlipstreamLoader

    torch.manual_seed(args.seed)  # the same initial weights in every replica (init_sync=False relies on it)
    data = stdlib_corpus_shards(args.data_cache, args.corpus_mb, args.context, 0)
    dataset = ShardedDataset(data)
    vocab = int(dataset.index.meta["vocab_size"])
    loader = SlipstreamLoader(dataset, batch_size=args.batch_size, seed=args.seed, drop_last=True,
                              rank=args.replica, world_size=args.replicas)
    model = GPT(vocab=vocab, dim=args.dim, layers=args.layers, context=args.context)
    inner = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    warmup = max(1, args.steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        inner, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / args.steps))))
    outer = torch.optim.SGD(model.parameters(), lr=args.outer_lr, momentum=args.outer_momentum,
                            nesterov=args.outer_momentum > 0)

    # The replica group's own store, on the node's address: the quorum's primary store is
    # where the groups' gloo ranks meet, so the other nodes must reach it.
    store = torch.distributed.TCPStore(args.addr, args.store_port, is_master=True, wait_for_workers=False)
    timeout = timedelta(seconds=args.timeout_s)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout),
        load_state_dict=lambda sd: (model.load_state_dict(sd["model"]), inner.load_state_dict(sd["inner"])),
        state_dict=lambda: {"model": model.state_dict(), "inner": inner.state_dict()},
        min_replica_size=args.replicas,
        use_async_quorum=False,  # DiLoCo refuses the asynchronous quorum
        init_sync=False,
        replica_id=f"replica_{args.replica}",
        store_addr=args.addr,
        store_port=args.store_port,
        rank=0,
        world_size=1,
        lighthouse_addr=args.lighthouse_addr,
        hostname=args.addr,  # what the other groups dial; the host name is the same in every namespace
        timeout=timeout,
        quorum_timeout=timeout,
        connect_timeout=timeout,
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    records = open(out / f"rank{args.replica}.jsonl", "w")
    batches = (b for _epoch in iter(int, 1) for b in loader)
    loss_sum, window, losses = torch.zeros(()), 0, []
    t_window = start = time.perf_counter()
    # Bucketized: the pseudo-gradient in one all-reduce (bucket_cap_mb default 1 GiB), as a user on a
    # slow link would configure it; torchft's default sends one all-reduce per parameter tensor, each
    # paying the link's round trips (22 tensors here).
    with DiLoCo(manager, [model], inner, outer, sync_every=args.inner_steps, backup_device=torch.device("cpu"),
                pin_memory=False, use_bucketization=not args.per_param):
        for step in range(1, args.steps + 1):
            tokens = next(batches)[:, : args.context + 1].long()
            loss = loss_fn(model(tokens[:, :-1]), tokens[:, 1:])
            inner.zero_grad()
            loss.backward()
            inner.step()  # every H-th: DiLoCo's hook runs the quorum, the all-reduce and the outer step
            sched.step()
            loss_sum += loss.detach()
            window += 1
            if step % args.log_every == 0 or step == args.steps:
                now = time.perf_counter()
                mean = float(loss_sum) / window
                losses.append(mean)
                records.write(json.dumps({"step": step, "rank": args.replica, "time_s": round(now - start, 6),
                                          "loss": mean, "step_time_s": (now - t_window) / window}) + "\n")
                records.flush()
                loss_sum.zero_()
                window, t_window = 0, now
    loop_s = time.perf_counter() - start
    records.close()
    loader.close()
    result = {"replica": args.replica, "loop_s": loop_s, "steps": args.steps, "final_loss": losses[-1],
              "outer_steps_committed": manager.current_step(), "errored": str(manager.errored() or "") or None,
              "use_bucketization": not args.per_param, "torchft_version": importlib.metadata.version("torchft"),
              "params": sum(p.numel() for p in model.parameters())}
    if args.replica == 0:
        torch.save(model.state_dict(), out / "model.pt")
    (out / f"result-{args.replica}.json").write_text(json.dumps(result))
    print(f"torchft replica {args.replica}: {args.steps} steps in {loop_s:.1f} s, final loss {losses[-1]:.4f}, "
          f"{result['outer_steps_committed']} outer steps committed", flush=True)
    manager.shutdown(wait=False)
    del store
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lighthouse", action="store_true", help="run the lighthouse (the quorum server) instead")
    p.add_argument("--port", type=int, default=29510, help="the lighthouse's port")
    p.add_argument("--replicas", type=int, default=2, help="replica groups (one per node)")
    p.add_argument("--replica", type=int, default=0, help="this replica group's index (its data-parallel rank)")
    p.add_argument("--addr", default="127.0.0.1", help="this node's address (its store and Manager server)")
    p.add_argument("--store-port", type=int, default=29520)
    p.add_argument("--lighthouse-addr", default="http://127.0.0.1:29510")
    p.add_argument("--timeout-s", type=float, default=300.0, help="torchft's collective, quorum and connect timeouts")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--inner-steps", type=int, default=50, help="H: inner steps between outer steps (sync_every)")
    p.add_argument("--per-param", action="store_true",
                   help="torchft's default: one all-reduce per parameter tensor (else one bucketized all-reduce)")
    p.add_argument("--outer-lr", type=float, default=0.7)
    p.add_argument("--outer-momentum", type=float, default=0.0, help="Nesterov when above 0 (the paper: 0.9)")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per replica per step")
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--corpus-mb", type=float, default=4.0)
    p.add_argument("--data-cache", default=os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"),
                                                        "slipstream"))
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--out", default="torchft-out")
    args = p.parse_args(argv)
    if args.lighthouse:
        return serve_lighthouse(args)
    if not 0 <= args.replica < args.replicas:
        p.error(f"--replica must be in [0, --replicas({args.replicas})), got {args.replica}")
    if args.steps % args.inner_steps:
        p.error(f"--steps({args.steps}) must be a multiple of --inner-steps({args.inner_steps}): the run must end "
                "on an outer step, so the saved model is the replicas' common one")
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    return train(args)


if __name__ == "__main__":
    sys.exit(main())
