"""The plan cache (compiler/plan_cache.py): a hit gives the plan planned without the cache,
answers of another model, mesh or cluster are never read, a corrupt file is rebuilt."""
import shutil

import pytest

from alpa_lite import LogicalMesh, plan
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
    assert again.stats["ilp_solves"] == 0 and again.stats["disk_hits"] > 0
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
    assert other.to_json() == _plan(**change).to_json()


def test_corrupt_cache_file_is_ignored_and_rebuilt(base, cache):
    files = sorted(cache.iterdir())
    assert files
    for f in files:
        f.write_bytes(b"not a pickle")
    with pytest.warns(UserWarning, match="ignored and rebuilt"):
        rebuilt = _plan(cache)
    assert rebuilt.stats["disk_hits"] == 0 and rebuilt.to_json() == base[1]
    assert _plan(cache).stats["ilp_solves"] == 0  # the rebuilt files are read again
