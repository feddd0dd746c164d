"""The per-node agent of a multi-node job: starts this machine's ranks and keeps the nodes in step.

One agent runs on every node: started by ``deepshard --no_ssh --node_rank N ...`` on each machine,
or by the launcher over ssh / pdsh as ``python -m deepshard.launcher.node --world_info ...
--node_rank N ...``. Each agent

1. opens the coordination channel (:mod:`.coordination`): node 0's agent serves a TCPStore on
   ``master_port + 1``, the others connect to it, and all check they describe the same job;
2. per attempt, waits for every node (a barrier), then starts its local ranks with the single-machine
   supervisor (:mod:`.supervisor`): global ranks follow the hostfile order, ``CROSS_RANK`` is the
   node index, ``DEEPSHARD_RESTART_COUNT`` the attempt number;
3. watches its ranks and the channel: when a local rank dies it publishes the failure (rank, host,
   exit, end of output) before stopping its other ranks; when another node publishes one, or node 0
   sees a node's heartbeat stop for 10 s, or the store goes away, it stops its ranks (SIGTERM, SIGKILL
   after 5 s);
4. after a failure, with ``--max_restarts R``, restarts every node's ranks (the same world) up to R
   times; the script resumes from its checkpoint. A signal, a lost node or an unreachable store end
   the job without restart;
5. exits 0 when every node's ranks succeeded, else the failing rank's exit code; node 0 prints the
   job's failure report (which rank on which host, and the end of its output).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from deepshard.launcher.coordination import (
    HEARTBEAT_TIMEOUT_S,
    ChannelLost,
    Heartbeat,
    JobChannel,
    JobConfigMismatch,
    JobFailure,
    JoinTimeout,
    coordination_port,
    open_store,
)
from deepshard.launcher.hostfile import decode_world_info
from deepshard.launcher.local import (
    LocalLaunch,
    NodePlace,
    RankSpec,
    detect_cuda_devices,
    die_with_parent,
    parse_core_list,
    plan_local_ranks,
)
from deepshard.launcher.options import LaunchError, add_process_args, add_script_args
from deepshard.launcher.supervisor import RankFailure, supervise_ranks
from deepshard.utils.logging import logger

RESTART_COUNT_ENV = "DEEPSHARD_RESTART_COUNT"
JOIN_TIMEOUT_S = 300.0
EXIT_WAIT_S = 15.0
WATCH_INTERVAL_S = 0.25


@dataclass(frozen=True)
class NodeJob:
    """What one node's agent runs: the whole world (hosts and slots, in rank order), which node this
    is, and how each rank runs."""

    world: dict[str, list[int]]
    node_rank: int
    launch: LocalLaunch
    max_restarts: int = 0
    log_dir: str | None = None
    exit_on_stdin_close: bool = False
    report_on_node0: bool = False
    """Started by ssh / pdsh: every node's output reaches one terminal, so only node 0 prints the
    failure report (otherwise the failing node prints its own too)."""

    def __post_init__(self) -> None:
        if not 0 <= self.node_rank < len(self.world):
            raise LaunchError(f"--node_rank {self.node_rank} is out of range: the selection has "
                              f"{len(self.world)} nodes ({', '.join(self.world)}), so node ranks run "
                              f"0..{len(self.world) - 1}")
        if self.max_restarts < 0:
            raise LaunchError(f"--max_restarts {self.max_restarts} must be >= 0")

    @property
    def hosts(self) -> list[str]:
        """Host names in node order."""
        return list(self.world)

    @property
    def host(self) -> str:
        """This node's host name as the hostfile spells it."""
        return self.hosts[self.node_rank]

    @property
    def world_size(self) -> int:
        """Ranks in the whole job."""
        return sum(len(slots) for slots in self.world.values())

    def place(self) -> NodePlace:
        """This node's position: its first global rank, the world size, its index, the node count."""
        offset = sum(len(self.world[h]) for h in self.hosts[:self.node_rank])
        return NodePlace(offset, self.world_size, self.node_rank, len(self.world))

    def fingerprint(self) -> str:
        """What every node must agree on (compared through the coordination store)."""
        return json.dumps({"world": self.world, "max_restarts": self.max_restarts,
                           "master_port": self.launch.master_port}, sort_keys=True)


