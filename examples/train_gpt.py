"""Train a small GPT on the Python standard library's source, checkpointing every step.

A byte-level GPT-2 style model (plain PyTorch) is trained on the ``.py`` files of
the local standard library, so the example needs no network. Every iteration is
checkpointed with ``datastates_hist``; ``--stop-at`` simulates a crash and
``--resume`` continues from the latest committed step, bit-for-bit.

Example:
    python examples/train_gpt.py --size tiny --steps 50 --stop-at 20
    python examples/train_gpt.py --size tiny --steps 50 --resume
"""
import argparse
import math
import os
import sys
import time

# Training on every core with a checkpointer working beside it: OpenMP threads that sleep when
# idle instead of spinning leave the checkpointer the CPU it needs (docs/performance.md, "Idle
# OpenMP threads"). libgomp reads this when torch loads it, so it is set before the import.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

# Let the example run from a source checkout without installing the package.
_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO_ROOT not in sys.path:
    sys.path.append(_REPO_ROOT)
import datastates_hist as dh  # noqa: E402

# size -> (n_layer, n_embd, n_head); roughly 0.2M, 5M and 50M parameters.
SIZES = {"tiny": (3, 64, 4), "small": (6, 256, 8), "medium": (10, 640, 10)}
VOCAB = 256  # byte-level tokens


class Block(nn.Module):
    """Pre-LayerNorm transformer block: causal self-attention then GELU MLP."""

    def __init__(self, n_embd, n_head, dropout):
        super().__init__()
        self.n_head, self.dropout = n_head, dropout
        self.ln1, self.ln2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(),
                                 nn.Linear(4 * n_embd, n_embd), nn.Dropout(dropout))
        self.resid_drop = nn.Dropout(dropout)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        # (b, t, c) -> (b, heads, t, head_dim) as expected by SDPA.
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        x = x + self.resid_drop(self.proj(y.transpose(1, 2).reshape(b, t, c)))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """GPT-2 style decoder with learned positions and an untied output head."""

    def __init__(self, n_layer, n_embd, n_head, block_size=256, dropout=0.1):
        super().__init__()
        self.block_size = block_size
        self.tok_emb = nn.Embedding(VOCAB, n_embd)
        self.pos_emb = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, VOCAB, bias=False)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx):
        """Return logits of shape (batch, time, VOCAB) for byte ids ``idx``."""
        t = idx.shape[1]
        assert t <= self.block_size, f"sequence length {t} > block_size {self.block_size}"
        x = self.drop(self.tok_emb(idx) + self.pos_emb(torch.arange(t, device=idx.device)))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def build_model(size: str, block_size: int = 256, dropout: float = 0.1) -> nn.Module:
    """Build a GPT of a named size.

    Args:
        size: One of ``"tiny"``, ``"small"``, ``"medium"``.
        block_size: Maximum context length (size of the position embedding).
        dropout: Dropout probability; > 0 so that RNG state matters on resume.

    Returns:
        The model, in float32 and training mode.
    """
    n_layer, n_embd, n_head = SIZES[size]
    return GPT(n_layer, n_embd, n_head, block_size=block_size, dropout=dropout)


def load_corpus(max_bytes: int = 8 << 20) -> torch.Tensor:
    """Concatenate the standard library's ``.py`` files, sorted by path.

    Args:
        max_bytes: Stop once this many bytes are collected (the last file is cut).

    Returns:
        A 1-D uint8 tensor of at most ``max_bytes`` bytes.
    """
    root = os.path.dirname(os.__file__)
    paths = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Installed third-party packages differ between machines; keep only the stdlib.
        dirnames[:] = [d for d in dirnames if d not in ("site-packages", "dist-packages")]
        paths += [os.path.join(dirpath, f) for f in filenames if f.endswith(".py")]
    chunks, total = [], 0
    for path in sorted(paths):
        if total >= max_bytes:
            break
        with open(path, "rb") as f:
            data = f.read(max_bytes - total)
        chunks.append(data)
        total += len(data)
    return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8)


def get_batch(corpus, batch_size, block_size, generator=None):
    """Sample ``batch_size`` random windows; ``y`` is ``x`` shifted by one byte.

    Offsets come from torch's global RNG unless ``generator`` is given, so a
    checkpointed RNG state reproduces the same batches after a resume.
    """
    ix = torch.randint(len(corpus) - block_size - 1, (batch_size, 1), generator=generator)
    windows = corpus[ix + torch.arange(block_size + 1)].long()
    return windows[:, :-1], windows[:, 1:]


def make_scheduler(optimizer, total_steps, warmup_steps):
    """LambdaLR: linear warmup, then cosine decay to 10% of the peak LR."""
    def lr_lambda(step):  # a plain function: LambdaLR stores it as None in state_dict
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return 0.1 + 0.45 * (1.0 + math.cos(math.pi * progress))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)


def make_optimizer(model, lr):
    """AdamW; 1-D params (biases, LayerNorm weights) get no weight decay."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95))


def history_policies(args) -> dict:
    """What the run keeps: the newest restore points (and every --keep-every-th), and the
    model's weights at every --trajectory-every-th step; everything with --keep-all."""
    if args.keep_all:
        return {}
    return {"keep": dh.KeepLast(args.keep_last) | dh.KeepEvery(args.keep_every),
            "trajectory": dh.Trajectory("model/*", every=args.trajectory_every, keep_bits=args.keep_bits)}


