"""`tess_compile.check` and `tess-compile check`: translation validation of the user's own model.

1. A small transformer (TinyGPT) matches at [2,2,2] and at 1-D p=4, and the
   user's model and inputs are left as they were (dtype, weights, no grads).
2. A broken rule is caught: LayerNorm lowered without the all-reduce of its
   backward sums (the forward stays exact) gives wrong gradients upstream of
   the norm; the report names them, and `strict=True` raises a ValueError.
3. The command line prints the table and exits 0, or 1 with the broken rule (in this
   process; the installed script in a subprocess in the slow tier).
4. A Hugging Face GPT-2 fed labels is checked on its own `.loss` (its loss
   casts the logits to float32, so float32 rounding is its floor: 1e-5).
5. An op with no rule is listed as replicated, with its source line; `loss_fn=` and
   `optimizer=` replace the loss and the optimizer.
"""

from __future__ import annotations

import copy
import os
import shutil
import subprocess
import sysconfig

import hf_models
import pytest
import torch
from models import TinyGPT
from torch import nn
from torch.ops import aten

from tess_compile.passes.rules import lowering_rules
from tess_compile import check, cli
from tess_compile.ops.split_norm import split_norm
from tess_compile.validation import CheckMismatch, CheckReport

MESHES = [(2, 2, "2.5d"), (2, 1, "1d")]
MODEL_PY = '''
import torch
from torch import nn


def make():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 8))
    return model, torch.randn(4, 3, 8)
'''


def _tiny_gpt():
    torch.manual_seed(0)
    return TinyGPT(vocab=16, hidden=16, heads=4, layers=1, seq=4), torch.randint(0, 16, (4, 4))


def _break_layer_norm(monkeypatch, mode: str) -> list:
    """LayerNorm's lowering without the all-reduce of its backward sums (split_norm's axes
    dropped): the forward stays exact, the input's gradient is each rank's partial one.
    Returns the split_norm nodes it broke."""
    table = lowering_rules(mode)
    original = table[aten.layer_norm.default]
    broken = []

    def lower_without_backward_all_reduce(b, node, args, kwargs):
        out = original(b, node, args, kwargs)
        assert out.target is split_norm, out
        out.args = (*out.args[:5], (), *out.args[6:])
        broken.append(out)
        return out

    monkeypatch.setitem(table, aten.layer_norm.default, lower_without_backward_all_reduce)
    return broken


@pytest.mark.parametrize("q, d, mode", MESHES, ids=["2.5d-q2d2", "1d-p4"])
def test_a_small_transformer_matches_and_stays_untouched(q, d, mode):
    model, ids = _tiny_gpt()
    before, ids_before = copy.deepcopy(model.state_dict()), ids.clone()
    report = check(model, q, d, example_inputs=(ids,), mode=mode, progress=False)
    assert isinstance(report, CheckReport) and report.ok, report.table()
    assert report.tolerance == 1e-12 and report.compute_dtype == torch.float64
    assert report.loss_source == "a random projection of the outputs"
    assert set(report.gradients) == {name for name, _ in model.named_parameters()}
    assert report.redundant_work == pytest.approx(1.0, abs=0.05) and report.replicated_ops == []
    for name, value in model.state_dict().items():
        assert value.dtype == torch.float32 and torch.equal(value, before[name]), name
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(ids, ids_before)
    table = str(report)
    for row in ("outputs", "loss", "gradients", "weights after the step", "redundant work", "replicated ops"):
        assert f"\n{row} " in table, table
    assert "tolerance 1e-12" in table and ("[q=2, q=2, d=2]" if mode != "1d" else "1-D [p=4]") in table, table
    assert table.endswith("result: OK"), table


