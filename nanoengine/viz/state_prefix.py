"""What the chapter 04 prefix-tree view shows, as plain data computed from a `RunTrace`.

- `prefix_tree_state(trace)`: the requests' prompts as paths over full blocks (a trie), hits vs misses, laid
  out as a tidy tree (x = block depth, one row per request).

The shared helpers (colours, `check_trace`, `seq_colors`) live in `nanoengine.viz.state`. No matplotlib, no
ipywidgets, no torch here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from nanoengine.engine.block_manager import BlockManager  # pure Python: the chained hash, no torch
from nanoengine.trace import RunTrace
from nanoengine.viz.state import check_trace, seq_colors


# ---------------------------------------------------------------------------------------------- prefix tree
@dataclass
class PrefixNode:
    """One full prompt block, named by the whole prefix up to it (as the chained hash names it)."""

    node_id: int
    parent: int | None  # None for the root (the empty prefix)
    depth: int  # logical block index + 1 (root: 0)
    tokens: tuple[int, ...]
    hash: int | None  # the block manager's chained hash of this prefix (None for the root)
    seq_ids: list[int] = field(default_factory=list)  # requests whose prompt passes through here
    hits: int = 0  # admissions that reused this block from the prefix cache
    misses: int = 0  # admissions that computed it
    block_ids: list[int] = field(default_factory=list)  # physical blocks seen holding this prefix
    children: list[int] = field(default_factory=list)
    x: float = 0.0
    y: float = 0.0


@dataclass
class PrefixLeaf:
    """Where a request ends: its last full block node, plus the tokens of its partial tail block."""

    seq_id: int
    node_id: int
    tail_tokens: int
    prompt_tokens: int
    hit_tokens: int  # prefix-cache hit tokens at its first admission
    x: float = 0.0
    y: float = 0.0


@dataclass
class PrefixTreeState:
    block_size: int
    nodes: list[PrefixNode]
    leaves: list[PrefixLeaf]
    seq_colors: dict[int, str]
    hit_tokens: int  # over all admissions (readmissions after preemption too)
    prompt_tokens: int

    @property
    def root(self) -> PrefixNode:
        return self.nodes[0]

    def path(self, seq_id: int) -> list[PrefixNode]:
        """The nodes from the root's first child down to the request's last full block."""
        leaf = next((lf for lf in self.leaves if lf.seq_id == seq_id), None)
        if leaf is None:
            raise KeyError(f"seq {seq_id} is not in this trace's prompts {sorted(self.seq_colors)}")
        out, node = [], self.nodes[leaf.node_id]
        while node.parent is not None:
            out.append(node)
            node = self.nodes[node.parent]
        return out[::-1]

    @property
    def max_depth(self) -> int:
        return max(n.depth for n in self.nodes)


def prefix_tree_state(trace: RunTrace) -> PrefixTreeState:
    trace = check_trace(trace)
    block_size = trace.block_size
    colors = seq_colors(trace)
    nodes = [PrefixNode(0, None, 0, (), None)]
    by_prefix: dict[tuple[int, ...], int] = {(): 0}
    hash_to_blocks: dict[int, set[int]] = {}
    for s in trace.steps:
        for b, h in s.block_hashes.items():
            hash_to_blocks.setdefault(h, set()).add(b)
    leaf_node: dict[int, int] = {}
    for sid in sorted(trace.prompts):
        prompt = trace.prompts[sid]
        parent, h = 0, None
        nodes[0].seq_ids.append(sid)
        for i in range(len(prompt) // block_size):
            prefix = tuple(prompt[: (i + 1) * block_size])
            block = tuple(prompt[i * block_size: (i + 1) * block_size])
            h = BlockManager.compute_hash(list(block), h)
            nid = by_prefix.get(prefix)
            if nid is None:
                nid = len(nodes)
                by_prefix[prefix] = nid
                nodes.append(PrefixNode(nid, parent, i + 1, block, h,
                                        block_ids=sorted(hash_to_blocks.get(h, ()))))
                nodes[parent].children.append(nid)
            nodes[nid].seq_ids.append(sid)
            parent = nid
        leaf_node[sid] = parent
    # hits and misses per admission (a preempted sequence is admitted again and may hit its own blocks)
    first_hit: dict[int, int] = {}
    total_hits = 0
    for s in trace.steps:
        for sid, hit in s.cache_hits:
            total_hits += hit
            first_hit.setdefault(sid, hit)
            if sid not in leaf_node:
                continue
            for depth, node in enumerate(_path(nodes, leaf_node[sid]), start=1):
                if depth * block_size <= hit:
                    node.hits += 1
                else:
                    node.misses += 1
    leaves = [PrefixLeaf(sid, leaf_node[sid], len(trace.prompts[sid]) % block_size, len(trace.prompts[sid]),
                         first_hit.get(sid, 0)) for sid in sorted(trace.prompts)]
    state = PrefixTreeState(block_size, nodes, leaves, colors, total_hits, trace.prompt_tokens)
    _layout(state)
    return state


def _path(nodes: list[PrefixNode], nid: int) -> list[PrefixNode]:
    out = []
    while nodes[nid].parent is not None:
        out.append(nodes[nid])
        nid = nodes[nid].parent
    return out[::-1]


def _layout(state: PrefixTreeState) -> None:
    """Tidy tree, left to right: x = block depth, leaves one row each in depth-first order."""
    leaves_at: dict[int, list[PrefixLeaf]] = {}
    for leaf in state.leaves:
        leaves_at.setdefault(leaf.node_id, []).append(leaf)
    leaf_x = state.max_depth + 1
    row = 0

    def place(nid: int) -> float:
        nonlocal row
        node = state.nodes[nid]
        # requests ending here and subtrees below, in the order their first request arrived
        items = [(lf.seq_id, lf) for lf in leaves_at.get(nid, [])]
        items += [(min(state.nodes[c].seq_ids), c) for c in node.children]
        ys = []
        for _, item in sorted(items, key=lambda kv: kv[0]):
            if isinstance(item, PrefixLeaf):
                item.x, item.y = leaf_x, float(row)
                ys.append(item.y)
                row += 1
            else:
                ys.append(place(item))
        node.x = float(node.depth)
        node.y = sum(ys) / len(ys) if ys else float(row)
        return node.y

    place(0)
