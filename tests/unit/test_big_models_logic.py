"""Models bigger than one process, the parts that need no second process (dtrain_magic.weights, issue #26):
building on the meta device and initialising one module at a time, the checkpoint sources and their errors, the
name check, loading regions through torch.distributed.checkpoint in one process, the safetensors writer, ZeRO-3's
partition arithmetic, DeepSpeed's model-sized buffers, and the memory estimate's buffers. The multi-process runs are
in tests/integration/test_big_models.py."""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from dtrain_magic.config import RunConfig
from dtrain_magic.errors import WeightsError
from dtrain_magic.strategies.deepspeed import DeepSpeedStrategy, build_config, model_sizes
from dtrain_magic.strategies.memory import blocks, estimate, model_facts
from dtrain_magic.weights import deferred, loading, saving, sources


def make() -> nn.Module:
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    model.register_buffer("scale", torch.arange(3.0))
    return model


def seeded(factory=make, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return factory()


def assert_same(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for key in a:
        assert torch.equal(a[key], b[key]), key


# -- building without storage ----------------------------------------------------------------------------------

def test_parameters_go_to_meta_and_buffers_stay_real():
    with deferred.parameters_on_meta():
        model = make()
        tied = nn.Linear(4, 4)
    assert all(p.is_meta for p in model.parameters()) and all(p.is_meta for p in tied.parameters())
    assert torch.equal(model.scale, torch.arange(3.0))  # computed in __init__: kept
    assert deferred.has_meta_parameters(model)
    after = nn.Linear(2, 2)  # the patch is gone after the block
    assert not after.weight.is_meta and not deferred.has_meta_parameters(after)


def test_deferred_initialisation_gives_the_plain_builds_values_for_the_same_seed():
    plain = seeded()
    torch.manual_seed(0)
    with deferred.parameters_on_meta():
        model = make()
    pristine = deferred.pristine_copy(model)
    deferred.materialize(model, torch.device("cpu"))
    assert torch.equal(model.scale, torch.arange(3.0))  # to_empty would have emptied it
    deferred.initialise(model, pristine)
    assert_same(model.state_dict(), plain.state_dict())


def test_a_shared_parameter_is_initialised_once_and_a_view_gets_its_slice():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(10, 6)
            self.head = nn.Linear(6, 10, bias=False)
            self.head.weight = self.embed.weight

    plain = seeded(Tied)
    torch.manual_seed(0)
    with deferred.parameters_on_meta():
        model = Tied()
    pristine = deferred.pristine_copy(model)
    deferred.materialize(model, torch.device("cpu"))
    deferred.initialise(model, pristine)
    assert model.head.weight is model.embed.weight
    assert torch.equal(model.embed.weight, plain.embed.weight)  # the embedding's init, as in the plain build

    # a parameter that is a slice of the plain model's (GPT-2's q/k/v of c_attn under --tp)
    target = nn.Module()
    target.part = nn.Parameter(torch.zeros(3, 6))
    torch.manual_seed(0)
    with deferred.parameters_on_meta():
        pristine = Tied()
    deferred.initialise(target, pristine, {"part": deferred.View("embed.weight", 0, 2, 3)})
    assert torch.equal(target.part, plain.embed.weight[2:5])


def test_a_module_without_an_init_is_refused_by_name():
    class Scale(nn.Module):
        def __init__(self):
            super().__init__()
            self.gain = nn.Parameter(torch.ones(4))

    with deferred.parameters_on_meta():
        model = nn.Sequential(nn.Linear(4, 4), Scale())
    with pytest.raises(WeightsError, match=r"cannot initialise 1 module.*1 \(Scale\).*reset_parameters"):
        deferred.initialise(model, deferred.pristine_copy(model))


def test_optimizer_factories():
    params = [nn.Parameter(torch.ones(2))]
    opt = torch.optim.SGD(params, lr=0.1)
    assert deferred.optimizer_for(opt, params) is opt and deferred.optimizer_for(None, params) is None
    assert isinstance(deferred.optimizer_for(lambda p: torch.optim.Adam(p, lr=1e-3), params), torch.optim.Adam)
    with pytest.raises(TypeError, match="not an optimizer"):
        deferred.optimizer_for(lambda p: 3, params)
    assert deferred.is_factory(make) and not deferred.is_factory(make())


# -- checkpoint sources ---------------------------------------------------------------------------------------

def test_every_kind_of_checkpoint_is_recognised(tmp_path):
    state = seeded().state_dict()
    save_file(state, tmp_path / "one.safetensors")
    (tmp_path / "hf").mkdir()
    save_file(state, tmp_path / "hf" / "model.safetensors")
    (tmp_path / "sharded").mkdir()
    keys = list(state)
    save_file({k: state[k] for k in keys[:2]}, tmp_path / "sharded" / "model-00001-of-00002.safetensors")
    save_file({k: state[k] for k in keys[2:]}, tmp_path / "sharded" / "model-00002-of-00002.safetensors")
    index = {"metadata": {}, "weight_map": {k: f"model-0000{1 if i < 2 else 2}-of-00002.safetensors"
                                            for i, k in enumerate(keys)}}
    (tmp_path / "sharded" / "model.safetensors.index.json").write_text(json.dumps(index))
    torch.save(state, tmp_path / "weights.pt")
    (tmp_path / "ddp").mkdir()
    torch.save({"model": state, "optimizer": None, "micro_step": 3}, tmp_path / "ddp" / "checkpoint.pt")
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"model": dict(state), "optim": {"step": torch.tensor(1.0)}}, checkpoint_id=str(tmp_path / "dcp"),
                 no_dist=True)
    cases = {"one.safetensors": "safetensors", "hf": "safetensors", "sharded": "safetensors",
             "sharded/model.safetensors.index.json": "safetensors", "weights.pt": "torch state dict",
             "ddp": "torch state dict", "dcp": "torch.distributed.checkpoint"}
    for path, kind in cases.items():
        source = sources.open_weights(tmp_path / path)
        assert source.kind == kind, path
        assert sorted(source.names()) == sorted(keys), path
        assert source.shape("0.weight") == (16, 8) and source.dtype("0.weight") == torch.float32, path
    with sources.open_weights(tmp_path / "sharded").reading() as read:
        assert torch.equal(read("2.weight", (slice(1, 3), slice(None))), state["2.weight"][1:3])


