"""summa="auto" (the default): each product's cheapest schedule on a cluster, chosen in the
compile; keep_blocks="auto": the faster program that fits a cluster's memory, chosen before
compiling in simulate, dump, the backend and the command line; 1-D meshes without pricing;
the log lines; the program priced reused, not compiled again."""

from __future__ import annotations

import copy
import dataclasses
import logging
import sys

import pytest
import torch
from models import GPTBlock
from torch import nn

import tess_compile
from tess_compile.passes.driver import compile_model
from tess_compile.passes.product_schedule import ProductCase
from tess_compile.passes.summa import cheapest_schedule, schedule_prices
from tess_compile import CompileOptions, cli
from tess_compile.analysis import schedule_choice
from tess_compile.analysis.cost_model import predict_time
from tess_compile.analysis.schedule_choice import choose_schedule, resolve_auto
from tess_compile.cli.common import MODULE_NAME
from tess_compile.core.cluster import Cluster
from tess_compile.core.mesh import Mesh

MESH = Mesh(2, 2, "2.5d")
AUTO = CompileOptions(summa="auto", keep_blocks="auto")
# Slow to start a message, memory to spare: the fewest messages win, keeping the fetched blocks.
SLOW_LINKS = Cluster(gpus_per_node=4, intra_bandwidth=100e9, intra_latency=1e-3, inter_bandwidth=25e9,
                     inter_latency=1e-2, flops=1e12, memory=1e12)


def _profiled(fast: tuple[str, ...]) -> Cluster:
    """8 ranks a node whose collectives of `fast` take 1 us and the others 1 ms (profiled lines)."""
    lines = tuple((op, 2, "intra", 1e-6 if op in fast else 1e-3, 1e-12)
                  for op in ("broadcast", "reduce", "all_reduce", "all_gather", "reduce_scatter"))
    return dataclasses.replace(SLOW_LINKS, gpus_per_node=8, collectives=lines)


# Two machines that favour different schedules: fast broadcasts (and reduces) or fast gathers.
FAST_BROADCASTS = _profiled(("broadcast", "reduce", "all_reduce"))
FAST_GATHERS = _profiled(("all_gather", "reduce_scatter", "all_reduce"))
MODEL_PY = '''
import torch
from torch import nn


def make_mlp():
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 8)), torch.randn(4, 3, 8)
'''


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 8)).double(), torch.randn(
        4, 3, 8, dtype=torch.float64)


def fastest_fitting(choice, memory: float):
    return min((item for item in choice.priced if item.memory.total <= memory), key=lambda item: item.time.step_s)


def assert_exact(sim, model, x):
    """Output and every gradient of `sim` are `model`'s (float64)."""
    target = torch.randn_like(model(x))
    (sim(x) * target).sum().backward()
    (model(x) * target).sum().backward()
    torch.testing.assert_close(sim(x), model(x), rtol=1e-12, atol=1e-12)
    grads = sim.full_grads()
    for name, param in model.named_parameters():
        torch.testing.assert_close(grads[name], param.grad, rtol=1e-12, atol=1e-12, msg=name)


@pytest.mark.parametrize("cluster, expected", [(FAST_BROADCASTS, "overlap"), (FAST_GATHERS, "gather")],
                         ids=["fast-broadcasts", "fast-gathers"])
def test_auto_takes_each_products_cheapest_on_each_cluster(cluster, expected):
    """Two hand-built machines choose differently; each choice is the products' cheapest, the
    program is priced no slower than any one schedule for all products, and it is exact."""
    torch.manual_seed(0)
    model, x = GPTBlock(8, 2).double(), torch.randn(4, 3, 8, dtype=torch.float64)
    program = compile_model(model, MESH, (x,), summa="auto", cluster=cluster)
    assert program.schedules == {expected: 4}, program.schedules  # qkv, proj, fc, out
    auto = predict_time(program, cluster).step_s
    for summa in ("broadcast", "overlap", "gather"):
        fixed = predict_time(compile_model(model, MESH, (x,), summa=summa, cluster=cluster), cluster).step_s
        assert auto <= fixed * (1 + 1e-9), (summa, auto, fixed)
    assert_exact(tess_compile.simulate(copy.deepcopy(model), 2, 2, example_inputs=(x,), summa="auto", cluster=cluster),
                 model, x)


