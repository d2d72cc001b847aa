"""The compiler: capture -> place -> verify -> rewrite -> verify, one stage a file."""

from passes.capture import capture
from passes.place import place
from passes.rewrite import rewrite
from passes.verify import verify_placed, verify_rewritten

__all__ = ["capture", "place", "rewrite", "verify_placed", "verify_rewritten"]
