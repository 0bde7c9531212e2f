"""The elastic agent's stop signals, raised where they cannot break its bookkeeping.

torch's agent (``torch.distributed.elastic.multiprocessing.api``) turns SIGTERM,
SIGINT, SIGHUP and SIGQUIT into a ``SignalException`` raised by a plain signal
handler, wherever the agent's main thread is at that moment. When that moment
falls inside ``subprocess.Popen.poll`` (the agent polls every worker every
monitor interval), the exception can leave the Popen's wait lock held, after
which the agent never sees that worker exit: it waits out its shutdown timeout,
SIGKILLs a worker that already finished, and waits again (see
:mod:`slipstream.process.safe_signals`, which has the reproduction).

:func:`install` swaps torch's handler function for one that raises the same
exception, with the same message, but only outside standard-library code. torch
registers the handler by the module-level name each time it starts workers
(``PContext.start``), so replacing that name covers restarts too. On a torch
without that name, nothing changes and torch's own handler stays.
"""

from __future__ import annotations

import os
import signal

from ..process import safe_signals


def install() -> bool:
    """Make torch's agent raise its ``SignalException`` only at safe points (idempotent);
    False when this torch has no handler of that name (its own handler is then used)."""
    from torch.distributed.elastic.multiprocessing import api as mp_api

    current = getattr(mp_api, "_terminate_process_handler", None)
    if current is None:
        return False
    if safe_signals.is_safe_handler(current):
        return True

    def signal_exception(signum: int) -> BaseException:
        sigval = signal.Signals(signum)
        return mp_api.SignalException(f"Process {os.getpid()} got signal: {sigval}", sigval=sigval)

    mp_api._terminate_process_handler = safe_signals.handler(signal_exception)
    return True
