"""Rank 0's console on a terminal, in process, on a pseudo-terminal of 80 and 120 columns (issue #46 items 1, 6).

Each test points ``sys.stdout``/``sys.stderr`` at the pty, drives :class:`ConsoleSink` with fixed
records, and reads the screen a person would see (``terminal_screen.Screen``): the display
fits the width on two lines, lines printed meanwhile land above it, and when another live
display is up (Lightning's rich bar, a Trainer's tqdm bar) ours steps aside and says one plain
line per log step, without ever raising.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings

import pytest

from slipstream.metrics import ConsoleSink
from tests.conftest import need_module
from tests.metrics.terminal_screen import Screen, TerminalReader, open_terminal

STRAGGLER = ("straggler: rank 1 is 42% slower than the median rank (31.5 ms vs 22.1 ms of compute per step, "
             "+9.4 ms) in 3 of the last 3 log steps")


def _record(step: int) -> dict:
    rec = {"step": step, "loss": 2.3012, "lr": 1e-3, "samples_per_s": 1734.0, "tokens_per_s": 55000.0,
           "step_time_s": 0.0123, "comm_exposed_s": 0.0015, "mfu": 0.031}
    if step >= 30:
        rec.update(straggler_rank=1, straggler_slowdown=0.42, straggler_message=STRAGGLER)
    return rec


class Terminal:
    """A pty of ``columns`` columns that ``sys.stdout`` and ``sys.stderr`` write to."""

    def __init__(self, columns: int, monkeypatch: pytest.MonkeyPatch) -> None:
        self.columns = columns
        master, slave = open_terminal(columns)
        self.reader = TerminalReader(master)
        self.stream = open(slave, "w", buffering=1, encoding="utf-8")
        self._master = master
        monkeypatch.delenv("COLUMNS", raising=False)  # the width must come from the terminal itself
        monkeypatch.setenv("TERM", "xterm-256color")
        monkeypatch.setattr(sys, "stdout", self.stream)
        monkeypatch.setattr(sys, "stderr", self.stream)

    def screen(self) -> list[str]:
        """Close the terminal's writing end and return the screen's rows."""
        sys.stdout = sys.stderr = sys.__stderr__  # monkeypatch restores the test's own afterwards
        self.stream.close()
        text = self.reader.text()
        os.close(self._master)
        screen = Screen(self.columns)
        screen.feed(text)
        self.raw = text
        return screen.lines()


@pytest.fixture(params=[80, 120], ids=["80col", "120col"])
def terminal(request, monkeypatch):
    """Opens the terminal when called, in the test itself: pytest's capture puts its own
    ``sys.stdout``/``sys.stderr`` back between a fixture's setup and the test."""
    return lambda: Terminal(request.param, monkeypatch)


@pytest.mark.parametrize("total", [100, None], ids=["total", "no-total"])
def test_the_display_fits_the_terminal_and_lines_print_above_it(terminal, total):
    terminal = terminal()
    sink = ConsoleSink(total)
    for step in range(10, 61, 10):
        sink.write(_record(step))
        if step == 40:
            # What Python prints for a warning (pytest records warnings.warn's instead of printing it).
            sys.stderr.write(warnings.formatwarning("a warning from the script", UserWarning, __file__, 1))
            print("a print from the script")
            logging.getLogger("slipstream.test").warning("[slipstream] a warning of ours")
    sink.close()
    rows = terminal.screen()
    bars = [i for i, row in enumerate(rows) if row.startswith("train ")]
    # One display, at the bottom, the bar on one row and the fields on the next: nothing wrapped
    # it onto more rows (a row of exactly the width would have, at the next character).
    assert len(bars) == 1, rows
    bar, status = rows[bars[0]], rows[bars[0] + 1]
    assert bars[0] + 2 == len(rows), rows
    assert len(bar) <= terminal.columns and len(status) <= terminal.columns
    count = "60/100" if total else "step 60"
    assert f" {count} " in bar and "None" not in bar, bar
    assert ("ETA " in bar) == bool(total), bar
    assert status.startswith("loss 2.3012 | lr 0.001 | 1734.0 samples/s"), status
    # Fields are dropped whole where the width ends, never cut (no "t…", no "30/…").
    assert "…" not in bar + status
    if terminal.columns >= 120:
        assert status.endswith("straggler rank 1 +42%"), status
    # What was printed meanwhile is above the display, whole.
    above = "\n".join(rows[: bars[0]])
    for text in ("UserWarning: a warning from the script", "a print from the script",
                 "[slipstream] a warning of ours", "[slipstream] straggler: rank 1 is 42% slower"):
        assert text in above.replace("\n", " ") or text in above, (text, rows)
    assert above.count("[slipstream] straggler:") == 1  # announced once


def _lightning_like_bar():
    """What Lightning's RichProgressBar does when training starts (lightning 2.x, rich >= 14.1):
    reconfigure rich's global console (a new, empty stack of live displays), pop a live display
    left on it, and start its own Progress there."""
    from rich import get_console, reconfigure
    from rich.progress import Progress

    reconfigure()
    console = get_console()
    if getattr(console, "_live_stack", None):
        console.clear_live()
    bar = Progress(console=console, auto_refresh=False)
    bar.add_task("Epoch 0", total=60)
    bar.start()
    return bar


