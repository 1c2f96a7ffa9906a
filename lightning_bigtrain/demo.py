"""The main job: a char-level GPT trained on Shakespeare by 2 CPU ranks, with a printed report.

    bigtrain demo [--output runs/demo] [--max-steps 250] [--val-batches 16] [--strategy bigtrain_zero2] [--devices 2]
                  [--compression powersgd|topk|onebit|int8|int4|fp16|bf16] [--teacher runs/demo/model.ckpt]
                  [--prune 0.5] [--prune-channels 0.5]

As features land, each adds itself here, so the demo shows the plugins working together. The default
strategy is ZeRO stage 2 (gradients and optimizer states sharded over the 2 ranks).
``--compression`` compresses the gradient exchange: with ``--strategy ddp`` through CompressedDDPStrategy,
with ``bigtrain_zero1`` through ZeroStrategy(stage=1, compression=...) (stages 2 and 3 take fp16/bf16 only).
The trained model is saved to ``<output>/model.ckpt``; ``--teacher`` distils such a checkpoint into a student
a fifth of the demo model's depth x width (KnowledgeDistillation, T=2, alpha=0.5). ``--prune S`` prunes the
Linear weights to sparsity S during training (MagnitudePruning: global magnitude, cubic ramp to 3/4 of the run;
any strategy); ``--prune-channels A`` removes the fraction A of every MLP's hidden units (StructuredPruning;
``--strategy ddp``). Both print a per-layer table at the end.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

__all__ = ["main", "run_demo"]


def run_demo(
    output: str = "runs/demo",
    max_steps: int = 250,
    devices: int = 2,
    accelerator: str = "cpu",
    val_batches: int = 16,
    strategy: str = "bigtrain_zero2",
    compression: str | None = None,
    teacher: str | None = None,
    prune: float | None = None,
    prune_channels: float | None = None,
) -> dict:
    """Validate, train and validate again; returns the :class:`RunReport` dictionary (on rank 0)."""
    import lightning as L
    from lightning.pytorch.loggers import CSVLogger

    import lightning_bigtrain  # noqa: F401  (registers the bigtrain_* strategy names)
    from lightning_bigtrain.callbacks import RunReport
    from lightning_bigtrain.data import ShakespeareDataModule
    from lightning_bigtrain.models import CharGPT

    if max_steps < 1:
        raise ValueError(f"`bigtrain demo --max-steps {max_steps}`: max-steps must be >= 1.")
    L.seed_everything(1234, verbose=False)
    data = ShakespeareDataModule(block_size=128, batch_size=32)
    callbacks: list[L.Callback] = []
    if teacher is None:
        model = CharGPT(vocab_size=data.vocab_size, block_size=128, n_layer=4, n_head=4, n_embd=128)
        title = "bigtrain demo: char-GPT on Shakespeare"
    else:
        from lightning_bigtrain.callbacks import KnowledgeDistillation

        model = CharGPT(vocab_size=data.vocab_size, block_size=128, n_layer=2, n_head=2, n_embd=64)
        callbacks.append(KnowledgeDistillation(teacher, temperature=2.0, alpha=0.5))
        title = f"bigtrain demo: char-GPT student distilled from {teacher}"
    if prune is not None:
        from lightning_bigtrain.callbacks import MagnitudePruning

        callbacks.append(MagnitudePruning(prune, plot=True))
        title += f", pruned to {prune:.0%} sparsity"
    if prune_channels is not None:
        from lightning_bigtrain.callbacks import StructuredPruning

        callbacks.append(StructuredPruning(prune_channels))
        title += f", {prune_channels:.0%} of the MLP channels removed"
    report = RunReport(path=str(Path(output) / "report.md"), title=title)
    strategy_arg: Any = strategy
    if compression is not None:
        from lightning_bigtrain.strategies import CompressedDDPStrategy, ZeroStrategy

        if strategy == "ddp":
            strategy_arg = CompressedDDPStrategy(compression)
        elif strategy.startswith("bigtrain_zero"):
            strategy_arg = ZeroStrategy(stage=int(strategy[len("bigtrain_zero")]), compression=compression)
        else:
            raise ValueError(f"`bigtrain demo --strategy {strategy} --compression ...`: use ddp or bigtrain_zero1.")
    trainer = L.Trainer(
        accelerator=accelerator,
        devices=devices,
        strategy=strategy_arg if devices > 1 else "auto",
        max_steps=max_steps,
        val_check_interval=max_steps,
        check_val_every_n_epoch=None,
        limit_val_batches=val_batches,
        num_sanity_val_steps=0,
        callbacks=[*callbacks, report],
        logger=CSVLogger(output, name="logs"),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=10,
    )
    trainer.validate(model, datamodule=data, verbose=False)
    trainer.fit(model, datamodule=data)
    trainer.save_checkpoint(Path(output) / "model.ckpt")
    return report.report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bigtrain demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--output", default="runs/demo", help="folder for report.md and logs")
    parser.add_argument("--max-steps", type=int, default=250)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--val-batches", type=int, default=16, help="validation batches before and after training")
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument(
        "--strategy",
        default="bigtrain_zero2",
        choices=["ddp", "bigtrain_zero1", "bigtrain_zero2", "bigtrain_zero3"],
        help="data-parallel strategy for the 2 ranks",
    )
    parser.add_argument(
        "--compression",
        default=None,
        choices=["powersgd", "topk", "onebit", "int8", "int4", "fp16", "bf16"],
        help="compress the gradient exchange (ddp, bigtrain_zero1; zero2/3 take fp16/bf16 only)",
    )
    parser.add_argument(
        "--teacher", default=None, help="a CharGPT checkpoint (runs/demo/model.ckpt) to distil into a smaller student"
    )
    parser.add_argument(
        "--prune",
        type=float,
        default=None,
        metavar="SPARSITY",
        help="prune the Linear weights to this sparsity during training (MagnitudePruning)",
    )
    parser.add_argument(
        "--prune-channels",
        type=float,
        default=None,
        metavar="AMOUNT",
        help="remove this fraction of each MLP's hidden units (StructuredPruning; --strategy ddp)",
    )
    args = parser.parse_args(argv)
    for flag, value in (("--prune", args.prune), ("--prune-channels", args.prune_channels)):
        if value is not None and not 0 <= value < 1:
            parser.error(f"{flag} {value}: must be a fraction in [0, 1).")
    if args.prune_channels is not None and args.strategy != "ddp":
        parser.error(
            f"--prune-channels needs --strategy ddp: {args.strategy} cannot follow shapes that change mid-training."
        )
    if args.val_batches < 1:
        parser.error(f"--val-batches {args.val_batches}: must be >= 1.")
    if args.max_steps < 1:
        parser.error(f"--max-steps {args.max_steps}: max-steps must be >= 1.")
    if args.compression not in (None, "fp16", "bf16") and args.strategy in ("bigtrain_zero2", "bigtrain_zero3"):
        parser.error(
            f"--compression {args.compression} needs --strategy ddp or bigtrain_zero1: at stages 2 and 3 each rank "
            "keeps only a slice of the reduced gradients (fp16/bf16 work there, as a low-precision reduce-scatter)."
        )
    run_demo(args.output, args.max_steps, args.devices, args.accelerator, args.val_batches, strategy=args.strategy,
             compression=args.compression, teacher=args.teacher, prune=args.prune,
             prune_channels=args.prune_channels)  # fmt: skip
    return 0
