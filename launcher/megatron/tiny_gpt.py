"""The Megatron dry run: a tiny megatron-core GPT trained on CPU over gloo, with tensor, pipeline and
data parallelism laid over the launched world, through megatron-core's own DDP, optimizer and
pipeline schedules. It proves the launch (ranks, groups, env) carries real Megatron training, on a
machine without a GPU, in seconds.

The data is learnable (each sequence counts up from a random start), so the loss must fall.
"""

from __future__ import annotations

import contextlib
import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

from ..rank.capture import report
from .exit_signal import ExitSignal
from .steptimes import timed

MICRO_BATCH = 4
MICROBATCHES = 2  # a step's micro-batches per rank, unless `global_batch` sets them
# What the trainer takes from megatron-core: imported together by `import_megatron_core`, and ahead by
# a dry run's warm spares (runners.py `DryRunRunner.warm_imports`).
MEGATRON_MODULES = (
    "megatron.core.parallel_state",
    "megatron.core.distributed",
    "megatron.core.models.gpt",
    "megatron.core.models.gpt.gpt_layer_specs",
    "megatron.core.optimizer",
    "megatron.core.pipeline_parallel",
    "megatron.core.tensor_parallel",
    "megatron.core.transformer",
)


# Optional packages megatron-core imports if it can and goes on without, which this trainer never
# uses: the Multi-Storage Client (msc:// checkpoint paths; this trainer saves with torch.save), 0.2-0.3
# of megatron-core's ~1.5 CPU-s of import in every dry-run rank (2026-12-06, 2 cores). Triton cannot
# be left out: megatron-core's pipeline schedules import it unconditionally.
DRY_RUN_NOT_INSTALLED = ("multistorageclient",)


def import_megatron_core() -> None:
    """megatron-core for this trainer, without what its import spends on `torch.compile` (its config
    turns every fusion off, on CPU and GPU alike: compat.py `torch_compile_left_off`) and on optional
    packages it never uses (`DRY_RUN_NOT_INSTALLED`). Only in a process that imports megatron-core
    here first, the dry run's own rank; where megatron-core is already imported (a warm spare, a warm
    pool, which any program may take) nothing changes."""
    if "megatron.core" in sys.modules:
        return
    import importlib

    from .compat import not_installed, torch_compile_left_off

    with torch_compile_left_off(), not_installed(DRY_RUN_NOT_INSTALLED):
        for name in MEGATRON_MODULES:
            importlib.import_module(name)


