"""The autotuner: ``deepshard --autotuning tune|run ...`` (see docs/tools.md#autotuner)."""
