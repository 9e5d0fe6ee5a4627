"""LoRA / PEFT adapters' pure logic (issue #38), in one process: ``ctx.save_weights(adapters_only=True)`` and
``ctx.full_state_dict(merged=True)`` through a one-rank DDP context, the meta twin, the name filter of the stream, the
optimizer over trainable parameters only, and the errors (no peft, not a peft model, empty adapters). The 2-rank
runs under DDP, FSDP2 and ZeRO-3 are tests/integration/test_lora.py."""

from __future__ import annotations

import sys

import pytest
import torch

from dtrain_magic.config import RunConfig
from dtrain_magic.errors import MissingDependencyError, UnsupportedCodeError
from dtrain_magic.strategies.ddp import DDPStrategy
from dtrain_magic.weights import adapters
from dtrain_magic.weights.deferred import optimizer_for
from dtrain_magic.weights.saving import stream
from dtrain_magic.worker.context import TrainContext

peft = pytest.importorskip("peft")


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def make_base() -> Net:
    torch.manual_seed(0)
    return Net()


def make_lora() -> torch.nn.Module:
    return peft.get_peft_model(make_base(), peft.LoraConfig(r=2, lora_alpha=4, target_modules=["fc1", "fc2"]))


def one_rank_context(model: torch.nn.Module) -> tuple[TrainContext, torch.nn.Module]:
    """A prepared one-process DDP context (no process group: one rank) after 3 Adam steps on ``model``."""
    strategy = DDPStrategy(RunConfig(), 0, 0, 1, torch.device("cpu"))
    ctx = TrainContext(RunConfig(), strategy, 0, 0, 1, torch.device("cpu"))
    prepared, _ = ctx.prepare(model, lambda params: torch.optim.Adam(params, lr=0.05))
    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(1))
    for _ in range(3):
        ctx.backward(prepared(x).square().mean())
        ctx.step()
    return ctx, prepared


def test_adapters_save_in_peft_format_and_merge_as_peft_does(tmp_path):
    ctx, model = one_rank_context(make_lora())
    x = torch.randn(3, 4)
    with torch.no_grad():
        expected = model(x)
    files = ctx.save_weights(tmp_path, adapters_only=True)
    assert sorted(f.rsplit("/", 1)[1] for f in files) == ["adapter_config.json", "adapter_model.safetensors"]
    reloaded = peft.PeftModel.from_pretrained(make_base(), str(tmp_path))
    with torch.no_grad():
        assert torch.allclose(reloaded(x), expected, atol=1e-6, rtol=0)

    before = {k: v.clone() for k, v in ctx.full_state_dict().items()}
    merged = ctx.full_state_dict(merged=True)
    assert set(merged) == {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}  # the plain model's names
    by_peft = reloaded.merge_and_unload().state_dict()
    assert all(torch.allclose(merged[k], by_peft[k], atol=1e-6, rtol=0) for k in by_peft)
    assert not torch.equal(merged["fc1.weight"], before["base_model.model.fc1.base_layer.weight"])  # merged in
    after = ctx.full_state_dict()
    assert all(torch.equal(after[k], before[k]) for k in before)  # merging left the training model as it was
    assert ctx.full_state_dict(merged=True).keys() == merged.keys()  # the twin survives a merge


def test_frozen_base_weights_get_no_optimizer_and_do_not_change():
    model = make_lora()
    frozen = {n: p.clone() for n, p in model.named_parameters() if not p.requires_grad}
    ctx, prepared = one_rank_context(model)
    params = {id(p) for g in ctx.strategy.optimizer.param_groups for p in g["params"]}
    assert params == {id(p) for p in prepared.parameters() if p.requires_grad} and len(params) == 4
    assert all(torch.equal(p, frozen[n]) for n, p in prepared.named_parameters() if n in frozen)
    assert optimizer_for(lambda ps: torch.optim.SGD(ps, lr=1), [torch.nn.Parameter(torch.ones(1))]) is not None


def test_meta_twin_holds_no_storage_keeps_ties_and_leaves_the_model():
    model = torch.nn.Sequential(torch.nn.Embedding(5, 3), torch.nn.Linear(3, 5))
    model[1].weight = model[0].weight
    twin = adapters.meta_twin(model)
    assert all(p.is_meta for p in twin.parameters()) and not any(p.is_meta for p in model.parameters())
    assert twin[1].weight is twin[0].weight


def test_the_stream_gathers_only_the_included_names():
    gathered = []
    state = {"a": torch.ones(2), "b": torch.zeros(2), "c": torch.ones(1)}
    out = dict(stream(state, lambda v: gathered.append(v) or v, True, include={"a", "c"}.__contains__))
    assert list(out) == ["a", "c"] and len(gathered) == 2


def test_adapters_only_and_merged_refuse_a_model_without_peft(tmp_path):
    ctx, _ = one_rank_context(make_base())
    with pytest.raises(TypeError, match=r"adapters_only=True\) is for a peft model.*Net.*get_peft_model"):
        ctx.save_weights(tmp_path, adapters_only=True)
    with pytest.raises(TypeError, match=r"merged=True\) is for a peft model"):
        ctx.full_state_dict(merged=True)
    with pytest.raises(RuntimeError, match="adapters are empty"):
        adapters.save_adapters(str(tmp_path), make_lora(), {"base_model.model.fc1.lora_A.default.weight":
                                                            torch.empty(0)})


def test_missing_peft_names_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "peft", None)  # import peft now raises ImportError, as when not installed
    with pytest.raises(MissingDependencyError, match=r"needs peft, which is not installed: pip install peft"):
        adapters.require_peft("ctx.save_weights(adapters_only=True)")
    assert adapters.is_peft_model(make_base()) is False


def test_a_peft_model_built_without_storage_is_refused_before_it_trains():
    """Each layer's default init would give LoRA's B non-zero values: the model would not start as the base model."""
    strategy = DDPStrategy(RunConfig(), 0, 0, 1, torch.device("cpu"))
    ctx = TrainContext(RunConfig(), strategy, 0, 0, 1, torch.device("cpu"))
    with torch.device("meta"):
        model = make_lora()
    with pytest.raises(UnsupportedCodeError, match=r"built on the meta device .* apply peft.get_peft_model to it"):
        ctx.prepare(model, lambda params: torch.optim.Adam(params))
    assert strategy.model is None  # refused before the strategy wrapped anything
