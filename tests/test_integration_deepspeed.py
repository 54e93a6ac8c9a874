"""The DeepSpeed checkpoint engine: real DeepSpeed engines on the CPU (one process, gloo),
``save_checkpoint``/``load_checkpoint`` through the history, and a SIGKILLed run resumed."""

import json
import os
import socket
import subprocess
import sys

import pytest
import torch

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # read when deepspeed is imported
deepspeed = pytest.importorskip("deepspeed")

from deepspeed.accelerator import get_accelerator  # noqa: E402
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo  # noqa: E402
from deepspeed.runtime.fp16.loss_scaler import CreateLossScaler, DynamicLossScaler  # noqa: E402

import datastates_hist as dh  # noqa: E402
from datastates_hist.errors import CorruptionError, StepOrderError  # noqa: E402
from datastates_hist.integrations.deepspeed import HistoryCheckpointEngine, attach  # noqa: E402
from datastates_hist.store import Store  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(ROOT, "examples", "train_deepspeed.py")


@pytest.fixture(scope="module")
def one_process():
    """torch.distributed as DeepSpeed sets it up for one process, taken down after the module."""
    with pytest.MonkeyPatch.context() as mp:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                           "MASTER_PORT": str(port)}.items():
            mp.setenv(key, value)
        # one process needs no shared-memory collectives (nor their C++ op, built at first use)
        mp.setitem(deepspeed.ops.__compatible_ops__, "deepspeed_shm_comm", False)
        yield
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def make_engine(stage, fp16=False):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    config = {"train_batch_size": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
              "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}},
              "zero_optimization": {"stage": stage}}
    if fp16:  # dynamic loss scaling, DeepSpeed's default under fp16
        config["fp16"] = {"enabled": True, "initial_scale_power": 8}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def train(engine, steps):
    dtype = next(engine.module.parameters()).dtype
    for _ in range(steps):
        g = torch.Generator().manual_seed(engine.global_steps)
        x, y = torch.randn(4, 8, generator=g).to(dtype), torch.randn(4, 1, generator=g).to(dtype)
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        engine.step()


def weights(engine):
    return {k: v.clone() for k, v in engine.module.state_dict().items()}


def bit_equal(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(-1).view(torch.uint8),
                                                                     b.view(-1).view(torch.uint8))


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_save_checkpoint_then_load_checkpoint_is_bit_exact(one_process, tmp_path, stage):
    run, ckpt = str(tmp_path / "run"), str(tmp_path / "ckpt")
    engine = make_engine(stage)
    attach(engine, run)
    train(engine, 3)
    engine.save_checkpoint(ckpt, client_state={"epoch": 2, "position": (3, 4)})
    saved = weights(engine)
    train(engine, 2)  # the history keeps step 3 as it was
    after = make_engine(stage)
    train(after, 3)
    assert after.global_steps == 3  # a run that went on from step 3 the same way
    train(after, 2)
    expected = weights(after)
    engine.checkpoint_engine.close()

    fresh = make_engine(stage)
    attach(fresh, run)
    path, client_state = fresh.load_checkpoint(ckpt)
    assert path == os.path.join(ckpt, "global_step3", "mp_rank_00_model_states.pt")
    assert client_state["epoch"] == 2 and client_state["position"] == (3, 4)
    assert fresh.global_steps == 3
    assert all(bit_equal(saved[k], v) for k, v in weights(fresh).items())
    train(fresh, 2)  # optimizer and scheduler state came back too: training goes on identically
    assert all(bit_equal(expected[k], v) for k, v in weights(fresh).items())
    fresh.load_checkpoint(ckpt)  # again, after training on what the first load gave
    assert all(bit_equal(saved[k], v) for k, v in weights(fresh).items())
    train(fresh, 2)
    assert all(bit_equal(expected[k], v) for k, v in weights(fresh).items())
    fresh.checkpoint_engine.close()

    with dh.open(run) as history:
        names = set(history.names(3))
        assert history.step_data(3).values["items"]["extra/deepspeed_tag"] == "global_step3"  # the tag it was saved as
    assert {"model/0.weight", "model/0.bias", "model/2.weight", "model/2.bias"} <= names
    assert not any(n.startswith("extra/mp_rank_00_model_states/module/") for n in names)
    if stage:
        assert "extra/zero_pp_rank_0_mp_rank_00_optim_states/optimizer_state_dict/single_partition_of_fp32_groups/0" \
            in names
    with open(path) as f:
        assert json.load(f) == {"format": "datastates-hist deepspeed pointer", "version": 1, "step": 3,
                                "file": "mp_rank_00_model_states", "tag": "global_step3", "run": "../../run"}


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_fp16_with_dynamic_loss_scaling_is_saved_and_loaded(one_process, tmp_path, monkeypatch, stage):
    # DeepSpeed's CPU accelerator reports no fp16 without mkldnn's fp16; torch computes it on the CPU anyway
    monkeypatch.setattr(type(get_accelerator()), "is_fp16_supported", lambda self: True)
    run, ckpt = str(tmp_path / "run"), str(tmp_path / "ckpt")
    engine = make_engine(stage, fp16=True)
    attach(engine, run)
    train(engine, 3)
    engine.save_checkpoint(ckpt)
    saved = weights(engine)
    scaler = dict(vars(engine.optimizer.loss_scaler)) if stage else None
    train(engine, 2)
    expected = weights(engine)
    engine.checkpoint_engine.close()

    fresh = make_engine(stage, fp16=True)
    attach(fresh, run)
    fresh.load_checkpoint(ckpt)
    assert fresh.global_steps == 3 and all(bit_equal(saved[k], v) for k, v in weights(fresh).items())
    if stage:  # ZeRO keeps the scaler object in its optimizer file
        assert type(fresh.optimizer.loss_scaler) is DynamicLossScaler
        assert vars(fresh.optimizer.loss_scaler) == scaler and scaler["dtype"] is torch.float16
        assert scaler["cur_iter"] == 3
    train(fresh, 2)
    assert all(bit_equal(expected[k], v) for k, v in weights(fresh).items())
    fresh.checkpoint_engine.close()