def choose_layout(world: int, local_world: int) -> tuple[int, int, int]:
    """TP 2 inside a node when it can, then PP 2 across what is left, then DP: TP2 x PP2 on 4 ranks."""
    tp = 2 if local_world % 2 == 0 and world % 2 == 0 else 1
    pp = 2 if (world // tp) % 2 == 0 else 1
    return tp, pp, world // (tp * pp)


def resolve_layout(world: int, local_world: int, tp: int | None, pp: int | None) -> tuple[int, int]:
    """TP and PP as given (`--dry-run tp=.. pp=..`), the one not given 1 as Megatron defaults it;
    neither given: `choose_layout`'s."""
    if tp is None and pp is None:
        return choose_layout(world, local_world)[:2]
    return 1 if tp is None else tp, 1 if pp is None else pp


def layout_problem(
    world: int, tp: int, pp: int, global_batch: int | None, micro_batch: int = MICRO_BATCH
) -> str | None:
    """Why the tiny trainer cannot run TP `tp` x PP `pp` (and `global_batch`) on `world` ranks."""
    if world % (tp * pp):
        return f"TP {tp} x PP {pp} = {tp * pp} does not divide {world} ranks"
    dp = world // (tp * pp)
    if global_batch is not None and global_batch % (micro_batch * dp):
        return f"global batch {global_batch} is not a multiple of micro batch {micro_batch} x DP {dp}"
    return None


def train(
    steps: int = 20,
    seq: int = 32,
    vocab: int = 128,
    hidden: int = 64,
    heads: int = 4,
    layers: int = 4,
    micro_batch: int = MICRO_BATCH,
    microbatches: int = MICROBATCHES,
    lr: float = 3e-3,
    save: str | None = None,
    save_every: int = 5,
    data: str | None = None,
    tp: int | None = None,
    pp: int | None = None,
    global_batch: int | None = None,
    exit_signal_handler: bool = False,
) -> dict[str, Any]:
    """Train; with `save`, checkpoint every `save_every` steps and resume from the latest one there
    (at another DP size too: the model and optimizer are the same on every DP rank); with `data`, on
    the tokens of a Megatron indexed dataset (`data`.bin/.idx, as Megatron's preprocessing writes it)
    instead of counting sequences. `tp`/`pp` fix the layout (`resolve_layout`), `global_batch` the
    sequences a step takes over all DP ranks (micro-batches per rank follow from the DP size).
    `exit_signal_handler`: SIGTERM to any rank ends the training at the next step on every rank, with
    a checkpoint where `save` is given, as Megatron-Bridge's option of that name (exit_signal.py)."""
    import torch
    import torch.distributed as dist

    from .preflight import quiet_megatron

    # megatron-core's warnings about this machine (no TransformerEngine, Apex or CUDA runtime, a
    # deprecated GPTModel): ~20 lines from every rank that say nothing about the launch it checks
    with quiet_megatron():
        import_megatron_core()
    owned = not dist.is_initialized()  # the dry run hands over the group its check ran in
    if owned:
        dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    try:
        ckpt = Checkpoints(save, save_every) if save else None
        corpus = _read_corpus(data) if data else None
        if corpus is not None:
            vocab = max(vocab, int(corpus.max()) + 1)
        world = dist.get_world_size()
        tp, pp = resolve_layout(world, int(os.environ.get("LOCAL_WORLD_SIZE", world)), tp, pp)
        if problem := layout_problem(world, tp, pp, global_batch, micro_batch):
            raise ValueError(f"--dry-run: {problem}")
        if global_batch is not None:
            microbatches = global_batch // (micro_batch * (world // (tp * pp)))
        shape = (seq, vocab, hidden, heads, layers, micro_batch, microbatches)
        with quiet_megatron(), ExitSignal() if exit_signal_handler else contextlib.nullcontext() as stop:
            return _train(steps, shape, (tp, pp), lr, ckpt, corpus, stop)
    finally:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        if owned:
            dist.destroy_process_group()
        del torch


class Checkpoints:
    """Per-rank checkpoints in `<dir>/iter_<N>/tp<t>-pp<p>-dp<d>.pt` (by parallel rank, so that another
    DP size loads them), and `<dir>/latest` naming the last complete one (written by rank 0 after every
    rank has saved), as Megatron's tracker file does."""

    def __init__(self, root: str, every: int):
        self.root, self.every = Path(root), every

    def latest(self) -> int:
        tracker = self.root / "latest"
        return int(tracker.read_text()) if tracker.is_file() else 0

    def save(self, iteration: int, part: tuple[int, int, int], state: dict[str, Any]) -> None:
        """`part`: this rank's (TP, PP, DP) rank."""
        import torch
        import torch.distributed as dist

        folder = self.root / f"iter_{iteration:07d}"
        folder.mkdir(parents=True, exist_ok=True)
        rank = dist.get_rank()
        if rank == 0:  # the start and end of a save, as Megatron-Bridge says them (the goodput ledger's)
            print(f"saving checkpoint at iteration {iteration} to {self.root}", flush=True)
        torch.save(state, folder / _part_file(*part))
        dist.barrier()
        if rank == 0:
            tmp = self.root / "latest.tmp"
            tmp.write_text(str(iteration))
            tmp.replace(self.root / "latest")
            print(f"saved checkpoint at iteration {iteration} to {self.root}", flush=True)
        dist.barrier()

    def load(self, iteration: int, part: tuple[int, int, int]) -> tuple[dict[str, Any], bool]:
        """The state saved by the rank at `part` (TP, PP, DP), or, at a DP rank the checkpoint did not
        have (saved at a smaller DP size), by DP rank 0 at the same TP and PP: False then, its data
        position is not this rank's own."""
        import torch

        folder = self.root / f"iter_{iteration:07d}"
        own = folder / _part_file(*part)
        path = own if own.is_file() else folder / _part_file(part[0], part[1], 0)
        return torch.load(path, weights_only=False), path == own


def _part_file(tp: int, pp: int, dp: int) -> str:
    return f"tp{tp}-pp{pp}-dp{dp}.pt"


def _read_corpus(prefix: str):
    """Every token of the dataset, in order, read with megatron-core's own reader."""
    import numpy as np
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    for suffix in (".bin", ".idx"):
        if not os.path.isfile(prefix + suffix):
            raise FileNotFoundError(
                f"--dry-run data={prefix}: no {prefix}{suffix} on this node; give the prefix of a Megatron "
                "indexed dataset (examples/data/prepare.py makes one)"
            )
    ds = IndexedDataset(prefix)
    return torch.from_numpy(np.concatenate([ds[i] for i in range(len(ds))]).astype(np.int64))


def _train(steps, shape, layout, lr, ckpt, corpus=None, stop: ExitSignal | None = None) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from .cpu_megatron import adapt_megatron_to_cpu

    seq, vocab, hidden, heads, layers, micro_batch, microbatches = shape
    world, rank = dist.get_world_size(), dist.get_rank()
    tp, pp = layout
    dp = world // (tp * pp)

    from megatron.core import parallel_state
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import random as mp_random
    from megatron.core.transformer import TransformerConfig

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    adapt_megatron_to_cpu()
    torch.manual_seed(1234)
    mp_random.get_cuda_rng_tracker().add(
        "model-parallel-rng", 1234 + 2718 + parallel_state.get_tensor_model_parallel_rank()
    )

    config = TransformerConfig(
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        pipeline_dtype=torch.float32,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=vocab,
        max_sequence_length=seq,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
    )
    ddp = DistributedDataParallel(
        config,
        DistributedDataParallelConfig(grad_reduce_in_fp32=False, overlap_grad_reduce=False),
        model,
    )
    config.finalize_model_grads_func = finalize_model_grads  # all-reduces grads across DP (and embeddings)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=lr, clip_grad=0.0, bf16=False, fp16=False), [ddp]
    )
    forward_backward = get_forward_backward_func()

    dp_rank = parallel_state.get_data_parallel_rank()
    gen = torch.Generator().manual_seed(100 + dp_rank)  # same data across TP/PP, different across DP
    mask = torch.triu(torch.ones(1, 1, seq, seq, dtype=torch.bool), diagonal=1)  # True = masked (causal)
    positions = torch.arange(seq).unsqueeze(0).expand(micro_batch, seq)

    def batches():
        while True:
            if corpus is None:
                start = torch.randint(0, vocab, (micro_batch, 1), generator=gen)
                tokens = (start + torch.arange(seq + 1)) % vocab
            else:  # windows of the real text at random offsets
                start = torch.randint(0, len(corpus) - seq - 1, (micro_batch, 1), generator=gen)
                tokens = corpus[start + torch.arange(seq + 1)]
            yield tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def forward_step(data_iterator, model):
        tokens, labels = next(data_iterator)
        output = model(tokens, positions, mask, labels=labels)

        def loss_func(output_tensor):
            loss = output_tensor.float().mean()
            return loss, {"lm loss": loss.detach()}

        return output, loss_func

    timed_step = timed(forward_step)  # straggler detection (megatron/steptimes.py)
    data = batches()
    losses: list[float] = []
    first = ckpt.latest() if ckpt else 0
    part = (
        parallel_state.get_tensor_model_parallel_rank(),
        parallel_state.get_pipeline_model_parallel_rank(),
        dp_rank,
    )
    if first:
        if rank == 0:  # the start and end of a load, as Megatron-Bridge says them (the goodput ledger's)
            print(f"loading checkpoint from {ckpt.root} at iteration {first}", flush=True)
        state, own = ckpt.load(first, part)
        ddp.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        if own:
            gen.set_state(state["data"])
        else:  # a DP rank the checkpoint did not have: data of its own from here
            gen.manual_seed(100 + dp_rank + 1000 * first)
        if rank == 0:
            saved_dp = state.get("dp", dp)
            at = f" at DP {dp} (saved at DP {saved_dp})" if saved_dp != dp else ""
            print(f"resumed from checkpoint at iteration {first}{at}", flush=True)
    reporter = (
        parallel_state.is_pipeline_last_stage()
        and parallel_state.get_tensor_model_parallel_rank() == 0
        and parallel_state.get_data_parallel_rank() == 0
    )
    last = steps  # where the training ended: `steps`, or earlier on an exit signal
    for step in range(first, steps):
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        out = forward_backward(
            forward_step_func=timed_step,
            data_iterator=data,
            model=[ddp],
            num_microbatches=microbatches,
            seq_length=seq,
            micro_batch_size=micro_batch,
            forward_only=False,
        )
        optimizer.step()
        if parallel_state.is_pipeline_last_stage():
            # the schedule divides each microbatch's loss by their number: the sum is the mean
            losses.append(float(sum(o["lm loss"] for o in out)))
            if reporter:  # one rank tells the driver, as Megatron logs on one rank
                report(step + 1, steps, losses[-1], tokens=micro_batch * microbatches * dp * seq)
        last = step + 1
        stopping = stop is not None and stop.agreed()
        if ckpt and (stopping or (last % ckpt.every == 0 and last < steps)):
            state = {"model": ddp.state_dict(), "optimizer": optimizer.state_dict(), "data": gen.get_state()}
            state["dp"] = dp
            ckpt.save(last, part, state)
        if stopping:
            if rank == 0:  # Bridge's words (training/train.py), with the iteration
                print(f"exiting program after receiving SIGTERM at iteration {last}.", flush=True)
            break
    return {"rank": rank, "tp": tp, "pp": pp, "dp": dp, "dp_rank": dp_rank, "losses": losses or None,
            "first_iteration": first, "iterations": last}  # fmt: skip