def test_the_cheapest_schedule_is_the_argmin_of_its_prices():
    case = ProductCase(False, (4, 32, 64), (64, 64), "linear", 4)
    for cluster in (FAST_BROADCASTS, FAST_GATHERS, SLOW_LINKS):
        prices = schedule_prices(case, MESH, cluster)
        assert cheapest_schedule(case, MESH, cluster) == min(prices, key=prices.get)
    shared = dataclasses.replace(case, a_shared=True)  # the input's gather is another product's
    assert schedule_prices(shared, MESH, FAST_BROADCASTS)["gather"] < schedule_prices(case, MESH, FAST_BROADCASTS)[
        "gather"]
    kept = dataclasses.replace(case, keep_blocks=True)  # no refetch in backward
    assert all(schedule_prices(kept, MESH, SLOW_LINKS)[s] < schedule_prices(case, MESH, SLOW_LINKS)[s]
               for s in ("broadcast", "gather"))


def test_the_default_is_auto_logged_and_exact(caplog):
    torch.manual_seed(0)
    model, x = GPTBlock(8, 2).double(), torch.randn(4, 3, 8, dtype=torch.float64)
    with caplog.at_level(logging.INFO, logger="tess_compile"):
        sim = tess_compile.simulate(copy.deepcopy(model), 2, 2, example_inputs=(x,))
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("summa=auto on mesh")]
    assert lines == ["summa=auto on mesh [q=2, q=2, d=2]: gather for 4 products (priced on CALIBRATED_CLUSTER)"]
    assert_exact(sim, model, x)


def test_keep_blocks_auto_takes_the_fastest_that_fits_each_cluster():
    """On `SLOW_LINKS` keeping the blocks wins; with only the leaner program's memory, not
    keeping them. Each is the argmin of its list."""
    model, x = mlp()
    roomy = choose_schedule(model, MESH, (x,), AUTO, SLOW_LINKS)
    tight_cluster = dataclasses.replace(SLOW_LINKS, memory=min(item.memory.total for item in roomy.priced))
    tight = choose_schedule(model, MESH, (x,), AUTO, tight_cluster)
    assert [item.label for item in roomy.priced] == ["auto", "auto+keep"]
    for choice, cluster in ((roomy, SLOW_LINKS), (tight, tight_cluster)):
        assert choice.fits and choice.best == fastest_fitting(choice, cluster.memory)
        assert (choice.options.summa, choice.options.keep_blocks) == ("auto", choice.best.keep_blocks)
        assert choice.program.schedules == dict(choice.best.schedules)
    assert roomy.options.keep_blocks is True and tight.options.keep_blocks is False
    # the face resolves on the cluster it is given, and reuses the program it priced
    resolved = resolve_auto(model, MESH, (x,), AUTO, tight_cluster)
    assert resolved.options == tight.options and resolved.program is not None
    # with no memory for any auto program, the broadcast schedule's are priced as well
    starved = choose_schedule(model, MESH, (x,), AUTO, dataclasses.replace(SLOW_LINKS, memory=1.0))
    assert [item.label for item in starved.priced] == ["auto", "auto+keep", "broadcast", "broadcast+keep"]
    assert not starved.fits


def test_the_priced_program_is_not_compiled_again(caplog):
    model, x = mlp()
    with caplog.at_level(logging.INFO, logger="tess_compile"):
        tess_compile.simulate(model, 2, 2, example_inputs=(x,), summa="gather", keep_blocks="auto", cluster=SLOW_LINKS)
    compiles = [r for r in caplog.records if r.getMessage().startswith("compiled Sequential")]
    assert len(compiles) == 2, caplog.text  # with and without kept blocks, the chosen one reused
    assert "keep_blocks=auto: chose gather, keep_blocks=True" in caplog.text
    assert "on the given cluster" in caplog.text


