"""Speculative decoding: DDTree / DFlash-chain draft trees, the accept walk, the decode harness."""

from .accept import AcceptResult, accept, accept_path_mask, target_picks
from .tree import DraftTree, build_tree, build_tree_heap, chain_tree, topk_logprobs, tree_size

__all__ = [
    "AcceptResult", "DraftTree", "accept", "accept_path_mask", "build_tree", "build_tree_heap", "chain_tree",
    "target_picks", "topk_logprobs", "tree_size",
]