def test_a_missing_or_unusable_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(WeightsError, match=r"weights='.*nowhere': no such file or directory \(expected a "
                                           r"\.safetensors file"):
        sources.open_weights(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.txt").write_text("hi")
    with pytest.raises(WeightsError, match="the directory holds no checkpoint .* it holds notes.txt"):
        sources.open_weights(tmp_path / "empty")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "model-00001-of-00002.safetensors"}}))
    with pytest.raises(WeightsError, match="names 1 shard.* that do not exist: .*model-00001-of-00002"):
        sources.open_weights(tmp_path / "broken")
    (tmp_path / "text.bin").write_text("not a checkpoint")
    with pytest.raises(WeightsError, match="text.bin is neither a safetensors nor a torch file"):
        sources.open_weights(tmp_path / "text.bin")
    torch.save([1, 2], tmp_path / "list.pt")
    with pytest.raises(WeightsError, match="holds a list, not a state dict"):
        sources.open_weights(tmp_path / "list.pt")


# -- names, then the load --------------------------------------------------------------------------------------

def test_names_and_shapes_that_do_not_match_are_all_listed(tmp_path):
    save_file(seeded().state_dict(), tmp_path / "model.safetensors")
    source = sources.open_weights(tmp_path)
    other = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 5), nn.Linear(5, 2))
    with pytest.raises(WeightsError) as error:
        loading.match(other, source)
    text = str(error.value)
    assert "does not match Sequential" in text
    assert "2 parameters of the model are not in the checkpoint: 3.weight, 3.bias" in text
    assert "1 tensor of the checkpoint is not in the model: scale" in text
    assert "2 shapes differ: 2.weight (model (5, 16), checkpoint (4, 16)), 2.bias (model (5,), checkpoint (4,))" in text
    assert text.endswith("Nothing was loaded or trained")
    wrapped = nn.Module()
    wrapped.model = seeded()
    with pytest.raises(WeightsError, match="The model's names start with 'model.' where the checkpoint's do not"):
        loading.match(wrapped, source)


def test_a_tied_parameter_may_be_stored_once_and_a_missing_buffer_keeps_its_value(tmp_path):
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(10, 6)
            self.head = nn.Linear(6, 10, bias=False)
            self.head.weight = self.embed.weight
            self.register_buffer("steps", torch.tensor([7.0]))

    saved = seeded(Tied)
    save_file({"embed.weight": saved.embed.weight.detach()}, tmp_path / "model.safetensors")  # as save_pretrained
    model = seeded(Tied, seed=1)
    plan = loading.match(model, sources.open_weights(tmp_path))
    assert plan.source_of == {"embed.weight": "embed.weight", "head.weight": "embed.weight"}
    assert plan.kept == {"steps"}
    loading.load(model, plan)
    assert torch.equal(model.head.weight, saved.embed.weight) and model.steps.item() == 7.0


