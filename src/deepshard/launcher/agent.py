"""One node's ranks under torch's elastic agent (the engine ``torchrun`` runs on)."""
from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence

from torch.distributed.elastic.agent.server.api import RunResult, WorkerSpec, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.api import SignalException, _terminate_process_handler

from deepshard.launcher import rank_errors
from deepshard.launcher.coordination import ChannelLost, JobFailure
from deepshard.launcher.local import LOCAL_RANK_MACRO, AgentJob
from deepshard.launcher.rank_streams import RankStream, RankStreams
from deepshard.launcher.rendezvous import NodeRendezvous
from deepshard.launcher.output import FALLOUT_HOLD_S, Output, exit_status, fold_noise, signal_handlers
from deepshard.utils.logging import logger

MONITOR_INTERVAL_S = 0.1
GRACE_S = 5
HANDLED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)

RANK_SHIM = (
    "import ctypes, json, os, signal, sys\n"
    "ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with the agent\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    os._exit(1)  # the agent died before the guard was set\n"
    "setup, env = json.loads(sys.argv[2]), os.environ\n"
    "cores = setup['cores'][int(env['LOCAL_RANK'])] if setup['cores'] else None\n"
    "if cores:\n"
    "    os.sched_setaffinity(0, cores)\n"
    "env.update(setup['env'])\n"
    "if cores and 'OMP_NUM_THREADS' not in setup['user_env']:\n"
    "    env['OMP_NUM_THREADS'] = str(len(cores))\n"
    "env['DEEPSHARD_RESTART_COUNT'] = env.get('TORCHELASTIC_RESTART_COUNT', '0')\n"
    "env['CROSS_RANK'], env['CROSS_SIZE'] = env.get('GROUP_RANK', '0'), env.get('GROUP_WORLD_SIZE', '1')\n"
    "os.execvp(sys.argv[3], sys.argv[3:])")


def entry(job: AgentJob, agent_pid: int, python: str = sys.executable) -> tuple[str, list[str]]:
    """torch's entrypoint and arguments for one rank: the shim (see :data:`RANK_SHIM`), then the command."""
    setup = {"cores": [list(c) for c in job.cores] if job.cores else None, "env": job.rank_env,
             "user_env": sorted(job.user_env & {"OMP_NUM_THREADS"})}
    return python, ["-c", RANK_SHIM, str(agent_pid), json.dumps(setup), *job.argv]


