"""A small terminal emulator for the display tests: what a person would see on the screen.

Feeds the bytes a program wrote to a pseudo-terminal through the few controls rich and tqdm
use (carriage return, line feed, cursor up/down/column, erase in line/display, colours and
modes ignored), with the deferred line wrap of a real terminal at ``columns``: a line longer
than the terminal wraps onto the next, which is how a display "splits across lines".

Example::

    screen = Screen(columns=80)
    screen.feed(os.read(master_fd, 65536).decode())
    screen.lines()    # the text rows, trailing blanks cut
"""

from __future__ import annotations

import fcntl
import os
import re
import struct
import termios
import unicodedata

_CONTROL = re.compile(r"\x1b\[([0-9;?]*)([@-~])|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)|\x1b[()][0-9A-Za-z]|\x1b[=>78]")


def _cells(ch: str) -> int:
    return 2 if unicodedata.east_asian_width(ch) in ("W", "F") else 1


class Screen:
    def __init__(self, columns: int) -> None:
        self.columns = columns
        self.rows: list[list[str]] = [[]]
        self.row = self.col = 0
        self._wrap_pending = False

    def _line(self) -> list[str]:
        while len(self.rows) <= self.row:
            self.rows.append([])
        line = self.rows[self.row]
        while len(line) < self.col:
            line.append(" ")
        return line

    def _put(self, ch: str) -> None:
        width = _cells(ch)
        if self._wrap_pending or self.col + width > self.columns:
            self.row, self.col, self._wrap_pending = self.row + 1, 0, False
        line = self._line()
        cells = [ch] + [""] * (width - 1)
        line[self.col:self.col + width] = cells
        self.col += width
        if self.col >= self.columns:
            self.col, self._wrap_pending = self.columns - 1, True

    def _csi(self, params: str, final: str) -> None:
        if params.startswith("?") or final == "m":
            return  # modes (cursor shown/hidden) and colours: nothing to see
        n = int(params.split(";")[0]) if params.split(";")[0].isdigit() else None
        self._wrap_pending = False
        if final == "A":
            self.row = max(0, self.row - (n or 1))
        elif final == "B":
            self.row += n or 1
        elif final == "C":
            self.col = min(self.columns - 1, self.col + (n or 1))
        elif final == "D":
            self.col = max(0, self.col - (n or 1))
        elif final == "G":
            self.col = (n or 1) - 1
        elif final == "K":
            line = self._line()
            if (n or 0) == 0:
                del line[self.col:]
            elif n == 1:
                line[:self.col + 1] = [" "] * (self.col + 1)
            else:
                line.clear()
        elif final == "J":
            self._line()
            del self.rows[self.row + 1:]
            del self.rows[self.row][self.col:]

    def feed(self, text: str) -> None:
        pos = 0
        while pos < len(text):
            m = _CONTROL.match(text, pos)
            if m:
                if m.group(2):
                    self._csi(m.group(1), m.group(2))
                pos = m.end()
                continue
            ch = text[pos]
            pos += 1
            if ch == "\r":
                self.col, self._wrap_pending = 0, False
            elif ch == "\n":
                self.row, self._wrap_pending = self.row + 1, False
            elif ch == "\b":
                self.col, self._wrap_pending = max(0, self.col - 1), False
            elif ch == "\x1b" or unicodedata.category(ch) == "Cc":
                continue
            else:
                self._put(ch)

    def lines(self) -> list[str]:
        out = ["".join(row).rstrip() for row in self.rows]
        while out and not out[-1]:
            out.pop()
        return out


def open_terminal(columns: int, rows: int = 50) -> tuple[int, int]:
    """A pseudo-terminal of ``columns`` x ``rows``: (master fd, slave fd)."""
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))
    return master, slave


class TerminalReader:
    """Drains a pseudo-terminal's master end on a thread (a full pty buffer would block the writer)."""

    def __init__(self, master: int) -> None:
        import threading

        self.master = master
        self._chunks: list[bytes] = []
        self._thread = threading.Thread(target=self._drain, daemon=True)
        self._thread.start()

    def _drain(self) -> None:
        while True:
            try:
                data = os.read(self.master, 65536)
            except OSError:  # EIO: every slave end is closed
                return
            if not data:
                return
            self._chunks.append(data)

    def text(self, timeout_s: float = 10.0) -> str:
        """All that was written, once every slave end is closed (the writer is done)."""
        self._thread.join(timeout_s)
        return b"".join(self._chunks).decode("utf-8", errors="replace")


def run_in_terminal(argv: list[str], columns: int, env: dict[str, str], timeout_s: float, cwd: str | None = None):
    """Run ``argv`` with stdin, stdout and stderr on a new pseudo-terminal of ``columns`` columns
    (``COLUMNS`` set to match, as a shell exports it); returns (exit code, everything it wrote)."""
    import subprocess

    master, slave = open_terminal(columns)
    reader = TerminalReader(master)
    env = {**env, "COLUMNS": str(columns), "TERM": "xterm-256color"}
    proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, env=env, cwd=cwd, start_new_session=True)
    os.close(slave)
    try:
        rc = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        from slipstream.launch.proc import kill_tree

        kill_tree(proc.pid)
        proc.wait()
        raise
    text = reader.text()
    os.close(master)
    return rc, text
