"""Rank 0's live progress display on a terminal, and how it shares the terminal with others.

Two lines, each cut to the terminal's width (never wrapped, so a narrow terminal
cannot split the bar)::

    train ━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━   30/100  12s  ETA 28s
    loss 2.3012 | lr 0.001 | 1734.0 samples/s | 12.3 ms/step | comm 12%

The second line holds as many whole fields of the log step as fit, in the
order :func:`~.sinks.status_parts` gives them (most useful first); the count
reads ``step 30`` when the total is unknown.

Sharing the terminal:

* The display draws on a rich ``Console`` of its own, never rich's global one:
  Lightning's ``RichProgressBar`` reconfigures the global console (a new, empty
  stack of live displays) and pops whatever is on it, so a display of ours
  kept there failed when it stopped (``IndexError: pop from empty list`` from
  ``clear_live``, after training succeeded: the run exited 1).
* Lines the process writes to ``sys.stdout``/``sys.stderr`` while the display
  is up (prints, warnings, logging, our straggler message) are printed above
  it, whole lines, through :class:`_AboveTheDisplay` (rich's own redirection
  buffers a ``\\r``-drawn bar such as tqdm's into one line per frame).
* It starts at the first log step, not before: a framework opens its own
  display when training starts (Lightning's bar, a Trainer's tqdm bar), so by
  then it is up, and ours never shows beside it.
* When another live display appears in the process (rich's live display on its
  global console or through a stream, a tqdm bar, or anything that moves the
  cursor through ``sys.stdout``/``sys.stderr``), ours steps aside for good: it
  erases itself, puts the streams back, and the sink prints one plain line per
  log step (:func:`print_beside`, above the other display when it is rich's or
  tqdm's). Two displays redrawing one terminal garble both.
* Nothing here raises into training: a display that fails steps aside too, so a
  run's exit code is never the display's.

Example::

    display = TerminalDisplay(total_steps=100)
    if not display.update(30, ["loss 2.3012"], eta_s=28.0):   # another display is up: ours stepped aside
        print_beside("[slipstream] step 30/100 | loss 2.3012", sys.stderr)
    display.close()
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import sys
import threading
import time
from typing import IO, Any

log = logging.getLogger(__name__)

REFRESH_S = 0.25
"""How often the elapsed time is redrawn, and how soon another display taking the terminal is noticed."""

# What a display writes and a line of text never holds: a carriage return that does not end a
# line (tqdm's redraw), or a terminal control sequence other than colour (CSI ... m).
_CURSOR_CONTROL = re.compile(r"\r(?!\n)|\x1b\[[0-9;?]*[@-ln-~]")


def eta_text(seconds: float) -> str:
    """``75`` -> ``"1m 15s"``: two units at most, as a person reads a remaining time."""
    s = round(max(0.0, seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m {s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h {s % 3600 // 60:02d}m"
    return f"{s // 86400}d {s % 86400 // 3600:02d}h"


def terminal_columns(stream: IO[str]) -> int:
    """The width to draw at: ``COLUMNS`` when set (as Python's ``shutil`` reads it), else the
    terminal ``stream`` is on (asked at every redraw, so a resized window is followed), else 80.

    Example::

        terminal_columns(sys.stderr)   # 120 in a 120-column terminal
    """
    columns = os.environ.get("COLUMNS", "")
    if columns.isdigit() and int(columns) > 0:
        return int(columns)
    try:
        return os.get_terminal_size(stream.fileno()).columns or 80
    except (AttributeError, ValueError, OSError):
        return 80


def can_draw(stream: IO[str]) -> bool:
    """Whether ``stream`` is a terminal that can hold a live display (not ``TERM=dumb``)."""
    try:
        tty = stream.isatty()
    except (AttributeError, ValueError, OSError):
        return False
    return tty and os.environ.get("TERM", "").lower() not in ("dumb", "unknown")


def _rich_console_with_live() -> Any:
    """Rich's global console (what Lightning draws on) while a live display is up on it, else None.
    Read, never created: ``rich.get_console()`` would make one."""
    rich = sys.modules.get("rich")
    console = getattr(rich, "_console", None) if rich is not None else None
    # _live_stack: rich >= 14.1 (nested live displays); _live: before.
    if console is not None and (getattr(console, "_live_stack", None) or getattr(console, "_live", None)):
        return console
    return None


def other_live_display() -> str | None:
    """What else draws a live display in this process, or None: rich's (on its global console,
    or redirecting a standard stream) or an open tqdm bar. Only modules already imported are
    looked at.

    Example::

        other_live_display()   # "tqdm progress bar" while a Trainer's bar is open
    """
    if _rich_console_with_live() is not None:
        return "rich live display"
    for stream in (sys.stdout, sys.stderr):
        if type(stream).__name__ == "FileProxy" and type(stream).__module__.startswith("rich"):
            return "rich live display"
    tqdm = sys.modules.get("tqdm.std")
    if tqdm is not None:
        try:
            bars = list(getattr(tqdm.tqdm, "_instances", ()))
        except RuntimeError:  # the set changed while read (a bar opened or closed in another thread)
            return "tqdm progress bar"
        if any(not getattr(bar, "disable", False) for bar in bars):
            return "tqdm progress bar"
    return None


def print_beside(line: str, stream: IO[str]) -> None:
    """Print ``line`` to the terminal without cutting through another live display: above rich's
    (through its console) or tqdm's (``tqdm.write``), else on ``stream``.

    Example::

        print_beside("[slipstream] step 30 | loss 2.3012", sys.stderr)
    """
    console = _rich_console_with_live()
    if console is not None:
        console.print(line, markup=False, highlight=False, emoji=False)
        return
    tqdm = sys.modules.get("tqdm.std")
    if tqdm is not None and other_live_display() == "tqdm progress bar":
        tqdm.tqdm.write(line, file=stream)
        return
    stream.write(line + "\n")
    stream.flush()


class _AboveTheDisplay:
    """Stands in for ``sys.stdout``/``sys.stderr`` while the display is up: whole lines are printed
    above it; a write that moves the cursor is another display drawing, so ours steps aside and
    the write goes through unchanged, as does everything once ours is gone, or in a forked child
    (a data loader worker) that has a copy of the display but is not drawing it."""

    def __init__(self, display: TerminalDisplay, stream: IO[str]) -> None:
        self._display = display
        self.stream = stream
        self._pid = os.getpid()
        self._partial: list[str] = []

    def write(self, text: str) -> int:
        display = self._display
        if os.getpid() != self._pid or not display.active:
            return self._through(text)
        if _CURSOR_CONTROL.search(text):
            display.step_aside("another display writes to the terminal")
            return self._through(text)
        head, newline, tail = text.rpartition("\n")
        if not newline:
            self._partial.append(text)
            return len(text)
        lines, self._partial = "".join(self._partial) + head, [tail] if tail else []
        if not display.print_lines(lines):  # it stepped aside meanwhile: the lines go through
            self.stream.write(lines + "\n")
        return len(text)

    def flush(self) -> None:
        if self._partial and os.getpid() == self._pid:
            text, self._partial = "".join(self._partial), []
            if self._display.print_lines(text):  # a prompt without its newline: its own line above
                return
            self.stream.write(text)
        self.stream.flush()

    def _through(self, text: str) -> int:
        self._release()
        return self.stream.write(text)

    def _release(self) -> None:
        if self._partial:
            text, self._partial = "".join(self._partial), []
            self.stream.write(text)

    def isatty(self) -> bool:
        return self.stream.isatty()

    def fileno(self) -> int:
        return self.stream.fileno()

    def __getattr__(self, name: str) -> Any:  # encoding, errors, buffer, ...
        return getattr(self.stream, name)


class TerminalDisplay:
    """The live two-line display (module docstring). :meth:`update` returns False once the display
    has stepped aside (or failed), and the caller then prints a plain line (:func:`print_beside`).

    stream: the terminal to draw on (default: the real ``sys.stderr``).
    refresh_s: how often the elapsed time is redrawn and other displays are looked for.
    """

    def __init__(self, total_steps: int | None, stream: IO[str] | None = None, refresh_s: float = REFRESH_S) -> None:
        self.total_steps = total_steps  # drawn from the first update() on (see there)
        stream = stream if stream is not None else sys.stderr
        while isinstance(stream, _AboveTheDisplay):  # an earlier display's, passing writes through
            stream = stream.stream
        self.stream: IO[str] = getattr(stream, "rich_proxied_file", stream)
        self.stepped_aside: str | None = None  # why ours gave the terminal up, once it did
        self._lock = threading.RLock()
        self._live: Any = None
        self._proxies: dict[str, _AboveTheDisplay] = {}
        self._step = 0
        self._status: list[str] = []
        self._eta_s: float | None = None
        self._started_s = time.monotonic()
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None
        self._refresh_s = refresh_s
        self._started = False

    @property
    def active(self) -> bool:
        return self._live is not None

    def _start(self) -> None:
        from rich.console import Console
        from rich.live import Live

        class _Console(Console):
            def show_cursor(self, show: bool = True) -> bool:
                # Never hidden: a run killed while drawing (SIGKILL, OOM) must not leave the
                # user's shell without a cursor; the cost is a cursor at the bar's end.
                return True

        console = _Console(file=self.stream, highlight=False)
        # Rich's own stream redirection stays off: _AboveTheDisplay does it (module docstring).
        self._live = Live(console=console, get_renderable=self._render, auto_refresh=False,
                          redirect_stdout=False, redirect_stderr=False, transient=False)
        self._live.start()
        for name in ("stdout", "stderr"):
            current = getattr(sys, name)
            if current is not None and current.isatty():
                proxy = _AboveTheDisplay(self, current)
                self._proxies[name] = proxy
                setattr(sys, name, proxy)
        self._ticker = threading.Thread(target=self._tick, args=(self._refresh_s,), name="slipstream-progress", daemon=True)
        self._ticker.start()
        atexit.register(self.close)  # a script that raised never reaches the sink's close

    # --- what is drawn --------------------------------------------------------------------
    def _render(self) -> Any:
        from rich.console import Group
        from rich.progress_bar import ProgressBar
        from rich.table import Column, Table
        from rich.text import Text

        count = f"{self._step}/{self.total_steps}" if self.total_steps else f"step {self._step}"
        times = eta_text(time.monotonic() - self._started_s)
        if self._eta_s is not None:
            times += f"  ETA {eta_text(self._eta_s)}"
        bar = Table.grid(Column(no_wrap=True), Column(ratio=1, no_wrap=True), Column(no_wrap=True),
                         Column(no_wrap=True), padding=(0, 1), expand=True)
        bar.add_row(Text("train", style="bold"),
                    ProgressBar(total=self.total_steps, completed=self._step, width=None),
                    Text(count), Text(times, style="yellow"))
        return Group(bar, _StatusLine(self._status))

    # --- driven by the sink ---------------------------------------------------------------
    def update(self, step: int, status: list[str], eta_s: float | None) -> bool:
        """Show log step ``step``: its fields ``status`` and the time left; False when not shown.

        The first call starts the display: by then a framework's own display (Lightning's bar,
        a Trainer's tqdm bar, opened when training starts) is up, and ours never shows."""
        with self._lock:
            if not self._started:
                self._started = True
                self.stepped_aside = other_live_display()
                if self.stepped_aside is None:
                    try:
                        self._start()
                    except Exception as exc:  # noqa: BLE001 - a display must never stop a run
                        self._abandon(f"the display failed to start: {exc!r}")
            if not self.active:
                return False
            other = other_live_display()
            if other is not None:
                self.step_aside(other)
                return False
            self._step, self._status, self._eta_s = step, list(status), eta_s
            return self._refresh()

    def print_lines(self, text: str) -> bool:
        """Print ``text`` (lines) above the display; False when not shown (stepped aside)."""
        from rich.ansi import AnsiDecoder
        from rich.text import Text

        with self._lock:
            if not self.active:
                return False
            try:
                self._live.console.width = terminal_columns(self.stream)
                lines = text.split("\n")
                self._live.console.print(Text("\n").join(AnsiDecoder().decode_line(line) for line in lines))
            except Exception as exc:  # noqa: BLE001
                self._abandon(f"the display failed to print: {exc!r}")
                return False
            return True

    def _refresh(self) -> bool:
        try:
            # The width of the terminal drawn on, not of the first standard stream that is one
            # (rich's own rule, stdin first).
            self._live.console.width = terminal_columns(self.stream)
            self._live.refresh()
        except Exception as exc:  # noqa: BLE001
            self._abandon(f"the display failed to draw: {exc!r}")
            return False
        return True

    def _tick(self, refresh_s: float) -> None:
        while not self._stop.wait(refresh_s):
            with self._lock:
                if not self.active:
                    return
                other = other_live_display()
                if other is not None:
                    self.step_aside(other)
                    return
                self._refresh()

    # --- giving the terminal up -------------------------------------------------------------
    def step_aside(self, why: str) -> None:
        """Another display took the terminal: erase ours and put the streams back, for good."""
        with self._lock:
            if not self.active:
                return
            self.stepped_aside = why
            self._live.transient = True  # erased, so the other display draws where ours was
            self._finish()
            log.debug("progress display stepped aside: %s", why)

    def close(self) -> None:
        """Leave the last state drawn (the run's final line) and give the terminal back."""
        with self._lock:
            if self.active:
                self._finish()
        atexit.unregister(self.close)
        self._stop.set()
        if self._ticker is not None and self._ticker is not threading.current_thread():
            self._ticker.join(timeout=5)

    def _finish(self) -> None:
        live, self._live = self._live, None
        self._stop.set()
        try:
            self._restore_streams()
            live.stop()
        except Exception as exc:  # noqa: BLE001
            log.debug("the progress display did not stop cleanly: %r", exc)

    def _restore_streams(self) -> None:
        for name, proxy in self._proxies.items():
            proxy._release()
            if getattr(sys, name) is proxy:  # else another display wrapped it: ours passes writes through
                setattr(sys, name, proxy.stream)
        self._proxies = {}

    def _abandon(self, why: str) -> None:
        self.stepped_aside = why
        if self._live is not None:
            self._finish()
        else:
            self._restore_streams()
        log.debug("progress display off: %s", why)


class _StatusLine:
    """The log step's fields, as many whole ones as fit the width (a cut field reads wrong)."""

    def __init__(self, parts: list[str]) -> None:
        self.parts = parts

    def __rich_console__(self, console: Any, options: Any) -> Any:
        from rich.text import Text

        line = ""
        for part in self.parts:
            candidate = f"{line} | {part}" if line else part
            if len(candidate) > options.max_width:
                break
            line = candidate
        yield Text(line or (self.parts[0] if self.parts else ""), no_wrap=True, overflow="ellipsis")


__all__ = ["REFRESH_S", "TerminalDisplay", "can_draw", "eta_text", "other_live_display", "print_beside", "terminal_columns"]
