"""The step programs of the GPU acceptance run (benchmarks/gpu_acceptance.py).

Each runs as its own subprocess and writes a result JSON: probe (environment),
resume (an example checkpointed and resumed, bitwise), perf (bf16 vs fp32,
profiler on vs off, peak memory), ranks (multi-rank configurations, per-rank
model digests). See docs/gpu.md.
"""
