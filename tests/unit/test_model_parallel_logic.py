"""Model parallelism's pure logic, in one process: the (pp, dp, tp) layout, pipeline splitting (balance, user
split points, cutting a stage, the forward-chain check), tensor-parallel plans, GPT-2's q/k/v split, and the
memory estimate under --tp/--pp. What needs several processes is in tests/integration/test_model_parallel.py."""

from itertools import pairwise

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from dtrain_magic.parallel import pipeline_split as ps
from dtrain_magic.parallel import tensor_parallel as tpl
from dtrain_magic.parallel.hf_gpt2 import SplitQKV, plain_state_dict
from dtrain_magic.parallel.mesh import ParallelDims
from dtrain_magic.strategies.memory import estimate, table


# -- the mesh ---------------------------------------------------------------------------------------------
def test_dims_and_rank_layout_tensor_parallel_innermost():
    dims = ParallelDims(8, tp=2, pp=2)
    assert (dims.dp, dims.shape, dims.describe()) == (2, (2, 2, 2), "pp 2 x dp 2 x tp 2")
    assert [dims.coordinates(r)["tp"] for r in range(4)] == [0, 1, 0, 1]
    assert [dims.coordinates(r)["dp"] for r in range(4)] == [0, 0, 1, 1]
    assert [dims.coordinates(r)["pp"] for r in (0, 3, 4, 7)] == [0, 0, 1, 1]
    assert all(dims.rank_of(**dims.coordinates(r)) == r for r in range(8))
    assert ParallelDims(2).describe() == "dp 2" and not ParallelDims(2).model_parallel


@pytest.mark.parametrize("world,tp,pp", [(3, 2, 1), (4, 3, 1), (6, 2, 2)])
def test_dims_refuse_a_world_size_the_mesh_cannot_hold(world, tp, pp):
    with pytest.raises(ValueError, match=f"world size {world} is not a multiple of tp {tp} x pp {pp}"):
        ParallelDims(world, tp=tp, pp=pp)


# -- pipeline splitting -------------------------------------------------------------------------------------
def mlp(widths=(8, 32, 16, 4)) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for a, b in pairwise(widths):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


class Blocks(nn.Module):
    """An embedding, a ModuleList of blocks, a head: the shape of most transformer models."""

    def __init__(self, residual: bool = False, width: int = 16):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(8, width)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(4))
        self.head = nn.Linear(width, 4)
        self.residual = residual

    def forward(self, x):
        h = self.embed(x)
        for layer in self.layers:
            h = h + layer(h) if self.residual else layer(h)
        return self.head(h)


def test_balance_minimises_the_heaviest_stage_and_keeps_activations_with_their_layer():
    assert ps.balance([10, 0, 10, 0, 10, 0, 10], 2) == [0, 4]
    assert ps.balance([288, 0, 528, 0, 68], 2) == [0, 2]  # 288 | 596 beats 816 | 68
    assert ps.balance([5, 5, 5, 5], 4) == [0, 1, 2, 3]
    assert ps.balance([0, 7, 1, 1, 1, 1, 1, 1, 1], 2) == [0, 2]
    with pytest.raises(ValueError, match="the model has 2 part\\(s\\) with parameters, fewer than the 3 stages"):
        ps.balance([3, 0, 3], 3)


def test_chain_of_sequential_and_of_a_model_with_a_module_list():
    assert [(link.name, link.num_params) for link in ps.chain_of(mlp())] == [
        ("0", 288), ("1", 0), ("2", 528), ("3", 0), ("4", 68),
    ]
    links = ps.chain_of(Blocks())
    assert [link.name for link in links] == ["embed", "layers.0", "layers.1", "layers.2", "layers.3", "head"]
    assert [link.container for link in links] == ["", "layers", "layers", "layers", "layers", ""]
    with pytest.raises(ValueError, match="has 1 part"):
        ps.chain_of(nn.Sequential(nn.Linear(2, 2)))


def test_user_split_points_by_name_or_index_and_their_errors():
    links = ps.chain_of(Blocks())
    assert ps.split_starts(links, 2, ["layers.2"]) == [0, 3]
    assert ps.split_starts(links, 3, [2, "layers.3"]) == [0, 2, 4]
    for bad, message in [(["layers.2", "head"], "give the 1 part"), (["nope"], "'nope' is not a part"),
                         (["embed"], "parts after the first"), ("layers.2", "give the 1 part")]:
        with pytest.raises(ValueError, match=message):
            ps.split_starts(links, 2, bad)
    with pytest.raises(ValueError, match="each after the last"):
        ps.split_starts(links, 3, ["layers.3", "layers.1"])


