"""Measurement scripts (headlines in BENCHMARKS.md, details under benchmarks/results/); run from the repository root,
e.g. ``python -m benchmarks.run --quick`` or ``python -m benchmarks.gpu_acceptance``.

A regular package, not a namespace one, so ``python -m benchmarks.X`` and
``slipstream run -m benchmarks.X`` resolve to this folder only.
"""