def test_deepspeed_objects_come_back_as_their_classes(one_process, tmp_path):
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    engine = make_engine(2)
    checkpoints = attach(engine, str(tmp_path / "run"))
    train(engine, 1)
    engine.save_checkpoint(str(tmp_path / "ckpt"))
    tag_dir = tmp_path / "ckpt" / "global_step1"
    zero = checkpoints.load(str(tag_dir / "zero_pp_rank_0_mp_rank_00_optim_states.pt"), map_location="cpu")
    optim = zero["optimizer_state_dict"]
    assert type(optim["loss_scaler"]) is LossScaler and optim["loss_scaler"].cur_scale == 1.0
    assert optim["zero_stage"] is ZeroStageEnum.gradients
    assert optim["param_slice_mappings"][0]["0.bias"] == fragment_address(numel=16, start=128)
    model = checkpoints.load(str(tag_dir / "mp_rank_00_model_states.pt"))
    assert model["param_shapes"][0]["0.weight"] == torch.Size([16, 8])
    assert type(model["param_shapes"][0]["0.weight"]) is torch.Size
    checkpoints.close()


def test_a_file_that_is_not_a_pointer_is_refused_unread(one_process, tmp_path):
    engine = make_engine(0)
    checkpoints = attach(engine, str(tmp_path / "run"))
    pickled = tmp_path / "mp_rank_00_model_states.pt"
    torch.save({"module": {}}, pickled)
    with pytest.raises(ValueError) as err:
        checkpoints.load(str(pickled))
    assert str(err.value) == (
        f"{pickled} is not a checkpoint file written by HistoryCheckpointEngine (a torch.save file of "
        "DeepSpeed's own engine?): load it with DeepSpeed's own checkpoint engine, or import it into a "
        "history with: datastates-hist import")
    checkpoints.close()


def save_tag(checkpoints, save_dir, step, tag=None, **state):
    """What engine.save_checkpoint(save_dir, tag) does at global step ``step``, without an engine."""
    info = CheckpointCommitInfo(tag=tag or f"global_step{step}", save_dir=str(save_dir), save_latest=True)
    checkpoints.create(info)
    os.makedirs(os.path.join(save_dir, info.tag), exist_ok=True)
    path = os.path.join(save_dir, info.tag, "mp_rank_00_model_states.pt")
    checkpoints.save({"module": {"w": torch.full((2,), float(step))}, "global_steps": step, **state}, path)
    checkpoints.commit(info)
    return path