def train(args) -> dict:
    """Run the training loop described by ``args`` (see :func:`build_parser`).

    Returns:
        ``{"last_step", "losses", "mean_step_s", "start_step"}``; ``losses``
        holds one float per step run by this call, ``mean_step_s`` excludes
        the first (warm-up) step when more than one step ran.
    """
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    corpus = load_corpus(args.corpus_bytes)
    model = build_model(args.size, block_size=args.block_size)
    if args.dtype == "bfloat16":
        model = model.to(torch.bfloat16)
    optimizer = make_optimizer(model, args.lr)
    scheduler = make_scheduler(optimizer, args.steps, max(1, args.steps // 10))
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model {args.size}: {n_params / 1e6:.2f}M params | corpus {len(corpus) / 1e6:.1f} MB")

    ckpt = None if args.no_ckpt else dh.Checkpointer(args.run_dir, backend=args.backend, codec=args.codec,
                                                     **history_policies(args))
    start, tokens_seen = 0, 0
    if (args.resume or args.resume_from is not None) and ckpt is not None:
        if ckpt.steps():
            # Also restores torch/numpy/python RNG, so batches and dropout continue exactly.
            r = ckpt.restore(args.resume_from, model=model, optimizer=optimizer, scheduler=scheduler)
            ckpt.truncate(after=r.step)  # later steps, if any, belong to the abandoned branch
            start, tokens_seen = r.step + 1, r.extra["data"]["tokens_seen"]
            print(f"resumed from step {r.step} in {args.run_dir}")
        else:
            print(f"no committed steps in {args.run_dir}; starting from step 0")

    end = args.steps if args.stop_at is None else min(args.steps, args.stop_at + 1)
    losses, times = [], []
    model.train()
    try:
        for step in range(start, end):
            t0 = time.perf_counter()
            x, y = get_batch(corpus, args.batch_size, args.block_size)
            logits = model(x)
            loss = F.cross_entropy(logits.float().view(-1, VOCAB), y.reshape(-1))
            loss.backward()
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            tokens_seen += x.numel()
            losses.append(loss.item())
            if ckpt is not None:  # returns at once; the snapshot is taken in the background
                ckpt.write(step, model, optimizer, scheduler=scheduler,
                           data={"step": step, "tokens_seen": tokens_seen, "loss": losses[-1]})
            times.append(time.perf_counter() - t0)
            if step % args.log_every == 0 or step == end - 1:
                print(f"step {step:5d} | loss {losses[-1]:.4f} | {times[-1] * 1e3:7.1f} ms")
    finally:
        if ckpt is not None:
            ckpt.close()  # waits for pending checkpoints to commit

    # The first step pays one-off warm-up costs (allocator, kernel selection); leave it out.
    timed = times[1:] or times
    mean_s = sum(timed) / len(timed) if timed else 0.0
    last = end - 1 if times else start - 1
    # tensors the flush stored raw because it had fallen far behind training (README)
    raw = f" | {ckpt.raw_to_keep_up} tensors stored raw to keep up" if ckpt is not None and ckpt.raw_to_keep_up else ""
    print(f"done: {len(times)} steps (last {last}) | mean step {mean_s * 1e3:.1f} ms (excl. first)"
          f" | run dir {args.run_dir if ckpt is not None else '(no checkpoints)'}{raw}")
    return {"last_step": last, "losses": losses, "mean_step_s": mean_s, "start_step": start}


def build_parser() -> argparse.ArgumentParser:
    """Return the command-line parser (tests can use ``build_parser().parse_args([...])``)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run-dir", default="runs/gpt")
    p.add_argument("--size", choices=sorted(SIZES), default="small")
    p.add_argument("--steps", type=int, default=200, help="total training steps")
    p.add_argument("--stop-at", type=int, default=None,
                   help="exit after checkpointing this step (simulates a crash)")
    p.add_argument("--resume", action="store_true", help="continue from the latest committed step")
    p.add_argument("--resume-from", type=int, default=None, metavar="STEP",
                   help="continue from STEP, dropping the committed steps after it")
    p.add_argument("--backend", choices=["adios2", "hdf5"], default="adios2")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--no-ckpt", action="store_true", help="train without checkpointing")
    p.add_argument("--keep-last", type=int, default=2, help="restore points kept: the newest N ...")
    p.add_argument("--keep-every", type=int, default=1000, help="... and every K-th step")
    p.add_argument("--trajectory-every", type=int, default=1,
                   help="other steps keep the model's weights every N steps")
    p.add_argument("--keep-bits", type=int, default=None, metavar="N",
                   help="trajectory points keep the weights rounded to N mantissa bits (lossy; default: exact)")
    p.add_argument("--keep-all", action="store_true", help="keep every step as a restore point")
    p.add_argument("--codec", choices=["delta", "key", "raw"], default="delta")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument("--corpus-bytes", type=int, default=8 << 20)
    return p


def main(argv=None):
    """Parse ``argv`` and train."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.keep_bits is not None and args.keep_all:
        parser.error("--keep-bits rounds trajectory points, and --keep-all keeps none")
    return train(args)


if __name__ == "__main__":
    main()
