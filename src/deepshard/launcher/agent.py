"""One node's ranks under torch's elastic agent (the engine ``torchrun`` runs on), driven through its public
interface: ``LocalElasticAgent(...).run()`` with deepshard's ``LogsSpecs`` and rank shim (:mod:`.rank_streams`) and
rendezvous handler (:mod:`.rendezvous`), whose calls reach :class:`JobWatch`."""
from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

from torch.distributed import DistError
from torch.distributed.elastic.agent.server import WorkerSpec
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import SignalException
from torch.distributed.elastic.rendezvous import RendezvousError

from deepshard.launcher.board import JobBoard, JobFailure, StoreLost
from deepshard.launcher.local import AgentJob
from deepshard.launcher.options import LaunchError
from deepshard.launcher.output import FALLOUT_HOLD_S, Output, exit_status, signal_group
from deepshard.launcher.rank_streams import STATUS_ENV, RankStream, RankStreams, shim_argv, watch_ranks
from deepshard.launcher.rendezvous import JobRendezvous, RendezvousFailed
from deepshard.launcher.report import report_held, report_local
from deepshard.utils.logging import logger

MONITOR_INTERVAL_S = 0.1
GRACE_S = 5
HANDLED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
EXIT_BARRIER_S = 1
"""torch's exit barrier, for multi-node static jobs: their agents wait for one another on the job board instead,
where another node's failure ends the wait at once."""


class JobStopped(Exception):
    """The job ends without a restart (a signal, a lost node, the launcher gone): ``failure`` says why."""

    def __init__(self, failure: JobFailure) -> None:
        super().__init__(failure.headline())
        self.failure = failure