def plan_node_ranks(job: NodeJob, base_env: Mapping[str, str], available_cores: Sequence[int],
                    restart_count: int = 0, python: str = sys.executable,
                    agent_pid: int | None = None) -> list[RankSpec]:
    """This node's ranks for attempt ``restart_count`` (pure). With ``agent_pid``, each rank is
    killed if the agent dies (see :func:`~deepshard.launcher.local.die_with_parent`)."""
    env = dict(base_env)
    env[RESTART_COUNT_ENV] = str(restart_count)
    try:
        specs = plan_local_ranks(job.launch, job.world[job.host], env, available_cores, python, job.place())
    except ValueError as exc:
        raise LaunchError(str(exc)) from exc
    if agent_pid is None:
        return specs
    return [dataclasses.replace(s, cmd=die_with_parent(s.cmd, agent_pid, python)) for s in specs]


def failure_from_rank(job: NodeJob, failure: RankFailure) -> JobFailure:
    """A local rank's failure as the job-wide record other nodes read."""
    who = f"rank {failure.rank} (local rank {failure.local_rank}, pid {failure.pid})"
    return JobFailure("rank", job.node_rank, job.host, who, f"exited with {failure.describe_exit()}",
                      failure.exit_code, rank=failure.rank, tail=failure.tail)


def format_job_failure(failure: JobFailure, full: bool) -> str:
    """The report: the headline, and with ``full`` the end of the failed rank's output."""
    lines = [f"deepshard: {failure.headline()}"]
    if full and failure.kind == "rank":
        name = f"rank {failure.rank} (host {failure.host})"
        if failure.tail:
            lines += [f"----- last output of {name} -----", failure.tail,
                      f"----- end of rank {failure.rank} output -----"]
        else:
            lines.append(f"({name} printed nothing)")
    return "\n".join(lines)


class _StdinWatch:
    """``--exit_on_stdin_close``: the ssh launcher holds our stdin open; EOF means it went away."""

    def __init__(self) -> None:
        self.closed = threading.Event()
        threading.Thread(target=self._run, name="deepshard-stdin", daemon=True).start()

    def _run(self) -> None:
        try:
            while os.read(0, 4096):
                pass
        except OSError:
            pass
        self.closed.set()


class _Watch:
    """Polled by the supervisor: returns a reason to stop this node's ranks (and keeps the
    :class:`JobFailure` behind it in ``failure``)."""

    def __init__(self, agent: "_Agent", attempt: int) -> None:
        self.agent, self.attempt = agent, attempt
        self.failure: JobFailure | None = None
        self._next = 0.0

    def __call__(self, force: bool = False) -> str | None:
        now = time.monotonic()
        if self.failure is None and (force or now >= self._next):
            self._next = now + WATCH_INTERVAL_S
            self.failure = self.agent.check(self.attempt)
        return None if self.failure is None else self.failure.headline()