class NodeAgent(LocalElasticAgent):
    """torch's ``LocalElasticAgent`` with deepshard's output, report and job-wide failure hooks."""

    def __init__(self, spec: WorkerSpec, job: AgentJob, streams: RankStreams, rdzv: NodeRendezvous,
                 on_started: Callable[[list[int]], None] | None = None) -> None:
        super().__init__(spec, streams, shutdown_timeout=GRACE_S, exit_barrier_timeout=rdzv.join_timeout_s)
        self.job, self.streams, self.rdzv, self.on_started = job, streams, rdzv, on_started
        self.first: RankStream | None = None
        self.job_failure: JobFailure | None = None
        self.stopped_others = 0
        self._announced = self._stopping = False
        self._generation = 0
        self._lock = threading.Lock()

    # ------------------------------------------------------------------------------ torch's hooks

    def _start_workers(self, worker_group):  # type: ignore[no-untyped-def]
        with self._lock:
            self.first, self.job_failure, self._announced, self._stopping = None, None, False, False
            self._generation += 1
        self.streams.out.release()
        pids = super()._start_workers(worker_group)
        for local_rank, pid in pids.items():
            threading.Thread(target=self._watch_exit, args=(local_rank, pid, self._generation), name=f"deepshard-wait-{local_rank}",
                             daemon=True).start()
        if self.on_started is not None:
            self.on_started(sorted(pids.values()))
        logger.info("started %d ranks: %s", len(pids), ", ".join(
            f"rank {w.global_rank} pid {pids[w.local_rank]}" for w in worker_group.workers))
        if self.job.log_dir is not None:
            logger.info("per-rank logs: %s", ", ".join(str(s.log_path) for s in self.streams.streams.values()))
        return pids

    def _stop_workers(self, worker_group, *args, **kwargs):  # type: ignore[no-untyped-def]
        super()._stop_workers(worker_group, *args, **kwargs)
        self._end_attempt()

    def _shutdown(self, death_sig: signal.Signals = signal.SIGTERM, timeout: int = 30) -> None:
        super()._shutdown(death_sig, timeout)
        self._end_attempt()

    def _monitor_workers(self, worker_group):  # type: ignore[no-untyped-def]
        if self._pcontext is None:
            return super()._monitor_workers(worker_group)
        running = self._note_exits()
        if self.first is not None and running:
            self.stopped_others = len(running)
            self._pcontext.close(timeout=GRACE_S)  # every other rank: SIGTERM, SIGKILL after the grace
        result = super()._monitor_workers(worker_group)
        if result.state == WorkerState.HEALTHY:
            self.streams.out.flush_stale(list(self.streams.streams.values()), FALLOUT_HOLD_S)
        if result.state == WorkerState.FAILED:
            self._note_exits()
            return self._failed(result)
        if result.state == WorkerState.HEALTHY and self.rdzv.multi_node:
            return self._check_job(result)
        if result.state == WorkerState.SUCCEEDED and self.rdzv.multi_node:
            return self._await_others(result)
        return result

    def _restart_workers(self, worker_group):  # type: ignore[no-untyped-def]
        self._stop_workers(worker_group)  # every rank gone and its output drained before the report
        self.report(restarting=True)
        super()._restart_workers(worker_group)

    # ------------------------------------------------------------------------------ bookkeeping

    def _watch_exit(self, local_rank: int, pid: int, generation: int) -> None:
        """Learn of a rank's exit the moment it happens (``WNOWAIT``: torch still reaps it), so the other ranks'
        output is held before their fallout arrives."""
        try:
            info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
        except ChildProcessError:  # torch reaped it first
            return
        if info is None:
            return
        code = info.si_status if info.si_code == os.CLD_EXITED else -info.si_status
        self._exited(local_rank, code, pid, generation)

    def _exited(self, local_rank: int, code: int, pid: int, generation: int | None = None) -> None:
        with self._lock:
            if generation is not None and generation != self._generation:
                return  # a rank of an attempt that already ended
            stream = self.streams.mark_exited(local_rank, code, pid)
            if code != 0 and self.first is None and not self._stopping:
                self.first = stream
                self.streams.out.hold()

    def _note_exits(self) -> list[int]:
        """Stamp the ranks that exited since the last look; the first failure holds the others' output."""
        running = []
        for local_rank, handler in self._pcontext.subprocess_handlers.items():  # type: ignore[union-attr]
            code = handler.proc.poll()
            if code is None:
                running.append(local_rank)
                continue
            self._exited(local_rank, code, handler.proc.pid)
        return running

    def _end_attempt(self) -> None:
        """The attempt's ranks are gone: close torch's ends of their pipes and drain the readers."""
        if self._pcontext is not None:
            for handler in getattr(self._pcontext, "subprocess_handlers", {}).values():
                for name in ("_stdout", "_stderr"):
                    stream = getattr(handler, name, None)
                    if stream is not None and not stream.closed:
                        stream.close()
        self.streams.finish()

    def _failed(self, result: RunResult) -> RunResult:
        if self.first is None:  # it failed between our look and torch's: take torch's root cause
            local = min(result.failures.values(), key=lambda f: f.timestamp).local_rank
            self.first = self.streams.streams[local]
        if self.rdzv.multi_node and self.job_failure is None:
            self.job_failure = self.rdzv.publish_rank_failure(self.first)
            if self.job_failure is not None and not self.job_failure.restartable:
                self._remaining_restarts = 0
        return result

    def _check_job(self, result: RunResult) -> RunResult:
        found = self.rdzv.check()
        if found is None:
            return result
        self._stop_for(found)
        self.stopped_others = len(self._note_exits())
        return RunResult(state=WorkerState.FAILED)

    def _stop_for(self, failure: JobFailure) -> None:
        """Another node's failure (or a lost node) ends this attempt here too."""
        with self._lock:
            self.job_failure, self._stopping = failure, True
        if not failure.restartable:
            self._remaining_restarts = 0

    def _await_others(self, result: RunResult) -> RunResult:
        """This node's ranks succeeded: wait for every node's, or a failure elsewhere (then restart or stop
        with the job)."""
        try:
            self.rdzv.channel.mark_finished(self.rdzv.round)
            while not self.rdzv.channel.all_finished(self.rdzv.round):
                found = self.rdzv.check(force=True)
                if found is not None:
                    self._stop_for(found)
                    return RunResult(state=WorkerState.FAILED)
                time.sleep(MONITOR_INTERVAL_S)
        except ChannelLost as exc:
            self._stop_for(self.rdzv.store_lost(str(exc)))
            return RunResult(state=WorkerState.FAILED)
        return result

    # ------------------------------------------------------------------------------ the report

    @property
    def restart_count(self) -> int:
        return self._worker_group.spec.max_restarts - self._remaining_restarts

    def exit_code(self) -> int:
        if self.job_failure is not None:
            return self.job_failure.exit_code
        return exit_status(self.first.returncode if self.first is not None else 1)

    def report(self, restarting: bool) -> None:
        """Print this attempt's failure (once), then the other ranks' output since."""
        if self._announced:
            return
        self._announced = True
        attempt = self.restart_count - (1 if restarting else 0)
        if self.first is not None and self.first.held:  # the failing rank's own last words, where they belong
            self.streams.out.write_now(bytes(self.first.held))
            self.first.held.clear()
        if self.rdzv.multi_node:  # then the ranks' own words, as they are: the report names the job's failure
            self.rdzv.report(self.job_failure, self.first is not None, self.job, attempt, restarting)
            self.streams.out.release()
            self.streams.out.flush_stale(list(self.streams.streams.values()), 0.0)
            return
        if self.first is not None:
            report_local(self.first, self.streams, self.stopped_others)
            if restarting:
                logger.warning("attempt %d failed (exit %d); restarting every rank (restart %d of %d)", attempt,
                               self.exit_code(), attempt + 1, self.job.max_restarts)
        report_held(self.streams, self.first)
        self.streams.out.release()


