"""Local multi-process launcher: run a function on N processes joined in a
torch.distributed process group on this machine and collect each rank's result.

Used by tests, examples and the command-line tool for real multi-process runs.
When a run fails or hangs, the error names the rank that stopped first, and
gives the Python stack of every rank that was still running (where it hung).
"""

from __future__ import annotations

import datetime
import faulthandler
import gc
import logging
import multiprocessing as mp
import os
import pathlib
import pickle
import queue
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
from multiprocessing import reduction

import torch
import torch.distributed as dist

__all__ = ["run_local"]

log = logging.getLogger("tess_compile.runtime.launch")


_POLL_S = 0.1  # how often the parent checks for results and dead children


_GRACE_S = 1.0  # after a failure, how long to wait for other ranks' reports


_STOP_S = 5.0  # how long a child gets after SIGTERM before SIGKILL


_EXIT_S = 10.0  # how long children that all reported get to exit by themselves before SIGTERM


_STACK_S = 2.0  # how long the parent waits for a running child's stack dump


_STACK_SIGNAL = getattr(signal, "SIGUSR1", None)  # asks a child to dump its stack (POSIX)


# What the fork server imports once, so that a child does not import it again (seconds of CPU
# per rank, most of an 8-rank launch on a small machine). It imports nothing that starts a thread.
_PRELOAD = ["torch", "torch.distributed", "tess_compile"]
# Imported by the fork server too where the launching process has imported their package (a job on
# transformers' models): their import is most of the rest of a child's start.
_PRELOAD_IF_USED = ["transformers.modeling_utils", "transformers.generation.utils"]


class _Stdio:
    """The parent's stdout and stderr as they are at launch, handed to a child: one forked from
    the server would otherwise write to the server's, those of the first launch."""

    def __reduce__(self):  # called while the child is started: the fds travel with it
        return _Stdio._inherited, (reduction.DupFd(1), reduction.DupFd(2))

    @staticmethod
    def _inherited(out, err):
        return (out.detach(), err.detach())


def _attach_stdio(fds) -> None:
    """Make the child's fds 1 and 2 the parent's (`_Stdio`)."""
    sys.stdout.flush()
    sys.stderr.flush()
    for target, fd in zip((1, 2), fds):
        os.dup2(fd, target)
        os.close(fd)