class _Agent:
    def __init__(self, job: NodeJob, channel: JobChannel, base_env: Mapping[str, str],
                 cores: Sequence[int], heartbeat: Heartbeat | None, stdin: _StdinWatch | None,
                 on_started: Callable[[list[int]], None] | None) -> None:
        self.job, self.channel, self.base_env, self.cores = job, channel, base_env, cores
        self.heartbeat, self.stdin, self.on_started = heartbeat, stdin, on_started
        self.lost: list[int] = []

    def _abort(self, failure: JobFailure) -> JobFailure:
        try:
            return self.channel.publish_abort(failure)
        except ChannelLost:
            return failure

    def _store_lost(self, detail: str) -> JobFailure:
        return JobFailure("lost", 0, self.job.hosts[0], "the coordination store (node 0's agent)",
                          f"stopped answering: {detail}", 1, restartable=False)

    def check(self, attempt: int) -> JobFailure | None:
        """Anything that must stop this node's ranks now (None: carry on)."""
        job = self.job
        if self.stdin is not None and self.stdin.closed.is_set():
            return self._abort(JobFailure("abort", job.node_rank, job.host, "the launcher's ssh connection",
                                          "closed (launcher stopped)", 1, restartable=False))
        if self.heartbeat is not None and self.heartbeat.lost is not None:
            return self._store_lost(self.heartbeat.lost)
        try:
            found = self.channel.abort() or self.channel.failure(attempt)
            if found is None and job.node_rank == 0:
                lost = self.channel.lost_nodes()
                if lost:
                    self.lost = lost
                    n = lost[0]
                    found = self.channel.publish_abort(JobFailure(
                        "lost", n, job.hosts[n], "the node agent",
                        f"sent no heartbeat for {self.channel.heartbeat_timeout_s:.0f} s (killed, or its "
                        "machine is unreachable)", 1, restartable=False))
            return found
        except ChannelLost as exc:
            return self._store_lost(str(exc))

    def _publish(self, attempt: int, failure: RankFailure, box: list[JobFailure]) -> None:
        mine = failure_from_rank(self.job, failure)
        try:
            box.append(self.channel.publish_failure(attempt, mine))
        except ChannelLost as exc:
            logger.warning("could not tell the other nodes that %s failed: %s", mine.who, exc)
            box.append(mine)

    def _blame_lost_node(self, failure: JobFailure) -> JobFailure:
        """Node 0: a rank that failed because a peer's connection closed is usually the consequence of a
        node that vanished (its agent killed, its machine down). Watch the heartbeats for one timeout;
        if a node went silent, the job failed because of that node, and the report says so."""
        if self.job.node_rank != 0 or failure.kind != "rank" or not _lost_a_peer(failure.tail):
            return failure
        deadline = time.monotonic() + self.channel.heartbeat_timeout_s + 2 * WATCH_INTERVAL_S + 1.0
        try:
            while time.monotonic() < deadline:
                lost = self.channel.lost_nodes()
                if lost:
                    self.lost, n = lost, lost[0]
                    return self._abort(JobFailure(
                        "lost", n, self.job.hosts[n], "the node agent",
                        f"sent no heartbeat for {self.channel.heartbeat_timeout_s:.0f} s (killed, or its machine "
                        f"is unreachable); {failure.who} on host {failure.host} then lost its connection to "
                        "that node's ranks", 1, restartable=False))
                time.sleep(0.2)
        except ChannelLost:
            pass
        return failure

    def _await_others(self, attempt: int, watch: _Watch) -> JobFailure | None:
        """This node's ranks succeeded: wait until every node's did, or the job failed elsewhere."""
        try:
            self.channel.mark_finished(attempt)
            while True:
                if watch(force=True) is not None:
                    return watch.failure
                if self.channel.all_finished(attempt):
                    return None
                time.sleep(0.1)
        except ChannelLost as exc:
            return self._store_lost(str(exc))

    def attempt(self, attempt: int) -> JobFailure | None:
        """Run one attempt on this node; None when every node succeeded, else why the job failed."""
        specs = plan_node_ranks(self.job, self.base_env, self.cores, attempt, agent_pid=os.getpid())
        watch, box = _Watch(self, attempt), []
        result = supervise_ranks(specs, log_dir=self.job.log_dir, on_started=self.on_started, watch=watch,
                                 on_failure=lambda f: self._publish(attempt, f, box), report=False)
        if result.signal is not None:
            what = f"received {signal.Signals(result.signal).name}"
            return self._abort(JobFailure("abort", self.job.node_rank, self.job.host, "the node agent",
                                          what, result.exit_code, restartable=False))
        if result.failure is not None:
            local = failure_from_rank(self.job, result.failure)
            if self.job.node_rank != 0 and not self.job.report_on_node0:  # node 0 reports in report()
                print(format_job_failure(local, full=True), file=sys.stderr, flush=True)
            return self._blame_lost_node(box[0] if box else local)
        if result.stopped_by is not None:
            return watch.failure
        return self._await_others(attempt, watch)

    def _headline_wanted(self, failure: JobFailure) -> bool:
        job = self.job
        if job.node_rank == 0 or (failure.kind == "lost" and failure.node == 0):
            return True  # node 0 reports the job; when node 0 is gone, every node says so
        if job.report_on_node0:
            return False
        return not (failure.kind == "rank" and failure.node == job.node_rank)  # printed in attempt()

    def report(self, failure: JobFailure, attempt: int) -> None:
        job = self.job
        if self._headline_wanted(failure):
            print(format_job_failure(failure, full=job.node_rank == 0), file=sys.stderr, flush=True)
        restart = failure.restartable and attempt < job.max_restarts
        ending = (f"restarting every rank (restart {attempt + 1} of {job.max_restarts})" if restart
                  else f"exiting with code {failure.exit_code}")
        print(f"deepshard: node {job.node_rank} ({job.host}) stopped its {len(job.world[job.host])} "
              f"rank(s) of {job.world_size} on {len(job.world)} nodes; {ending}", file=sys.stderr, flush=True)

    def run(self, join_timeout_s: float) -> int:
        for attempt in range(self.job.max_restarts + 1):
            try:
                self.channel.join(attempt, join_timeout_s)
            except JoinTimeout as exc:
                self.lost = sorted(set(self.lost) | set(exc.missing))  # never joined: nothing to confirm
                raise
            if attempt == 0 or self.job.node_rank == 0:
                logger.info("node %d (%s): attempt %d, all %d nodes joined", self.job.node_rank,
                            self.job.host, attempt, len(self.job.world))
            failure = self.attempt(attempt)
            if failure is None:
                return 0
            self.report(failure, attempt)
            if not failure.restartable:
                return failure.exit_code
        return failure.exit_code  # type: ignore[possibly-undefined]

    def close(self) -> None:
        if self.heartbeat is not None:
            self.heartbeat.stop()
        try:
            if self.job.node_rank == 0:
                waiting = self.channel.wait_exited(EXIT_WAIT_S, skip=self.lost)
                if waiting:
                    logger.warning("node(s) %s did not confirm the end of the job; closing anyway", waiting)
            else:
                self.channel.mark_exited()
        except ChannelLost:
            pass