def test_a_dynamic_loss_scaler_of_fp16_comes_back_with_its_dtype(tmp_path):
    # the scaler as DeepSpeed builds it for fp16 with dynamic loss scaling; dtypes in a client state too
    scaler = CreateLossScaler(dtype=torch.float16, static_loss_scale=0, dynamic_scaling=True,
                              dynamic_loss_args={"init_scale": 2.0**16, "scale_window": 1000, "min_scale": 1,
                                                 "delayed_shift": 2, "consecutive_hysteresis": False})
    scaler.update_scale(True)  # an overflow: the scaler's state moves off its defaults
    checkpoints = HistoryCheckpointEngine(str(tmp_path / "run"))
    path = save_tag(checkpoints, tmp_path / "ckpt", 1, optimizer_state_dict={"loss_scaler": scaler},
                    dtypes=[torch.bfloat16, torch.float32])
    state = checkpoints.load(path)
    loaded = state["optimizer_state_dict"]["loss_scaler"]
    assert type(loaded) is DynamicLossScaler and loaded.dtype is torch.float16
    assert vars(loaded) == vars(scaler) and loaded.cur_hysteresis == 1
    assert state["dtypes"] == [torch.bfloat16, torch.float32]
    checkpoints.close()


def write_crafted(checkpoints, tmp_path, step, value):
    """A step holding file ``f`` as ``value``, and a pointer to it."""
    checkpoints.checkpointer.write(step, {}, f={"global_steps": step, "x": value})
    checkpoints.checkpointer.wait()
    pointer = tmp_path / "f.pt"
    pointer.write_text(json.dumps({"format": "datastates-hist deepspeed pointer", "version": 1, "step": step,
                                   "file": "f", "run": "run"}))
    return str(pointer)


SCALER = "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"


@pytest.mark.parametrize("stored,problem", [
    ({"__deepspeed__": "os.system", "fields": "echo hi"},
     "a stored DeepSpeed object of class 'os.system' is not one HistoryCheckpointEngine writes "
     f"({SCALER}, deepspeed.runtime.fp16.loss_scaler.LossScaler, deepspeed.runtime.zero.config.ZeroStageEnum, "
     "deepspeed.utils.tensor_fragment.fragment_address, torch.Size, torch.dtype)"),
    ({"__deepspeed__": "torch.dtype", "fields": "save"},
     "the stored fields of a torch.dtype are damaged (torch.save is not a dtype)"),
    ({"__deepspeed__": SCALER, "fields": {"cur_scale": 2.0, "update_scale": 3}},  # would hide the method
     f"a stored {SCALER} has the fields ['update_scale'], which a DynamicLossScaler does not have"),
    ({"__deepspeed__": SCALER, "fields": [1, 2]}, f"the stored fields of a {SCALER} are damaged (list, not a dict)"),
])
def test_a_stored_object_the_engine_does_not_write_is_refused(tmp_path, stored, problem):
    checkpoints = HistoryCheckpointEngine(str(tmp_path / "run"))
    pointer = write_crafted(checkpoints, tmp_path, 5, stored)
    with pytest.raises(CorruptionError) as err:
        checkpoints.load(pointer)
    assert str(err.value) == f"{tmp_path / 'run'} step 5 f: {problem}"
    checkpoints.close()


def load_error(checkpoints, path, pointer=None):
    """The message ``load(path)`` refuses the file with, ``pointer`` written to it first when given."""
    if pointer is not None:
        with open(path, "w") as f:
            json.dump(pointer, f)
    with pytest.raises(CorruptionError) as err:
        checkpoints.load(path)
    return str(err.value)


def test_a_pointer_in_the_folder_of_another_tag_or_step_is_refused(tmp_path):
    run = tmp_path / "run"
    checkpoints = HistoryCheckpointEngine(str(run))
    first = save_tag(checkpoints, tmp_path / "ckpt", 1)
    second = save_tag(checkpoints, tmp_path / "ckpt", 2)
    pointer, pointer_of_second = (json.loads(open(path).read()) for path in (first, second))
    assert load_error(checkpoints, first, {**pointer, "step": 2}) == (
        f"{first} is the pointer of DeepSpeed's tag 'global_step1', but step 2 of {run} was saved as tag "
        "'global_step2': a stale or altered pointer (the history was truncated and the step saved again?); save the "
        "checkpoint again")
    # tag global_step1's pointer copied into the folder of global_step2
    assert load_error(checkpoints, second, pointer) == (
        f"{second} is the pointer of DeepSpeed's tag 'global_step1', but lies in {tmp_path / 'ckpt' / 'global_step2'}, "
        "not in the folder of that tag: a copied or moved pointer; load tag 'global_step1' where it was saved, or "
        "save the checkpoint again")
    checkpoints.checkpointer.truncate(after=1)
    save_tag(checkpoints, tmp_path / "ckpt", 2, tag="best")  # step 2 again: global_step2's pointer is stale
    assert load_error(checkpoints, second, pointer_of_second) == (
        f"{second} is the pointer of DeepSpeed's tag 'global_step2', but step 2 of {run} was saved as tag 'best': "
        "a stale or altered pointer (the history was truncated and the step saved again?); save the checkpoint "
        "again")
    assert load_error(checkpoints, first, {**pointer, "file": "deepspeed_tag"}) == (
        f"{first} points at file 'deepspeed_tag' of step 1 in {run}, which the step does not hold")
    del pointer["tag"]  # a pointer written before pointers held their tag is read as before
    with open(first, "w") as f:
        json.dump(pointer, f)
    assert checkpoints.load(first)["module"]["w"].tolist() == [1.0, 1.0]
    checkpoints.close()


