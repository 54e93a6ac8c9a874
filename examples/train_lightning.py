"""Train the example GPT with Lightning, every optimizer step checkpointed into a history.

The model, corpus, optimizer and LR schedule are those of ``train_gpt.py`` (the same flags), in
a ``LightningModule``; the batches come from a resumable loader (Lightning stores its position
with every checkpoint), so ``--resume`` continues from the newest restore point exactly as the
uninterrupted run would have gone on, bit for bit.

Example:
    python examples/train_lightning.py --size tiny --steps 50 --stop-at 20
    python examples/train_lightning.py --size tiny --steps 50 --resume
    datastates-hist ls runs/lit
"""
import time

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

import train_gpt  # the folder of this script is on sys.path: it puts the repository there too
import datastates_hist as dh
from datastates_hist.integrations.lightning import HistoryCheckpoint


class GPTModule(L.LightningModule):
    """The example GPT, trained with AdamW and the warm-up-then-cosine schedule of train_gpt.py."""

    def __init__(self, size: str = "tiny", block_size: int = 128, lr: float = 1e-3, steps: int = 200,
                 dtype: str = "float32"):
        super().__init__()
        self.save_hyperparameters()  # stored with every step (extra/lightning/hyper_parameters)
        self.model = train_gpt.build_model(size, block_size=block_size)
        if dtype == "bfloat16":
            self.model = self.model.to(torch.bfloat16)

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.model(x)
        loss = F.cross_entropy(logits.float().view(-1, train_gpt.VOCAB), y.reshape(-1))
        self.log("loss", loss)  # stored with every step as extra/data/loss
        return loss

    def configure_optimizers(self):
        optimizer = train_gpt.make_optimizer(self.model, self.hparams.lr)
        steps = self.hparams.steps
        scheduler = train_gpt.make_scheduler(optimizer, steps, max(1, steps // 10))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class Windows:
    """Batches of random windows of ``corpus``, ``batches`` of them an epoch, each epoch in an order
    fixed by ``(seed, epoch)``. Resumable: Lightning stores ``state_dict()`` (the epoch and the
    batches given) with every checkpoint and calls ``load_state_dict()`` when it resumes."""

    def __init__(self, corpus: torch.Tensor, batch_size: int, block_size: int, batches: int, seed: int):
        self.corpus, self.batch_size, self.block_size = corpus, batch_size, block_size
        self.batches, self.seed = batches, seed
        self.epoch, self.position = 0, 0

    def __len__(self) -> int:
        return self.batches

    def __iter__(self):
        if self.position >= self.batches:  # the last epoch was finished: a new one
            self.epoch, self.position = self.epoch + 1, 0
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        starts = torch.randint(len(self.corpus) - self.block_size - 1, (self.batches, self.batch_size, 1),
                               generator=generator)
        for i in range(self.position, self.batches):
            self.position = i + 1
            windows = self.corpus[starts[i] + torch.arange(self.block_size + 1)].long()
            yield windows[:, :-1], windows[:, 1:]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = state["epoch"], state["position"]


class StepTimer(Callback):
    """Wall time of each training batch, hooks and checkpointing included (the first is left out
    of the mean: warm-up), and the global step training started from."""

    def __init__(self):
        self.times: list[float] = []
        self.start_step = 0
        self._start = None

    def on_train_start(self, trainer, pl_module):
        self.start_step = trainer.global_step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        now = time.perf_counter()
        if self._start is not None:
            self.times.append(now - self._start)
        self._start = now

    def mean_s(self) -> float:
        timed = self.times[1:] or self.times
        return sum(timed) / len(timed) if timed else 0.0


def build_parser():
    """train_gpt.py's flags, with ``--baseline`` (Lightning's own ModelCheckpoint instead)."""
    p = train_gpt.build_parser()
    p.description = __doc__.splitlines()[0]
    p.set_defaults(run_dir="runs/lit")
    p.add_argument("--baseline", action="store_true",
                   help="save with Lightning's ModelCheckpoint(every_n_train_steps=1) into RUN_DIR instead "
                        "(to compare the overhead)")
    p.add_argument("--batches-per-epoch", type=int, default=1000)
    return p


def train(args, callbacks=()) -> dict:
    """Train as ``args`` say; ``callbacks`` are added to the Trainer's.

    Returns:
        ``{"last_step", "mean_step_s", "start_step"}``.
    """
    if args.threads:
        torch.set_num_threads(args.threads)
    L.seed_everything(args.seed, verbose=False)
    corpus = train_gpt.load_corpus(args.corpus_bytes)
    module = GPTModule(args.size, args.block_size, args.lr, args.steps, args.dtype)
    loader = Windows(corpus, args.batch_size, args.block_size, args.batches_per_epoch, args.seed)
    timer = StepTimer()
    extra = {"callbacks": [timer, *callbacks], "enable_checkpointing": False}
    ckpt_path = None
    if args.baseline:
        extra = {"callbacks": [timer, *callbacks, ModelCheckpoint(args.run_dir, every_n_train_steps=1)]}
    elif not args.no_ckpt:
        history = HistoryCheckpoint(args.run_dir, backend=args.backend, codec=args.codec,
                                    **train_gpt.history_policies(args))
        extra = {"callbacks": [timer, *callbacks, history], "plugins": [history.checkpoint_io]}
        if args.resume or args.resume_from is not None:
            try:  # checked before the later steps go
                ckpt_path = history.resume_path(args.resume_from)
            except (dh.StepNotFoundError, dh.StoreNotFoundError) as exc:
                raise SystemExit(f"--resume-from {args.resume_from}: {exc}") from None
            print(f"resuming from {ckpt_path}" if ckpt_path else f"no restore point in {args.run_dir}; "
                  "starting from step 0")
        if args.resume_from is not None:  # later steps belong to the branch left behind
            history.checkpoint_io.checkpointer.truncate(after=args.resume_from)
    trainer = L.Trainer(max_steps=args.steps if args.stop_at is None else min(args.steps, args.stop_at),
                        accelerator="auto", devices=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, log_every_n_steps=args.log_every, **extra)
    trainer.fit(module, loader, ckpt_path=ckpt_path)
    print(f"done: global step {trainer.global_step} | mean step {timer.mean_s() * 1e3:.1f} ms (excl. first) | "
          f"loss {float(trainer.callback_metrics.get('loss', float('nan'))):.4f} | run dir {args.run_dir}")
    return {"last_step": trainer.global_step, "mean_step_s": timer.mean_s(), "start_step": timer.start_step}


def main(argv=None):
    """Parse ``argv`` and train."""
    return train(build_parser().parse_args(argv))


if __name__ == "__main__":
    main()