@pytest.mark.parametrize("kind", ["safetensors", "torch"])
def test_load_reads_regions_through_dcp_including_a_view(tmp_path, kind):
    full = seeded().state_dict()
    if kind == "safetensors":
        save_file(full, tmp_path / "model.safetensors")
    else:
        torch.save(full, tmp_path / "model.pt")
    source = sources.open_weights(tmp_path if kind == "safetensors" else tmp_path / "model.pt")

    class Split(nn.Module):  # 2.weight as two halves, as GPT-2's fused c_attn becomes q, k, v
        def __init__(self):
            super().__init__()
            self.low = nn.Parameter(torch.zeros(2, 16))
            self.high = nn.Parameter(torch.zeros(2, 16))

    model = Split()
    plan = loading.LoadPlan(source, {"2.weight": "2.weight"})
    loading.load(model, plan, {"low": deferred.View("2.weight", 0, 0, 2), "high": deferred.View("2.weight", 0, 2, 2)})
    assert torch.equal(model.low, full["2.weight"][:2]) and torch.equal(model.high, full["2.weight"][2:])


def test_a_zero3_partition_is_written_from_the_rows_it_covers(tmp_path):
    weight = torch.arange(35.0).reshape(7, 5)
    save_file({"w": weight}, tmp_path / "model.safetensors")
    source = sources.open_weights(tmp_path)
    world = 3
    size = math.ceil(35 / world)  # DeepSpeed's partition size (aligned to the world size here)
    parts = []
    for rank in range(world):
        param = nn.Parameter(torch.empty(0))
        param.ds_id, param.ds_numel, param.ds_shape = 0, 35, (7, 5)  # what zero.Init sets
        param.ds_tensor = torch.full((size,), -1.0)
        param.ds_tensor.ds_numel = size
        module = nn.Module()
        module.w = param
        loading.load_zero3_partitions(module, loading.LoadPlan(source, {"w": "w"}), rank)
        parts.append(param.ds_tensor)
    flat = torch.cat(parts)
    assert torch.equal(flat[:35], weight.reshape(-1)) and torch.equal(flat[35:], torch.full((1,), -1.0))


# -- saving ------------------------------------------------------------------------------------------------------

def test_the_stream_is_written_as_hugging_face_shards_that_load_into_the_plain_model(tmp_path):
    model = seeded()
    stream = saving.stream(model.state_dict(keep_vars=True), lambda value: value, keep=True)
    files = saving.write_safetensors(str(tmp_path / "out"), stream, is_writer=True, max_shard_bytes=600)
    names = sorted(p.rsplit("/", 1)[1] for p in files)
    assert names[-1] == "model.safetensors.index.json" and names[0].startswith("model-00001-of-0000")
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    state = {}
    for shard in set(index["weight_map"].values()):
        state.update(load_file(tmp_path / "out" / shard))
    plain = make()
    plain.load_state_dict(state)
    assert_same(plain.state_dict(), model.state_dict())
    # a rank that is not the writer drives the stream and writes nothing
    assert saving.write_safetensors(str(tmp_path / "none"), iter([("a", None)]), is_writer=False) == []
    assert not (tmp_path / "none").exists()
    with pytest.raises(ValueError, match="max_shard_bytes must be positive"):
        saving.write_safetensors(str(tmp_path / "x"), iter([]), True, 0)


def test_a_tied_tensor_is_written_once_and_one_file_needs_no_index(tmp_path):
    shared = torch.ones(3, 2)
    state = {"embed.weight": shared, "head.weight": shared, "bias": torch.zeros(3)}
    files = saving.write_safetensors(str(tmp_path), saving.stream(state, lambda v: v, True), True)
    assert [f.rsplit("/", 1)[1] for f in files] == ["model.safetensors"]
    assert sorted(load_file(tmp_path / "model.safetensors")) == ["bias", "embed.weight"]
    assert saving.collect(saving.stream(state, lambda v: v, True)).keys() == state.keys()
    assert saving.collect(saving.stream(state, lambda v: v, False)) == {}


