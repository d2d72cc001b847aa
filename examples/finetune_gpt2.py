"""Fine-tune a small Hugging Face GPT-2 with tess-compile on a shipped text.

A `transformers.GPT2LMHeadModel` is built from a small `GPT2Config` (random
weights, nothing downloaded, dropout off, tied embeddings) with a
character-level vocabulary taken from examples/data/tiny_text.txt. It is
sharded with `tess_compile.shard` on a [q, q, d] Tesseract mesh of q*q*d
local gloo processes and trained with AdamW on random windows of the text,
the model computing its own language-model loss
(`sharded(input_ids=ids, labels=ids, use_cache=False).loss`). Every rank also
trains an identical unsharded copy (the oracle) on the same batches, and
rank 0 prints both losses per step. At the end the sharded model's
`full_state_dict()` is loaded into a fresh unsharded GPT2LMHeadModel, which
writes a short greedy continuation of a prompt (shown beside the untrained
model's).

AdamW runs with eps 1e-6 rather than its default 1e-8. The two models'
gradients agree to float32 rounding (about 1e-8), but a few gradients are
themselves no larger: the key projection's bias has an exactly zero gradient
in exact arithmetic (softmax ignores a constant added to every key), so in
float32 it is rounding noise of order 1e-11, and a few weight entries have
gradients of order 1e-9. AdamW divides each gradient by sqrt(v) + eps, which
with eps 1e-8 turns such noise into steps of order lr whose sign depends on
the summation order: the losses then part by more than 1e-5 (relative) from
about step 16 (`--eps 1e-8` shows it). With eps 1e-6 the default 30 steps
agree to about 1e-6. Longer runs part anyway, from about step 40: float32
training amplifies rounding differences; see tests/test_hf_models.py for
exact gradient checks.

In 30 steps the model goes from uniform guessing (loss ln 64 = 4.16) to the
text's letter frequencies (about 2.95), so its greedy continuation is all
spaces, the commonest character; the most likely next characters, printed
beside it, show what it learned. `--steps 200` (about 2.5 minutes on two
cores) writes "the the the ...".

    python3 examples/finetune_gpt2.py                 # q=2, d=2: 8 processes
    python3 examples/finetune_gpt2.py --simulate      # all 8 ranks in this process
    python3 examples/finetune_gpt2.py --q 2 --d 1 --steps 10
"""

from __future__ import annotations

import argparse
import copy
import logging
import math
import os
import sys
import time
import warnings

import torch
import transformers
from transformers import GPT2Config, GPT2LMHeadModel

try:
    import tess_compile
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import tess_compile
from tess_compile import run_local

log = logging.getLogger("finetune_gpt2")

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_TEXT = os.path.join(HERE, "data", "tiny_text.txt")
PROMPT = "The weather"
SAMPLE_CHARS = 60


# --------------------------------------------------------------------------- data


class CharVocab:
    """A character-level vocabulary of a text, padded with unused ids to a multiple of `multiple`."""

    def __init__(self, text: str, multiple: int):
        self.chars = sorted(set(text))
        self.index = {c: i for i, c in enumerate(self.chars)}
        self.size = multiple * math.ceil(len(self.chars) / multiple)

    def encode(self, text: str) -> torch.Tensor:
        unknown = sorted(set(text) - set(self.index))
        if unknown:
            raise ValueError(f"characters {unknown!r} are not in the vocabulary of the training text")
        return torch.tensor([self.index[c] for c in text], dtype=torch.long)

    def decode(self, ids) -> str:
        # Padding ids never occur in the text; shown as <pad> should the model pick one.
        return "".join(self.chars[i] if i < len(self.chars) else "<pad>" for i in ids)


class Windows:
    """Batches of random windows of the encoded text from a seeded generator: the same on every rank."""

    def __init__(self, tokens: torch.Tensor, seq: int, batch: int, seed: int):
        self.tokens, self.seq, self.batch = tokens, seq, batch
        self.gen = torch.Generator().manual_seed(seed)

    def next(self) -> torch.Tensor:
        """(batch, seq) token ids; the model shifts them itself to predict each next character."""
        starts = torch.randint(len(self.tokens) - self.seq + 1, (self.batch,), generator=self.gen)
        return torch.stack([self.tokens[s:s + self.seq] for s in starts.tolist()])


