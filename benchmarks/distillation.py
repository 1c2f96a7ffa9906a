"""Knowledge distillation: accuracy gained by a small student, step-time overhead, and a char-GPT student.

Fashion-MNIST: a teacher CNN (about 94k parameters) is trained first on the full training split; a student
with 1/15 of its parameters is trained for the same number of steps with and without
``KnowledgeDistillation``, 3 seeds each, on the full training split and on a 5,000-image transfer set.
Temperature and alpha come from a small sweep on the transfer set scored on the validation split (seed 0);
test accuracy is reported. Overhead: median step time of the student alone vs with the live teacher vs with
the cached top-k logits (cache filled in a first epoch, timed in the second), alternating rounds. Shakespeare:
a 2-layer, 64-wide char-GPT distilled from a 4-layer, 256-wide one vs trained alone, equal steps; alpha from
a two-point sweep (T=2) on the validation loss, the test loss reported.

Every configuration runs in its own process, one at a time (run nothing else while it runs).

    python -m benchmarks.distillation [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import (
    RESULTS_DIR,
    command_line,
    machine_info,
    merge_runs,
    print_table,
    provenance,
    ratio,
    run_worker,
    write_results,
)

TEACHER_CHANNELS = (32, 64, 128)
STUDENT_CHANNELS = (8, 16, 32)
TRANSFER_SIZE = 5000
SWEEP = [(2.0, 0.5), (2.0, 0.9), (4.0, 0.5), (4.0, 0.9), (1.0, 0.9), (2.0, 1.0)]  # (temperature, alpha)
GPT_ALPHAS = (0.5, 0.2)  # the char-GPT student's alpha sweep (T=2), scored on the validation split


def _fashion(transfer: bool, seed: int, batch_size: int = 128) -> Any:
    from lightning_bigtrain.data import FashionMNISTDataModule

    class Transfer(FashionMNISTDataModule):
        """The first 5,000 training images; validation and test splits whole."""

        def setup(self, stage: str | None = None) -> None:
            super().setup(stage)
            train = self._splits["train"]
            self._splits["train"] = type(train)(train.images[:TRANSFER_SIZE], train.labels[:TRANSFER_SIZE])

    cls = Transfer if transfer else FashionMNISTDataModule
    return cls(batch_size=batch_size, seed=0)


def _trainer(steps: int, callbacks: list[Any], val: bool = False) -> Any:
    import lightning as L

    return L.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
                     limit_val_batches=1.0 if val else 0, num_sanity_val_steps=0,
                     val_check_interval=None, check_val_every_n_epoch=10_000)  # fmt: skip


def _evaluate(model: Any, data: Any, split: str) -> dict[str, float]:
    import lightning as L

    lm = split.startswith("gpt_")
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=64 if lm else 1.0,
                        limit_test_batches=64 if lm else 1.0)  # fmt: skip
    run = trainer.test if split in ("test", "gpt_test") else trainer.validate
    return run(model, datamodule=data, verbose=False)[0]


def worker(args: argparse.Namespace) -> dict[str, Any]:
    import lightning as L
    import torch

    from benchmarks.common import set_flush_denormal
    from lightning_bigtrain.callbacks import DistillationOptions, KnowledgeDistillation
    from lightning_bigtrain.data import ShakespeareDataModule
    from lightning_bigtrain.models import CharGPT, FashionCNN

    set_flush_denormal()
    torch.set_num_threads(2)
    L.seed_everything(args.seed, verbose=False)
    result: dict[str, Any] = {}
    if args.worker == "cnn_teacher":
        teacher = FashionCNN(channels=TEACHER_CHANNELS)
        data = _fashion(False, 0)
        trainer = _trainer(args.steps, [])
        trainer.fit(teacher, datamodule=data)
        trainer.save_checkpoint(args.teacher)
        result["test_acc"] = _evaluate(teacher, data, "test")["test_acc"]
        result["params"] = sum(p.numel() for p in teacher.parameters())
    elif args.worker == "cnn_student":
        student = FashionCNN(channels=STUDENT_CHANNELS)
        data = _fashion(args.transfer, args.seed)
        callbacks = []
        if args.kd:
            callbacks.append(KnowledgeDistillation(args.teacher, temperature=args.temperature, alpha=args.alpha))
        trainer = _trainer(args.steps, callbacks)
        trainer.fit(student, datamodule=data)
        metrics = _evaluate(student, data, args.score)
        result["acc"] = metrics["val_acc" if args.score == "val" else "test_acc"]
        result["params"] = sum(p.numel() for p in student.parameters())
    elif args.worker == "cnn_timing":
        times: list[float] = []
        epoch_steps = TRANSFER_SIZE // 128 + 1

        class Clock(L.Callback):
            def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
                self.t0 = time.perf_counter()

            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                if trainer.current_epoch == 1 and batch_idx >= 3:  # second epoch: the cache is full
                    times.append(time.perf_counter() - self.t0)

        callbacks: list[Any] = []
        if args.mode == "live":
            callbacks.append(KnowledgeDistillation(args.teacher))
        elif args.mode == "cached":
            cache = str(Path(tempfile.mkdtemp()) / "cache.pt")
            callbacks.append(
                KnowledgeDistillation(args.teacher, cache=cache, options=DistillationOptions(cache_top_k=10))
            )
        trainer = _trainer(2 * epoch_steps, [*callbacks, Clock()])
        trainer.fit(FashionCNN(channels=STUDENT_CHANNELS), datamodule=_fashion(True, 0))
        result["step_s"] = statistics.median(times)
        if args.mode == "cached":
            result["hits"], result["misses"] = callbacks[0]._hits, callbacks[0]._misses
    elif args.worker in ("gpt_teacher", "gpt_student"):
        data = ShakespeareDataModule(block_size=128, batch_size=16)
        if args.worker == "gpt_teacher":
            model = CharGPT(vocab_size=data.vocab_size, block_size=128, n_layer=4, n_head=4, n_embd=256)
            callbacks = []
        else:
            model = CharGPT(vocab_size=data.vocab_size, block_size=128, n_layer=2, n_head=2, n_embd=64)
            callbacks = (
                [KnowledgeDistillation(args.teacher, temperature=args.temperature, alpha=args.alpha)] if args.kd else []
            )
        trainer = _trainer(args.steps, callbacks)
        trainer.fit(model, datamodule=data)
        if args.worker == "gpt_teacher":
            trainer.save_checkpoint(args.teacher)
        result["val_loss"] = _evaluate(model, data, "gpt_val")["val_loss"]
        result["test_loss"] = _evaluate(model, data, "gpt_test")["test_loss"]
        result["params"] = sum(p.numel() for p in model.parameters())
    Path(args.out).write_text(json.dumps(result))
    return result


def accuracy(run: Any, cnn_teacher: str, quick: bool, seeds: list[int], figures: dict[str, Any]) -> None:
    t = figures["cnn_teacher"]
    # Temperature and alpha: a small sweep on the transfer set, scored on the validation split.
    sweep = {}
    for temperature, alpha in SWEEP[:1] if quick else SWEEP:
        r = run("cnn_student", teacher=cnn_teacher, kd=True, transfer=True, temperature=temperature, alpha=alpha,
                score="val")  # fmt: skip
        sweep[f"T={temperature},alpha={alpha}"] = r["acc"]
        print(f"sweep T={temperature} alpha={alpha}: val acc {r['acc']:.4f}", flush=True)
    best = max(sweep, key=sweep.__getitem__)
    best_t, best_a = (float(part.split("=")[1]) for part in best.split(","))
    figures["sweep_val_acc"] = sweep
    figures["chosen"] = {"temperature": best_t, "alpha": best_a}

    rows = []
    for regime in ("transfer", "full"):
        accs: dict[str, list[float]] = {"alone": [], "kd": []}
        for seed in seeds:
            for kd in (False, True):
                r = run("cnn_student", teacher=cnn_teacher, kd=kd, transfer=regime == "transfer", seed=seed,
                        temperature=best_t, alpha=best_a)  # fmt: skip
                accs["kd" if kd else "alone"].append(r["acc"])
                figures.setdefault("student_params", r["params"])
                print(f"{regime} seed {seed} {'KD' if kd else 'alone'}: test acc {r['acc']:.4f}", flush=True)
        gain = [100 * (k - a) for k, a in zip(accs["kd"], accs["alone"], strict=True)]
        figures[regime] = {**accs, "gain_points": gain, "mean_gain_points": statistics.fmean(gain)}
        rows.append({
            "regime": regime, "alone acc": statistics.fmean(accs["alone"]), "KD acc": statistics.fmean(accs["kd"]),
            "gain pts": statistics.fmean(gain), "gain min..max": f"{min(gain):+.2f}..{max(gain):+.2f}",
        })  # fmt: skip
    print(f"\nStudent ({figures['student_params']} params) vs teacher ({t['params']}); T={best_t}, alpha={best_a}")
    figures["accuracy_table"] = print_table(rows, list(rows[0]))


def timing(run: Any, cnn_teacher: str, rounds: int, figures: dict[str, Any]) -> None:
    times: dict[str, list[float]] = {"plain": [], "live": [], "cached": []}
    for round_ in range(rounds):
        order = list(times) if round_ % 2 == 0 else list(times)[::-1]
        for mode in order:
            r = run("cnn_timing", teacher=cnn_teacher, mode=mode)
            times[mode].append(r["step_s"])
            if mode == "cached":
                figures["cache_hits_misses"] = [r["hits"], r["misses"]]
            print(f"timing round {round_} {mode}: {r['step_s'] * 1000:.2f} ms/step", flush=True)
    medians = {m: statistics.median(v) for m, v in times.items()}
    figures["step_s"] = times
    figures["overhead_live"] = ratio(medians["live"], medians["plain"])
    figures["overhead_cached"] = ratio(medians["cached"], medians["plain"])
    print(f"step time vs student alone: live teacher {figures['overhead_live']:.2f}x, "
          f"cached logits {figures['overhead_cached']:.2f}x")  # fmt: skip


def gpt(run: Any, gpt_teacher: str, figures: dict[str, Any]) -> None:
    gt = run("gpt_teacher", teacher=gpt_teacher)
    alone = run("gpt_student", teacher=gpt_teacher)
    sweep = {a: run("gpt_student", teacher=gpt_teacher, kd=True, temperature=2.0, alpha=a) for a in GPT_ALPHAS}
    best = min(sweep, key=lambda a: sweep[a]["val_loss"])  # chosen on validation, reported on test
    distilled = sweep[best]
    figures["gpt"] = {"teacher": gt, "alone": alone, "kd": distilled, "alpha": best, "temperature": 2.0,
                      "sweep_val_loss": {str(a): r["val_loss"] for a, r in sweep.items()}}  # fmt: skip
    print(f"char-GPT: teacher ({gt['params']} params) test loss {gt['test_loss']:.4f}; student ({alone['params']}) "
          f"alone {alone['test_loss']:.4f}, distilled (T=2, alpha={best} of {GPT_ALPHAS} on validation) "
          f"{distilled['test_loss']:.4f}")  # fmt: skip


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="few steps, one seed (a smoke run)")
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--parts", nargs="+", default=["accuracy", "timing", "gpt"],
                        choices=["accuracy", "timing", "gpt"],
                        help="what to run; the other parts' figures are kept from the last results file")  # fmt: skip
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="plain", help=argparse.SUPPRESS)
    parser.add_argument("--teacher", default="", help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=100, help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--kd", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--transfer", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--temperature", type=float, default=4.0, help=argparse.SUPPRESS)
    parser.add_argument("--alpha", type=float, default=0.9, help=argparse.SUPPRESS)
    parser.add_argument("--score", default="test", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args)

    quick = args.quick
    work = Path("runs/bench-distillation-quick" if quick else "runs/bench-distillation")
    work.mkdir(parents=True, exist_ok=True)
    steps = {"cnn_teacher": 60 if quick else 1300, "cnn_student": 40 if quick else 800,
             "gpt_teacher": 30 if quick else 600, "gpt_student": 30 if quick else 600}  # fmt: skip
    seeds = [0] if quick else [0, 1, 2]
    rounds = 1 if quick else 3
    figures: dict[str, Any] = {"steps": steps, "seeds": seeds}
    previous = args.results_dir / "distillation.json"
    kept: dict[str, Any] | None = None
    if set(args.parts) != {"accuracy", "timing", "gpt"} and previous.exists():
        kept = json.loads(previous.read_text())
        figures.update(kept["figures"])
        print(f"kept the figures of the parts not run from {previous}")
    command = command_line("benchmarks.distillation", argv)
    runs = merge_runs(kept, args.parts, provenance(command))

    def run(worker_name: str, **kw: Any) -> dict[str, Any]:
        argv_ = ["--worker", worker_name, "--steps", str(steps.get(worker_name, 0))]
        for key, value in kw.items():
            if isinstance(value, bool):
                argv_ += [f"--{key}"] if value else []
            else:
                argv_ += [f"--{key}", str(value)]
        return run_worker("benchmarks.distillation", argv_, timeout=3600)

    cnn_teacher = str(work / "cnn_teacher.ckpt")
    if "accuracy" in args.parts or not Path(cnn_teacher).exists():
        t = run("cnn_teacher", teacher=cnn_teacher)
        figures["cnn_teacher"] = t
        print(f"CNN teacher: {t['params']} parameters, test accuracy {t['test_acc']:.4f}", flush=True)
    if "accuracy" in args.parts:
        accuracy(run, cnn_teacher, quick, seeds, figures)
    if "timing" in args.parts:
        timing(run, cnn_teacher, rounds, figures)
    if "gpt" in args.parts:
        gpt(run, str(work / "gpt_teacher.ckpt"), figures)

    payload = {"config": {"quick": quick, "transfer_size": TRANSFER_SIZE, "timing_rounds": rounds},
               "machine": machine_info(), "runs": runs, "figures": figures}  # fmt: skip
    headline = (
        f"transfer-set gain {figures['transfer']['mean_gain_points']:+.2f} pts, "
        f"full {figures['full']['mean_gain_points']:+.2f}; cached overhead {figures['overhead_cached']:.2f}x"
    )
    path = write_results("distillation", payload, headline, args.results_dir, command=command)
    print(f"wrote {path}")
    return figures


def render_block(results_dir: Path = RESULTS_DIR) -> str:
    """The ``distillation`` figure block (docs/distillation.md), from ``results/distillation.json`` only: the
    CNN teacher and student (parameters, steps, the temperature and alpha the sweep chose), the test-accuracy
    gain of distillation over the student alone per regime (mean, min..max, over the seeds recorded), the step
    time with the live teacher and with cached logits over the student alone, and the char-GPT student."""
    from benchmarks.common import count, load_results, points, runs_line, sig, times

    results = load_results(results_dir, "distillation.json")
    f, cfg = results["figures"], results.get("config", {})
    lines = [runs_line(results, "distillation.json", ["accuracy", "timing", "gpt"], results_dir), ""]
    steps = f.get("steps", {})
    if "transfer" in f:
        teacher, student = f["cnn_teacher"], f["student_params"]
        size = f" of {cfg['transfer_size']:,} images" if "transfer_size" in cfg else ""
        lines += [
            f"Fashion-MNIST: teacher CNN {count(teacher['params'])} parameters ({steps.get('cnn_teacher', '?')} "
            f"steps, test accuracy {sig(teacher['test_acc'])}); student {count(student)} parameters "
            f"(1/{teacher['params'] / student:.0f}), {steps.get('cnn_student', '?')} steps; temperature "
            f"{f['chosen']['temperature']:g} and alpha {f['chosen']['alpha']:g} chosen by a "
            f"{len(f['sweep_val_acc'])}-point sweep on the validation split.",
            "",
            "| training set | student alone, test acc | distilled, test acc | gain: mean (min..max) | seeds |",
            "|---|---|---|---|---|",
        ]
        for regime, label in (("transfer", f"transfer set{size}"), ("full", "full training split")):
            r = f[regime]
            gain = r["gain_points"]
            lines.append(
                f"| {label} | {sig(sum(r['alone']) / len(r['alone']))} | {sig(sum(r['kd']) / len(r['kd']))} "
                f"| {points(r['mean_gain_points'])} ({min(gain):+.2f}..{max(gain):+.2f}) | {len(gain)} |"
            )
        lines.append("")
    if "overhead_live" in f:
        rounds = len(f["step_s"]["plain"])
        lines += [
            f"Step time over the student alone (median of {rounds} alternating rounds): live teacher "
            f"**{times(f['overhead_live'])}**, cached top-k teacher logits **{times(f['overhead_cached'])}**.",
            "",
        ]
    if "gpt" in f:
        g = f["gpt"]
        sweep = ", ".join(f"{a}: {sig(v)}" for a, v in g["sweep_val_loss"].items())
        temperature = f"T={g['temperature']:g}, " if "temperature" in g else ""
        lines.append(
            f"Char-GPT: student {count(g['alone']['params'])} parameters distilled from a "
            f"{count(g['teacher']['params'])} teacher ({steps.get('gpt_student', '?')} steps, {temperature}"
            f"alpha={g['alpha']:g} chosen on validation loss: "
            f"{sweep}): test loss **{sig(g['kd']['test_loss'])}** vs {sig(g['alone']['test_loss'])} alone "
            f"(teacher {sig(g['teacher']['test_loss'])})."
        )
    return "\n".join(lines).rstrip()


if __name__ == "__main__":
    main(sys.argv[1:])
