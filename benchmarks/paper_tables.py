"""The transformer layer the benchmarks compile, and the Tesseract paper's Tables 1 and 2.

`Block` is a pre-LN GPT layer (fused QKV, causal attention, MLP 4x), the
layer all three methods parallelise in the papers. `TABLE_1` (strong
scaling) and `TABLE_2` (weak scaling) hold each row's method, mesh, batch,
hidden size, heads and the measured forward and backward seconds per batch
(NVLink 200 GB/s inside nodes of 4 A100s, InfiniBand 200 Gb/s between).

The paper does not state the sequence length or the layer count: the
benchmarks assume `SEQ` and report per layer. A batch that the mesh's
`d*q` does not divide (12 on [4,4,2] and [8,8,1]) is raised to the next
multiple, as the paper itself did for [4,4,4]; the tables print the batch used.

`compile_paper_layer` compiles a row as the paper's runs most likely ran it
(docs/planner.md, "Calibration"): in fp16 (`PAPER_DTYPE`), the layer
recomputed in backward (activation checkpointing: the measured backward is
3.0x the forward in every Tesseract and Optimus row, forward + twice the
forward); `compile_layer` compiles the plain fp32 layer.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from tess_compile.passes.driver import compile_model
from tess_compile.core.mesh import Mesh
from tess_compile.core.program import Program

__all__ = ["PAPER_DTYPE", "SEQ", "TABLE_1", "TABLE_2", "Block", "CheckpointedBlock", "PaperRow", "compile_layer",
           "compile_paper_layer"]

SEQ = 512  # assumed: the paper does not give the sequence length
PAPER_DTYPE = torch.float16  # assumed: the paper's codes (Megatron-LM, Optimus, ColossalAI) train in fp16


class Block(nn.Module):
    """Pre-LN GPT block with fused QKV and causal attention."""

    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv, self.proj = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
        self.fc, self.out = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(h, dim=-1)
        q, k, v = (t.view(b, s, self.heads, h // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, h)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class CheckpointedBlock(nn.Module):
    """A `Block` under activation checkpointing: backward recomputes it, collectives included."""

    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.block = Block(hidden, heads)

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False)


def compile_layer(mesh: Mesh, batch: int, hidden: int, heads: int, seq: int = SEQ, *,
                  dtype: torch.dtype = torch.float32, checkpoint: bool = False) -> Program:
    """One `Block` (a `CheckpointedBlock` if `checkpoint`) on a `[batch, seq, hidden]` input
    of `dtype`, built on the meta device (no weight is allocated) and compiled for `mesh` in the
    papers' schedule (q broadcasts of each operand) with the batch split alone (Megatron-LM without
    sequence parallelism), as the paper's codes ran it."""
    with torch.device("meta"):
        block = (CheckpointedBlock if checkpoint else Block)(hidden, heads).to(dtype)
        x = torch.empty(batch, seq, hidden, dtype=dtype)
    return compile_model(block, mesh, (x,), summa="broadcast", token_split="none")


@functools.lru_cache(maxsize=None)
def compile_paper_layer(row: "PaperRow", seq: int = SEQ) -> Program:
    """One layer of `row`'s configuration as the paper ran it (assumed): fp16, checkpointed.
    Cached: each row is compiled once per process."""
    return compile_layer(row.mesh, row.batch_used, row.hidden, row.heads, seq, dtype=PAPER_DTYPE, checkpoint=True)


@dataclass(frozen=True)
class PaperRow:
    method: str  # "Megatron-LM", "Optimus" or "Tesseract"
    mesh: Mesh
    batch: int  # the paper's batch
    hidden: int
    heads: int
    forward_s: float  # measured seconds per batch
    backward_s: float

    @property
    def batch_used(self) -> int:
        """The paper's batch, raised to a multiple of the batch split d*q if needed."""
        parts = self.mesh.size("depth") * self.mesh.size("row")
        return -(-self.batch // parts) * parts

    @property
    def shape(self) -> str:
        """The paper's notation: [p], [q,q] or [q,q,d]."""
        if self.mesh.mode == "1d":
            return f"[{self.mesh.num_ranks}]"
        if self.mesh.mode == "2d" and self.method == "Optimus":
            return f"[{self.mesh.q},{self.mesh.q}]"
        return f"[{self.mesh.q},{self.mesh.q},{self.mesh.d}]"


def _row(method: str, shape: tuple, batch: int, hidden: int, heads: int, fwd: float, bwd: float) -> PaperRow:
    if method == "Megatron-LM":
        mesh = Mesh(1, shape[0], "1d")
    elif method == "Optimus":
        mesh = Mesh(shape[0], 1, "2d")
    else:
        mesh = Mesh(shape[0], shape[2])
    return PaperRow(method, mesh, batch, hidden, heads, fwd, bwd)


TABLE_1 = [
    _row("Megatron-LM", (4,), 12, 3072, 64, 0.1225, 0.4749),
    _row("Megatron-LM", (16,), 12, 3072, 64, 0.1143, 0.4293),
    _row("Megatron-LM", (64,), 12, 3072, 64, 0.1195, 0.5306),
    _row("Optimus", (2, 2), 12, 3072, 64, 0.1676, 0.5019),
    _row("Optimus", (4, 4), 12, 3072, 64, 0.2099, 0.6159),
    _row("Optimus", (8, 8), 12, 3072, 64, 0.1329, 0.3986),
    _row("Tesseract", (2, 2, 1), 12, 3072, 64, 0.1666, 0.5014),
    _row("Tesseract", (2, 2, 2), 12, 3072, 64, 0.0999, 0.3002),
    _row("Tesseract", (4, 4, 1), 12, 3072, 64, 0.1444, 0.4343),
    _row("Tesseract", (4, 4, 2), 12, 3072, 64, 0.1244, 0.3727),
    _row("Tesseract", (4, 4, 4), 16, 3072, 64, 0.0869, 0.2636),
    _row("Tesseract", (8, 8, 1), 12, 3072, 64, 0.1799, 0.5178),
]

TABLE_2 = [
    _row("Megatron-LM", (4,), 60, 2048, 32, 0.0793, 0.2613),
    _row("Megatron-LM", (16,), 60, 4096, 64, 0.2081, 0.5149),
    _row("Megatron-LM", (64,), 30, 8192, 128, 0.4638, 1.0963),
    _row("Optimus", (2, 2), 96, 2048, 32, 0.0827, 0.2445),
    _row("Optimus", (4, 4), 192, 4096, 64, 0.1829, 0.5458),
    _row("Optimus", (8, 8), 384, 8192, 128, 0.1962, 0.5964),
    _row("Tesseract", (1, 1, 1), 48, 1024, 16, 0.0603, 0.1669),
    _row("Tesseract", (2, 2, 1), 96, 2048, 32, 0.0867, 0.2557),
    _row("Tesseract", (2, 2, 2), 192, 2048, 32, 0.0864, 0.2552),
    _row("Tesseract", (4, 4, 1), 192, 4096, 64, 0.1177, 0.3553),
    _row("Tesseract", (4, 4, 2), 384, 4096, 64, 0.1173, 0.3521),
    _row("Tesseract", (4, 4, 4), 768, 4096, 64, 0.1155, 0.3468),
    _row("Tesseract", (8, 8, 1), 384, 8192, 128, 0.1799, 0.5178),
]