def _context():
    """The children's start method: forked from a server that has imported `_PRELOAD`, and
    `_PRELOAD_IF_USED` where this process uses their package (where the platform has a fork server;
    spawned otherwise). Either way a child imports the job's own modules and
    takes the parent's environment as it is at launch."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    used = [name for name in _PRELOAD_IF_USED if name.split(".")[0] in sys.modules]
    ctx.set_forkserver_preload(_PRELOAD + used)
    return ctx


def run_local(fn, world_size, *, args=(), backend="gloo", timeout_s=120.0,
              collective_timeout_s=60.0, env=None) -> list:
    """Run fn(rank, world_size, *args) on world_size local processes; return the per-rank
    results in rank order.

    fn must be a module-level function; args and the results must be picklable. env adds
    (or overrides) environment variables in the children.
    Raises RuntimeError if any rank raises or dies and TimeoutError if the
    ranks do not all finish within timeout_s seconds. The message names the
    rank that stopped first (with every failed rank's traceback) and the ranks
    still running, with their Python stacks: those outside a torch.distributed
    call are where the run hung. After a run in which every rank reported a result the
    children get a few seconds to exit by themselves (their exit handlers free what they
    hold); every child still running then, or after a failure, is terminated before returning.
    """
    _check_args(world_size, timeout_s, collective_timeout_s, env)
    payload = _pickle_job(fn, args)
    ctx = _context()
    results = ctx.Queue()
    base_env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), **(env or {})}
    stack_dir = pathlib.Path(tempfile.mkdtemp(prefix="tess-stacks-"))
    procs = [
        ctx.Process(target=_worker, name=f"tess-rank-{rank}",
                    args=(rank, world_size, backend, collective_timeout_s, base_env, payload, results,
                          str(stack_dir / f"rank{rank}.txt"), _Stdio()))
        for rank in range(world_size)
    ]
    log.info("starting %d processes (backend=%s, port=%s)", world_size, backend, base_env["MASTER_PORT"])
    start = time.monotonic()
    stacks = {}
    try:
        for proc in procs:
            proc.start()
        outcomes = _collect(procs, results, start + timeout_s, stack_dir)
        stacks = _running_stacks(procs, outcomes, stack_dir)
        if len(outcomes) == world_size and all(ok for ok, *_ in outcomes.values()):
            _await_exit(procs, _EXIT_S)
    finally:
        _stop(procs)
        results.close()
        shutil.rmtree(stack_dir, ignore_errors=True)
    log.info("%d processes ended in %.1f s", world_size, time.monotonic() - start)
    return _unpack(outcomes, world_size, timeout_s, stacks)


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


def _worker(rank, world_size, backend, collective_timeout_s, env, payload, results, stack_file, stdio):
    """Child entry point: join the group, run fn and report (rank, ok, data) on the queue,
    then leave the group and exit (objects left in reference cycles are not collected).

    On the parent's signal the child writes its Python stacks to `stack_file`, and on a
    fatal signal (a segmentation fault in native code) the stacks it crashed in.
    """
    _attach_stdio(stdio)
    os.environ.clear()  # the parent's environment at launch, not the fork server's
    os.environ.update(env, RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    stack_out = open(stack_file, "w")  # noqa: SIM115  (open for the life of the process)
    faulthandler.enable(file=stack_out, all_threads=True)
    if _STACK_SIGNAL is not None:
        faulthandler.register(_STACK_SIGNAL, file=stack_out, all_threads=True)
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
        gc.freeze()  # exit without collecting torch's object graphs: seconds of CPU a rank (see _await_exit)


def _collect(procs, results, deadline, stack_dir):
    """Gather {rank: (ok, data, seconds)} until all ranks report, one fails, or the deadline passes;
    `seconds` is when the parent learnt of it (a death, from the exit code; with the stack the
    child crashed in where it wrote one)."""
    outcomes = {}
    failed_at = None
    while len(outcomes) < len(procs) and time.monotonic() < deadline:
        _drain(results, outcomes, _POLL_S)
        for rank, proc in enumerate(procs):
            if rank not in outcomes and proc.exitcode is not None:
                _drain(results, outcomes, 0)  # its report may still sit in the pipe
                reason = f"process exited with code {proc.exitcode} without reporting a result"
                outcomes.setdefault(rank, (False, reason + _crash_stack(stack_dir / f"rank{rank}.txt"),
                                           time.monotonic()))
        if failed_at is None and not all(ok for ok, *_ in outcomes.values()):
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at > _GRACE_S:
            break
    return outcomes


def _drain(results, outcomes, wait_s):
    """Move every report now on the queue (waiting up to wait_s for the first) into outcomes."""
    try:
        rank, ok, data = results.get(timeout=wait_s) if wait_s else results.get_nowait()
        while True:
            outcomes[rank] = (ok, data, time.monotonic())
            rank, ok, data = results.get_nowait()
    except queue.Empty:
        pass


def _await_exit(procs, wait_s):
    """Give every child up to `wait_s` seconds in all to exit by itself. A child stopped by a
    signal skips its exit handlers, and so leaks the named semaphores of the multiprocessing
    locks it made (tqdm's, which torch.fx's interpreter makes in every compile): the resource
    tracker then warns of "leaked semaphore objects" when the parent exits. The children
    skip the interpreter's last garbage collection (`gc.freeze` in `_worker`), which took
    5 s for 8 ranks on 2 cores; they end in under a second."""
    deadline = time.monotonic() + wait_s
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))


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


def _crash_stack(file) -> str:
    """"; it crashed in:" and the stack a dead child's `faulthandler` dumped on a fatal signal
    (its "Fatal Python error" report), or "" if it wrote none."""
    try:
        text = file.read_text()
    except OSError:
        return ""
    start = text.find("Fatal Python error")
    return f"; it crashed in:\n{text[start:].strip()}" if start >= 0 else ""


def _running_stacks(procs, outcomes, stack_dir) -> dict[int, str]:
    """{rank: Python stack of its main thread} of every child that has not reported and still runs."""
    running = [rank for rank, proc in enumerate(procs) if rank not in outcomes and proc.is_alive()]
    if _STACK_SIGNAL is None or not running:
        return {}
    for rank in running:
        try:
            os.kill(procs[rank].pid, _STACK_SIGNAL)
        except OSError:
            pass
    files = {rank: stack_dir / f"rank{rank}.txt" for rank in running}
    deadline = time.monotonic() + _STACK_S
    while time.monotonic() < deadline and not all(_main_stack(f) for f in files.values()):
        time.sleep(_POLL_S)
    return {rank: _main_stack(file) or "(no stack: the process did not answer)" for rank, file in files.items()}


def _main_stack(file) -> str:
    """The dumped stack of the thread that runs `_worker` (the user's function), if written yet."""
    try:
        text = file.read_text()
    except OSError:
        return ""
    threads = [block for block in text.split("\n\n") if "_worker" in block]
    return threads[0].strip() if threads else ""


def _in_collective(stack: str) -> bool:
    """Whether a dumped stack is inside torch.distributed (waiting for peers)."""
    return "torch/distributed/" in stack.replace("\\", "/")


def _summary(text: str) -> str:
    """The last line of a traceback (the exception), or the text itself."""
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else text


def _unpack(outcomes, world_size, timeout_s, stacks=None):
    """Return the results in rank order, or raise for failed or unfinished ranks."""
    stacks = stacks or {}
    failed = sorted((rank for rank, (ok, *_) in outcomes.items() if not ok), key=lambda r: outcomes[r][2])
    missing = [rank for rank in range(world_size) if rank not in outcomes]
    hung = [rank for rank in missing if rank in stacks and not _in_collective(stacks[rank])]
    waiting = [rank for rank in missing if rank in stacks and rank not in hung]
    running = "".join(f"\n--- rank {rank} (still running; its stack, most recent call first) ---\n{stacks[rank]}"
                      for rank in missing if rank in stacks)
    if failed:
        first = failed[0]
        lines = [f"rank(s) {failed} of {world_size} failed (first reported first): "
                 f"rank {first} stopped first: {_summary(outcomes[first][1])}"]
        if missing:
            lines.append(f"rank(s) {missing} had not finished when the launcher stopped them"
                         + (" (stacks below)" if running else ""))
        details = "\n".join(f"--- rank {rank} ---\n{outcomes[rank][1]}" for rank in failed)
        raise RuntimeError("\n".join(lines) + "\n" + details + running)
    if missing:
        where = ""
        if hung:
            where += f"; rank(s) {hung} outside any torch.distributed call: where the run hung"
        if waiting:
            where += f"; rank(s) {waiting} inside torch.distributed calls, waiting for their peers"
        raise TimeoutError(f"rank(s) {missing} of {world_size} did not finish within timeout_s={timeout_s} s"
                           f"{where}{running}")
    return [pickle.loads(outcomes[rank][1]) for rank in range(world_size)]
