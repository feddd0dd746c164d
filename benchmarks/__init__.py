"""Benchmarks: one workload under deepshard and under the engines a user would pick instead.

``python benchmarks/bench.py`` (or ``make bench``) runs every engine (torch DDP, torch FSDP2, DeepSpeed
stages 0-3 when installed, deepshard stages 0-3) on the same workload, one engine at a time in fresh
processes, and prints step time, memory and bytes communicated next to the ZeRO formulas. See
docs/benchmarks.md.

Modules: ``workloads`` (models and data), ``engines`` (one runner per engine), ``measure`` (peak RSS,
collective byte counting, live tensor bytes), ``formulas`` (ZeRO memory and volume formulas, targets),
``worker`` (one rank), ``spawn`` (one case in N processes), ``report`` (table, JSON, chart, markdown),
``bench`` (the command line).
"""
