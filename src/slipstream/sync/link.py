"""The link model, under its former name: it lives in :mod:`slipstream.link`.

Moved out of ``sync`` so that the planner can use it without importing this
package (which needs torch). This module only re-exports it, for code that still
imports ``slipstream.sync.link``; new code imports :mod:`slipstream.link`.
"""

from ..link import Link, all_gather_bytes, allreduce_bytes, allreduce_steps, reduce_scatter_bytes

__all__ = ["Link", "all_gather_bytes", "allreduce_bytes", "allreduce_steps", "reduce_scatter_bytes"]