@pytest.mark.parametrize("change,problem", [
    ({"step": True}, "its step is not a whole number"),
    ({"step": 1.0}, "its step is not a whole number"),
    ({"file": 3}, "its file is not a string"),
    ({"file": "../x"}, "its file '../x' is not a path inside a tag's folder"),
    ({"file": "/x"}, "its file '/x' is not a path inside a tag's folder"),
    ({"run": None}, "its run is not a string"),
    ({"tag": ["global_step1"]}, "its tag is not a string"),
])
def test_a_damaged_pointer_names_what_is_wrong(tmp_path, change, problem):
    checkpoints = HistoryCheckpointEngine(str(tmp_path / "run"))
    path = save_tag(checkpoints, tmp_path / "ckpt", 1)
    pointer = json.loads(open(path).read())
    assert load_error(checkpoints, path, {**pointer, **change}) == (
        f"{path} is a damaged HistoryCheckpointEngine pointer: {problem}")
    assert load_error(checkpoints, path, {**pointer, "version": 2}) == (
        f"{path} is a HistoryCheckpointEngine pointer of version 2, but this engine reads version 1")
    checkpoints.close()


def test_a_file_named_as_the_tag_item_is_refused(tmp_path):
    checkpoints = HistoryCheckpointEngine(str(tmp_path / "run"))
    checkpoints.create(CheckpointCommitInfo(tag="global_step1", save_dir=str(tmp_path / "ckpt"), save_latest=True))
    with pytest.raises(ValueError) as err:
        checkpoints.save({}, str(tmp_path / "ckpt" / "global_step1" / "deepspeed_tag.pt"))
    assert str(err.value) == (
        f"{tmp_path / 'ckpt' / 'global_step1' / 'deepspeed_tag.pt'}: HistoryCheckpointEngine keeps the tag of each "
        "step as extra/deepspeed_tag, so it cannot store a file named deepspeed_tag.pt; name the file otherwise")
    checkpoints.close()


def test_a_pointer_into_another_history_is_refused(one_process, tmp_path):
    engine = make_engine(0)
    attach(engine, str(tmp_path / "run"))
    train(engine, 1)
    engine.save_checkpoint(str(tmp_path / "ckpt"))
    engine.checkpoint_engine.close()
    other = HistoryCheckpointEngine(str(tmp_path / "other"))
    pointer = str(tmp_path / "ckpt" / "global_step1" / "mp_rank_00_model_states.pt")
    with pytest.raises(ValueError) as err:
        other.load(pointer)
    assert str(err.value) == (f"{pointer} points into the history {tmp_path / 'run'}, but this engine reads "
                              f"{tmp_path / 'other'}: attach the engine to {tmp_path / 'run'}")
    other.close()


def test_bad_saves_are_refused_with_the_reason(one_process, tmp_path):
    engine = make_engine(0)
    checkpoints = attach(engine, str(tmp_path / "run"))
    train(engine, 1)
    with pytest.raises(ValueError) as err:
        engine.save_checkpoint(str(tmp_path / "ckpt"), client_state={"meta": {"__deepspeed__": 1}})
    assert str(err.value) == (
        f"{tmp_path / 'ckpt' / 'global_step1' / 'mp_rank_00_model_states.pt'}/meta: a dict with the key "
        "'__deepspeed__' cannot be stored by HistoryCheckpointEngine (the key marks DeepSpeed's objects); "
        "rename the key")
    with pytest.raises(TypeError) as err:
        engine.save_checkpoint(str(tmp_path / "ckpt"), client_state={"thing": object()})
    assert str(err.value) == (
        "cannot checkpoint 'extra/mp_rank_00_model_states': value/thing: a value of type builtins.object cannot "
        "be stored without pickle; convert it to numbers, strings, lists and dicts, give it "
        "state_dict()/load_state_dict(), or register a StateProvider for its type")
    with pytest.raises(ValueError, match=r"is not under .*save_16bit_model"):
        engine.save_16bit_model(str(tmp_path / "export"))
    assert checkpoints.checkpointer.steps() == []
    checkpoints.close()