_PEER_GONE = ("connection closed by peer", "connection reset by peer", "closed its connection",
              "broken pipe")


def _lost_a_peer(tail: str) -> bool:
    """Does a failed rank's output say a peer's connection went away (rather than an error of its own)?"""
    text = tail.lower()
    return any(mark in text for mark in _PEER_GONE)


def _env_float(environ: Mapping[str, str], key: str, default: float) -> float:
    value = environ.get(key)
    if not value:
        return default
    try:
        return float(value)
    except ValueError:
        raise LaunchError(f"{key}={value!r} is not a number of seconds; e.g. {key}={default:.0f}") from None


def run_node(job: NodeJob, base_env: Mapping[str, str], available_cores: Sequence[int],
             on_started: Callable[[list[int]], None] | None = None) -> int:
    """Run this node's part of the job (see the module docstring); returns the exit status.

    ``DEEPSHARD_JOIN_TIMEOUT`` (seconds, default 300) bounds the wait for the other nodes;
    ``DEEPSHARD_HEARTBEAT_TIMEOUT`` (default 10) how long a silent node is tolerated.
    """
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")  # the agent's store errors are reported by us
    join_timeout = _env_float(base_env, "DEEPSHARD_JOIN_TIMEOUT", JOIN_TIMEOUT_S)
    beat_timeout = _env_float(base_env, "DEEPSHARD_HEARTBEAT_TIMEOUT", HEARTBEAT_TIMEOUT_S)
    in_main = threading.current_thread() is threading.main_thread()
    saved = signal.signal(signal.SIGTERM, _interrupt) if in_main else None
    try:
        return _run_agent(job, base_env, available_cores, on_started, join_timeout, beat_timeout)
    except KeyboardInterrupt as exc:
        print(f"deepshard: node {job.node_rank} ({job.host}): interrupted", file=sys.stderr, flush=True)
        return _interrupt_code(exc)
    finally:
        if in_main:
            signal.signal(signal.SIGTERM, saved)


