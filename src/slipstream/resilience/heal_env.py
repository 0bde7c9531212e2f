"""The environment of healing in place (``slipstream run --heal``): torch-free, for the supervisor.

The supervisor (:mod:`slipstream.launch.supervisor`) must start in milliseconds and never
import torch; the training side (:mod:`slipstream.resilience.heal`) reads the same names.
"""

HEAL = "SLIPSTREAM_HEAL"
""""1": each rank runs under a supervisor that replaces its training process in place."""
STORE = "SLIPSTREAM_HEAL_STORE"
"""HOST:PORT of the store the ranks agree on generations through, hosted by the launcher that hosts
the rendezvous (one node: a free port; more: the rendezvous port + 1 on its host)."""
SPARES = "SLIPSTREAM_HEAL_SPARES"
"""Warm spares each supervisor keeps (0 or 1): a process with torch imported, waiting."""
CHILD = "SLIPSTREAM_HEAL_CHILD"
""""1" in the training process (and its spare): it runs the script rather than supervising."""
REPLACEMENT = "SLIPSTREAM_HEAL_REPLACEMENT"
""""1": this process replaces a rank whose training process died."""
ARMED_FILE = "SLIPSTREAM_HEAL_ARMED_FILE"
"""A path the training process writes once it can heal; its supervisor replaces it only then."""
PID_DIR = "SLIPSTREAM_HEAL_PID_DIR"
"""A directory where each supervisor writes ``rank<R>.pid``: its training process (for tools and benchmarks)."""
JOIN_TIMEOUT = "SLIPSTREAM_HEAL_JOIN_TIMEOUT_S"
"""How long a rank waits for the next generation's group to form before it gives up (default 120 s)."""