@pytest.mark.parametrize("mesh", [Mesh(1, 4, "1d"), Mesh(1, 1, "2.5d")], ids=["1d", "q1"])
def test_no_summa_steps_resolve_without_pricing(mesh, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("priced a mesh without SUMMA steps")

    monkeypatch.setattr(schedule_choice, "compile_model", refuse)
    model, x = mlp()
    resolved = resolve_auto(model, mesh, (x,), dataclasses.replace(AUTO, mode=mesh.mode))
    assert (resolved.options.keep_blocks, resolved.program) == (False, None)
    assert resolved.summary.endswith("(no SUMMA steps to schedule)"), resolved.summary
    assert compile_model(model, mesh, (x,), options=resolved.options).schedules == {}  # nothing to choose


def test_a_compile_takes_no_keep_blocks_auto_and_bad_clusters_are_named():
    model, x = mlp()
    with pytest.raises(ValueError, match="keep_blocks='auto' must be resolved before compiling"):
        compile_model(model, MESH, (x,), keep_blocks="auto")
    with pytest.raises(ValueError, match="cluster file 'nowhere.json' not found"):
        tess_compile.simulate(model, 2, 2, example_inputs=(x,), cluster="nowhere.json")
    with pytest.raises(TypeError, match="cluster=4 is not a cluster"):
        tess_compile.simulate(model, 2, 2, example_inputs=(x,), cluster=4)


def test_dump_says_what_auto_chose(tmp_path):
    model, x = mlp()
    path = tmp_path / "fast.json"
    FAST_BROADCASTS.save(path)
    text = tess_compile.dump(model, 2, 2, example_inputs=(x,), summa="auto", cluster=path)
    assert f"# summa=auto on mesh [q=2, q=2, d=2]: overlap for 2 products (priced on cluster {path})\n" in text
    assert "tess.broadcast_start" in text and "tess.all_gather" not in text


def run_main(argv: list[str], folder, monkeypatch, capsys) -> tuple[int, str, str]:
    """cli.main(argv) in `folder`: (exit code, stdout, stderr)."""
    monkeypatch.chdir(folder)
    monkeypatch.setattr(sys, "path", list(sys.path))  # load_factory adds the file's folder
    monkeypatch.setitem(sys.modules, MODULE_NAME, None)  # and imports it under this name
    code = cli.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_the_command_line_takes_auto_and_a_cluster_file(tmp_path, monkeypatch, capsys):
    (tmp_path / "model.py").write_text(MODEL_PY)
    SLOW_LINKS.save(tmp_path / "slow.json")
    mesh = ["--q", "2", "--d", "2"]
    code, out, err = run_main(["run", "model.py:make_mlp", *mesh, "--simulate", "--steps", "1", "--summa", "auto",
                               "--keep-blocks", "auto", "--cluster", "slow.json"], tmp_path, monkeypatch, capsys)
    assert code == 0 and out.splitlines()[-1].startswith("max rel diff"), err
    code, out, err = run_main(["dump", "model.py:make_mlp", *mesh, "--summa", "auto", "--keep-blocks", "auto",
                               "--cluster", "slow.json"],
                              tmp_path, monkeypatch, capsys)
    assert code == 0, err
    assert "# keep_blocks=auto: chose keep_blocks=True on mesh [q=2, q=2, d=2]" in out
    assert "on cluster slow.json; summa=auto on mesh [q=2, q=2, d=2]: gather for 2 products (priced on cluster " \
           "slow.json)\n" in out
    code, _, err = run_main(["dump", "model.py:make_mlp", *mesh, "--summa", "auto", "--cluster", "missing.json"],
                            tmp_path, monkeypatch, capsys)
    assert code == 2 and "cluster file 'missing.json' not found" in err, err
    code, out, err = run_main(["plan", "model.py:make_mlp", "--gpus", "8", "--dp", "1", "--pp", "1", "--cluster",
                               "slow.json", "--gpus-per-node", "8"], tmp_path, monkeypatch, capsys)
    assert code == 0, err
    assert out.startswith("# 8 GPUs, 8 per node; intra-node 100 GB/s, 1000 us; inter-node 25 GB/s, 10000 us; "
                          "1 TFLOP/s and 1000 GB per GPU"), out


def test_the_backend_with_auto(caplog):
    torch._dynamo.reset()
    model, x = mlp()
    oracle = copy.deepcopy(model)
    compiled = torch.compile(model, backend="tesseract",
                             options={"q": 2, "d": 2, "simulate": True, "summa": "auto", "cluster": SLOW_LINKS})
    with caplog.at_level(logging.INFO, logger="tess_compile"):
        out = compiled(x)
    assert "summa=auto on mesh [q=2, q=2, d=2]: gather for 2 products (priced on the given cluster)" in caplog.text
    out.sum().backward()
    expected = oracle(x)
    expected.sum().backward()
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    for param, ref in zip(model.parameters(), oracle.parameters()):
        torch.testing.assert_close(param.grad, ref.grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("cluster, expected", [(FAST_BROADCASTS, "overlap"), (FAST_GATHERS, "gather")],
                         ids=["fast-broadcasts", "fast-gathers"])
def test_simulated_pipeline_prices_auto_on_its_cluster(cluster, expected):
    torch.manual_seed(0)
    blocks, x = [GPTBlock(8, 2).double() for _ in range(2)], torch.randn(4, 3, 8, dtype=torch.float64)
    pipeline = tess_compile.simulate_pipeline(blocks, 2, 2, example_inputs=(x,), summa="auto", cluster=cluster)
    assert [stage.program.schedules for stage in pipeline.stages] == [{expected: 4}] * 2
