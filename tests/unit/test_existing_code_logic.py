"""Pure logic behind running existing training code unchanged (issue #13): which init_process_group
calls can adopt the run's group, the call form's parsing and validation, spotting Ray Train loops,
Hugging Face flag mapping, metric filtering."""

import types

import pytest

from dtrain_magic.errors import CaptureError, DistributeError, UnsupportedCodeError
from dtrain_magic.integrations import numbers
from dtrain_magic.integrations.compat_dist import check_request, requested_backends
from dtrain_magic.integrations.hf import apply_flags
from dtrain_magic.integrations.ray_train import report_step
from dtrain_magic.notebook.capture import call_statement, capture
from dtrain_magic.payload import CTX, BoundCall, refers_to_ray_train


# -- init_process_group adoption ---------------------------------------------------------------------
@pytest.mark.parametrize("backend,expected", [
    (None, set()), ("", set()), ("gloo", {"gloo"}), ("GLOO", {"gloo"}), ("nccl", {"nccl"}),
    ("cpu:gloo,cuda:nccl", {"gloo", "nccl"}), ("undefined", set()),
])
def test_requested_backends(backend, expected):
    assert requested_backends(backend) == expected


def cpu_run(**kwargs):
    return check_request(current_backend="gloo", cuda_available=False, rank=1, world_size=2, **kwargs)


@pytest.mark.parametrize("backend", [None, "gloo", "GLOO"])
def test_compatible_requests_are_adopted_silently(backend):
    cpu_run(backend=backend)
    cpu_run(backend=backend, requested_rank=1, requested_world_size=2)
    cpu_run(backend=backend, requested_rank=-1, requested_world_size=-1)  # torch's "not given"


def test_nccl_on_cpu_is_a_short_error_saying_what_to_do():
    with pytest.raises(UnsupportedCodeError) as info:
        cpu_run(backend="nccl")
    message = str(info.value)
    assert isinstance(info.value, DistributeError)
    assert "NCCL needs CUDA" in message and "backend='gloo'" in message and "--gpu" in message


def test_nccl_with_cuda_but_a_cpu_run_says_to_use_gpu():
    with pytest.raises(UnsupportedCodeError, match="--gpu"):
        check_request("nccl", current_backend="gloo", cuda_available=True, rank=0, world_size=2)
    check_request("nccl", current_backend="nccl", cuda_available=True, rank=0, world_size=2)
    check_request("cpu:gloo,cuda:nccl", current_backend="cpu:gloo,cuda:nccl", cuda_available=True, rank=0, world_size=2)


def test_unknown_backend_and_wrong_ranks_are_refused():
    with pytest.raises(UnsupportedCodeError, match="'mpi' is not available"):
        cpu_run(backend="mpi")
    with pytest.raises(UnsupportedCodeError, match="this process is rank 1"):
        cpu_run(backend="gloo", requested_rank=0)
    with pytest.raises(UnsupportedCodeError, match="this run has 2 processes"):
        cpu_run(backend="gloo", requested_world_size=4)