def test_with_lightnings_rich_bar_ours_steps_aside_and_never_raises(terminal):
    terminal = terminal()
    sink = ConsoleSink(total_steps=None)  # made when the model is adopted, before Lightning's bar starts
    theirs = _lightning_like_bar()
    try:
        for step in range(10, 61, 10):
            theirs.update(theirs.task_ids[0], completed=step, refresh=True)
            sink.write(_record(step))
    finally:
        theirs.stop()
    sink.close()  # was: IndexError: pop from empty list (from rich's clear_live), the run's exit 1
    rows = terminal.screen()
    assert "train " not in terminal.raw  # ours never drew: one progress display
    lines = [row for row in rows if row.startswith("[slipstream] step ")]
    assert [line.split(" | ")[0] for line in lines] == [f"[slipstream] step {s}" for s in range(10, 61, 10)], rows
    assert sum(row.startswith("Epoch 0") for row in rows) == 1, rows  # theirs, drawn below our lines
    assert rows[-1].startswith("Epoch 0"), rows


def test_a_display_that_starts_later_takes_over_and_ours_is_erased(terminal):
    terminal = terminal()
    sink = ConsoleSink(total_steps=60)
    sink.write(_record(10))  # ours is up
    theirs = _lightning_like_bar()
    try:
        for step in range(20, 61, 10):
            theirs.update(theirs.task_ids[0], completed=step, refresh=True)
            sink.write(_record(step))
    finally:
        theirs.stop()
    sink.close()
    rows = terminal.screen()
    assert not any(row.startswith("train ") for row in rows), rows  # erased when it stepped aside
    assert sum(row.startswith("Epoch 0") for row in rows) == 1, rows
    assert any(row.startswith("[slipstream] step 60/60 | loss 2.3012") for row in rows), rows


def test_with_a_trainers_tqdm_bar_ours_steps_aside(terminal):
    terminal = terminal()
    tqdm = need_module("tqdm", "pip install tqdm (the Trainer's progress bar)")
    sink = ConsoleSink(total_steps=60)
    bar = tqdm.tqdm(total=60, file=sys.stderr, dynamic_ncols=True)  # the Trainer's, opened at train begin
    try:
        for step in range(10, 61, 10):
            bar.update(10)
            sink.write(_record(step))
    finally:
        bar.close()
    sink.close()
    rows = terminal.screen()
    assert "train " not in terminal.raw
    assert sum(row.startswith("[slipstream] step ") for row in rows) == 6, rows
    assert sum("60/60 [" in row for row in rows) == 1, rows  # tqdm's bar, once, not a line per frame


def test_a_failing_display_falls_back_to_plain_lines(terminal, monkeypatch):
    terminal = terminal()
    from rich.live import Live

    def broken(self, *args, **kwargs):
        raise RuntimeError("terminal gone")

    sink = ConsoleSink(total_steps=30)
    monkeypatch.setattr(Live, "refresh", broken)
    for step in (10, 20, 30):
        sink.write(_record(step))  # never raises into training
    sink.close()
    rows = terminal.screen()
    assert any(row.startswith("[slipstream] step 30/30") for row in rows), rows


LIGHTNING_SCRIPT = '''
import lightning as L, torch
from torch import nn
from torch.nn import functional as F


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Linear(32, 10)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


data = torch.utils.data.TensorDataset(torch.randn(1024, 32), torch.randint(10, (1024,)))
trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=20)
trainer.fit(Model(), torch.utils.data.DataLoader(data, batch_size=16))
'''


@pytest.mark.distributed
def test_an_unmodified_lightning_script_exits_0_in_a_terminal(tmp_path):
    """The issue's case end to end: Lightning's own rich bar (its default) and ours in one process
    of `slipstream run -n 2 --sync bf16` on an 80-column terminal. It trained and then exited 1
    (IndexError from our bar's stop); now 0, with Lightning's display and our plain lines."""
    from tests.metrics.terminal_screen import run_in_terminal

    need_module("lightning", "bash scripts/install.sh test")
    script = tmp_path / "train.py"
    script.write_text(LIGHTNING_SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, "-m", "slipstream", "run", "-n", "2", "--sync", "bf16",
            "--run-dir", str(tmp_path / "run"), str(script)]
    rc, text = run_in_terminal(argv, columns=80, env=env, timeout_s=300, cwd=str(tmp_path))
    screen = Screen(80)
    screen.feed(text)
    rows = screen.lines()
    assert rc == 0, "\n".join(rows[-40:])
    assert "IndexError" not in text
    assert "`max_steps=20` reached" in text
    assert "train \x1b" not in text and not any(row.startswith("train ") for row in rows)  # ours stepped aside
    assert [row.split(" | ")[0] for row in rows if row.startswith("[slipstream] step ")] == [
        "[slipstream] step 10", "[slipstream] step 20"], rows