def test_a_broken_rule_is_caught_and_the_wrong_gradient_named(monkeypatch):
    broken = _break_layer_norm(monkeypatch, "2.5d")
    model, ids = _tiny_gpt()
    report = check(model, 2, 2, example_inputs=(ids,), progress=False)
    assert broken, "the broken LayerNorm rule never ran"
    assert not report.ok
    assert max(report.outputs.values()) <= 1e-12, report.table()  # the forward is exact
    name, error = report.worst()
    assert name.startswith("gradient of ") and error > 1e-6, report.table()
    wrong = {key for key, value in report.gradients.items() if value > report.tolerance}
    assert name.removeprefix("gradient of ") in wrong
    assert "ln_f.weight" not in wrong and "head.weight" not in wrong, wrong  # after the last norm: right
    assert f"result: MISMATCH: {name} differs" in report.table(), report.table()

    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 8))  # smaller, as strict
    with pytest.raises(ValueError, match="gradient of 0.weight differs from the unsharded model's by") as raised:
        check(mlp, 2, 2, example_inputs=torch.randn(4, 3, 8), strict=True, progress=False)
    assert isinstance(raised.value, CheckMismatch) and not raised.value.report.ok


@pytest.fixture
def factory_file(tmp_path, monkeypatch):
    (tmp_path / "model.py").write_text(MODEL_PY)
    monkeypatch.chdir(tmp_path)
    return "model.py:make"


def test_the_command_line_prints_the_table_and_exits_0(factory_file, capsys):
    code = cli.main(["check", factory_file, "--q", "2", "--d", "2"])
    out, err = capsys.readouterr()
    assert code == 0, out + err
    assert out.startswith("tess-compile check: mesh [q=2, q=2, d=2]") and "result: OK" in out, out


def test_the_command_line_exits_1_on_a_mismatch(factory_file, monkeypatch, capsys):
    _break_layer_norm(monkeypatch, "2.5d")
    code = cli.main(["check", factory_file, "--q", "2", "--d", "2"])
    out, err = capsys.readouterr()
    assert code == 1, out + err
    assert "result: MISMATCH: gradient of 0." in out, out  # the first Linear, before the norm
    assert "tess-compile: error: gradient of 0." in err, err


@pytest.mark.slow
def test_the_installed_script_checks_a_model(factory_file):
    scripts = os.pathsep.join([sysconfig.get_path("scripts"), os.environ.get("PATH", "")])
    script = shutil.which("tess-compile", path=scripts)
    if script is None:
        pytest.fail("the tess-compile script is not installed: run `python3 -m pip install -e .` in the repository")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([script, "check", factory_file, "--q", "2", "--d", "1", "--mode", "1d"], env=env,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "mesh 1-D [p=4]" in proc.stdout and proc.stdout.rstrip().endswith("result: OK"), proc.stdout
    assert "stages," not in proc.stderr, proc.stderr  # no progress bar off a terminal


def test_a_hugging_face_model_is_checked_on_its_own_loss():
    model, kwargs = hf_models.build("gpt2", 2, 2)
    report = check(model, 2, 2, example_inputs=kwargs, progress=False)
    assert report.ok, report.table()
    assert report.loss_source == "the output's .loss"
    assert report.compute_dtype == torch.float32 and report.tolerance == 1e-5  # HF's loss upcasts to float32
    assert set(report.outputs) == {"output['loss']", "output['logits']"}
    assert "(its code casts float64 down to float32): tolerance 1e-05" in report.table(), report.table()


class PowerOfTwo(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x):
        return self.linear(torch.pow(2.0, x))  # aten.pow.Scalar has no sharding rule


def test_ops_without_a_rule_are_listed_as_replicated_and_the_loss_and_optimizer_are_the_users():
    torch.manual_seed(0)
    with pytest.warns(UserWarning, match="run replicated"):
        report = check(PowerOfTwo(), 2, 2, example_inputs=(torch.randn(4, 3, 8),), progress=False,
                       loss_fn=lambda out: out.pow(2).mean(), optimizer=lambda params: torch.optim.Adam(params))
    assert report.ok, report.table()
    assert report.loss_source == "loss_fn" and report.optimizer == "Adam(lr=0.001)"
    assert len(report.replicated_ops) == 1 and report.replicated_ops[0].startswith("pow.Scalar x1 at "), report
    assert "test_check.py" in report.replicated_ops[0]
