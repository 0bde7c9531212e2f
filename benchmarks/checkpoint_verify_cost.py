"""What checkpoint verification costs: the checksums at save, and each checkpoint_verify mode at load.

    python benchmarks/checkpoint_verify_cost.py [--mb 256] [--repeats 5] [--dir /tmp]

One process, no communication. A model of ``--mb / 2`` MB of fp32 weights plus
SGD momentum (``--mb`` MB of state in all) is saved with CheckpointManager
``--repeats`` times, each save timed whole, with checkpoint_verify=full (the
marker records CRC-32s) and, alternating in the same run, with
checkpoint_verify=size (sizes only). Then the
newest checkpoint is checked in each mode (full, size, off) and loaded whole
(restore_latest) in each mode. Medians; the ratios are what to compare across
machines. The files were just written, so reads come from the page cache: on a
cold cache, ``full`` reads the checkpoint from disk once more before loading it.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
from torch import nn

from slipstream.checkpoint import layout, verify
from slipstream.checkpoint.manager import CheckpointManager
from slipstream.checkpoint.states import ModelOptimizerState


def _state(mb: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    width = 2048  # one Linear(2048, 2048) is 16 MiB of fp32 weights
    blocks = max(1, (mb // 2) // 16)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(blocks)])
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    model(torch.ones(1, width)).sum().backward()
    opt.step()  # momentum buffers: as many bytes as the weights
    return model, opt


def _manager(directory: str, model: nn.Module, opt: torch.optim.Optimizer, mode: str = "full") -> CheckpointManager:
    mgr = CheckpointManager(directory, keep_last=2, handle_sigterm=False, verify=mode)
    mgr.register("model_optimizer", ModelOptimizerState(model, opt))
    return mgr


def _median_s(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=256, help="MB of state (weights + momentum)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory under /tmp)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    model, opt = _state(args.mb)
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="slipstream-verify-cost-") as directory:
        # full records sizes and CRC-32s; size records sizes only (the same save otherwise).
        managers = {mode: _manager(directory, model, opt, mode) for mode in ("full", "size")}
        step = [0]

        def save(mode: str) -> None:
            step[0] += 1
            assert managers[mode].save(step[0])

        save("full")  # warm-up: first-touch costs
        with_crc, sizes_only = [], []
        for _ in range(args.repeats):  # alternate, so drifting load on the machine hits both alike
            with_crc.append(_median_s(lambda: save("full"), 1))
            sizes_only.append(_median_s(lambda: save("size"), 1))
        save("full")
        latest = layout.find_latest(directory)
        size = verify.checkpoint_bytes(latest.info)
        checksum_only = _median_s(lambda: verify.describe_files(latest.path), args.repeats)
        print(f"state {size / 1e6:.0f} MB in {latest.path}; {args.repeats} repeats, medians")
        crc, plain = statistics.median(with_crc), statistics.median(sizes_only)
        print(f"save with CRC-32s {crc * 1e3:8.0f} ms   sizes only {plain * 1e3:8.0f} ms   "
              f"ratio {crc / plain:.2f}   (checksumming alone {checksum_only * 1e3:.0f} ms, "
              f"{size / checksum_only / 1e9:.2f} GB/s)")
        for mode in ("full", "size", "off"):
            check = _median_s(lambda: verify.check(latest, mode), args.repeats)
            reader = _manager(directory, *_state(args.mb), mode=mode)
            load = _median_s(reader.restore_latest, args.repeats)
            print(f"load, checkpoint_verify={mode:<4}  check {check * 1e3:8.1f} ms   whole restore {load * 1e3:8.0f} ms")


if __name__ == "__main__":
    main()