def vocab_multiple(q: int) -> int:
    """The vocabulary is padded to a multiple of both q (the embedding is split over it) and 64."""
    return 64 * q // math.gcd(64, q)


def load_text(args) -> tuple[CharVocab, torch.Tensor]:
    with open(args.text, encoding="utf-8") as f:
        text = f.read()
    vocab = CharVocab(text, vocab_multiple(args.q))
    return vocab, vocab.encode(text)


# --------------------------------------------------------------------------- model


def make_model(args, vocab_size: int) -> GPT2LMHeadModel:
    """A fresh GPT-2 with random weights drawn from torch's global generator."""
    cfg = GPT2Config(
        vocab_size=vocab_size, n_positions=args.seq, n_embd=args.hidden, n_layer=args.layers,
        n_head=args.heads, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        summary_first_dropout=0.0, use_cache=False, tie_word_embeddings=True,
    )
    return GPT2LMHeadModel(cfg)


def build(args):
    """The vocabulary, the model, an identical unsharded copy (the oracle), the data stream and an example batch."""
    transformers.logging.set_verbosity_error()
    vocab, tokens = load_text(args)
    torch.manual_seed(args.seed)  # HF initialises weights from the global generator: same model on every rank
    model = make_model(args, vocab.size)
    oracle = copy.deepcopy(model)
    example = Windows(tokens, args.seq, args.batch, args.seed + 1).next()
    return vocab, model, oracle, Windows(tokens, args.seq, args.batch, args.seed + 1), example


def compile_quietly(fn, *fn_args, **kwargs):
    """Call tess_compile.shard / simulate, logging its one "ops run replicated" warning at INFO
    (so on rank 0 only).

    GPT-2 has a few small ops without a sharding rule (the `aten.index` of its attention mask);
    they run replicated on every rank, and every rank's compile reports them.
    """
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UserWarning)
        result = fn(*fn_args, **kwargs)
    for warning in caught:
        if "no sharding rule" in str(warning.message):
            log.info("%s", warning.message)
    return result


# --------------------------------------------------------------------------- training


