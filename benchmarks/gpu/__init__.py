"""GPU benchmarks and the CUDA test run: see benchmarks/gpu_check.sh and docs/benchmarks.md (GPU)."""