def early_exits(streams: RankStreams, failed: RankStream) -> str | None:
    """A line naming the ranks that exited 0 before ``failed`` failed (they left the others waiting in
    their next collective), or None."""
    early = [s for s in streams.streams.values() if s is not failed and s.returncode == 0
             and s.ended_at is not None and failed.ended_at is not None and s.ended_at <= failed.ended_at]
    if not early:
        return None
    names = ", ".join(s.name for s in early)
    lead = max(failed.ended_at - s.ended_at for s in early)  # type: ignore[operator]
    verb = "was" if len(early) == 1 else "were"
    return (f"deepshard: {names} exited 0 while the others were still running ({lead:.1f}s before "
            f"{failed.name} failed): {names} {verb} done while the others still expected it in their "
            "collectives. Every rank must run the same number of steps (and call save_checkpoint) alike; "
            "look for a rank-dependent loop bound, break or early return")


def report_local(failed: RankStream, streams: RankStreams, stopped: int) -> None:
    """One node's report: early exits, the ranks' one-line errors, then who failed and its last output."""
    early = early_exits(streams, failed)
    if early is not None:
        print(early, file=sys.stderr, flush=True)
    errors = rank_errors.collect(os.environ.get(rank_errors.ERROR_DIR_ENV))
    if errors:
        print(rank_errors.format_errors(errors), file=sys.stderr, flush=True)
    reported = any(failed.rank in ranks for ranks in errors.values())
    plural = "rank" if stopped == 1 else "ranks"
    lines = [f"deepshard: {failed.who} exited with {failed.exit}; stopped the other {stopped} {plural}"]
    tail, trace = failed.text(), error_file_traceback(failed.error_file)
    if trace and not reported:
        lines += [f"----- traceback of rank {failed.rank} (its error file) -----", trace.rstrip()]
    if not reported and not (trace and trace.strip().splitlines()[-1] in tail):
        lines += ([f"----- last output of rank {failed.rank} -----", tail] if tail else
                  [f"(rank {failed.rank} printed nothing)"])
    if not reported and (tail or trace):
        lines.append(f"----- end of rank {failed.rank} output -----")
    if failed.log_path:
        lines.append(f"full log of rank {failed.rank}: {failed.log_path}")
    print("\n".join(lines), file=sys.stderr, flush=True)