def test_a_job_of_several_ranks_is_refused(one_process, tmp_path, monkeypatch):
    make_engine(0)  # torch.distributed is up
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    with pytest.raises(ValueError) as err:
        HistoryCheckpointEngine(str(tmp_path / "run"))
    assert str(err.value) == ("HistoryCheckpointEngine writes the history of one process, but this DeepSpeed job "
                              "has 2 ranks; run it as one process, or keep DeepSpeed's own checkpoint engine")
    assert not os.path.exists(tmp_path / "run")


def test_attach_needs_a_deepspeed_engine(tmp_path):
    with pytest.raises(TypeError) as err:
        attach(torch.nn.Linear(2, 2), str(tmp_path / "run"))
    assert str(err.value) == "attach() needs a DeepSpeed engine (from deepspeed.initialize), got Linear"


def test_saving_after_resuming_an_older_tag_says_how_to_branch(one_process, tmp_path):
    run, ckpt = str(tmp_path / "run"), str(tmp_path / "ckpt")
    engine = make_engine(1)
    attach(engine, run)
    for _ in range(2):
        train(engine, 2)
        engine.save_checkpoint(ckpt)
    engine.checkpoint_engine.close()
    fresh = make_engine(1)
    checkpoints = attach(fresh, run)
    fresh.load_checkpoint(ckpt, tag="global_step2")
    train(fresh, 2)
    with pytest.raises(StepOrderError) as err:
        fresh.save_checkpoint(ckpt)
    assert str(err.value) == (
        f"DeepSpeed's tag 'global_step4' is global step 4, but {run} already holds step 4: steps only grow. "
        "To go on from an older checkpoint, drop the later steps first: "
        "checkpoint_engine.checkpointer.truncate(after=2)")
    checkpoints.checkpointer.truncate(after=2)
    fresh.save_checkpoint(ckpt)
    assert checkpoints.checkpointer.steps() == [2, 4]
    checkpoints.close()


KILLED_IN_COMMIT = """
import os, signal, sys
os.environ.setdefault("DS_ACCELERATOR", "cpu")
sys.path.insert(0, sys.argv[3])
import datastates_hist as dh
from datastates_hist.integrations.deepspeed import HistoryCheckpointEngine
from test_integration_deepspeed import save_tag
engine = HistoryCheckpointEngine(sys.argv[1], keep=dh.KeepLast(1))
*before, last = map(int, sys.argv[4].split(","))
for step in before:
    save_tag(engine, sys.argv[2], step)
HistoryCheckpointEngine._write_pointer = lambda *args: os.kill(os.getpid(), signal.SIGKILL)
save_tag(engine, sys.argv[2], last)  # killed once the step is committed, before its pointers and `latest`
"""


def killed_in_commit(tmp_path, steps):
    run, save_dir = str(tmp_path / "run"), str(tmp_path / "ckpt")
    child = subprocess.run([sys.executable, "-c", KILLED_IN_COMMIT, run, save_dir, os.path.dirname(__file__), steps],
                           capture_output=True, text=True, timeout=300)
    assert child.returncode == -9, child.stderr
    return run, save_dir


def test_keep_holds_the_step_latest_names_until_deepspeed_can_resume_from_a_newer_one(tmp_path):
    """A save SIGKILLed between the history's commit and DeepSpeed's `latest`: KeepLast(1)
    alone would have removed step 4, the only one `latest` and the pointers can reach."""
    run, save_dir = killed_in_commit(tmp_path, "4,8")
    assert (tmp_path / "ckpt" / "latest").read_text() == "global_step4"
    assert os.listdir(tmp_path / "ckpt" / "global_step8") == []
    checkpoints = HistoryCheckpointEngine(run, keep=dh.KeepLast(1))
    assert checkpoints.checkpointer.steps() == [4, 8]
    state = checkpoints.load(os.path.join(save_dir, "global_step4", "mp_rank_00_model_states.pt"))
    assert state["module"]["w"].tolist() == [4.0, 4.0]
    checkpoints.checkpointer.truncate(after=4)  # as the error of saving step 8 again says
    save_tag(checkpoints, save_dir, 8)
    assert checkpoints.checkpointer.steps() == [4, 8]  # `latest` named step 4 during the commit
    assert (tmp_path / "ckpt" / "latest").read_text() == "global_step8"  # written by the engine, whole
    save_tag(checkpoints, save_dir, 12)
    assert checkpoints.checkpointer.steps() == [8, 12]
    checkpoints.close()


