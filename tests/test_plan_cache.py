"""The plan cache (compiler/plan_cache.py): a hit gives the plan planned without the cache,
answers of another model, mesh or cluster are never read, a corrupt file is rebuilt; the graph
for any batch size (core/capture.py) gives a changed batch the plan of a fresh capture, and a
model that specializes on the batch is captured afresh."""
import shutil

import pytest
import torch
import torch.distributed as dist

from alpa_lite import LogicalMesh, parallelize, plan
from alpa_lite.core.capture import CaptureError, capture, capture_any_batch
from alpa_lite.core.options import PipelineOptions
from alpa_lite.zoo.models import build_model


def _plan(cache=None, batch=8, num_layers=2, mesh=(1, 4), cluster="a100", **pipeline):
    model, example = build_model("gpt-tiny", batch, 16, device="meta", num_layers=num_layers)
    pipe = PipelineOptions(**({"num_microbatches": 2} | pipeline), workers=1) if pipeline is not None else None
    return plan(model, example, LogicalMesh(mesh, cluster=cluster), pipeline=pipe, cache=cache)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A cache filled by one pipelined plan, and that plan (checked against a fresh one)."""
    directory = tmp_path_factory.mktemp("cache")
    first = _plan(directory)
    assert first.stats["disk_hits"] == 0 and first.stats["ilp_solves"] > 0
    assert first.to_json() == _plan().to_json()
    return directory, first.to_json()


@pytest.fixture
def cache(base, tmp_path):
    return shutil.copytree(base[0], tmp_path / "cache")


def test_cache_hit_is_the_fresh_plan(base, cache):
    again = _plan(cache)
    assert again.stats["ilp_solves"] == 0 and again.stats["disk_hits"] > 0 and again.stats["graph_hits"] == 1
    assert again.to_json() == base[1]


def test_intra_op_cache_hit_is_the_fresh_plan(tmp_path):
    model, example = build_model("gpt-tiny", 8, 16, device="meta", num_layers=2)
    mesh = LogicalMesh((2, 2), cluster="a100")
    fresh = plan(model, example, mesh)
    first, again = (plan(model, example, mesh, cache=tmp_path) for _ in range(2))
    assert (first.stats["disk_hits"], again.stats["disk_hits"]) == (0, 1)
    assert fresh.to_json() == first.to_json() == again.to_json()
    other = plan(model, example, mesh, cache=tmp_path, memory_budget=2**30)  # another budget: another ILP
    assert other.stats["disk_hits"] == 0


def test_replan_with_other_pipeline_options_reuses_answers(cache):
    auto = _plan(cache, num_microbatches=None, microbatch_candidates=(1, 2))  # B=2 answered already
    assert auto.stats["disk_hits"] > 0
    assert auto.to_json() == _plan(num_microbatches=None, microbatch_candidates=(1, 2)).to_json()


@pytest.mark.parametrize("change", [{"num_layers": 3}, {"batch": 16}, {"mesh": (2, 2)}, {"cluster": "v100"}],
                         ids=["model", "batch", "mesh", "cluster"])
def test_other_model_batch_mesh_or_cluster_reads_nothing(cache, change):
    other = _plan(cache, **change)
    assert other.stats["disk_hits"] == 0 and other.stats["ilp_solves"] > 0
    assert other.stats["graph_hits"] == ("num_layers" not in change)  # the graph: of the same model at any batch
    assert other.to_json() == _plan(**change).to_json()


def test_corrupt_cache_file_is_ignored_and_rebuilt(base, cache):
    files = sorted(cache.iterdir())
    assert files
    for f in files:
        f.write_bytes(b"not a pickle")
    with pytest.warns(UserWarning, match="ignored and rebuilt"):
        rebuilt = _plan(cache)
    assert rebuilt.stats["disk_hits"] == rebuilt.stats["graph_hits"] == 0 and rebuilt.to_json() == base[1]
    again = _plan(cache)  # the rebuilt files are read again
    assert again.stats["ilp_solves"] == 0 and again.stats["graph_hits"] == 1


def test_an_answer_changed_in_a_file_that_still_unpickles_is_not_read(tmp_path):
    """A byte flipped inside a stored answer can leave a valid pickle, a wrong plan: the entries
    carry their sha256, and a file whose entries differ from it is rebuilt, with one warning."""
    import pickle
    model, example = build_model("gpt-tiny", 8, 16, device="meta", num_layers=2)
    mesh = LogicalMesh((2, 2), cluster="a100")
    fresh = plan(model, example, mesh, cache=tmp_path)
    (path,) = tmp_path.glob("intra-*.pkl")
    data = pickle.loads(path.read_bytes())
    entries = pickle.loads(data["entries"])
    entries["solution"].choice[0] = (entries["solution"].choice[0] + 1) % 2  # another valid strategy index
    path.write_bytes(pickle.dumps(data | {"entries": pickle.dumps(entries, protocol=4)}))
    with pytest.warns(UserWarning, match="sha256 differs") as record:
        again = plan(model, example, mesh, cache=tmp_path)
    assert sum("ignored and rebuilt" in str(w.message) for w in record) == 1
    assert again.stats["disk_hits"] == 0 and again.to_json() == fresh.to_json()


def test_a_cache_directory_that_cannot_be_created_is_one_clear_error(tmp_path):
    (tmp_path / "afile").write_text("")
    with pytest.raises(ValueError, match="cannot be created"):
        _plan(tmp_path / "afile" / "sub")


# ------------------------------------------------------------------ the graph for any batch size


def _intra(batch, cache=None, mesh=(2, 2), **build):
    model, example = build_model("gpt-tiny", batch, 16, device="meta", num_layers=2, **build)
    return plan(model, example, LogicalMesh(mesh, cluster="a100"), cache=cache)


def test_changed_batch_reads_the_graph_and_plans_as_fresh(tmp_path):
    first = _intra(8, tmp_path)
    assert first.stats["graph_hits"] == 0 and first.to_json() == _intra(8).to_json()
    for batch in (4, 16, 8):  # 8: the batch it was exported at, read back too
        again = _intra(batch, tmp_path)
        assert again.stats["graph_hits"] == 1 and again.stats["disk_hits"] == (batch == 8)
        assert again.to_json() == _intra(batch).to_json()
    other_mesh = _intra(16, tmp_path, mesh=(1, 4))  # the graph does not depend on the mesh: read
    assert other_mesh.stats["graph_hits"] == 1 and other_mesh.to_json() == _intra(16, mesh=(1, 4)).to_json()
    heads = _intra(16, tmp_path, num_heads=2)  # the same parameters, another head count: another graph
    assert heads.stats["graph_hits"] == 0 and heads.to_json() == _intra(16, num_heads=2).to_json()


def test_changed_batch_of_a_pipeline_reads_the_graph(cache):
    for batch, b in ((16, 2), (16, 4)):  # microbatches of 8 and 4 rows from the graph exported at 4
        again = _plan(cache, batch=batch, num_microbatches=b)
        assert again.stats["graph_hits"] == 1 and again.stats["disk_hits"] == 0
        assert again.to_json() == _plan(batch=batch, num_microbatches=b).to_json()


class _LiteralBatch(torch.nn.Module):
    """A ``view`` with the batch written in: export at another batch would run it with 8 rows."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(16, 16)

    def forward(self, x):
        return self.fc(x).view(8, -1).square().mean()