def test_ddp_streams_its_whole_model_from_rank_0(capsys):
    from dtrain_magic.strategies.ddp import DDPStrategy

    strategy = DDPStrategy(RunConfig(strategy="ddp", num_processes=1), 0, 0, 1, torch.device("cpu"))
    model, _ = strategy.wrap(seeded(), None)
    assert_same(strategy.rank0_state_dict(), model.state_dict())
    with strategy.init_context():
        built = make()
    assert not deferred.has_meta_parameters(built)  # DDP keeps a whole copy: a plain build, said once
    assert "under ddp builds the whole model on every rank: DDP keeps a whole copy" in capsys.readouterr().out


# -- DeepSpeed sized to the model -----------------------------------------------------------------------------

def test_deepspeed_buffers_follow_the_hidden_size_and_user_keys_win():
    config = RunConfig(strategy="deepspeed", zero=3, num_processes=2, micro_batch=2)
    zero = build_config(config, hidden=4096)["zero_optimization"]
    h2 = 4096 * 4096
    assert zero["reduce_bucket_size"] == h2 and zero["stage3_prefetch_bucket_size"] == int(0.9 * h2)
    assert zero["stage3_param_persistence_threshold"] == 40960
    assert zero["stage3_max_live_parameters"] == zero["stage3_max_reuse_distance"] == zero["sub_group_size"] == h2
    assert "reduce_bucket_size" not in build_config(config)["zero_optimization"]  # no model: DeepSpeed's defaults
    assert "stage3_prefetch_bucket_size" not in model_sizes(4096, 2)
    assert model_sizes(16, 3)["reduce_bucket_size"] == 1 << 20  # a tiny model: a floor, not 256 elements
    user = json.dumps({"zero_optimization": {"reduce_bucket_size": 1000, "sub_group_size": "auto",
                                             "stage3_max_live_parameters": "auto"}})
    zero = build_config(config.replace(deepspeed_config=user), hidden=4096)["zero_optimization"]
    assert zero["reduce_bucket_size"] == 1000 and zero["sub_group_size"] == h2
    zero = build_config(config.replace(deepspeed_config=user))["zero_optimization"]
    assert "sub_group_size" not in zero and "stage3_max_live_parameters" not in zero  # "auto" without a model


# -- the estimate's buffers ----------------------------------------------------------------------------------

def test_blocks_are_a_transformers_blocks_and_tied_parts_stay_with_the_root():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.trunk = nn.Module()
            self.trunk.embed = nn.Embedding(50, 8)
            self.trunk.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
            self.head = nn.Linear(8, 50, bias=False)
            self.head.weight = self.trunk.embed.weight

    net = Net()
    assert blocks(net) == list(net.trunk.layers)
    mlp = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    assert blocks(mlp) == [mlp[0], mlp[2]]
    facts = model_facts(net)
    assert (facts.num_params, facts.largest_param, facts.largest_block, facts.hidden) == (
        400 + 3 * 72, 400, 400, 8)  # the root's own part (the tied embedding) is the largest unit


def test_the_estimate_adds_each_strategys_buffers_given_the_models_facts():
    facts = model_facts(nn.Sequential(*[nn.Linear(64, 64) for _ in range(8)]))
    psi = facts.num_params
    ddp = estimate(psi, "ddp", None, "fp32", 2, facts=facts)
    assert ddp.states == 16 * psi and dict(ddp.buffer_parts)["DDP's gradient buckets"] == 4 * psi
    assert ddp.total == ddp.states + ddp.buffers and "+ buffers" in ddp.line()
    fsdp = estimate(psi, "fsdp", None, "fp32", 2, facts=facts)
    assert dict(fsdp.buffer_parts)["unsharded blocks (in use, prefetched, gradient)"] == 3 * 4 * 64 * 65
    z3 = estimate(psi, "deepspeed", 3, "fp32", 2, facts=facts,
                  settings=model_sizes(facts.hidden, 3))
    assert z3.optimizer == 8 * psi / 2  # ZeRO-3 in fp32 steps its partitions themselves: no master copy
    parts = dict(z3.buffer_parts)  # a sub-group (1 << 20 elements here) is at most this rank's whole partition
    assert parts["a sub-group's flat fp32 gradient"] == 4 * psi / 2
    assert parts["Adam's step temporaries (one sub-group)"] == 2 * 4 * psi / 2
    with torch.device("meta"):  # the MLP: 8 x Linear(4096, 4096), sub-groups of H² partition elements
        big = model_facts(nn.Sequential(*[nn.Linear(4096, 4096) for _ in range(8)]))
    big_z3 = estimate(big.num_params, "deepspeed", 3, "fp32", 2, facts=big, settings=model_sizes(big.hidden, 3))
    assert dict(big_z3.buffer_parts)["Adam's step temporaries (one sub-group)"] == 2 * 4 * 4096 * 4096
    assert big_z3.total < 0.6 * estimate(big.num_params, "ddp", None, "fp32", 2, facts=big).total
    assert estimate(psi, "ddp", None, "fp32", 2).buffers == 0  # no facts (a typed size): the states alone
    settings = DeepSpeedStrategy.memory_settings(RunConfig(strategy="deepspeed", zero=3, num_processes=2,
                                                           micro_batch=1), facts)
    assert settings["reduce_bucket_size"] == 1 << 20