def test_adopt_in_a_real_one_process_group_and_restore():
    """The replacements on a real (one-process, in-memory) gloo group: init adopts, destroy is deferred,
    restore puts torch's functions back."""
    import torch.distributed as dist

    from dtrain_magic.integrations import compat_dist

    real_init, real_destroy = dist.init_process_group, dist.destroy_process_group
    real_init("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        compat_dist.adopt(0, 0, 1, 1)
        from torch.distributed import init_process_group  # what a cell's import resolves to meanwhile

        init_process_group("gloo", init_method="env://")  # no TCPStore, no error: adopted
        dist.destroy_process_group()
        assert dist.is_initialized()  # deferred to the worker's teardown
        with pytest.raises(UnsupportedCodeError):
            dist.init_process_group("nccl")
        compat_dist.restore()
        assert dist.init_process_group is real_init and dist.destroy_process_group is real_destroy
    finally:
        compat_dist.restore()
        real_destroy()


# -- the call form -----------------------------------------------------------------------------------
def test_call_statement_rules():
    ns = {"earlier": lambda: None}
    exec("def earlier_fn(lr): pass", ns)
    assert call_statement("def train(lr): pass\ntrain(0.1)\n", ns).func.id == "train"
    assert call_statement("def train(lr): pass\ndef helper(): pass\ntrain(0.1)\n", ns) is None  # not the last def
    assert call_statement("def train(lr): pass\nprint(1)\n", ns) is None
    assert call_statement("earlier_fn(0.1)\n", ns).func.id == "earlier_fn"  # a function from an earlier cell
    assert call_statement("len([1])\n", ns) is None  # a builtin, not a notebook function
    assert call_statement("def a(): pass\ndef b(x): pass\nb(1)\n", ns, fn_name="a") is None
    assert call_statement("def a(x): pass\ndef b(): pass\na(1)\n", ns, fn_name="a").func.id == "a"


def test_capture_call_form_binds_arguments_and_does_not_run_the_call():
    ns = {}
    cell = ("LR = 0.5\nCALLS = []\ndef train(lr, ctx, steps=1):\n    CALLS.append(lr)\n    return lr * steps, ctx\n"
            "train(LR * 2, ctx, steps=3)\n")
    payload, fn = capture(cell, ns)
    assert ns["CALLS"] == []  # the last line runs on the workers, not in the notebook
    assert payload.call_text == "train(LR * 2, ctx, steps=3)" and payload.takes_ctx
    bound = payload.load()
    assert isinstance(bound, BoundCall)
    assert bound("the-ctx") == (3.0, "the-ctx")
    assert CTX in bound.args


def test_call_form_without_ctx_is_called_without_it():
    payload, _ = capture("def train(a, b=2):\n    return a + b\ntrain(1, b=5)\n", {})
    assert not payload.takes_ctx and payload.load()() == 6


@pytest.mark.parametrize("cell,message", [
    ("def train(lr): pass\ntrain(0.1, steps=3)\n", "unexpected keyword argument 'steps'"),
    ("def train(lr): pass\ntrain()\n", "missing a required argument: 'lr'"),
    ("def train(lr): pass\ntrain(undefined_name)\n", "evaluating the argument `undefined_name` failed"),
    ("def train(lr): pass\ntrain(ctx.rank)\n", "ctx can be passed only as a bare argument"),
])
def test_bad_calls_are_capture_errors_before_launch(cell, message):
    with pytest.raises(CaptureError) as info:
        capture(cell, {})
    assert message in str(info.value)


def test_unpicklable_argument_is_named():
    import threading

    ns = {"LOCK": threading.Lock()}
    with pytest.raises(CaptureError, match=r"argument 1 \(lock\) cannot be pickled"):
        capture("def train(x): pass\ntrain(LOCK)\n", ns)


def test_two_required_parameters_without_a_call_suggest_the_call_form():
    with pytest.raises(CaptureError, match=r"end the cell with the call, e.g. `train\(lr, epochs\)`"):
        capture("def train(lr, epochs): pass\n", {})


# -- Ray Train loops ---------------------------------------------------------------------------------
def test_refers_to_ray_train():
    fake_train = types.ModuleType("ray.train")
    fake_ray = types.ModuleType("ray")
    fake_ray.train = fake_train

    def report(metrics):
        pass

    report.__module__ = "ray.train"
    ns = {"ray": fake_ray, "train_mod": fake_train, "report": report, "__name__": "__main__"}
    exec("def a():\n    ray.train.report({})\n", ns)
    exec("def b():\n    report({})\n", ns)
    exec("def c():\n    import ray.train.torch\n", ns)
    exec("def helper():\n    train_mod.get_context()\ndef d():\n    helper()\n", ns)
    exec("def e(ctx):\n    ctx.log(loss=1)\n    import os\n    return os.environ['RANK']\n", ns)
    exec("def f():\n    def inner():\n        from ray.train import report\n    inner()\n", ns)
    exec("def train(): pass\ndef g():\n    ray.init()\n    train()\n", ns)  # ray and a `train`, not ray.train
    exec("def h():\n    import ray\n    ray.train.get_context()\n", ns)
    assert [refers_to_ray_train(ns[n]) for n in "abcdefgh"] == [True, True, True, True, False, True, False, True]


def test_report_step():
    assert report_step({"loss": 1, "step": 7}, 3) == 7
    assert report_step({"loss": 1, "epoch": 2}, 3) == 2
    assert report_step({"loss": 1, "epoch": 0.5}, 3) == 3  # a fractional epoch is not a step
    assert report_step({"loss": 1, "step": True}, 3) == 3


# -- Hugging Face --------------------------------------------------------------------------------------
def args(**kw):
    base = dict(bf16=False, fp16=False, gradient_accumulation_steps=1, mixed_precision="no")
    base.update(kw)
    return types.SimpleNamespace(**base)


def test_flags_fill_in_trainer_defaults():
    a = args()
    apply_flags(a, "bf16", 4)
    assert a.bf16 and a.mixed_precision == "bf16" and a.gradient_accumulation_steps == 4
    b = args(bf16=True, gradient_accumulation_steps=4)
    apply_flags(b, "bf16", 4)  # the same values: fine
    c = args(gradient_accumulation_steps=8, fp16=True)
    apply_flags(c, "fp32", 1)  # flags at their defaults leave the user's arguments alone
    assert c.gradient_accumulation_steps == 8 and c.fp16 and not c.bf16


def test_flags_conflicting_with_trainer_arguments_are_errors():
    with pytest.raises(UnsupportedCodeError, match=r"--precision bf16 conflicts with TrainingArguments\(fp16=True\)"):
        apply_flags(args(fp16=True), "bf16", 1)
    with pytest.raises(UnsupportedCodeError, match=r"--grad-accum 2 conflicts .*gradient_accumulation_steps=4"):
        apply_flags(args(gradient_accumulation_steps=4), "fp32", 2)


def test_numbers_keeps_numeric_metrics_only():
    import torch

    got = numbers({"loss": torch.tensor(0.5), "lr": 1e-3, "epoch": 1, "name": "x", "flag": True,
                   "vec": torch.ones(3), "nan": float("nan"), "none": None})
    assert got == {"loss": 0.5, "lr": 1e-3, "epoch": 1.0}


# -- before launch -----------------------------------------------------------------------------------
def test_a_ray_train_loop_off_ray_is_refused_and_dry_run_shows_the_call(tmp_path):
    from dtrain_magic.config import RunConfig
    from dtrain_magic.driver.runner import check, check_payload, dry_run_text
    from dtrain_magic.errors import ConfigError
    from dtrain_magic.payload import Payload

    payload = Payload(b"", "loop", False, call_text="loop({'lr': 0.1})", uses_ray_train=True)
    with pytest.raises(ConfigError, match=r"--backend: loop\(\{'lr': 0.1\}\) calls Ray Train .* --backend ray"):
        check_payload(RunConfig(backend="local"), payload)
    check_payload(RunConfig(backend="ray"), payload)
    plan = check(RunConfig(backend="local", tracking_uri=f"sqlite:///{tmp_path}/mlflow.db"))
    assert "would run loop({'lr': 0.1}) on 2 local process(es)" in dry_run_text(plan, payload)
