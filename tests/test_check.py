"""`tess_compile.check` and `tess-compile check`: translation validation of the user's own model.

1. A small transformer (TinyGPT) matches at [2,2,2] and at 1-D p=4, and the
   user's model and inputs are left as they were (dtype, weights, no grads).
2. A broken rule is caught: LayerNorm lowered without the all-reduce of its
   backward sums (the forward stays exact) gives wrong gradients upstream of
   the norm; the report names them, and `strict=True` raises a ValueError.
3. The command line prints the table and exits 0, or 1 with the broken rule (in this
   process; the installed script in a subprocess in the slow tier).
4. A Hugging Face GPT-2 fed labels is checked on its own `.loss`, whose cast of the
   logits to float32 keeps float64 (1e-12); so do a Llama-style RMSNorm's casts, and a rule
   broken by 1e-7 behind one is caught. A cache the sharded module does not return
   (transformers' DynamicCache under use_cache=True) is "not compared", never a mismatch.
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
    assert report.compute_dtype == torch.float64 and report.tolerance == 1e-12  # its loss's .float() kept float64
    assert any(cast.startswith(".float() at ") and "modeling_gpt2.py" in cast for cast in report.kept_float64), report
    assert set(report.outputs) == {"output['loss']", "output['logits']"}
    assert "kept float64 at the model's own casts to a less precise dtype (1): .float() at modeling_gpt2.py:" \
        in report.table(), report.table()


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


class Float32RMSNorm(nn.Module):
    """Llama's and Qwen's RMSNorm: computes in float32 whatever the model's dtype."""

    def __init__(self, hidden: int):
        super().__init__()
        self.weight = nn.Parameter(1.0 + 0.1 * torch.randn(hidden))

    def forward(self, x):
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.weight * x.to(dtype)


def _llama_style():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), Float32RMSNorm(16), nn.Linear(16, 8)), torch.randn(4, 3, 8)


def test_casts_down_keep_float64_and_a_rule_off_by_1e_7_is_caught(monkeypatch):
    model, x = _llama_style()
    report = check(model, 2, 2, example_inputs=x, progress=False)
    assert report.ok and report.compute_dtype == torch.float64 and report.tolerance == 1e-12, report.table()
    assert [cast.split(" at ")[0] for cast in report.kept_float64] == [".to(torch.float32)"], report.kept_float64
    assert "test_check.py" in report.kept_float64[0]
    assert "forward" not in model.__dict__ and next(model.parameters()).dtype == torch.float32  # untouched

    table = lowering_rules("2.5d")
    monkeypatch.setitem(table, aten.rsqrt.default,  # the norm's scale off by a relative 1e-7
                        lambda b, node, args, kwargs: b.call(aten.mul.Tensor, b.call(aten.rsqrt.default, *args),
                                                             1.0 + 1e-7))
    report = check(model, 2, 2, example_inputs=x, progress=False)
    assert not report.ok and 1e-8 < report.outputs["output"] < 1e-6, report.table()


class CachingModel(nn.Module):
    """Returns a cache (an object of a class named Cache, as transformers' are) unless use_cache=False."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x, use_cache: bool = True):
        return {"logits": self.linear(x), "cache": TinyCache() if use_cache else None}


class Cache:
    pass


class TinyCache(Cache):
    pass


def test_a_cache_the_sharded_module_drops_is_not_compared_and_warned_once(caplog):
    torch.manual_seed(0)
    report = check(CachingModel(), 2, 2, example_inputs=torch.randn(4, 3, 8), progress=False)
    assert report.ok and set(report.outputs) == {"output['logits']"}, report.table()
    assert list(report.not_compared) == ["output['cache']"], report.not_compared
    assert "not compared: output['cache'], a TinyCache that the sharded module does not return" in report.table()
    assert sum("returns a TinyCache" in record.getMessage() for record in caplog.records) == 1, caplog.text


QWEN_PY = '''
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM


def make():
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    ids = torch.randint(0, 64, (4, 16))
    return Qwen2ForCausalLM(config), {"input_ids": ids, "labels": ids}
'''


@pytest.mark.slow
def test_a_default_config_hugging_face_decoder_with_labels_passes(tmp_path, monkeypatch, capsys):
    """Qwen2 as shipped: use_cache=True (its DynamicCache is not compared), RMSNorm and loss casts
    to float32 kept float64, so compared at 1e-12."""
    (tmp_path / "qwen.py").write_text(QWEN_PY)
    monkeypatch.chdir(tmp_path)
    code = cli.main(["check", "qwen.py:make", "--q", "2", "--d", "2"])
    out, err = capsys.readouterr()
    assert code == 0, out + err
    assert "tolerance 1e-12" in out and "not compared: output['cache'], a DynamicCache" in out, out
    assert ".to(torch.float32) at modeling_qwen2.py:" in out, out
