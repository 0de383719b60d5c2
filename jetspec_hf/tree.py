"""Draft trees: building one from per-depth draft log-probs, its verification mask, and walking it for acceptance.

Pure functions on small tensors and lists; no model in here.

Node 0 is the root: the last committed token (the "anchor"), whose key/value is not yet in the target cache. Every
parent comes before its children, so a tree is fully described by `tokens`, `parents` and `depths`.
"""

import heapq
from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class DraftTree:
    tokens: torch.LongTensor  # [n] token of each node; tokens[0] is the root (anchor)
    parents: torch.LongTensor  # [n] index of the parent node; -1 for the root
    depths: torch.LongTensor  # [n] 0 for the root
    scores: torch.Tensor = field(default=None)  # [n] cumulative draft log-prob (0 at the root)

    def __post_init__(self):
        n = self.tokens.shape[0]
        if self.parents[0] != -1 or not (self.parents[1:] < torch.arange(1, n)).all() or (self.parents[1:] < 0).any():
            raise ValueError("a draft tree lists every parent before its children, with the root (parent -1) first")

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def children(self) -> list[dict[int, int]]:
        """Per node, token -> child index. Siblings never share a token (top-W tokens of one depth are distinct)."""
        children: list[dict[int, int]] = [{} for _ in range(len(self))]
        for child, (parent, token) in enumerate(zip(self.parents.tolist(), self.tokens.tolist())):
            if parent >= 0:
                children[parent][token] = child
        return children

    def ancestor_mask(self) -> torch.BoolTensor:
        """`[n, n]`, True where column j is node i itself or one of its ancestors (what node i may attend to)."""
        n = len(self)
        rows = torch.arange(n)
        keep = torch.zeros(n, n, dtype=torch.bool)
        keep[rows, rows] = True
        ancestor = self.parents.clone()
        # Pointer jumping by one level per pass: at most depth passes, each vectorised over all nodes.
        while (ancestor >= 0).any():
            has = ancestor >= 0
            keep[rows[has], ancestor[has]] = True
            ancestor = torch.where(has, self.parents[ancestor.clamp(min=0)], ancestor)
        return keep


def build_tree(root_token: int, draft_logprobs: torch.Tensor, budget: int, width: int) -> DraftTree:
    """Best-first tree on cumulative draft log-prob under a node budget (the authors' `accum_logp` rule).

    `draft_logprobs` is `[D, V]`: row d-1 is the full-vocabulary-normalised log-distribution of depth d. The same top-W
    tokens of a depth serve every parent at that depth. The budget counts the root. A popped node gets all its
    (up to W) children at once, in rank order, while the budget lasts; ties pop in creation order. Candidates with
    log-prob -inf (removed by top-k/top-p warping) are never added.
    """
    if budget < 1 or width < 1:
        raise ValueError(f"tree budget and width must be >= 1, got budget={budget}, width={width}")
    max_depth = draft_logprobs.shape[0]
    k = min(width, draft_logprobs.shape[-1])
    top_logprobs, top_tokens = torch.topk(draft_logprobs.float(), k, dim=-1) if max_depth else (None, None)
    top_logprobs = top_logprobs.tolist() if max_depth else []
    top_tokens = top_tokens.tolist() if max_depth else []

    tokens, parents, depths, scores = [int(root_token)], [-1], [0], [0.0]
    frontier = [(-0.0, 0)]  # (negated score, node index): heapq is a min-heap; index breaks ties by creation order
    while frontier and len(tokens) < budget:
        neg_score, node = heapq.heappop(frontier)
        depth = depths[node]
        if depth == max_depth:
            continue
        for rank in range(min(k, budget - len(tokens))):
            logprob = top_logprobs[depth][rank]
            if logprob == float("-inf"):
                break  # ranks are sorted: everything after is -inf too
            child = len(tokens)
            tokens.append(top_tokens[depth][rank])
            parents.append(node)
            depths.append(depth + 1)
            scores.append(-neg_score + logprob)
            heapq.heappush(frontier, (-scores[child], child))
    return DraftTree(
        tokens=torch.tensor(tokens, dtype=torch.long),
        parents=torch.tensor(parents, dtype=torch.long),
        depths=torch.tensor(depths, dtype=torch.long),
        scores=torch.tensor(scores, dtype=torch.float32),
    )


def walk_tree(
    children: list[dict[int, int]], pick: Callable[[int], int], commit: Callable[[int], bool]
) -> tuple[list[int], list[int]]:
    """Acceptance: from the root, repeatedly commit the token the target picks at the current node, and move to the
    child holding that token while there is one.

    `pick(node)` is the token the target produces after the path ending at `node` (its argmax, or one draw from its
    processed distribution); `commit(token)` appends it to the output and says whether generation must stop right
    after it (EOS, max length, a stopping criterion). Picks are made lazily along the walked path only, so logits
    processors and the sampler run exactly once per committed token, in order, as in plain decoding.

    Returns `(path, committed)`: the visited nodes (root first; their keys/values are kept) and the committed tokens
    (one per visited node: the accepted drafts, then the target's own "bonus" token).
    """
    path, committed = [0], []
    while True:
        token = pick(path[-1])
        committed.append(token)
        child = children[path[-1]].get(token)
        if commit(token) or child is None:
            return path, committed
        path.append(child)
