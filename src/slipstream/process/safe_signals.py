"""Signal handlers that raise, but never where the exception would leave a lock held.

Python runs a signal handler in the main thread between two bytecodes, wherever
that thread happens to be. A handler that raises (torch's elastic agent raises
``SignalException`` on SIGTERM, SIGINT, SIGHUP and SIGQUIT) can therefore land
in ``subprocess.Popen.poll`` after its ``self._waitpid_lock.acquire(False)`` and
before the ``try`` whose ``finally`` releases the lock. The lock stays held for
good: every later ``poll()`` of that child answers "still running" and every
``wait(timeout)`` times out, even after the child exited. That is what failed
a CI run here: the agent got SIGTERM while polling its workers, waited its 30 s
shutdown timeout for a worker that had exited at once (with its emergency
checkpoint written), sent it SIGKILL, and waited 30 s more for it. The same gap
(an ``acquire`` before its ``try``) is in ``logging``'s handlers, in
``threading`` and in the import system: CPython's issue bpo-34486 and its kin.
``tests/launch/test_safe_signals.py`` reproduces the Popen case: torch's handler
orphans the lock in a fraction of tries, this one in none.

The handler made here raises only when the interrupted Python frame belongs to
no standard-library module (torch's agent loop, Slipstream, the user's code);
when it interrupts standard-library code it returns and has itself run again
:data:`REDELIVER_S` later (see :class:`_Redeliverer`), until the main thread is
out of it. After :data:`MAX_DEFER_S` of deferring it raises wherever it is, as
the plain handler would: a main thread blocked for long inside the standard
library is not kept from stopping. What the redelivery needs is set up by
:func:`handler`, never inside a signal handler, where starting a thread could
wait on a lock the interrupted code holds.

No library does this: torch installs its own raising handler, and CPython's
advice for the bug class is "do not raise from a signal handler", which the
elastic agent's design (an exception that unwinds its monitor loop) rules out.

Example::

    signal.signal(signal.SIGTERM, handler(lambda signum: SystemExit(128 + signum)))
"""

from __future__ import annotations

import os
import signal
import sysconfig
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType

REDELIVER_S = 0.005
"""How soon a deferred signal is delivered again."""
MAX_DEFER_S = 2.0
"""The longest a signal is deferred; then it raises wherever the main thread is."""


def _stdlib_dirs() -> tuple[tuple[str, ...], tuple[str, ...]]:
    paths = sysconfig.get_paths()
    stdlib = tuple({os.path.realpath(paths[k]) + os.sep for k in ("stdlib", "platstdlib") if k in paths})
    installed = tuple({os.path.realpath(paths[k]) + os.sep for k in ("purelib", "platlib") if k in paths})
    return stdlib, installed


_STDLIB, _INSTALLED = _stdlib_dirs()


def in_standard_library(frame: FrameType | None) -> bool:
    """True when ``frame`` runs standard-library code (frozen modules included), where an
    exception raised between two bytecodes can leave a lock held; False for code installed
    in site-packages, for the user's code, and for no frame at all."""
    if frame is None:
        return False
    filename = frame.f_code.co_filename
    known = _CLASSIFIED.get(filename)
    if known is None:  # once per file: realpath costs a syscall per path component
        if filename.startswith("<frozen "):
            known = True
        else:
            path = os.path.realpath(filename) if os.path.isabs(filename) else filename
            known = path.startswith(_STDLIB) and not path.startswith(_INSTALLED)
        _CLASSIFIED[filename] = known
    return known


_CLASSIFIED: dict[str, bool] = {}


class _Redeliverer:
    """Delivers a deferred signal again, a little later.

    By the kernel where it can: a one-shot ``ITIMER_REAL`` whose SIGALRM this module
    handles (taken only while SIGALRM has no handler of someone else's). Its arrival
    is independent of what the main thread does, so it lands in the agent's own code
    as often as that code runs. The fallback is a daemon thread that sleeps and
    signals again; a Python thread runs only when the main thread gives up the GIL,
    which it does mostly inside standard-library calls, so that fallback lands in
    them more often and relies on :data:`MAX_DEFER_S` more.
    """

    def __init__(self) -> None:
        self._wake = threading.Event()
        self.pending: tuple[int, Callable[[int, FrameType | None], None]] | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._uses_timer = False

    def start(self) -> None:
        """Outside any signal handler: take SIGALRM, or start the thread."""
        with self._lock:
            if self._uses_timer or (self._thread is not None and self._thread.is_alive()):
                return
            try:
                if threading.current_thread() is threading.main_thread() and \
                        signal.getsignal(signal.SIGALRM) in (signal.SIG_DFL, None):
                    signal.signal(signal.SIGALRM, self._on_alarm)
                    self._uses_timer = True
                    return
            except (AttributeError, ValueError, OSError):  # no SIGALRM (Windows)
                pass
            self._thread = threading.Thread(target=self._loop, name="slipstream-signal-redeliver", daemon=True)
            self._thread.start()

    def request(self, signum: int, on_signal: Callable[[int, FrameType | None], None]) -> None:
        """From inside a signal handler: plain assignments, a timer, an Event of our own."""
        self.pending = (signum, on_signal)
        if self._uses_timer:
            signal.setitimer(signal.ITIMER_REAL, REDELIVER_S)
        else:
            self._wake.set()

    def _on_alarm(self, signum: int, frame: FrameType | None) -> None:
        pending, self.pending = self.pending, None
        if pending is not None:
            pending[1](pending[0], frame)

    def _loop(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            time.sleep(REDELIVER_S)
            pending = self.pending
            if pending is not None:
                try:
                    os.kill(os.getpid(), pending[0])
                except OSError:  # pragma: no cover - signalling ourselves does not fail
                    pass


_REDELIVERER = _Redeliverer()


def handler(make_exception: Callable[[int], BaseException], *,
            max_defer_s: float = MAX_DEFER_S) -> Callable[[int, FrameType | None], None]:
    """A signal handler that raises ``make_exception(signum)`` in the main thread, outside
    standard-library code (see the module docstring). Call it where the handler is
    installed (the main thread): it prepares the redelivery there."""
    _REDELIVERER.start()
    deferred_since: list[float | None] = [None]

    def on_signal(signum: int, frame: FrameType | None) -> None:
        now = time.monotonic()
        first = deferred_since[0]
        if in_standard_library(frame) and (first is None or now - first < max_defer_s):
            if first is None:
                deferred_since[0] = now
            _REDELIVERER.request(signum, on_signal)
            return
        deferred_since[0] = None
        _REDELIVERER.pending = None
        raise make_exception(signum)

    on_signal.slipstream_safe = True  # type: ignore[attr-defined]
    return on_signal


def is_safe_handler(candidate: object) -> bool:
    """Whether ``candidate`` was made by :func:`handler`."""
    return bool(getattr(candidate, "slipstream_safe", False))


@contextmanager
def installed(signum: int, make_exception: Callable[[int], BaseException]) -> Iterator[None]:
    """Within the block, ``signum`` raises ``make_exception(signum)`` through :func:`handler`;
    the previous handler is back after it. Outside the main thread (where Python allows no
    handler) the block runs with the handlers as they are.

    Example::

        with installed(signal.SIGINT, lambda signum: KeyboardInterrupt()):
            wait_for(children)     # Ctrl-C cannot land inside their Popen.poll
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signum, handler(make_exception))
    try:
        yield
    finally:
        signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
