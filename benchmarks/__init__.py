"""miniTE benchmarks: ops/ (one script per op), e2e/ (one per engine), tools/ (SASS, Nsight Compute,
profiles, probes, tile sweeps); results/ holds the current numbers. Run from the repository root:
`python -m benchmarks.ops.bench_gemm --out OUT.json`."""