def cut(make, stages, stage, pp_split=None):
    model = make()
    links = ps.chain_of(model)
    starts = ps.split_starts(links, stages, pp_split)
    called = ps.cut_stage(model, links, ps.stage_ranges(starts, len(links))[stage])
    return model, called


@pytest.mark.parametrize("make", [mlp, Blocks], ids=["sequential", "module_list"])
def test_stages_keep_the_whole_models_names_and_compose_to_it(make):
    whole = make()
    first, called_first = cut(make, 2, 0)
    second, called_second = cut(make, 2, 1)
    assert set(first.state_dict()) | set(second.state_dict()) == set(whole.state_dict())
    assert not set(first.state_dict()) & set(second.state_dict())
    for name, value in {**first.state_dict(), **second.state_dict()}.items():
        assert torch.equal(value, whole.state_dict()[name]), name  # same names, same tensors
    x = torch.randn(5, 8)
    assert torch.allclose(second(first(x)), whole(x), atol=1e-6)
    if make is Blocks:  # removed top-level parts stand in as Identity and are still called
        assert called_first == ["embed", "layers.0", "layers.1", "head"]
        assert isinstance(first.head, nn.Identity) and isinstance(second.embed, nn.Identity)
        assert list(first.layers._modules) == ["0", "1"] and list(second.layers._modules) == ["2", "3"]
    else:
        assert called_second == ["2", "3", "4"]


def test_chain_check_passes_a_chain_and_then_removes_its_hooks():
    stage, called = cut(Blocks, 2, 1)
    check = ps.ChainCheck(stage, called)
    stage(torch.randn(3, 16))
    assert check.handles == [] and not stage._forward_hooks
    assert not ps.ChainCheck.needed(nn.Sequential()) and ps.ChainCheck.needed(Blocks())


def test_chain_check_refuses_a_forward_that_is_not_a_chain():
    stage, called = cut(lambda: Blocks(residual=True), 2, 0)
    ps.ChainCheck(stage, called)
    with pytest.raises(ValueError, match="in Blocks.forward, layers.1 does not receive the output of layers.0"):
        stage(torch.randn(3, 8))

    class Shuffled(Blocks):
        def forward(self, x):
            return self.head(self.embed(x))

    stage, called = cut(Shuffled, 2, 0)
    ps.ChainCheck(stage, called)
    with pytest.raises(ValueError, match=r"called its parts as \['embed', 'head'\], expected"):
        stage(torch.randn(3, 8))


def test_parameters_tied_across_stages_are_refused():
    model = mlp((4, 4, 4, 4))
    model[4].weight = model[0].weight
    links = ps.chain_of(model)
    with pytest.raises(ValueError, match="parameter 0.weight \\(stage 0\\) is shared with 4.weight \\(stage 1\\)"):
        ps.check_no_ties_across_stages(model, links, [0, 4])
    ps.check_no_ties_across_stages(model, links, [0])  # one stage holds both: fine


# -- tensor-parallel plans -----------------------------------------------------------------------------------
def kinds(styles):
    def kind(style):
        if isinstance(style, ColwiseParallel):
            return "col" + ("+gather" if style.output_layouts == (Replicate(),) else "")
        return "row" if isinstance(style, RowwiseParallel) else type(style).__name__
    return {name: kind(style) for name, style in styles.items()}


def test_consecutive_linears_alternate_colwise_rowwise_and_a_lone_one_gathers():
    assert kinds(tpl.sequential_styles(mlp(), 2)) == {"0": "col", "2": "row", "4": "col+gather"}
    assert kinds(tpl.sequential_styles(mlp((8, 32, 32, 16, 4)), 2)) == {"0": "col", "2": "row", "4": "col", "6": "row"}
    # a LayerNorm normalises over the sharded features: no pair across it; widths must divide by the degree
    seq = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 6), nn.GELU(), nn.Dropout(), nn.Linear(6, 3))
    assert kinds(tpl.sequential_styles(seq, 2)) == {"0": "col+gather", "2": "col", "5": "row"}
    assert kinds(tpl.sequential_styles(seq, 4)) == {"0": "col+gather"}
    nested = nn.Module()
    nested.mlp = mlp()
    assert kinds(tpl.sequential_styles(nested, 2)) == {"mlp.0": "col", "mlp.2": "row", "mlp.4": "col+gather"}


