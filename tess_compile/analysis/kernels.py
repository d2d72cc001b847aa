"""The kernels a per-rank program launches, as the cost model counts them: an analysis.

`KernelRecorder` (a dispatch mode) sums, per phase of a step (forward, backward), what prices
the kernels on a cluster (`PhaseProfile`): the matrix products' FLOPs and their smallest
dimensions (fused attention included), the bytes the other kernels read and write, the bias
copies of CPU products, the kernels and the runtime's own ops. Views, allocations, collectives
and a gradient bucket's packing launch none. `kernel_profile` records a function's;
`tess_compile.analysis.cost_model` prices them, and `tess_compile.analysis.step_record` records them
in the same fake step as a step's memory (`record_step`).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.utils._python_dispatch import TorchDispatchMode

from tess_compile.analysis.accounting import PHASES
from tess_compile.core.cluster import product_terms
from tess_compile.core.fake_run import tensor_bytes, tensor_leaves
from tess_compile.ops.collectives import COLLECTIVE_OPS
from tess_compile.ops.grad_bucket import packing

__all__ = ["KernelRecorder", "PhaseProfile", "kernel_profile"]


_MATMULS = ("mm", "addmm", "bmm", "baddbmm")


# Products that add a bias term: the CPU kernels first copy it into the output.
_BIASED = ("addmm", "baddbmm")


# Fused attention kernels (forward and backward): `_scaled_dot_product_flash_attention`,
# `..._efficient_attention`, `..._flash_attention_for_cpu`, ...
_ATTENTION_PREFIX = "_scaled_dot_product"


# The namespaces of the ops whose kernels or own work cost `Cluster.op_overhead` of host time each.
_HOST_NAMESPACES = ("aten", "tess")


# Ops that launch no kernel: views, aliases, allocations.
_NO_KERNEL = ("detach", "alias", "lift_fresh", "empty", "empty_like", "empty_strided", "new_empty",
              "new_empty_strided", "_unsafe_view", "_reshape_alias", "split", "split_with_sizes", "unbind", "chunk")


@dataclass(frozen=True)
class PhaseProfile:
    """The kernels one rank launches in one phase, as the cost model prices them."""

    matmul_flops: float = 0.0  # FLOPs of the matrix products (fused attention included)
    matmul_flops_per_size: float = 0.0  # the sum over products of FLOPs / smallest dimension
    memory_bytes: float = 0.0  # bytes the other kernels read and write
    num_kernels: int = 0  # kernels launched (products and others; collectives not counted)
    num_matmuls: int = 0
    bias_bytes: float = 0.0  # bytes the products with a bias term copy it with (`Cluster.bias_copy`)
    num_ops: int = 0  # kernels and the runtime's own non-collective ops (views and allocations not counted)

    def compute_terms(self) -> dict[str, float]:
        """The amounts of the cluster's compute terms (`core.cluster.COMPUTE_TERMS`) these kernels take."""
        return {"matmul_flops": self.matmul_flops, "matmul_flops_per_size": self.matmul_flops_per_size,
                "memory_bytes": self.memory_bytes, "kernels": self.num_kernels, "ops": self.num_ops}


def _product_shape(name: str, args) -> tuple[int, int, int, int]:
    """(batch, m, k, n) of a matrix-product kernel."""
    a, b = (args[0], args[1]) if name in ("mm", "bmm") else (args[1], args[2])
    batch = a.shape[0] if a.dim() == 3 else 1
    return batch, a.shape[-2], a.shape[-1], b.shape[-1]


class KernelRecorder(TorchDispatchMode):
    """Sums, per phase, what `PhaseProfile` holds over every op dispatched below it (`phase` None:
    none, as in an optimizer's step)."""

    def __init__(self):
        super().__init__()
        self.phase = "forward"
        self.totals = {phase: {"matmul_flops": 0.0, "matmul_flops_per_size": 0.0, "memory_bytes": 0.0,
                               "bias_bytes": 0.0, "num_kernels": 0, "num_matmuls": 0, "num_ops": 0}
                       for phase in PHASES}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.record(func, args, kwargs, out)
        return out

    def record(self, func, args, kwargs: dict, out) -> None:
        """Add the op `func` of `args` and `kwargs` that returned `out` to the totals of the phase (a mode
        of its own that also records kernels calls it, one mode in place of two)."""
        name = func._overloadpacket.__name__
        if self.phase is None or packing() or func in COLLECTIVE_OPS or func.namespace not in _HOST_NAMESPACES or func.is_view \
                or name in _NO_KERNEL:
            return  # collectives (priced apart, a gradient bucket's copies with them), views, allocations
        totals = self.totals[self.phase]
        totals["num_ops"] += 1
        if func.namespace != "aten":
            return  # the runtime's own ops launch no kernel of their own
        totals["num_kernels"] += 1
        if name in _MATMULS:
            batch, m, k, n = _product_shape(name, args)
            self._product(totals, 2 * batch * m * k * n, min(m, k, n))
            if name in _BIASED:  # the bias a CPU kernel copies into the output, which the product reads back
                totals["bias_bytes"] += 2 * tensor_bytes(out)
        elif name.startswith(_ATTENTION_PREFIX):
            # forward (q, k, v, ...), backward (grad_out, q, k, v, ...); the full score
            # matrix's two products, twice as many in backward
            backward = name.endswith("_backward")
            query, key = args[1:3] if backward else args[0:2]
            batch, heads, length, head_dim = query.shape
            flops = 4 * batch * heads * length * key.shape[-2] * head_dim * (2 if backward else 1)
            self._product(totals, flops, min(length, key.shape[-2], head_dim))
        else:
            totals["memory_bytes"] += sum(tensor_bytes(t) for t in tensor_leaves(args, kwargs, out))

    @staticmethod
    def _product(totals: dict, flops: int, size: int) -> None:
        totals["num_matmuls"] += 1
        for name, amount in product_terms(flops, size).items():
            totals[name] += amount


def kernel_profile(fn) -> PhaseProfile:
    """The kernels `fn()` launches, forward and backward alike, as the cost model counts them
    (on real or fake tensors): what `tess_compile.analysis.profiling` calibrates the cluster's
    compute constants with."""
    recorder = KernelRecorder()
    with recorder:
        fn()
    return PhaseProfile(**recorder.totals["forward"])