def error_file_traceback(path: str) -> str | None:
    """The traceback a rank wrote to torch's elastic error file (``@record``, or deepshard's rank entry)."""
    try:
        with open(path, encoding="utf-8") as handle:
            message = json.load(handle).get("message", {})
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(message, dict):
        return None
    trace = message.get("extraInfo", {}).get("py_callstack")
    return trace if isinstance(trace, str) and trace.strip() else None


def report_held(streams: RankStreams, failed: RankStream | None) -> None:
    """The other ranks' output since the failure, after the report, their connection noise folded."""
    for stream in streams.streams.values():
        if stream is failed or not stream.held:
            continue
        text, folded = fold_noise(bytes(stream.held).decode("utf-8", errors="replace"))
        stream.held.clear()
        if text:
            print(f"----- {stream.name}'s output after the failure -----\n{text}", file=sys.stderr, flush=True)
        if folded:
            where = f" (in {stream.log_path})" if stream.log_path else ""
            print(f"deepshard: folded {folded} lines of {stream.name}'s lost-connection fallout{where}",
                  file=sys.stderr, flush=True)


def run_agent(job: AgentJob, rdzv: NodeRendezvous,
              on_started: Callable[[list[int]], None] | None = None, python: str = sys.executable) -> int:
    """Run this node's part of the job under torch's agent; returns the exit status (0, the failing rank's
    exit code, 1 for a rank killed by a signal or a lost node, 128+N for signal N)."""
    torch_level = logging.DEBUG if logger.isEnabledFor(logging.DEBUG) else logging.CRITICAL
    logging.getLogger("torch.distributed.elastic").setLevel(torch_level)  # deepshard reports starts and stops
    os.environ.setdefault("TORCHELASTIC_SIGNALS_TO_HANDLE", ",".join(s.name for s in HANDLED_SIGNALS))  # as torchrun
    entrypoint, args = entry(job, os.getpid(), python)
    spec = WorkerSpec(role="default", local_world_size=job.nproc, rdzv_handler=rdzv, entrypoint=entrypoint,
                      args=tuple(args), max_restarts=job.max_restarts, monitor_interval=MONITOR_INTERVAL_S)
    streams = RankStreams(Output(), job.log_dir)
    agent = NodeAgent(spec, job, streams, rdzv, on_started)
    try:
        with signal_handlers(_terminate_process_handler, HANDLED_SIGNALS):  # also while it waits for nodes
            result = agent.run()
        if not result.is_failed():
            return 0
        agent.report(restarting=False)
        return agent.exit_code()
    except SignalException as exc:
        running = sum(1 for s in streams.streams.values() if s.ended_at is None)
        print(f"deepshard: received {exc.sigval.name}; forwarding it to {running} running ranks",
              file=sys.stderr, flush=True)
        rdzv.abort(f"received {exc.sigval.name}", 128 + exc.sigval)
        return 128 + exc.sigval
    except (ChannelLost, TimeoutError) as exc:
        print(f"deepshard: {rdzv.where}{exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        streams.cleanup()
        rdzv.close()
