"""Monitoring and tuning tools (``deepspeed.profiling`` and friends).

* ``flops_profiler``: :class:`FlopsProfiler` and :func:`get_model_profile` (DeepSpeed's names), forward and
  backward FLOPs measured per module (``flop_count``), the report (``profile_report``);
* ``memory_estimator``: the whole-run memory estimate per process; ``ds_estimators``: DeepSpeed's
  ``estimate_zero2/3_model_states_mem_needs_*``; ``memory_tracker``: measured live tensor bytes and peak;
  ``estimate_cli``: the ``deepshard_estimate_memory`` command;
* ``timers`` and ``engine_tools``: ``wall_clock_breakdown`` timers, throughput and the ``flops_profiler``
  config section, as the engine drives them.

The environment report is ``deepshard.utils.env_report`` (``ds_report_deepshard``).
"""
