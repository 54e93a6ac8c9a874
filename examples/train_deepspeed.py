"""Train a small MLP with DeepSpeed on the CPU, its checkpoints kept in a datastates-hist history.

``engine.save_checkpoint`` goes through
:class:`datastates_hist.integrations.deepspeed.HistoryCheckpointEngine`: each
tag is one step of the history (``RUN``), and DeepSpeed's checkpoint folder
(``CKPT``) keeps ``latest`` and small pointer files. The batches are drawn from
a generator seeded by the step, so a resumed run sees the batches the
uninterrupted one saw. ``--kill-at`` ends the process with SIGKILL after that
step; ``--resume`` goes on from DeepSpeed's ``latest`` tag.

Example:
    python examples/train_deepspeed.py --run /tmp/ds/run --ckpt /tmp/ds/ckpt --steps 20 --kill-at 12
    python examples/train_deepspeed.py --run /tmp/ds/run --ckpt /tmp/ds/ckpt --steps 20 --resume
"""
import argparse
import os
import signal
import sys

# DeepSpeed picks its accelerator when imported; one process, no launcher
os.environ.setdefault("DS_ACCELERATOR", "cpu")
for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}.items():
    os.environ.setdefault(key, value)

import deepspeed  # noqa: E402
import torch  # noqa: E402

# Let the example run from a source checkout without installing the package.
_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO_ROOT not in sys.path:
    sys.path.append(_REPO_ROOT)
from datastates_hist.integrations.deepspeed import attach  # noqa: E402


def free_port() -> str:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def make_engine(stage: int):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 1))
    config = {
        "train_batch_size": 8,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},  # no C++ op to build
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5}},
        "zero_optimization": {"stage": stage},
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def batch(step: int):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(8, 16, generator=g)
    return x, x.sum(dim=1, keepdim=True).sin()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run", required=True, help="the history's run directory")
    p.add_argument("--ckpt", required=True, help="DeepSpeed's checkpoint folder (latest, pointer files)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--save-every", type=int, default=4)
    p.add_argument("--stage", type=int, default=1, choices=(0, 1, 2), help="ZeRO stage")
    p.add_argument("--backend", default="adios2", choices=("adios2", "hdf5"))
    p.add_argument("--kill-at", type=int, default=None, help="SIGKILL this process after this step")
    p.add_argument("--resume", action="store_true", help="go on from DeepSpeed's latest tag")
    args = p.parse_args()
    os.environ.setdefault("MASTER_PORT", free_port())
    # single-process CPU runs need no shared-memory collectives; skipping them skips building their C++ op
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False

    engine = make_engine(args.stage)
    checkpoints = attach(engine, args.run, backend=args.backend)
    if args.resume:
        path, client_state = engine.load_checkpoint(args.ckpt)
        if path is None:
            sys.exit(f"no checkpoint to resume from in {args.ckpt}")
        print(f"resumed from step {engine.global_steps} (epoch {client_state['epoch']})")
    while engine.global_steps < args.steps:
        x, y = batch(engine.global_steps)
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        step = engine.global_steps
        if step % args.save_every == 0 or step == args.steps:
            engine.save_checkpoint(args.ckpt, client_state={"epoch": 0, "loss": loss.item()})
            print(f"step {step}: loss {loss.item():.6f}, saved")
        if step == args.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
    checkpoints.close()


if __name__ == "__main__":
    main()
