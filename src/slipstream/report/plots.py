"""The report's figures (matplotlib, Agg backend): each returns a Figure or None when
the run has no data for it.

Example::

    fig = loss_figure(load_run("runs/x"))
    fig.savefig("loss.png")
"""

from __future__ import annotations

from typing import Any

from .data import PHASE_KEYS, Run

PHASE_COLOURS = {
    "data_wait_s": "#9e9e9e",
    "forward_s": "#4c72b0",
    "backward_s": "#55a868",
    "comm_exposed_s": "#c44e52",
    "optimizer_s": "#8172b2",
    "checkpoint_s": "#ccb974",
    "other_s": "#dddddd",
}
# Colours no other figure uses, so a screenshot test can find these two plots by their pixels.
LR_COLOUR = "#2a9d8f"
GRAD_NORM_COLOUR = "#e76f51"
RANK_COLOURS = ["#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b2", "#937860", "#da8bc3", "#8c8c8c"]


def _plt():
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    return plt


def _new(title: str, width: float = 7.0, height: float = 3.4):
    plt = _plt()
    fig, ax = plt.subplots(figsize=(width, height), dpi=100)
    ax.set_title(title, fontsize=11, loc="left")
    ax.grid(True, alpha=0.3)
    return fig, ax


def _rank_colour(rank: int) -> str:
    return RANK_COLOURS[rank % len(RANK_COLOURS)]


def loss_figure(run: Run) -> Any:
    if not any(run.series("loss", r)[0] for r in run.ranks):
        return None
    fig, ax = _new("Training loss")
    for r in run.ranks:
        xs, ys = run.series("loss", r)
        if xs:
            ax.plot(xs, ys, label=f"rank {r}", color=_rank_colour(r), lw=2 if r == 0 else 1, alpha=1 if r == 0 else 0.5)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    if len(run.ranks) > 1:
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def _rank0_line(run: Run, key: str, title: str, ylabel: str, colour: str) -> Any:
    """One field of rank 0's records over the steps (a log scale when it spans over 100x)."""
    xs, ys = run.series(key)
    if not xs:
        return None
    fig, ax = _new(title)
    ax.plot(xs, ys, color=colour, marker="o", ms=3, lw=1.5)
    positive = [y for y in ys if y > 0]
    if len(positive) == len(ys) and max(ys) > 100 * min(ys):
        ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    fig.tight_layout()
    return fig


def lr_figure(run: Run) -> Any:
    """The learning rate of the first parameter group at each log step (``lr`` in the records)."""
    return _rank0_line(run, "lr", "Learning rate (parameter group 0)", "lr", LR_COLOUR)


def grad_norm_figure(run: Run) -> Any:
    """The global gradient 2-norm at each log step, before clipping (``grad_norm``; the same on
    every rank)."""
    return _rank0_line(run, "grad_norm", "Gradient norm (global, before clipping)", "2-norm", GRAD_NORM_COLOUR)


def throughput_figure(run: Run) -> Any:
    xs, ys = run.series("samples_per_s")
    txs, tys = run.series("tokens_per_s")
    if not xs and not txs:
        return None
    fig, ax = _new("Throughput of the job")
    if txs:
        ax.plot(txs, tys, color="#4c72b0", marker="o", ms=3, label="tokens/s")
        ax.set_ylabel("tokens / s")
    else:
        ax.plot(xs, ys, color="#4c72b0", marker="o", ms=3, label="samples/s")
        ax.set_ylabel("samples / s")
    mx, my = run.series("mfu")
    if mx:
        ax2 = ax.twinx()
        ax2.plot(mx, [v * 100 for v in my], color="#dd8452", ls="--", label="MFU %")
        ax2.set_ylabel("MFU %")
        ax2.set_ylim(bottom=0)
    ax.set_xlabel("step")
    ax.set_ylim(bottom=0)
    fig.tight_layout()
    return fig


def breakdown_figure(run: Run, rank: int = 0) -> Any:
    """Stacked phases per step (rank 0) over the run."""
    steps = [int(r["step"]) for r in run.ranks.get(rank, []) if r.get("forward_s") is not None]
    if not steps:
        return None
    fig, ax = _new(f"Where a step's time went (rank {rank}, ms per step)")
    recs = [r for r in run.ranks[rank] if r.get("forward_s") is not None]
    bottoms = [0.0] * len(recs)
    width = max(1.0, (steps[-1] - steps[0]) / max(len(steps), 1) * 0.8) if len(steps) > 1 else 0.8
    for key in PHASE_KEYS:
        vals = [float(r.get(key) or 0.0) * 1e3 for r in recs]
        if not any(vals):
            continue
        ax.bar(steps, vals, width=width, bottom=bottoms, color=PHASE_COLOURS[key], label=key[:-2], edgecolor="none")
        bottoms = [b + v for b, v in zip(bottoms, vals)]
    ax.set_xlabel("step")
    ax.set_ylabel("ms")
    ax.legend(fontsize=7, ncol=4, loc="upper right")
    fig.tight_layout()
    return fig