class JobWatch:
    """deepshard's side of one node's run: the ranks' starts and exits (from the shim), the first failure
    (it holds the other ranks' output and stops them at once), the job board of a multi-node job (``link``),
    signals, and the report of every attempt."""

    def __init__(self, job: AgentJob, streams: RankStreams, link: JobBoard | None = None,
                 on_started: Callable[[list[int]], None] | None = None) -> None:
        self.job, self.streams, self.link, self.on_started = job, streams, link, on_started
        self.attempt = self.restart_count = -1
        self.first: RankStream | None = None
        self.stopped: set[int] = set()
        self.job_failure: JobFailure | None = None
        self.stopping = False
        self.groups: dict[int, int] = {}  # local rank -> the process group torch started its shim in
        self.running_at_signal: int | None = None
        self._unwatch: Callable[[], None] | None = None
        self._saved: dict[int, Any] = {}
        self._lock = threading.Lock()

    def begin(self, envs: dict[int, dict[str, str]]) -> None:
        """torch is about to start an attempt's ranks (``LogsSpecs.reify``): watch them through the shim."""
        with self._lock:
            self.attempt = attempt = self.streams.attempt
            self.restart_count = int(next(iter(envs.values())).get("TORCHELASTIC_RESTART_COUNT", "0"))
            self.first, self.stopped, self.job_failure, self.stopping, self.groups = None, set(), None, False, {}
        self.streams.out.release()
        if self.link is not None:
            self.link.new_attempt()
        path = self.streams.path(f"attempt{attempt}-status.pipe")
        self._unwatch = watch_ranks(path, lambda local, pid, group: self._started(attempt, local, pid, group),
                                    lambda local, pid, code: self._exited(attempt, local, pid, code))
        for env in envs.values():
            env[STATUS_ENV] = path

    def _started(self, attempt: int, local_rank: int, pid: int, group: int) -> None:
        with self._lock:
            streams = self.streams.streams
            if attempt != self.attempt:
                return
            streams[local_rank].pid, self.groups[local_rank] = pid, group
            self.streams.opened(local_rank)
            if any(s.pid is None for s in streams.values()):
                return
        logger.info("started %d ranks: %s", len(streams),
                    ", ".join(f"rank {s.rank} pid {s.pid}" for s in streams.values()))
        if self.job.log_dir is not None:
            logger.info("per-rank logs: %s", ", ".join(str(s.log_path) for s in streams.values()))
        if self.on_started is not None:
            self.on_started(sorted(s.pid for s in streams.values() if s.pid is not None))

    def _exited(self, attempt: int, local_rank: int, pid: int, code: int) -> None:
        with self._lock:
            if attempt != self.attempt:
                return
            self.streams.streams[local_rank].pid = pid
            stream = self.streams.mark_exited(local_rank, code)
            if code == 0 or self.first is not None or self.stopping:
                return
            self.first = stream
            self.streams.out.hold()
            self._stop_running()
        if self.link is not None:
            self.job_failure = self.link.publish_rank_failure(attempt, stream)

    def _stop_running(self) -> None:
        """SIGTERM to every rank still running (its whole process group: helpers it started too), SIGKILL after
        ``GRACE_S`` (lock held)."""
        running = [s.local_rank for s in self.streams.streams.values() if s.running]
        self.stopped |= set(running)
        for local_rank in running:
            signal_group(self.groups.get(local_rank), signal.SIGTERM)
        timer = threading.Timer(GRACE_S, self._kill, args=(self.attempt, running))
        timer.daemon = True
        timer.start()

    def _kill(self, attempt: int, local_ranks: list[int]) -> None:
        with self._lock:
            for local_rank in local_ranks:
                if attempt == self.attempt and self.streams.streams[local_rank].running:
                    signal_group(self.groups.get(local_rank), signal.SIGKILL)

    def tick(self, force: bool = False) -> bool:
        """torch's agent looks at the job (main thread, every monitor interval while the ranks run); True while
        this node stops its ranks for something that happened elsewhere (then torch's rendezvous is left alone:
        its store may be gone with node 0)."""
        self.install_signal_handlers()
        self.streams.out.flush_stale(list(self.streams.streams.values()), FALLOUT_HOLD_S)
        found = self.link.check(self.attempt, force) if self.link is not None and not self.stopping else None
        if found is not None:
            with self._lock:
                self.job_failure, self.stopping = found, True
                self._stop_running()
        return self.stopping

    def nodes_waiting(self, count: int) -> int:
        """torch would restart every rank to let ``count`` nodes in. In a static job that is a node restarting
        after a failure, which the job board names (then the restart counts, as on that node): returns 0 so
        torch restarts on the ranks' exits instead. Otherwise (elastic: a node joining) ``count``."""
        if self.link is not None and self.tick(force=True):
            return 0
        logger.info("%d node(s) waiting to join: restarting every rank in a new world", count)
        with self._lock:
            self.stopping = True
        return count

    def install_signal_handlers(self) -> None:
        """Ours rather than torch's (it sets its own at every start): both raise ``SignalException``; ours first
        counts the ranks that were running. The ones before the first call come back with
        :meth:`restore_signal_handlers`."""
        if threading.current_thread() is threading.main_thread():
            for sig in HANDLED_SIGNALS:
                if signal.getsignal(sig) != self._on_signal:
                    self._saved.setdefault(sig, signal.getsignal(sig))
                    signal.signal(sig, self._on_signal)

    def restore_signal_handlers(self) -> None:
        for sig, handler in self._saved.items():
            signal.signal(sig, handler)

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.running_at_signal = sum(1 for s in self.streams.streams.values() if s.running)
        raise SignalException(f"Process {os.getpid()} got signal: {signum}", sigval=signal.Signals(signum))

    def attempt_ended(self, restarting: bool) -> None:
        """Every rank of the attempt is gone: drain their output and report (raises ``JobStopped`` where the job
        must end instead of restarting)."""
        if self._unwatch is not None:
            self._unwatch()
            self._unwatch = None
        self.streams.finish()
        stop = self.job_failure if self.job_failure is not None and not self.job_failure.restartable else None
        self.report(restarting and stop is None)
        if stop is not None and restarting:
            raise JobStopped(stop)

    def report(self, restarting: bool) -> None:
        """Print this attempt's failure (the failing rank's own last words first), then the other ranks' output
        since: as it is on a multi-node job (the report names the job's failure), folded on one machine."""
        first, out = self.first, self.streams.out
        if first is not None and first.held:
            out.write(bytes(first.held))
            first.held.clear()
        if self.link is not None:
            if self.job_failure is not None:
                self.job_failure = failure = self.link.blame(self.job_failure)
                ending = (f"restarting every rank (restart {self.restart_count + 1} of {self.job.max_restarts})"
                          if restarting else f"exiting with code {failure.exit_code}")
                self.link.report(failure, self.job.nproc, ending)
            out.release()
            out.flush_stale(list(self.streams.streams.values()), 0.0)
            return
        if first is not None:
            report_local(first, self.streams, self.stopped)
            if restarting:
                logger.warning("attempt %d failed (exit %d); restarting every rank (restart %d of %d)",
                               self.restart_count, self.exit_code(), self.restart_count + 1, self.job.max_restarts)
        report_held(self.streams, first)
        out.release()

    def exit_code(self) -> int:
        if self.job_failure is not None:
            return self.job_failure.exit_code
        return exit_status(self.first.returncode if self.first is not None else 1)

    def take_failures(self, failures: dict[int, Any]) -> None:
        """torch's record of the last attempt's failures, for a rank whose exit the shim could not report."""
        if self.first is None and failures:
            failure = min(failures.values(), key=lambda f: f.timestamp)
            self.first = self.streams.mark_exited(failure.local_rank, failure.exitcode)


