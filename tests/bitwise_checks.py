"""Bitwise batch-invariance checks of a target forward, shared by the GPU test and its CPU
(interpreter) variant.

The oracle is plain decoding: a chain of tokens fed one at a time (T = 1 steps) after a prompt.
Against it:
  causal  the first T chain tokens in one forward; row i must equal chain step i bit for bit;
  tree    a random tree of T nodes (ancestor-or-self mask, positions = start + depth) whose on-chain
          nodes carry the chain's token at their depth, so each such node's context is exactly a chain
          prefix and its row must equal that chain step; one off-chain node is checked against T = 1
          steps along its own path; then the deepest on-chain path is committed (KV compaction) and the
          next chain token, fed alone, must equal its chain step.
Each check returns failure messages (empty: bit for bit equal).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Chain:
    prompt_len: int
    tokens: torch.Tensor   # [n] the chain, on the target's device
    logits: torch.Tensor   # [n, V] row i = logits of tokens[i] fed alone after prompt + tokens[:i]


def _first_diff(a: torch.Tensor, b: torch.Tensor) -> str:
    rows = (a != b).reshape(a.shape[0], -1).any(1).nonzero().flatten().tolist()
    if not rows:
        return "equal"
    r = rows[0]
    return f"{len(rows)} rows differ, first row {r} (max |diff| {(a[r].float() - b[r].float()).abs().max():.3g})"


def chain_reference(target, prompt: list[int], n: int, gen: torch.Generator, extra: int = 160):
    """Prefill ``prompt``, then feed ``n`` random tokens one at a time. Returns (cache, Chain); the
    cache is sized for the chain plus ``extra`` slots of verify blocks."""
    dev = target.device
    cache = target.new_cache(len(prompt) + n + extra)
    target(torch.tensor(prompt, device=dev), cache)
    P = cache.length
    toks = torch.randint(0, target.cfg.vocab_size, (n,), generator=gen)
    rows = [target(toks[i:i + 1].to(dev), cache).logits[0] for i in range(n)]
    return cache, Chain(P, toks.to(dev), torch.stack(rows))


def check_causal(target, cache, chain: Chain, T: int) -> list[str]:
    cache.crop(chain.prompt_len)
    out = target(chain.tokens[:T], cache).logits
    cache.crop(chain.prompt_len)
    if torch.equal(out, chain.logits[:T]):
        return []
    return [f"causal T={T}: {_first_diff(out, chain.logits[:T])} vs the same tokens fed one at a time"]


def random_tree(T: int, chain: Chain, vocab: int, gen: torch.Generator, p_on: float = 0.8,
                fan: int = 4) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """A random tree: parent[i] in [i - fan, i), node 0 the root (chain token 0). Returns tokens [T],
    mask [T, T] (ancestor-or-self), depths [T], parents. Nodes take the chain token of their depth with
    probability p_on, else a random token."""
    n = chain.tokens.shape[0]
    chain_cpu = chain.tokens.cpu()
    parents = [-1]
    depth = [0]
    for i in range(1, T):
        lo = max(0, i - fan)
        p = int(torch.randint(lo, i, (1,), generator=gen))
        if depth[p] + 1 >= n:  # keep every node within the chain's length
            p = 0
        parents.append(p)
        depth.append(depth[p] + 1)
    toks = torch.empty(T, dtype=torch.long)
    for i in range(T):
        d = depth[i]
        on = i == 0 or float(torch.rand((), generator=gen)) < p_on
        toks[i] = chain_cpu[d] if on else int(torch.randint(0, vocab, (1,), generator=gen))
    mask = torch.zeros(T, T, dtype=torch.bool)
    for i in range(T):
        if i:
            mask[i] = mask[parents[i]]
        mask[i, i] = True
    return toks, mask, torch.tensor(depth), parents


def _path(i: int, parents: list[int]) -> list[int]:
    out = []
    while i >= 0:
        out.append(i)
        i = parents[i]
    return out[::-1]


def check_tree(target, cache, chain: Chain, T: int, gen: torch.Generator) -> list[str]:
    dev = target.device
    vocab = target.cfg.vocab_size
    toks, mask, depth, parents = random_tree(T, chain, vocab, gen)
    P = chain.prompt_len
    chain_cpu = chain.tokens.cpu()
    # a node is on the chain when its whole path spells the chain prefix of its length
    on: list[bool] = []
    for j in range(T):
        ok = bool(toks[j] == chain_cpu[depth[j]])
        on.append(ok and (parents[j] < 0 or on[parents[j]]))
    cache.crop(P)
    out = target(toks.to(dev), cache, positions=(P + depth).to(dev), tree_mask=mask.to(dev)).logits
    bad = []
    idx = [j for j in range(T) if on[j]]
    got, want = out[idx], chain.logits[depth[idx].to(dev)]
    if not torch.equal(got, want):
        bad.append(f"tree T={T}: on-chain nodes: {_first_diff(got, want)} vs their chain steps fed alone")
    # commit the deepest on-chain path, then the next chain token alone
    deepest = max(idx, key=lambda j: int(depth[j]))
    keep = _path(deepest, parents)
    cache.commit(torch.tensor(keep, device=dev))
    d = len(keep)
    if d < chain.tokens.shape[0]:
        nxt = target(chain.tokens[d:d + 1], cache).logits
        if not torch.equal(nxt[0], chain.logits[d]):
            bad.append(f"tree T={T}: after committing a path of {d} nodes, the next token differs from its chain "
                       f"step ({_first_diff(nxt, chain.logits[d:d + 1])})")
    # one off-chain node, against T = 1 steps along its own path
    off = [j for j in range(T) if not on[j]]
    if off:
        j = off[int(torch.randint(0, len(off), (1,), generator=gen))]
        cache.crop(P)
        row = None
        for k in _path(j, parents):
            row = target(toks[k:k + 1].to(dev), cache).logits[0]
        if not torch.equal(out[j], row):
            bad.append(f"tree T={T}: off-chain node {j} (depth {int(depth[j])}): "
                       f"{_first_diff(out[j:j + 1], row[None])} vs its path fed one token at a time")
    cache.crop(P)
    return bad


def check_target(target, prompt: list[int], Ts: list[int], seed: int, trees: bool = True) -> list[str]:
    """All checks for one prompt: chain of max(Ts) tokens, causal and tree blocks of every T."""
    gen = torch.Generator().manual_seed(seed)
    n = max(Ts)
    cache, chain = chain_reference(target, prompt, n, gen)
    bad: list[str] = []
    for T in Ts:
        bad += check_causal(target, cache, chain, T)
        if trees and T > 1:
            bad += check_tree(target, cache, chain, T, gen)
    return bad