def test_user_plan_accepts_styles_and_hf_names_and_names_bad_keys():
    model = Blocks()
    styles = tpl.user_styles(model, {"layers.*.0": "colwise", "head": RowwiseParallel()})
    assert kinds(styles) == {"layers.*.0": "col", "head": "row"}
    assert tpl.matching_modules(model, "layers.*.0") == [f"layers.{i}.0" for i in range(4)]
    with pytest.raises(ValueError, match="tp_plan key 'layer.0' matches no submodule of Blocks"):
        tpl.user_styles(model, {"layer.0": "colwise"})
    assert tpl.user_styles(model, {"layer.0": "colwise"}, skip_missing=True) == {}
    with pytest.raises(ValueError, match="unknown style name; allowed: colwise, rowwise"):
        tpl.user_styles(model, {"head": "diagonal"})
    with pytest.raises(TypeError, match="must be a ParallelStyle"):
        tpl.user_styles(model, {"head": nn.Linear(1, 1)})


def test_no_automatic_plan_is_a_clear_error():
    with pytest.raises(ValueError, match="no automatic tensor-parallel plan for Blocks.*tp_plan="):
        tpl.plan_for(Blocks(width=15), 2)
    plan = tpl.plan_for(mlp(), 2)
    assert "0 colwise, 2 rowwise" in plan.description and plan.renames == {} and plan.to_plain == []


def test_gpt2_qkv_split_computes_the_fused_projection_and_maps_back():
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(0)
    fused = Conv1D(3 * 8, 8)  # nf = 3 x hidden, nx = hidden
    nn.init.normal_(fused.bias)
    split = SplitQKV.from_fused(fused, 8)
    x = torch.randn(2, 5, 8)
    assert torch.allclose(split(x), fused(x), atol=1e-6)
    state = {f"h.0.attn.c_attn.{k}": v for k, v in split.state_dict().items()}
    state["h.0.ln_1.weight"] = torch.ones(8)
    plain = plain_state_dict(state)
    assert set(plain) == {"h.0.attn.c_attn.weight", "h.0.attn.c_attn.bias", "h.0.ln_1.weight"}
    assert torch.equal(plain["h.0.attn.c_attn.weight"], fused.weight)
    assert torch.equal(plain["h.0.attn.c_attn.bias"], fused.bias)


# -- memory estimate ------------------------------------------------------------------------------------------
def test_memory_estimate_divides_by_tp_and_stages_then_shards_over_replicas():
    psi = 1200
    plain = estimate(psi, "ddp", None, "fp32", 2)
    tp = estimate(psi, "ddp", None, "fp32", 2, tp=2)
    assert (tp.params, tp.grads, tp.optimizer) == (plain.params / 2, plain.grads / 2, plain.optimizer / 2)
    # 2-D: FSDP over 2 replicas of a 2-way tensor-parallel model = a quarter of everything
    two_d = estimate(psi, "fsdp", None, "fp32", 4, tp=2)
    assert two_d.total == pytest.approx(estimate(psi, "ddp", None, "fp32", 1).total / 4)
    three_d = estimate(psi, "ddp", None, "fp32", 8, tp=2, pp=2)
    assert three_d.params == 4 * psi / 4 and three_d.label == "ddp x tp 2 x pp 2"
    line = estimate(psi, "ddp", None, "fp32", 2, pp=2).line()
    assert line.startswith("memory estimate (ddp x pp 2, fp32, 2 processes, 1,200 parameters)")
    assert "not counted: activations" in line and "in-flight micro-batches" in line
    assert "not counted" not in plain.line()
    with pytest.raises(ValueError, match="not a multiple of tp 2 x pp 2"):
        estimate(psi, "ddp", None, "fp32", 6, tp=2, pp=2)


def test_memory_table_rows_for_model_parallelism():
    rows = table(1_000_000, "fp32", 4, tp=2).splitlines()
    assert [row.split()[0] for row in rows[2:]] == ["ddp", "fsdp"]
    assert rows[2].startswith("ddp x tp 2") and rows[3].startswith("fsdp x tp 2")
    assert len(table(1_000_000, "fp32", 4).splitlines()) == 2 + 6  # ddp, fsdp, ZeRO 0-3
