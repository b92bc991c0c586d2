"""The inter-op search holds the intra-op answer (Alpa, OSDI'22, section 5: one stage on the
whole mesh with one microbatch is the plan without pipelining), so ``pipeline="auto"`` never
predicts a slower step than no pipeline."""
import warnings

import pytest

from alpa_lite import LogicalMesh, plan
from alpa_lite.core.options import PipelineOptions
from alpa_lite.zoo.models import build_model


def test_default_microbatch_candidates_hold_one_and_two():
    assert {1, 2} <= set(PipelineOptions().microbatch_candidates)


def test_pipeline_search_is_never_worse_than_no_pipeline_gpt3_2_6b():
    """GPT-3 2.6B on a 2x4 A100 description, batch 32 (plan only). Two layers and B = 1 keep the
    test short: the one-stage option is what is tested (with more B the search only adds
    options)."""
    model, example = build_model("gpt3-2.6b", 32, device="meta")
    mesh = LogicalMesh((2, 4), cluster="a100")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        spmd = plan(model, example, mesh)
        piped = plan(model, example, mesh, pipeline=PipelineOptions(num_layers=2, microbatch_candidates=(1,)))
    # the answer is the plan without pipelining: one stage, one microbatch, on every device
    assert (len(piped.stages), piped.num_microbatches, piped.stages[0].submesh) == (1, 1, (2, 4))
    # stage options are priced from their listings as SPMD plans are (docs/planner.md, "One price"):
    # the one-stage B = 1 option on the SPMD plan's logical mesh is that plan
    assert piped.step_seconds <= spmd.step_seconds * (1 + 1e-9)


def test_bounded_search_is_the_unbounded_plan(monkeypatch):
    """The search drops the (range, submesh) pairs whose FLOPs alone take ``B t`` above the step
    time of a plan it already has (``inter_op._within``): it solves fewer stage ILPs and returns
    the plan of the search that prices them all."""
    from alpa_lite.compiler import inter_op

    model, example = build_model("gpt3-125m", 8, device="meta")
    mesh = LogicalMesh((2, 2), cluster="a100")
    pipe = PipelineOptions(num_layers=4, microbatch_candidates=(1, 2, 4), workers=1)
    bounded = plan(model, example, mesh, pipeline=pipe)
    within = inter_op._within
    monkeypatch.setattr(inter_op, "_within", lambda costs, b, bound: within(costs, b, float("inf")))
    full = plan(model, example, mesh, pipeline=pipe)
    assert bounded.stats["ilp_solves"] < full.stats["ilp_solves"]
    assert bounded.to_json() == full.to_json()
