"""Per-rank memory of a sharded GPT-2: parameter bytes near total/q^2, and no
per-rank tensor ever has the full vocabulary as a dim (logits stay split)."""

from __future__ import annotations

import torch
from hf_models import build

import tess_compile
from tess_compile.core.mesh import AXES


def _parts(layout, mesh) -> int:
    return int(torch.tensor([mesh.size(a) for a in AXES if type(layout.on(a)).__name__ == "Shard"] + [1]).prod())


def test_gpt2_parameter_bytes_and_no_full_logits():
    q, d = 2, 2
    model, kwargs = build("gpt2", q, d, torch.float32)
    vocab = model.config.vocab_size
    sim = tess_compile.simulate(model, q, d, example_inputs=kwargs, verify=True)
    mesh = sim.mesh
    params = dict(model.named_parameters())
    matrices = sum(p.numel() for p in params.values() if p.dim() == 2)
    vectors = sum(p.numel() for p in params.values() if p.dim() == 1)
    expected = matrices / q**2 + vectors / q  # vectors are split over col only
    for rank in range(mesh.num_ranks):
        held = sum(p.numel() for p in sim.ranks[rank].parameters())
        assert held <= 1.05 * expected, f"rank {rank} holds {held} parameters, expected about {expected:.0f}"
    # The learned positions are the one matrix split q ways, not q^2 (their ids are not batch-split).
    split_q2 = [s.name for s in sim.program.params if s.shape and len(s.shape) == 2 and _parts(s.layout, mesh) == q * q]
    assert "transformer.wte.weight" in split_q2
    for node in sim.program.graph.graph.nodes:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and val.dim() >= 2:
            assert vocab not in val.shape, f"{node.name} has the full vocabulary ({vocab}) in its local shape {list(val.shape)}"


def test_a_tied_weight_is_one_tensor_in_the_fake_run():
    """GPT-2's `lm_head.weight` (tied to `wte`) keeps `ALIAS_OF` on its per-rank placeholder and takes
    the tied tensor's very value, as the runtime feeds it: no second block in the predicted bytes."""
    from tess_compile.core.fake_run import placeholder_values
    from tess_compile.core.meta_keys import ALIAS_OF, ROLE

    model, kwargs = build("gpt2", 2, 1, torch.float32)
    program = tess_compile.simulate(model, 2, 1, example_inputs=kwargs).program
    nodes = list(program.graph.graph.find_nodes(op="placeholder"))
    values = dict(zip(nodes, placeholder_values(program.graph, program.mesh)))
    by_name = {ROLE.of(node)[1]: values[node] for node in nodes}
    (alias,) = [node for node in nodes if ROLE.of(node)[0] == "alias"]
    assert ALIAS_OF.of(alias) == "transformer.wte.weight"
    assert values[alias] is by_name["transformer.wte.weight"]