def train(args, sharded, oracle: GPT2LMHeadModel, data: Windows, *, show: bool) -> list[tuple]:
    """Run args.steps AdamW steps on both models; return rows (step, sharded, unsharded, diff)."""
    opt = torch.optim.AdamW(sharded.parameters(), lr=args.lr, eps=args.eps)
    opt_oracle = torch.optim.AdamW(oracle.parameters(), lr=args.lr, eps=args.eps)
    if show:
        print_header()
    rows = []
    for step in range(1, args.steps + 1):
        ids = data.next()

        opt.zero_grad(set_to_none=True)
        loss = sharded(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        opt.step()

        opt_oracle.zero_grad(set_to_none=True)
        loss_oracle = oracle(input_ids=ids, labels=ids, use_cache=False).loss
        loss_oracle.backward()
        opt_oracle.step()

        row = (step, loss.item(), loss_oracle.item(), abs(loss.item() - loss_oracle.item()))
        rows.append(row)
        if show:
            print_row(row)
    return rows


@torch.no_grad()
def greedy_sample(model: GPT2LMHeadModel, vocab: CharVocab, prompt: str, chars: int, seq: int) -> str:
    """`prompt` and `chars` characters after it, each the most likely next one (context: the last `seq`)."""
    was_training = model.training
    model.eval()
    ids = vocab.encode(prompt).tolist()
    for _ in range(chars):
        context = torch.tensor([ids[-seq:]])
        logits = model(input_ids=context, use_cache=False).logits[0, -1]
        ids.append(int(logits.argmax()))
    model.train(was_training)
    return vocab.decode(ids)


@torch.no_grad()
def likely_next(model: GPT2LMHeadModel, vocab: CharVocab, prompt: str, seq: int, k: int = 5) -> str:
    """The k most likely characters after `prompt` (context: its last `seq`), with their probabilities."""
    was_training = model.training
    model.eval()
    logits = model(input_ids=vocab.encode(prompt)[None, -seq:], use_cache=False).logits[0, -1]
    model.train(was_training)
    probs, ids = logits.softmax(-1).topk(k)
    return ", ".join(f"{vocab.decode([i])!r} {p:.2f}" for p, i in zip(probs.tolist(), ids.tolist()))


def describe(args, vocab: CharVocab, model: GPT2LMHeadModel) -> dict:
    """A greedy continuation of PROMPT and the most likely characters after it."""
    return {"sample": greedy_sample(model, vocab, PROMPT, SAMPLE_CHARS, args.seq),
            "next": likely_next(model, vocab, PROMPT, args.seq)}


def finish(args, vocab: CharVocab, full_state: dict, oracle: GPT2LMHeadModel) -> dict:
    """Load the gathered weights into a fresh unsharded GPT-2 and let it write; compare with the oracle's weights."""
    fresh = make_model(args, vocab.size)
    fresh.load_state_dict(full_state)
    reference = oracle.state_dict()
    weight_diff = max((full_state[k] - v).abs().max().item() for k, v in reference.items())
    return {"after": describe(args, vocab, fresh), "weight_diff": weight_diff}


def rank_main(rank: int, world_size: int, args) -> dict | None:
    """One process of the distributed run (called by run_local on every rank)."""
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"%(asctime)s rank {rank} %(levelname)s %(message)s")
    vocab, model, oracle, data, example = build(args)
    log.info("compiling GPT-2 for mesh q=%d d=%d on %d ranks", args.q, args.d, world_size)
    sharded = compile_quietly(tess_compile.shard, model, args.q, args.d,
                              example_inputs={"input_ids": example, "labels": example, "use_cache": False},
                              timeout=120)
    log.info("compiled; rank 0 holds %d of the model's %d parameters",
             sum(p.to_local().numel() for p in sharded.parameters()), sum(p.numel() for p in oracle.parameters()))
    before = describe(args, vocab, oracle) if rank == 0 else None  # the oracle still has the initial weights
    rows = train(args, sharded, oracle, data, show=rank == 0)
    full_state = sharded.full_state_dict()  # a collective: every rank takes part
    if rank != 0:
        return None
    return {"rows": rows, "before": before, **finish(args, vocab, full_state, oracle)}


def simulate_main(args) -> dict:
    """Every rank of the mesh in this process, via tess_compile.simulate."""
    vocab, model, oracle, data, example = build(args)
    log.info("compiling GPT-2 for mesh q=%d d=%d (simulated, %d ranks)", args.q, args.d, args.q * args.q * args.d)
    sim = compile_quietly(tess_compile.simulate, model, args.q, args.d,
                          example_inputs={"input_ids": example, "labels": example, "use_cache": False})
    log.info("compiled; training %d steps", args.steps)
    before = describe(args, vocab, oracle)  # the oracle still has the initial weights
    rows = train(args, sim, oracle, data, show=True)
    return {"rows": rows, "before": before, **finish(args, vocab, sim.full_state_dict(), oracle)}


# --------------------------------------------------------------------------- output


COLUMNS = ("step", "sharded loss", "unsharded loss", "abs diff")


def print_header() -> None:
    print(f"{COLUMNS[0]:>5}  {COLUMNS[1]:>14}  {COLUMNS[2]:>14}  {COLUMNS[3]:>10}", flush=True)


def print_row(row: tuple) -> None:
    step, loss, loss_oracle, diff = row
    print(f"{step:>5d}  {loss:>14.6f}  {loss_oracle:>14.6f}  {diff:>10.3e}", flush=True)