def ranks_figure(run: Run) -> Any:
    """Per-rank comparison: mean phase stack per rank, and busy time per rank over steps."""
    if not any(run.series("busy_s", r)[0] for r in run.ranks):
        return None
    plt = _plt()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9.0, 3.4), dpi=100, gridspec_kw={"width_ratios": [1, 1.6]})
    ax1.set_title("Mean ms per step, by rank", fontsize=11, loc="left")
    ranks = list(run.ranks)
    bottoms = [0.0] * len(ranks)
    for key in PHASE_KEYS:
        vals = [run.phase_means(r)[key] * 1e3 for r in ranks]
        if not any(vals):
            continue
        ax1.bar([str(r) for r in ranks], vals, bottom=bottoms, color=PHASE_COLOURS[key], label=key[:-2])
        bottoms = [b + v for b, v in zip(bottoms, vals)]
    ax1.set_xlabel("rank")
    ax1.set_ylabel("ms")
    ax1.legend(fontsize=6)
    ax2.set_title("Compute outside sync (busy), ms per step", fontsize=11, loc="left")
    for r in ranks:
        xs, ys = run.series("busy_s", r)
        ax2.plot(xs, [v * 1e3 for v in ys], color=_rank_colour(r), marker="o", ms=3, label=f"rank {r}")
    ax2.set_xlabel("step")
    ax2.set_ylim(bottom=0)
    ax2.legend(fontsize=7)
    for ax in (ax1, ax2):
        ax.grid(True, alpha=0.3)
    fig.tight_layout()
    return fig


def comm_figure(run: Run) -> Any:
    xs, ys = run.series("sync_bytes_sent_total")
    sx, sy = run.series("sync_bytes_sent")
    if not xs and not sx:
        return None
    fig, ax = _new("Communication volume (rank 0)")
    if xs:
        ax.plot(xs, [v / 2**20 for v in ys], color="#c44e52", marker="o", ms=3, label="sent, cumulative (MiB)")
    if sx:
        ax.plot(sx, [v / 2**20 for v in sy], color="#4c72b0", ls="--", label="sent per step (MiB)")
    ax.set_xlabel("step")
    ax.set_ylabel("MiB")
    cx, cy = run.series("sync_compression_ratio")
    if cx and any(abs(v - 1.0) > 1e-9 for v in cy):
        ax2 = ax.twinx()
        ax2.plot(cx, cy, color="#8172b2", ls=":", label="compression ratio")
        ax2.set_ylabel("compression ratio")
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    return fig


def memory_figure(run: Run) -> Any:
    if not any(run.series("mem_rss_bytes", r)[0] for r in run.ranks):
        return None
    fig, ax = _new("Memory per rank (GiB)")
    for r in run.ranks:
        xs, ys = run.series("mem_rss_bytes", r)
        ax.plot(xs, [v / 2**30 for v in ys], color=_rank_colour(r), label=f"rank {r} RSS")
        cx, cy = run.series("cuda_peak_allocated_bytes", r)
        if cx:
            ax.plot(cx, [v / 2**30 for v in cy], color=_rank_colour(r), ls="--", label=f"rank {r} CUDA peak allocated")
    ax.set_xlabel("step")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def timeline_figure(run: Run, last_steps: int = 3) -> Any:
    """A Gantt chart of the last few steps per rank (compute and communication rows)."""
    import glob
    import os

    from ..metrics.timeline import COMM_TID, load_events

    spans: dict[int, list[dict[str, Any]]] = {}
    for path in sorted(glob.glob(os.path.join(run.run_dir, "timeline", "rank*.json"))):
        try:
            events = load_events(path)
        except (OSError, ValueError):
            continue
        for e in events:
            if e.get("ph") == "X":
                spans.setdefault(int(e["pid"]), []).append(e)
    if not spans:
        return None
    last = min(max(e["args"]["step"] for e in evs) for evs in spans.values())
    first = max(1, last - last_steps + 1)
    chosen = {r: [e for e in evs if first <= e["args"]["step"] <= last] for r, evs in spans.items()}
    t0 = min((e["ts"] for evs in chosen.values() for e in evs), default=0.0)
    colours = dict(PHASE_COLOURS)
    colours.update({"comm_exposed_s": "#c44e52", "grad_sync_s": "#f0b0b0", "straggler_gather_s": "#e377c2"})
    fig, ax = _new(f"Timeline of steps {first}-{last} (ms)", width=9.0, height=1.6 + 0.7 * len(chosen))
    ticks, labels, seen = [], [], set()
    for i, r in enumerate(sorted(chosen)):
        for row, tid in ((2 * i, 1), (2 * i + 1, COMM_TID)):
            base = -row
            for e in chosen[r]:
                if e.get("tid") != tid:
                    continue
                key = e["name"] + "_s"
                label = e["name"] if e["name"] not in seen else None
                seen.add(e["name"])
                # grad_sync (the whole reduction window) underneath, the exposed wait on top.
                ax.broken_barh([((e["ts"] - t0) / 1e3, max(e["dur"] / 1e3, 0.05))], (base - 0.4, 0.8),
                               facecolors=colours.get(key, "#999999"), label=label,
                               zorder=1 if e["name"] == "grad_sync" else 2)
            ticks.append(base)
            labels.append(f"rank {r} {'compute' if tid == 1 else 'comm'}")
    ax.set_yticks(ticks)
    ax.set_yticklabels(labels, fontsize=8)
    ax.set_xlabel("ms")
    ax.set_axisbelow(True)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    fig.legend(fontsize=7, ncol=7, loc="lower center", frameon=False)
    return fig


FIGURES = (
    ("loss", "Loss", loss_figure),
    ("lr", "Learning rate", lr_figure),
    ("grad_norm", "Gradient norm", grad_norm_figure),
    ("throughput", "Throughput", throughput_figure),
    ("breakdown", "Step-time breakdown", breakdown_figure),
    ("ranks", "Per-rank comparison", ranks_figure),
    ("communication", "Communication volume", comm_figure),
    ("memory", "Memory", memory_figure),
    ("timeline", "Timeline (last steps)", timeline_figure),
)

__all__ = ["FIGURES", "GRAD_NORM_COLOUR", "LR_COLOUR", "PHASE_COLOURS"]