def test_the_cells_factory_is_followed_for_the_dry_run_estimate():
    from dtrain_magic.strategies.model_of_cell import model_of_cell

    cell = ("import torch\n"
            "def build():\n    return torch.nn.Sequential(torch.nn.Linear(100, 100), torch.nn.Linear(100, 10))\n"
            "def train(ctx):\n    model, opt = ctx.prepare({arg}, lambda p: torch.optim.Adam(p))\n")
    for arg in ("build", "lambda: build()", "lambda: torch.nn.Linear(100, 100)"):
        found = model_of_cell(cell.format(arg=arg), {})
        assert found.found, (arg, found.description)
        assert found.facts.num_params == found.num_params
    assert model_of_cell(cell.format(arg="build"), {}).num_params == 100 * 100 + 100 + 100 * 10 + 10


def test_ctx_prepare_takes_a_factory_and_refuses_what_cannot_work(tmp_path, capsys):
    from dtrain_magic.strategies.ddp import DDPStrategy
    from dtrain_magic.worker.context import TrainContext

    config = RunConfig(strategy="ddp", num_processes=1)
    ctx = TrainContext(config, DDPStrategy(config, 0, 0, 1, torch.device("cpu")), 0, 0, 1, torch.device("cpu"))
    with pytest.raises(TypeError, match="give the optimizer as a factory too"):
        ctx.prepare(make, torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=0.1))
    with pytest.raises(TypeError, match="the model factory returned int"):
        ctx.prepare(lambda: 3)
    with pytest.raises(WeightsError, match="no such file or directory"):
        ctx.prepare(make, None, weights=tmp_path / "missing.safetensors")
    save_file(seeded().state_dict(), tmp_path / "model.safetensors")
    model, opt = ctx.prepare(make, lambda params: torch.optim.SGD(params, lr=0.1), weights=tmp_path)
    assert_same(model.state_dict(), seeded().state_dict())
    assert [p for g in opt.param_groups for p in g["params"]] == list(model.parameters())
    with torch.device("meta"):
        everything_on_meta = make()
    with pytest.raises(WeightsError, match="1 buffer.* on the meta device, without values: scale. Build the model "
                                           "with ctx.init_model"):
        ctx.prepare(everything_on_meta, None, weights=tmp_path)
    files = ctx.save_weights(tmp_path / "out")
    assert [f.rsplit("/", 1)[1] for f in files] == ["model.safetensors"]
    assert_same(load_file(tmp_path / "out" / "model.safetensors"), dict(model.state_dict()))


def test_save_weights_of_a_hugging_face_model_writes_its_config_so_from_pretrained_loads_it(tmp_path):
    transformers = pytest.importorskip("transformers")
    from dtrain_magic.strategies.ddp import DDPStrategy
    from dtrain_magic.worker.context import TrainContext

    config = RunConfig(strategy="ddp", num_processes=1)
    ctx = TrainContext(config, DDPStrategy(config, 0, 0, 1, torch.device("cpu")), 0, 0, 1, torch.device("cpu"))
    gpt2 = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=8, vocab_size=16, n_positions=8)
    torch.manual_seed(0)
    model, _ = ctx.prepare(transformers.GPT2LMHeadModel(gpt2), None)
    files = ctx.save_weights(tmp_path / "out")
    assert {f.rsplit("/", 1)[1] for f in files} >= {"model.safetensors", "config.json"}
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "out")
    assert_same(dict(loaded.state_dict()), dict(getattr(model, "module", model).state_dict()))
    plain = nn.Linear(2, 2)  # a model without a config: only the weights
    ctx2 = TrainContext(config, DDPStrategy(config, 0, 0, 1, torch.device("cpu")), 0, 0, 1, torch.device("cpu"))
    ctx2.prepare(plain, None)
    assert [f.rsplit("/", 1)[1] for f in ctx2.save_weights(tmp_path / "plain")] == ["model.safetensors"]
