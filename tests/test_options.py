"""One option list: every entry point takes the compile options of `CompileOptions`, by the
same keywords with the same defaults, and compiles with every value each option takes, through
the one compile entry (`tess_compile.analysis.compile_entry.compile_for`); `checkpoint=` is the
deprecated name of `recompute=`; an unknown keyword is a TypeError that names the options; old
module paths still import."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import sys

import pytest
import torch
from models import GPTBlock
from torch import nn

import tess_compile
from tess_compile import CompileOptions
from tess_compile.cli import make_parser
from tess_compile.moved import MOVED

FIELDS = {field.name: field.default for field in dataclasses.fields(CompileOptions)}
ENTRY_POINTS = [tess_compile.shard, tess_compile.simulate, tess_compile.dump, tess_compile.check,
                tess_compile.pipeline_stage, tess_compile.simulate_pipeline, tess_compile.backend]


def small():
    torch.manual_seed(0)
    return GPTBlock(8, 2, bias=True).double(), torch.randn(4, 3, 8, dtype=torch.float64)


@pytest.mark.parametrize("entry", ENTRY_POINTS, ids=lambda f: f.__name__)
def test_every_entry_point_takes_the_same_options(entry):
    parameters = inspect.signature(entry).parameters
    taken = {name: parameters[name].default for name in FIELDS if name in parameters}
    assert taken == FIELDS, entry.__name__
    assert parameters["options"].default is None
    assert all(parameters[name].kind is inspect.Parameter.KEYWORD_ONLY for name in FIELDS)


@pytest.mark.parametrize("command", ["dump", "check", "run"])
def test_the_command_line_takes_the_same_options(command):
    parser = make_parser()
    args = parser.parse_args([command, "model.py:make", "--q", "2", "--d", "1"])
    assert {name: getattr(args, name) for name in FIELDS} == FIELDS
    args = parser.parse_args([command, "model.py:make", "--q", "2", "--d", "1", "--mode", "2d", "--summa", "gather",
                              "--keep-blocks", "--recompute", "blocks", "--batch-split", "depth", "--token-split",
                              "row", "--token-order", "contiguous", "--context", "ring", "--dynamic", "--strict",
                              "--verify"])
    assert {name: getattr(args, name) for name in FIELDS} == dict(mode="2d", summa="gather", keep_blocks=True,
                                                                   recompute="blocks", batch_split="depth",
                                                                   token_split="row", token_order="contiguous",
                                                                   context="ring", dynamic=True,
                                                                   strict=True, verify=True)
    old = parser.parse_args([command, "model.py:make", "--q", "2", "--d", "1", "--checkpoint", "selective"])
    assert old.recompute == "selective"
    auto = parser.parse_args([command, "model.py:make", "--q", "2", "--d", "1", "--summa", "auto",
                              "--keep-blocks", "auto"])
    assert (auto.summa, auto.keep_blocks) == ("auto", "auto")
    off = parser.parse_args([command, "model.py:make", "--q", "2", "--d", "1", "--keep-blocks", "off"])
    assert off.keep_blocks is False


# Each face that compiles in this process: (face, options) -> what the caller gets, after one call.
def _block():
    """A GPT block of 4 heads (they split over p = 4 in 1-D), float64, and its input."""
    torch.manual_seed(0)
    return GPTBlock(16, 4, bias=True).double(), torch.randn(4, 3, 16, dtype=torch.float64)


def _simulate(options):
    model, x = _block()
    sim = tess_compile.simulate(model, 2, _depth(options), example_inputs=(x,), options=options)
    return sim(x)


def _dump(options):
    model, x = _block()
    return tess_compile.dump(model, 2, _depth(options), example_inputs=(x,), options=options)


def _check(options):
    model, x = _block()
    return tess_compile.check(model, 2, _depth(options), example_inputs=(x,), options=options, progress=False)


def _backend(options):
    model, x = _block()
    torch._dynamo.reset()
    fields = {field: getattr(options, field) for field in FIELDS}
    return torch.compile(model, backend=tess_compile.backend(q=2, d=_depth(options), simulate=True, **fields))(x)


def _pipeline(options):
    (first, x), (second, _) = _block(), _block()
    pipe = tess_compile.simulate_pipeline([first, second], 2, _depth(options), example_inputs=(x,), options=options)
    return pipe(x)


def _depth(options) -> int:
    """d of the mesh: 2 but where the mode asks d = 1 (2d, and 1d's p = 4)."""
    return 1 if options.mode in ("2d", "1d") else 2


FACES = {"simulate": _simulate, "dump": _dump, "check": _check, "backend": _backend, "simulate_pipeline": _pipeline}
VALUES = [(name, value) for name, values in {
    "mode": ("2.5d", "2d", "3d", "1d"), "summa": ("auto", "broadcast", "overlap", "gather"),
    "keep_blocks": (False, True, "auto"), "recompute": ("none", "blocks", "selective"), "dynamic": (False, True),
    "strict": (False, True), "verify": (None, False, True),
}.items() for value in values]
# What a face refuses by design, with the words of its ValueError.
REFUSED = {("simulate_pipeline", "dynamic", True): "dynamic=True is not supported for pipeline stages"}


def _accepts(face: str, name: str, value) -> None:
    options = CompileOptions(**{name: value})
    refused = REFUSED.get((face, name, value))
    if refused is None:
        assert FACES[face](options) is not None
        return
    with pytest.raises(ValueError, match=refused):
        FACES[face](options)


def test_pipeline_stages_take_keep_blocks_auto():
    """keep_blocks="auto" is resolved once for each pipeline stage (it crashed there; every face with every
    value: the slow tier's test_every_face_takes_every_option_value)."""
    _accepts("simulate_pipeline", "keep_blocks", "auto")


@pytest.mark.slow
@pytest.mark.parametrize("face", FACES)
@pytest.mark.parametrize("name, value", VALUES, ids=[f"{n}={v}" for n, v in VALUES])
def test_every_face_takes_every_option_value(face, name, value):
    _accepts(face, name, value)


def test_options_object_and_keywords_give_one_program():
    model, x = small()
    by_keywords = tess_compile.simulate(model, 2, 2, example_inputs=(x,), summa="gather", keep_blocks=True)
    by_object = tess_compile.simulate(model, 2, 2, example_inputs=(x,),
                                      options=CompileOptions(summa="gather", keep_blocks=True))
    assert by_keywords.program.graph.code == by_object.program.graph.code
    with pytest.raises(TypeError, match="got options= and the option keywords"):
        tess_compile.simulate(model, 2, 2, example_inputs=(x,), options=CompileOptions(), summa="gather")


def test_dump_takes_the_schedule():
    """`dump` had no `summa` before the options were one list."""
    model, x = small()
    text = tess_compile.dump(model, 2, 1, example_inputs=(x,), summa="gather")
    assert "tess.all_gather" in text and "tess.broadcast(" not in text


def test_checkpoint_is_the_deprecated_name_of_recompute():
    model, x = small()
    with pytest.warns(FutureWarning, match=r"tess_compile.simulate\(checkpoint=...\) is deprecated: pass recompute="):
        old = tess_compile.simulate(model, 2, 1, example_inputs=(x,), checkpoint="selective")
    new = tess_compile.simulate(model, 2, 1, example_inputs=(x,), recompute="selective")
    assert old.program.graph.code == new.program.graph.code
    with pytest.raises(TypeError, match="got both checkpoint= and recompute="):
        tess_compile.simulate(model, 2, 1, example_inputs=(x,), checkpoint="none", recompute="none")


def test_an_unknown_keyword_names_the_options():
    model, x = small()
    with pytest.raises(TypeError, match=r"tess_compile.simulate\(\) got an unexpected keyword argument 'sumam' "
                                        r"\(did you mean 'summa'\?\); its compile options are mode, summa"):
        tess_compile.simulate(model, 2, 1, example_inputs=(x,), sumam="gather")


@pytest.mark.parametrize("field, value, message", [
    ("summa", "ring", "summa='ring' is not a schedule: use one of 'broadcast', 'overlap', 'gather'"),
    ("recompute", "all", "recompute='all' is not a recompute option: use one of 'none', 'blocks', 'selective'"),
    ("mode", "4d", "mode '4d' is not one of '1d', '2d', '2.5d', '3d'"),
    ("keep_blocks", "yes", "keep_blocks='yes' is not a bool or 'auto': pass keep_blocks=True, False or 'auto'"),
    ("verify", 1, "verify=1 is not a bool"),
])
def test_bad_option_values(field, value, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        CompileOptions(**{field: value})


def test_the_backend_by_name_takes_the_options():
    model, x = small()
    oracle = GPTBlock(8, 2, bias=True).double()
    oracle.load_state_dict(model.state_dict())
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="tesseract",
                             options={"q": 2, "d": 1, "simulate": True, "summa": "gather", "recompute": "selective"})
    assert torch.allclose(compiled(x), oracle(x), rtol=1e-12, atol=1e-12)
    with pytest.raises(Exception, match="it needs q and d and takes"):
        torch._dynamo.reset()
        torch.compile(nn.Linear(8, 8).double(), backend="tesseract", options={"q": 2, "d": 1, "sumam": "x"})(x)


def test_old_module_paths_still_import_with_a_warning():
    sys.modules.pop("tess_compile.cost_model", None)
    with pytest.warns(FutureWarning, match="tess_compile.cost_model is deprecated: its code moved to"):
        old = importlib.import_module("tess_compile.cost_model")
    assert old.predict_memory is tess_compile.analysis.memory.predict_memory
    assert old.Cluster is tess_compile.core.cluster.Cluster
    with pytest.raises(AttributeError, match="has no attribute 'nothing_here'"):
        old.nothing_here  # noqa: B018
    for name, homes in MOVED.items():  # every new home exists
        for home in homes:
            importlib.import_module(home)