def run_agent(job: AgentJob, rdzv: JobRendezvous, on_started: Callable[[list[int]], None] | None = None,
              python: str = sys.executable) -> int:
    """Run this node's part of the job under torch's agent; returns the exit status (0, the failing rank's exit
    code, 1 for a rank killed by a signal or a lost node, 128+N for signal N, 2 for mismatched nodes)."""
    level = logging.DEBUG if logger.isEnabledFor(logging.DEBUG) else logging.CRITICAL
    logging.getLogger("torch.distributed.elastic").setLevel(level)  # deepshard reports starts and stops
    os.environ.setdefault("TORCHELASTIC_SIGNALS_TO_HANDLE", ",".join(s.name for s in HANDLED_SIGNALS))  # as torchrun
    streams, link = RankStreams(Output(), job.log_dir), rdzv.board
    watch = JobWatch(job, streams, link, on_started)
    streams.on_attempt, rdzv.hooks = watch.begin, watch
    entrypoint, args = shim_argv(job.argv, os.getpid(), job.cores, job.rank_env, "OMP_NUM_THREADS" in job.user_env,
                                 python)
    spec = WorkerSpec(role="default", local_world_size=job.nproc, rdzv_handler=rdzv, entrypoint=entrypoint,
                      args=tuple(args), max_restarts=job.max_restarts, monitor_interval=MONITOR_INTERVAL_S)
    barrier_s = EXIT_BARRIER_S if link is not None else rdzv.join_timeout_s
    agent = LocalElasticAgent(spec, streams, exit_barrier_timeout=barrier_s, shutdown_timeout=GRACE_S)
    where, shut = (f"node {link.node_rank} ({link.host}): " if link is not None else ""), True

    def say(message: str, code: int) -> int:
        print(f"deepshard: {where}{message}", file=sys.stderr, flush=True)
        return code

    try:
        watch.install_signal_handlers()
        result = agent.run()
        failures = result.failures if result is not None and result.is_failed() else None
        if failures is not None:
            watch.take_failures(failures)
        watch.attempt_ended(restarting=False)
        if failures is not None:
            return watch.exit_code()
        found = link.await_others(watch.attempt) if link is not None else None
        if link is None or found is None:
            return 0
        link.report(found, job.nproc, f"exiting with code {found.exit_code}")
        return found.exit_code
    except SignalException as exc:
        shut = link is not None  # an elastic job goes on without this node (torch's agent does the same)
        running = watch.running_at_signal or 0
        told = f"forwarding it to {running} running {'rank' if running == 1 else 'ranks'}" if running else \
            "no rank was running"
        code = say(f"received {exc.sigval.name}; {told}", 128 + exc.sigval)
        if link is not None:
            link.stop_job(f"received {exc.sigval.name}", code)
        return code
    except JobStopped as exc:
        return exc.failure.exit_code
    except LaunchError as exc:
        return say(f"error: {exc}", 2)
    except (RendezvousFailed, StoreLost) as exc:
        return say(str(exc), 1)
    except DistError as exc:  # a store wait of torch's agent ran out (a node went away while they met)
        return say(f"attempt {watch.attempt + 1}: {str(exc).splitlines()[0]}", 1)
    except RendezvousError as exc:  # torch's rendezvous lost its store while the ranks ran
        cause = f" ({str(exc.__cause__).splitlines()[0]})" if exc.__cause__ and str(exc.__cause__) else ""
        return say(f"the rendezvous store at {rdzv.job.endpoint} (node 0's agent) stopped answering: {exc}{cause}", 1)
    finally:
        streams.cleanup()
        _close(rdzv, link, shut)
        watch.restore_signal_handlers()


def _close(rdzv: JobRendezvous, link: JobBoard | None, shut: bool) -> None:
    """Close the rendezvous (``shut``) and leave the job board; node 0 last, its store goes with it."""
    if link is not None and link.node_rank == 0:
        link.close()
    try:
        if shut:
            rdzv.shutdown()
    except Exception:  # noqa: BLE001 - the store may be gone with node 0; nothing is left to close then
        pass
    if link is not None and link.node_rank != 0:
        link.close()
