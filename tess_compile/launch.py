"""Local multi-process launcher: run a function on N processes joined in a
torch.distributed process group on this machine and collect each rank's result.

Used by tests, examples and the command-line tool for real multi-process runs.
"""

import datetime
import logging
import multiprocessing as mp
import os
import pickle
import queue
import socket
import time
import traceback

import torch
import torch.distributed as dist

__all__ = ["run_local"]

log = logging.getLogger("tess_compile.launch")

_POLL_S = 0.1  # how often the parent checks for results and dead children
_GRACE_S = 1.0  # after a failure, how long to wait for other ranks' reports
_STOP_S = 5.0  # how long a child gets after SIGTERM before SIGKILL


def run_local(fn, world_size, *, args=(), backend="gloo", timeout_s=120.0,
              collective_timeout_s=60.0, env=None) -> list:
    """Run fn(rank, world_size, *args) on world_size local processes; return the per-rank
    results in rank order.

    fn must be a module-level function; args and the results must be picklable. env adds
    (or overrides) environment variables in the children.
    Raises RuntimeError if any rank raises or dies (naming the rank(s), with
    their tracebacks) and TimeoutError if the ranks do not all finish within
    timeout_s seconds. Children are always terminated before returning.
    """
    _check_args(world_size, timeout_s, collective_timeout_s, env)
    payload = _pickle_job(fn, args)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    base_env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), **(env or {})}
    procs = [
        ctx.Process(target=_worker, name=f"tess-rank-{rank}",
                    args=(rank, world_size, backend, collective_timeout_s, base_env, payload, results))
        for rank in range(world_size)
    ]
    log.info("starting %d processes (backend=%s, port=%s)", world_size, backend, base_env["MASTER_PORT"])
    start = time.monotonic()
    try:
        for proc in procs:
            proc.start()
        outcomes = _collect(procs, results, start + timeout_s)
    finally:
        _stop(procs)
        results.close()
    log.info("%d processes ended in %.1f s", world_size, time.monotonic() - start)
    return _unpack(outcomes, world_size, timeout_s)


def _check_args(world_size, timeout_s, collective_timeout_s, env):
    """Raise ValueError for arguments run_local cannot use."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}; pass e.g. world_size=2")
    for name, value in (("timeout_s", timeout_s), ("collective_timeout_s", collective_timeout_s)):
        if not isinstance(value, (int, float)) or value <= 0:
            raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
    if env is not None and not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise ValueError(f"env must map str to str, got {env!r}; convert values with str()")


def _pickle_job(fn, args):
    """Pickle (fn, args) for the children, raising ValueError if that is impossible."""
    try:
        pickle.dumps(fn)
    except (pickle.PicklingError, AttributeError, TypeError) as exc:
        raise ValueError(
            f"fn {fn!r} cannot be pickled for the spawned processes ({exc}); "
            "define it with 'def' at module level (not a lambda, nested or local function)"
        ) from exc
    try:
        return pickle.dumps((fn, tuple(args)))
    except (pickle.PicklingError, AttributeError, TypeError) as exc:
        raise ValueError(
            f"args cannot be pickled for the spawned processes ({exc}); pass picklable values"
        ) from exc


def _free_port():
    """Return a TCP port on 127.0.0.1 that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(rank, world_size, backend, collective_timeout_s, env, payload, results):
    """Child entry point: join the group, run fn and report (rank, ok, data) on the queue."""
    os.environ.update(env, RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    try:
        fn, args = pickle.loads(payload)
        dist.init_process_group(backend, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=collective_timeout_s))
        results.put((rank, True, pickle.dumps(fn(rank, world_size, *args))))
    except BaseException:  # report everything, including SystemExit, to the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        results.close()
        results.join_thread()  # report before peers see our connections close
        if dist.is_initialized():
            dist.destroy_process_group()


def _collect(procs, results, deadline):
    """Gather {rank: (ok, data)} until all ranks report, one fails, or the deadline passes."""
    outcomes = {}
    failed_at = None
    while len(outcomes) < len(procs) and time.monotonic() < deadline:
        _drain(results, outcomes, _POLL_S)
        for rank, proc in enumerate(procs):
            if rank not in outcomes and proc.exitcode is not None:
                _drain(results, outcomes, 0)  # its report may still sit in the pipe
                reason = f"process exited with code {proc.exitcode} without reporting a result"
                outcomes.setdefault(rank, (False, reason))
        if failed_at is None and not all(ok for ok, _ in outcomes.values()):
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at > _GRACE_S:
            break
    return outcomes


def _drain(results, outcomes, wait_s):
    """Move every report now on the queue (waiting up to wait_s for the first) into outcomes."""
    try:
        rank, ok, data = results.get(timeout=wait_s) if wait_s else results.get_nowait()
        while True:
            outcomes[rank] = (ok, data)
            rank, ok, data = results.get_nowait()
    except queue.Empty:
        pass


def _stop(procs):
    """Terminate, then kill if needed, every child that is still running, and reap them all."""
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    deadline = time.monotonic() + _STOP_S
    for proc in procs:
        if proc.pid is None:
            continue
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join()


def _unpack(outcomes, world_size, timeout_s):
    """Return the results in rank order, or raise for failed or unfinished ranks."""
    failed = [rank for rank, (ok, _) in outcomes.items() if not ok]  # in the order reported
    if failed:
        details = "\n".join(f"--- rank {rank} ---\n{outcomes[rank][1]}" for rank in failed)
        raise RuntimeError(f"rank(s) {failed} of {world_size} failed (first reported first):\n{details}")
    missing = [rank for rank in range(world_size) if rank not in outcomes]
    if missing:
        raise TimeoutError(f"rank(s) {missing} of {world_size} did not finish within timeout_s={timeout_s} s")
    return [pickle.loads(outcomes[rank][1]) for rank in range(world_size)]