def test_a_first_save_killed_before_its_pointers_is_named_and_replaced_once_dropped(tmp_path):
    run, save_dir = killed_in_commit(tmp_path, "4")
    assert not (tmp_path / "ckpt" / "latest").exists()
    checkpoints = HistoryCheckpointEngine(run)
    with pytest.raises(StepOrderError) as err:
        save_tag(checkpoints, save_dir, 4)  # the run again, from the start, as DeepSpeed finds no `latest`
    assert str(err.value) == (
        f"DeepSpeed's tag 'global_step4' is global step 4, but {run} already holds step 4, its only step, which "
        "DeepSpeed cannot load (no HistoryCheckpointEngine pointer in the tag that SAVE_DIR/latest names): left "
        "from a save that was killed, it is replaced by this one once dropped: "
        "checkpoint_engine.checkpointer.truncate(after=-1)")
    checkpoints.checkpointer.truncate(after=-1)
    path = save_tag(checkpoints, save_dir, 4)
    assert checkpoints.load(path)["module"]["w"].tolist() == [4.0, 4.0]
    checkpoints.close()


def test_a_tag_saved_again_at_its_step_is_refused_without_advice_to_drop_every_step(tmp_path):
    checkpoints = HistoryCheckpointEngine(str(tmp_path / "run"))
    save_tag(checkpoints, tmp_path / "ckpt", 4)
    with pytest.raises(StepOrderError) as err:
        save_tag(checkpoints, tmp_path / "ckpt", 4, tag="final")
    assert str(err.value) == (
        f"DeepSpeed's tag 'final' is global step 4, but {tmp_path / 'run'} already holds step 4, its only step: "
        "a history keeps one checkpoint per global step; save after training on")
    with pytest.raises(StepOrderError) as err:
        save_tag(checkpoints, tmp_path / "ckpt", 2)
    assert str(err.value) == (
        f"DeepSpeed's tag 'global_step2' is global step 2, but {tmp_path / 'run'} already holds step 4, and no "
        "step before 2: load one of its checkpoints first (engine.load_checkpoint), or save this run into a new "
        "history")
    assert checkpoints.checkpointer.steps() == [4]
    checkpoints.close()


def run_example(*args):
    env = {k: v for k, v in os.environ.items() if k != "MASTER_PORT"}  # the example finds a free one
    out = subprocess.run([sys.executable, TRAIN, "--steps", "12", "--save-every", "4", *args],
                         capture_output=True, text=True, timeout=600, env=env)
    return out


def step_tensors(run, step):
    store = Store(run)
    with store.open_step(step) as data:
        tensors = {name: data.read(name) for name in data.records if not name.startswith("rng/")}
        items = {k: v for k, v in data.values["items"].items() if not k.startswith("rng/")}
    store.close()
    return tensors, items


@pytest.mark.parametrize("stage,backend", [(0, "hdf5"), (2, "adios2")])
def test_a_run_killed_mid_way_and_resumed_ends_as_the_uninterrupted_one(tmp_path, stage, backend):
    full = ["--run", str(tmp_path / "full"), "--ckpt", str(tmp_path / "full-ckpt")]
    cut = ["--run", str(tmp_path / "cut"), "--ckpt", str(tmp_path / "cut-ckpt")]
    common = ["--stage", str(stage), "--backend", backend]
    out = run_example(*full, *common)
    assert out.returncode == 0, out.stderr
    killed = run_example(*cut, *common, "--kill-at", "10")
    assert killed.returncode == -9, killed.stderr  # SIGKILL after step 10: step 8 is the newest saved
    assert (tmp_path / "cut-ckpt" / "latest").read_text() == "global_step8"
    resumed = run_example(*cut, *common, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from step 8 (epoch 0)" in resumed.stdout
    assert Store(str(tmp_path / "cut")).steps() == [4, 8, 12]
    want, want_items = step_tensors(str(tmp_path / "full"), 12)
    got, got_items = step_tensors(str(tmp_path / "cut"), 12)
    assert want.keys() == got.keys() and len(want) >= 8
    assert all(bit_equal(want[n], got[n]) for n in want)
    assert want_items == got_items  # the scheduler, the step counters, the loss in the client state
