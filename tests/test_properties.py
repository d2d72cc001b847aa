"""Property test: for any small block and mesh, the simulated model either
matches the unsharded model (forward and every gradient) or refuses with a
documented ValueError; a shardable configuration must match.

The property runs in float64. The drawn sizes include degenerate ones
(LayerNorm over 2 features, one token, a batch whose gradient terms cancel)
where fp32 itself is only good to ~5e-5 against the exact result, so an
fp32 comparison at 1e-5 would fail for reasons unrelated to sharding. In
float64 both sides agree to ~1e-14, and a sharding error is still O(1).
fp32 parity on well-conditioned sizes is test_parity.py's job. The fast tier
draws 6 examples, the slow tier 40.
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import assert_close_rel
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from models import make_block

import tess_compile
from tess_compile.core.mesh import Mesh


@st.composite
def configs(draw):
    q = draw(st.sampled_from([1, 2, 2, 3, 3]))  # q=1 is the trivial mesh: draw it less
    d = draw(st.integers(1, q))
    kind = draw(st.sampled_from(["gpt", "llama"]))
    # Half the examples are drawn shardable (batch a multiple of d*q, heads of q),
    # so that most of them reach the comparison rather than the ValueError.
    aligned = draw(st.booleans())
    if aligned:
        batch = d * q * draw(st.integers(1, max(1, 8 // (d * q))))
        heads = q * draw(st.integers(1, max(1, 4 // q)))
        hidden = heads * draw(st.integers(1, 3))
    else:
        batch = draw(st.integers(1, 8))
        if draw(st.booleans()):
            heads = draw(st.integers(1, 4))
            hidden = heads * draw(st.integers(1, 3))
        else:  # odd sizes: any hidden, any head count that divides it
            hidden = draw(st.integers(1, 12))
            heads = draw(st.sampled_from([h for h in range(1, 5) if hidden % h == 0]))
    return dict(
        q=q,
        d=d,
        kind=kind,
        hidden=hidden,
        heads=heads,
        batch=batch,
        seq=draw(st.integers(1, 5)),
        bias=draw(st.booleans()),
        mlp=draw(st.sampled_from(["gelu", "swiglu"])),
        seed=draw(st.integers(0, 2**16)),
    )


def shardable(c) -> bool:
    """Sizes that the layouts split evenly: batch over d*q, whole heads over q."""
    return c["batch"] % (c["d"] * c["q"]) == 0 and c["heads"] % c["q"] == 0


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(configs())
def test_match_or_value_error(c):
    check_match_or_value_error(c)


@pytest.mark.slow
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(configs())
def test_more_match_or_value_error(c):
    check_match_or_value_error(c)


def check_match_or_value_error(c) -> None:
    """The simulated block of `c` matches the unsharded one, or refuses with a ValueError naming the mesh (only
    where the sizes do not split)."""
    torch.manual_seed(c["seed"])
    q, d = c["q"], c["d"]
    model = make_block(c["kind"], c["hidden"], c["heads"], bias=c["bias"], mlp=c["mlp"]).double()
    reference = copy.deepcopy(model)
    x = torch.randn(c["batch"], c["seq"], c["hidden"], dtype=torch.float64)
    try:
        sim = tess_compile.simulate(model, q, d, example_inputs=(x,), verify=True)
    except ValueError as err:
        event("ValueError")
        assert not shardable(c), f"{c}: a shardable configuration was refused: {err}"
        assert str(Mesh(q, d)) in str(err), f"{c}: the error does not name the mesh: {err}"
        return

    event(f"compared q={q} d={d}")
    x_sim, x_ref = x.clone().requires_grad_(), x.clone().requires_grad_()
    out, expected = sim(x_sim), reference(x_ref)
    assert_close_rel(out, expected, name=f"output {c}")
    target = torch.randn_like(expected)
    (out * target).sum().backward()
    (expected * target).sum().backward()
    assert_close_rel(x_sim.grad, x_ref.grad, name=f"input grad {c}")
    grads = sim.full_grads()
    for name, param in reference.named_parameters():
        assert_close_rel(grads[name], param.grad, name=f"grad of {name} {c}")