# --------------------------------------------------------------------------- command line


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description="Fine-tune a small GPT-2 (transformers, random init) sharded by tess-compile on a "
                    "[q, q, d] mesh on a shipped text, comparing its loss with the unsharded model's.")
    parser.add_argument("--q", type=int, default=2, help="mesh side: q*q*d ranks (default 2)")
    parser.add_argument("--d", type=int, default=2, help="mesh depth, 1 <= d <= q (default 2)")
    parser.add_argument("--steps", type=int, default=30, help="training steps (default 30)")
    parser.add_argument("--seq", type=int, default=32, help="characters per window (default 32)")
    parser.add_argument("--batch", type=int, default=8, help="windows per batch, a multiple of d*q (default 8)")
    parser.add_argument("--layers", type=int, default=2, help="transformer blocks (default 2)")
    parser.add_argument("--hidden", type=int, default=64, help="hidden size (default 64)")
    parser.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (default 3e-3)")
    parser.add_argument("--eps", type=float, default=1e-6,
                        help="AdamW eps (default 1e-6; see the module docstring for why not 1e-8)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the model and the batches (default 0)")
    parser.add_argument("--text", default=DEFAULT_TEXT,
                        help="plain-text file to train on (default examples/data/tiny_text.txt)")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds the whole multi-process run may take (default 600)")
    parser.add_argument("--simulate", action="store_true",
                        help="run every rank in this process (tess_compile.simulate) instead of q*q*d processes")
    args = parser.parse_args(argv)

    for name in ("q", "d", "steps", "seq", "batch", "layers", "hidden", "heads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.d > args.q:
        parser.error(f"--d {args.d} is larger than --q {args.q}: Tesseract needs 1 <= d <= q")
    if not args.lr > 0:
        parser.error(f"--lr must be > 0, got {args.lr}")
    if not args.eps > 0:
        parser.error(f"--eps must be > 0, got {args.eps}")
    if not args.timeout > 0:
        parser.error(f"--timeout must be > 0, got {args.timeout}")
    if args.hidden % args.heads:
        parser.error(f"--hidden {args.hidden} is not divisible by --heads {args.heads}: "
                     f"use a hidden size that is a multiple of the head count")
    if args.heads % args.q:
        parser.error(f"--heads {args.heads} is not divisible by --q {args.q}: the heads are split "
                     f"over q; use a head count that is a multiple of {args.q}")
    parts = args.d * args.q
    if args.batch % parts:
        parser.error(f"--batch {args.batch} is not a multiple of d*q = {args.d}*{args.q} = {parts}: "
                     f"the batch is split over d*q; use e.g. --batch {parts * max(1, args.batch // parts)}")
    try:
        with open(args.text, encoding="utf-8") as f:
            length = len(f.read())
    except (OSError, UnicodeDecodeError) as exc:
        parser.error(f"--text {args.text}: cannot read it as UTF-8 text ({exc})")
    if length < args.seq:
        parser.error(f"--text {args.text} has {length} characters, fewer than --seq {args.seq}: "
                     f"use a shorter --seq or a longer text")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    world = args.q * args.q * args.d
    vocab, tokens = load_text(args)
    log.info("text: %d characters, %d distinct (vocabulary padded to %d); GPT-2: %d layers, hidden %d, "
             "%d heads, seq %d, batch %d; mesh q=%d d=%d (%d ranks)", len(tokens), len(vocab.chars), vocab.size,
             args.layers, args.hidden, args.heads, args.seq, args.batch, args.q, args.d, world)
    start = time.perf_counter()
    if args.simulate:
        result = simulate_main(args)
    else:
        log.info("launching %d local gloo processes", world)
        result = run_local(rank_main, world, args=(args,), backend="gloo",
                           timeout_s=args.timeout, collective_timeout_s=120)[0]
    wall = time.perf_counter() - start
    rows = result["rows"]
    worst = max(row[3] for row in rows)
    mode = "simulated" if args.simulate else f"{world} processes"
    print(f"loss {rows[0][1]:.4f} -> {rows[-1][1]:.4f} in {len(rows)} steps; "
          f"gathered weights vs unsharded model: max abs diff {result['weight_diff']:.3e}", flush=True)
    for when, what in (("before training", result["before"]), ("after training (gathered weights)", result["after"])):
        print(f"{when}, greedy: {what['sample']!r}", flush=True)
        print(f"    most likely after {PROMPT!r}: {what['next']}", flush=True)
    print(f"max abs diff {worst:.3e} over {len(rows)} steps; wall time {wall:.1f} s ({mode})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
