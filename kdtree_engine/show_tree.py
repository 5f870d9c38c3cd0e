"""ASCII view of a draft tree with the accepted path marked (``kdtree generate --show-tree``).

One line per node, children under their parent in node order (for DDTree: best-first pop order,
so siblings appear from the most to the least probable)::

    [0] 'def' (id 412) d0 root  *
    ├── [1] ' f' (id 77) d1 lp -0.12  *
    │   └── [3] 'oo' (id 98) d2 lp -0.51  *
    └── [2] ' g' (id 85) d1 lp -2.30
    bonus: '(' (id 7)

``*`` marks the nodes the target accepted (the root is always accepted: it is the previous round's
bonus token); the bonus token is the target's pick at the deepest accepted node.

Wiring into the CLI: :func:`add_show_tree_argument` adds the flag to a parser and
:func:`render_last_round` turns a finished :class:`~kdtree_engine.speculative.decode.GenerationResult`
into the text to print.
"""

from __future__ import annotations

import argparse
from typing import Any, Callable, Sequence

ACCEPTED_MARK = "*"
MAX_TEXT = 16


def token_label(tok: int, decode: Callable[[int], str] | None, max_text: int = MAX_TEXT) -> str:
    """``'text' (id N)`` with the text repr'd and truncated, or ``id N`` without a tokenizer."""
    if decode is None:
        return f"id {tok}"
    try:
        text = decode(tok)
    except Exception:  # a tokenizer that cannot decode a lone id: fall back to the id
        return f"id {tok}"
    r = repr(text)
    if len(r) > max_text:
        r = r[: max_text - 4] + "...'"
    return f"{r} (id {tok})"


def format_tree(tree: Any, accepted: Sequence[int], decode: Callable[[int], str] | None = None, *,
                logprobs: Sequence[float | None] | None = None, bonus: int | None = None,
                max_text: int = MAX_TEXT) -> str:
    """The tree as ASCII, accepted nodes marked with ``*``.

    ``tree`` is a :class:`~kdtree_engine.speculative.tree.DraftTree` (``tokens``, ``parents``, ``depths``
    tensors or lists); ``accepted`` the accepted node indices (root first); ``decode`` maps one token
    id to its text (None: ids only); ``logprobs`` the per-node draft log-probs (root None);
    ``bonus`` the target's bonus token, printed on a last line.
    """
    tokens = _as_list(tree.tokens)
    parents = _as_list(tree.parents)
    depths = _as_list(tree.depths)
    n1 = len(tokens)
    acc = set(int(i) for i in accepted)
    bad = sorted(i for i in acc if not 0 <= i < n1)
    if bad:
        raise ValueError(f"accepted node {bad[0]} is outside the tree ({n1} nodes)")
    children: list[list[int]] = [[] for _ in range(n1)]
    for i in range(1, n1):
        children[parents[i]].append(i)

    def line(i: int) -> str:
        parts = [f"[{i}]", token_label(tokens[i], decode, max_text), f"d{depths[i]}"]
        if i == 0:
            parts.append("root")
        elif logprobs is not None and logprobs[i] is not None:
            parts.append(f"lp {logprobs[i]:.2f}")
        s = " ".join(parts)
        return s + ("  " + ACCEPTED_MARK if i in acc else "")

    out = [line(0)]
    # iterative depth-first walk (trees can be deeper than is comfortable for recursion in principle)
    stack: list[tuple[int, str, bool]] = [(c, "", k == len(children[0]) - 1)
                                          for k, c in reversed(list(enumerate(children[0])))]
    while stack:
        i, prefix, last = stack.pop()
        out.append(prefix + ("└── " if last else "├── ") + line(i))
        child_prefix = prefix + ("    " if last else "│   ")
        kids = children[i]
        for k in range(len(kids) - 1, -1, -1):
            stack.append((kids[k], child_prefix, k == len(kids) - 1))
    if bonus is not None:
        out.append(f"bonus: {token_label(int(bonus), decode, max_text)}")
    return "\n".join(out)


def _as_list(x: Any) -> list[int]:
    return [int(v) for v in (x.tolist() if hasattr(x, "tolist") else x)]


def render_last_round(result: Any, decode_ids: Callable[[list[int]], str | None] | None = None) -> str:
    """Header + :func:`format_tree` for the last drafting round of a generation result.

    ``decode_ids`` decodes a list of ids (e.g. ``LLM.decode``); None or a decoder returning None
    prints ids only. A result without a recorded round (``--spec none``, or no round drafted) gives
    a one-line explanation.
    """
    tree = getattr(result, "last_tree", None)
    if tree is None:
        spec = result.stats.get("spec", "none") if hasattr(result, "stats") else "none"
        why = "plain decoding has no draft tree" if spec == "none" else "no round drafted a token"
        return f"(no draft tree to show: {why})"
    decode = None
    if decode_ids is not None and decode_ids([0]) is not None:
        def decode(t: int) -> str:
            return decode_ids([t]) or ""
    accepted = list(result.last_accepted or [0])
    n1 = tree.num_nodes
    depths = _as_list(tree.depths)
    s = result.stats
    what = s.get("spec", "?") + (f" budget {s['budget']}" if "budget" in s else "")
    start = int(_as_list(tree.positions)[0])
    head = (f"last drafting round ({what}): {n1 - 1} draft nodes, depth {max(depths)}, root at position {start}; "
            f"accepted {len(accepted) - 1} draft token(s) + bonus ({ACCEPTED_MARK} = accepted path)")
    body = format_tree(tree, accepted, decode, logprobs=result.last_draft_logprobs, bonus=result.last_bonus)
    return head + "\n" + body


def add_show_tree_argument(parser: argparse.ArgumentParser) -> None:
    """``--show-tree`` for ``kdtree generate``."""
    parser.add_argument("--show-tree", action="store_true",
                        help="after generating, print the last drafting round's tree with the accepted path "
                             "marked (needs --spec dflash|ddtree)")
