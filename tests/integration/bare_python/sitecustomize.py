"""A bare GPU machine, imitated: only the standard library, torch, numpy, pyyaml and rich
(with what they themselves require), and Slipstream from the source tree, not installed.

Put this folder first on PYTHONPATH with SLIPSTREAM_BARE_ALLOWED (comma-separated
top-level module names beyond the standard library) and SLIPSTREAM_BARE_SRC (the
source tree's src/) set; every Python process that inherits them, the acceptance
kit's subprocesses and `slipstream run`'s workers included, then:

* drops every sys.path entry that holds another ``slipstream`` package (an editable
  or regular install), so ``import slipstream`` finds SLIPSTREAM_BARE_SRC or nothing;
* refuses to import any other top-level module (ModuleNotFoundError, as if absent),
  and appends its name to SLIPSTREAM_BARE_AUDIT, so an optional import guarded by
  ``except ImportError`` still works and an unguarded one fails the run.

Used by tests/integration/test_gpu_acceptance.py.
"""

import os
import sys

_ALLOWED = {n for n in os.environ.get("SLIPSTREAM_BARE_ALLOWED", "").split(",") if n}
_SRC = os.environ.get("SLIPSTREAM_BARE_SRC")
_AUDIT = os.environ.get("SLIPSTREAM_BARE_AUDIT")

if _ALLOWED and _SRC:
    _src = os.path.realpath(_SRC)
    sys.path[:] = [p for p in sys.path
                   if not (os.path.isfile(os.path.join(p or ".", "slipstream", "__init__.py"))
                           and os.path.realpath(p or ".") != _src)]

    class _BareMachine:
        """A meta path finder that answers only for modules the bare machine lacks."""

        @staticmethod
        def find_spec(name, path=None, target=None):
            top = name.partition(".")[0]
            if top in _ALLOWED or top in sys.stdlib_module_names or top.startswith("_"):
                return None
            if _AUDIT:
                with open(_AUDIT, "a") as fh:
                    fh.write(f"{top} {os.getpid()} {' '.join(sys.argv)[:200]}\n")
            raise ModuleNotFoundError(f"No module named {top!r} (not on the bare GPU machine)", name=top)

    sys.meta_path.insert(0, _BareMachine)

    import importlib.util

    _find_spec = importlib.util.find_spec

    def find_spec(name, package=None):
        """importlib.util.find_spec: None for a module the bare machine lacks (how torch probes
        for optional packages), as if it were absent."""
        top = importlib.util.resolve_name(name, package).partition(".")[0] if name.startswith(".") else name.partition(".")[0]
        if top not in _ALLOWED and top not in sys.stdlib_module_names and not top.startswith("_"):
            return None
        return _find_spec(name, package)

    importlib.util.find_spec = find_spec
