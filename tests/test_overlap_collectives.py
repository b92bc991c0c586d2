"""``runtime/overlap.py`` on a traced graph of two parameter all-gathers and a gradient
reduce-scatter (one gloo rank): the second all-gather is issued, with its input's
concatenation, right after the first one's wait; the reduce-scatter's wait moves after the
compute that does not read it, to the output; a collective whose input comes from another's
wait stays; the reordered graph computes the same values."""
import torch
import torch.distributed as dist
from torch.fx.experimental.proxy_tensor import make_fx

from alpa_lite.runtime.overlap import overlap_collectives, overlap_windows

C = torch.ops._c10d_functional


def step(group: str):
    def f(w1, w2, b2, x):
        a1 = C.wait_tensor(C.all_gather_into_tensor(w1, 1, group))       # layer 1's weight
        h = torch.relu(x @ a1.view(4, 4))                                 # layer 1
        a2 = C.wait_tensor(C.all_gather_into_tensor(torch.cat([w2, b2]), 1, group))  # layer 2's weight and bias
        y = h @ a2[:16].view(4, 4) + a2[16:]                              # layer 2
        g = C.wait_tensor(C.reduce_scatter_tensor(y.sum(0), "sum", 1, group))  # a gradient, read by the output only
        z = torch.tanh(y) * 2                                             # compute that does not read it
        return z, g * 3
    return f


def test_prefetch_and_deferred_wait(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        inputs = (torch.randn(16), torch.randn(16), torch.randn(4), torch.randn(3, 4))
        gm = make_fx(step(dist.group.WORLD.group_name))(*inputs)
        want = gm(*inputs)
        before = overlap_windows(gm)
        moved = overlap_collectives(gm)
        ops = [n.target._opname for n in gm.graph.nodes if n.op == "call_function"]
        got = gm(*inputs)
    finally:
        dist.destroy_process_group()
    assert before == [("all_gather_into_tensor", 0), ("all_gather_into_tensor", 0), ("reduce_scatter_tensor", 0)]
    assert moved == {"prefetched": 1, "deferred": 1}
    assert ops == ["all_gather_into_tensor", "wait_tensor",
                   "cat", "all_gather_into_tensor",  # layer 2's gather, issued once layer 1's arrived
                   "view", "mm", "relu",  # layer 1, while it moves
                   "wait_tensor", "slice", "view", "mm", "slice", "add",
                   "sum", "reduce_scatter_tensor",
                   "tanh", "mul",  # while the gradient moves
                   "wait_tensor", "mul"]
    # layer 1's three ops run while layer 2's weight moves, tanh and mul while the gradient does
    assert overlap_windows(gm) == [("all_gather_into_tensor", 0), ("all_gather_into_tensor", 3),
                                   ("reduce_scatter_tensor", 2)]
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    assert overlap_collectives(gm) == {"prefetched": 0, "deferred": 0}  # nothing left to move