class _BranchOnBatch(torch.nn.Module):
    """A branch on the batch size: a graph for one side of it only."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(16, 16)

    def forward(self, x):
        h = self.fc(x)
        return (h * 2 if x.shape[0] > 8 else h).square().mean()


@pytest.mark.parametrize("cls", [_LiteralBatch, _BranchOnBatch])
def test_model_specialized_on_the_batch_captures_afresh(tmp_path, cls):
    torch.manual_seed(0)
    model, x = cls(), torch.randn(8, 16)
    with pytest.raises(CaptureError, match="does not export for any batch size"):
        capture_any_batch(model, (x,), fresh=capture(model, (x,)))
    mesh = LogicalMesh((1, 2), cluster="a100")
    assert plan(model, (x,), mesh, cache=tmp_path).stats["graph_hits"] == 0  # keeps why: no graph
    for batch in (8, 16):
        y = torch.randn(batch, 16)
        again = plan(model, (y,), mesh, cache=tmp_path)
        assert again.stats["graph_hits"] == 0 and again.to_json() == plan(model, (y,), mesh).to_json()


def test_graph_from_the_cache_trains_as_a_fresh_capture(tmp_path):
    """The graph read back runs: one process, mesh 1x1, two AdamW steps equal to a fresh capture's."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        losses = []
        for cache in (tmp_path / "cache", None):
            model, example = build_model("gpt-tiny", 8, 16, device="cpu", num_layers=2)
            plan(*build_model("gpt-tiny", 4, 16, device="cpu", num_layers=2), LogicalMesh((1, 1), cluster="cpu-gloo"),
                 cache=cache)  # fills the cache at batch 4
            p = plan(model, example, LogicalMesh((1, 1), cluster="cpu-gloo"), cache=cache)
            assert p.stats["graph_hits"] == (cache is not None)
            trainer = parallelize(model, (1, 1), example, plan=p)
            losses.append([float(trainer.step(*example)) for _ in range(2)])
        assert losses[0] == losses[1]
    finally:
        dist.destroy_process_group()
