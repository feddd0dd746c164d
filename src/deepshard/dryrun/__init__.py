"""Dry runs: one rank of an N-rank job in one process over torch's fake process group
(``deepshard dryrun``), and the planner built on them (``deepshard plan``)."""
from deepshard.dryrun.report import DryRunReport, format_report
from deepshard.dryrun.runner import run_callable, run_script

__all__ = ["DryRunReport", "format_report", "run_callable", "run_script"]
