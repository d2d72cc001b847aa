"""Tests for tess_compile.runtime.launch.run_local (real multi-process gloo runs)."""

import os
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from tess_compile.runtime.launch import run_local

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Worker functions must live at module level so spawned children can import them.

def _all_reduce_rank(rank, world_size, scale):
    """Sum every rank's id across the group; return (rank, sum * scale)."""
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return rank, t.item() * scale


def _raise_on_rank_1(rank, world_size):
    """Rank 1 raises; rank 0 waits in a collective that never completes."""
    if rank == 1:
        raise ValueError("boom from rank 1")
    dist.all_reduce(torch.zeros(1))


def _exit_on_rank_1(rank, world_size):
    """Rank 1 dies without reporting; rank 0 waits in a collective."""
    if rank == 1:
        os._exit(3)
    dist.all_reduce(torch.zeros(1))


def _segfault_on_rank_1(rank, world_size):
    """Rank 1 dies of a segmentation fault (as native code can); rank 0 waits in a collective."""
    if rank == 1:
        import faulthandler

        faulthandler._sigsegv()
    dist.all_reduce(torch.zeros(1))


def _sleep(rank, world_size):
    """Outlive any timeout the tests use."""
    time.sleep(60)


def _hang_on_rank_1(rank, world_size):
    """Rank 1 hangs outside any collective; rank 0 waits for it in one."""
    dist.barrier()  # both started
    if rank == 1:
        time.sleep(60)
    dist.all_reduce(torch.zeros(1))


@pytest.mark.slow
def test_results_in_rank_order_and_collective_works():
    n = 3
    results = run_local(_all_reduce_rank, n, args=(2,), timeout_s=60)
    assert results == [(rank, 2.0 * sum(range(n))) for rank in range(n)]


def _environment_and_output(rank, world_size):
    print(f"rank {rank} writes")  # to the stdout the parent has at launch
    sys.stdout.flush()
    return os.environ.get("TESS_LAUNCH_SET"), os.environ.get("TESS_LAUNCH_UNSET")


@pytest.mark.slow
def test_each_launch_hands_its_ranks_the_parents_environment_and_output_of_that_moment(monkeypatch, capfd, tmp_path):
    """Ranks fork from a server started by an earlier launch: they still see the environment and
    the stdout the parent has at this launch, not the server's."""
    monkeypatch.setenv("TESS_LAUNCH_UNSET", "before")
    earlier, stdout = open(tmp_path / "earlier.txt", "w"), os.dup(1)  # noqa: SIM115
    os.dup2(earlier.fileno(), 1)  # the first launch (which starts the server, if none runs) writes elsewhere
    try:
        assert run_local(_environment_and_output, 2) == [(None, "before")] * 2
    finally:
        os.dup2(stdout, 1)
        os.close(stdout)
        earlier.close()
    monkeypatch.setenv("TESS_LAUNCH_SET", "now")
    monkeypatch.delenv("TESS_LAUNCH_UNSET")
    capfd.readouterr()
    assert run_local(_environment_and_output, 2) == [("now", None)] * 2
    out = capfd.readouterr().out
    assert "rank 0 writes" in out and "rank 1 writes" in out, out


@pytest.mark.slow
def test_raising_rank_gives_runtime_error():
    with pytest.raises(RuntimeError) as info:
        run_local(_raise_on_rank_1, 2, timeout_s=60, collective_timeout_s=30)
    msg = str(info.value)
    assert msg.startswith("rank(s) [1")
    assert "rank 1 stopped first: ValueError: boom from rank 1" in msg
    assert "--- rank 1 ---\nTraceback" in msg
    assert "ValueError: boom from rank 1" in msg


@pytest.mark.slow
def test_dead_rank_ends_with_error_in_bounded_time():
    start = time.monotonic()
    with pytest.raises(RuntimeError) as info:  # the launcher sees the death directly
        run_local(_exit_on_rank_1, 2, timeout_s=60, collective_timeout_s=5)
    assert time.monotonic() - start < 30
    msg = str(info.value)
    assert "--- rank 1 ---\nprocess exited with code 3" in msg


@pytest.mark.slow
def test_crashed_rank_is_named_with_the_stack_it_crashed_in():
    with pytest.raises(RuntimeError) as info:
        run_local(_segfault_on_rank_1, 2, timeout_s=60, collective_timeout_s=5)
    crash = str(info.value).split("--- rank 1 ---")[1]
    assert "without reporting a result; it crashed in:\nFatal Python error: Segmentation fault" in crash, crash
    assert "in _segfault_on_rank_1" in crash, crash


@pytest.mark.slow
def test_overall_timeout_gives_timeout_error():
    with pytest.raises(TimeoutError, match=r"rank\(s\) \[0\].*timeout_s=5"):
        run_local(_sleep, 1, timeout_s=5)


@pytest.mark.slow
def test_hung_rank_is_named_with_its_stack():
    with pytest.raises(TimeoutError) as info:
        run_local(_hang_on_rank_1, 2, timeout_s=12, collective_timeout_s=60)
    msg = str(info.value)
    assert "rank(s) [1] outside any torch.distributed call: where the run hung" in msg, msg
    assert "rank(s) [0] inside torch.distributed calls" in msg, msg
    hung = msg.split("--- rank 1 (still running")[1]
    assert "in _hang_on_rank_1" in hung, msg


@pytest.mark.parametrize("fn, world_size, match", [
    (lambda rank, world_size: rank, 2, "module level"),
    (_sleep, 0, "world_size"),
    (_sleep, 2.0, "world_size"),
])
def test_bad_arguments_give_value_error(fn, world_size, match):
    with pytest.raises(ValueError, match=match):
        run_local(fn, world_size)


TWO_RANKS_PY = """
import multiprocessing

import torch
import torch.distributed as dist

from tess_compile.runtime.launch import run_local

LOCKS = []


def rank_main(rank, world_size):
    # a named semaphore held until exit, as tqdm's lock is in every compile (torch.fx's interpreter makes it)
    LOCKS.append(multiprocessing.get_context("spawn").RLock())
    total = torch.ones(1)
    dist.all_reduce(total)
    return total.item()


if __name__ == "__main__":
    print(run_local(rank_main, 2, timeout_s=120))
"""


@pytest.mark.slow
def test_a_run_that_succeeds_leaks_no_semaphore(tmp_path):
    """The children exit by themselves (their exit handlers free their semaphores) rather than
    being terminated once they reported, so no "leaked semaphore objects" warning ends the run."""
    (tmp_path / "two_ranks.py").write_text(TWO_RANKS_PY)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "two_ranks.py"], cwd=tmp_path, env=env, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[2.0, 2.0]", proc.stdout
    assert "leaked semaphore" not in proc.stderr, proc.stderr