def _run_agent(job: NodeJob, base_env: Mapping[str, str], available_cores: Sequence[int],
               on_started: Callable[[list[int]], None] | None, join_timeout: float, beat_timeout: float) -> int:
    addr, port = job.launch.master_addr, coordination_port(job.launch.master_port)
    is_host = job.node_rank == 0
    logger.info("node %d (%s): %s coordination store %s:%d", job.node_rank, job.host,
                "serving the" if is_host else "connecting to the", addr, port)
    heartbeat = None
    try:
        channel = JobChannel(open_store(addr, port, is_host, join_timeout), job.node_rank, len(job.world),
                             job.hosts, heartbeat_timeout_s=beat_timeout)
        channel.check_config(job.fingerprint())
        if not is_host:
            beat_channel = JobChannel(open_store(addr, port, False, join_timeout), job.node_rank,
                                      len(job.world), job.hosts)
            heartbeat = Heartbeat(beat_channel).start()
    except (ChannelLost, JobConfigMismatch) as exc:
        print(f"deepshard: node {job.node_rank} ({job.host}): {exc}", file=sys.stderr, flush=True)
        return 1
    stdin = _StdinWatch() if job.exit_on_stdin_close else None
    agent = _Agent(job, channel, base_env, available_cores, heartbeat, stdin, on_started)
    try:
        return agent.run(join_timeout)
    except (ChannelLost, TimeoutError) as exc:
        print(f"deepshard: node {job.node_rank} ({job.host}): {exc}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt as exc:
        code = _interrupt_code(exc)
        agent._abort(JobFailure("abort", job.node_rank, job.host, "the node agent", "was interrupted",
                                code, restartable=False))
        print(f"deepshard: node {job.node_rank} ({job.host}): interrupted; stopped the job", file=sys.stderr,
              flush=True)
        return code
    finally:
        agent.close()


class _Terminated(KeyboardInterrupt):
    """SIGTERM while no ranks run (connecting, waiting for the nodes)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _interrupt(signum: int, frame: object) -> None:
    """SIGTERM outside rank supervision: end like Ctrl-C, telling the other nodes."""
    raise _Terminated(signum)


def _interrupt_code(exc: KeyboardInterrupt) -> int:
    return 128 + getattr(exc, "signum", signal.SIGINT)


def build_parser() -> argparse.ArgumentParser:
    """The agent's own command line (written by the launcher; see :mod:`.runners`)."""
    parser = argparse.ArgumentParser(prog="python -m deepshard.launcher.node",
                                     description="deepshard's per-node agent (started by the launcher)")
    parser.add_argument("--world_info", required=True, help="the selected hosts and slots (base64 JSON)")
    parser.add_argument("--node_rank", type=int, required=True, help="this node's index in the world")
    parser.add_argument("--master_addr", required=True, help="node 0's address")
    parser.add_argument("--master_port", type=int, required=True, help="rendezvous port (agents use port+1)")
    parser.add_argument("--max_restarts", type=int, default=0, help="restarts after a failure")
    parser.add_argument("--exit_on_stdin_close", action="store_true",
                        help="stop the job when stdin reaches end-of-file (the ssh launcher went away)")
    parser.add_argument("--report_on_node0", action="store_true",
                        help="only node 0 prints failure reports (all nodes share one terminal)")
    add_process_args(parser)
    add_script_args(parser)
    return parser


def job_from_args(args: argparse.Namespace, world: dict[str, list[int]], environ: Mapping[str, str]) -> NodeJob:
    """A :class:`NodeJob` from the launcher's / agent's parsed flags (devices detected here)."""
    core_list = parse_core_list(args.bind_core_list) if args.bind_core_list else None
    try:
        devices = detect_cuda_devices(environ)
    except ValueError as exc:
        raise LaunchError(str(exc)) from exc
    launch = LocalLaunch(user_script=args.user_script, user_args=list(args.user_args),
                         master_addr=args.master_addr, master_port=args.master_port, module=args.module,
                         no_python=args.no_python, no_local_rank=args.no_local_rank, visible_devices=devices,
                         bind_cores=args.bind_cores_to_rank or core_list is not None, core_list=core_list)
    return NodeJob(world, args.node_rank, launch, args.max_restarts, args.enable_each_rank_log,
                   getattr(args, "exit_on_stdin_close", False), getattr(args, "report_on_node0", False))


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m deepshard.launcher.node``."""
    args = build_parser().parse_args(argv)
    if args.quiet or args.log_level:
        logger.setLevel(logging.WARNING if args.quiet else args.log_level.upper())
    base_env = dict(os.environ)
    try:
        job = job_from_args(args, decode_world_info(args.world_info), base_env)
        return run_node(job, base_env, sorted(os.sched_getaffinity(0)))
    except (LaunchError, ValueError) as exc:
        print(f"deepshard node agent: error: {exc}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
