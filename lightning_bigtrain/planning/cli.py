"""``bigtrain plan``: the planner from the command line, on a ``bigtrain fit`` config."""

from __future__ import annotations

import argparse
import copy
import importlib
from pathlib import Path
from typing import Any

from lightning_bigtrain.planning.planner import Cluster, Workload, plan

__all__ = ["main"]


def _instantiate(spec: dict[str, Any]) -> Any:
    module, _, name = spec["class_path"].rpartition(".")
    cls = getattr(importlib.import_module(module), name)
    return cls(**spec.get("init_args", {}))


def main(argv: list[str]) -> int:
    import torch
    import yaml

    parser = argparse.ArgumentParser(
        prog="bigtrain plan",
        description="Predict per-device memory and communication of DDP and ZeRO 1/2/3 (+ offload) for the "
        "config's model on the given hardware; print a table, write the recommended config and a chart.",
    )
    parser.add_argument("--config", required=True, help="a `bigtrain fit` YAML (its model, data and precision)")
    parser.add_argument("--devices", type=int, required=True, help="devices per node")
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--device-memory", default="80GB", help="e.g. 80GB, 24GiB")
    parser.add_argument("--intra-node-bandwidth", default="300GB/s", help="e.g. 300GB/s, 100Gbps")
    parser.add_argument("--inter-node-bandwidth", default="25Gbps", help="e.g. 25Gbps, 12.5GB/s")
    parser.add_argument("--batch-shape", help="per-device input shape, e.g. 32,128 (default: the data's "
                        "batch_size,block_size)")  # fmt: skip
    parser.add_argument("--precision", help="overrides the config's trainer.precision")
    parser.add_argument("--optimizer", default="adamw")
    parser.add_argument("--activation-checkpointing", action="store_true")
    parser.add_argument("--accelerator", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--output", default="runs/plan", help="folder for plan.yaml and memory.png")
    args = parser.parse_args(argv)

    config = yaml.safe_load(Path(args.config).read_text())
    if "model" not in config:
        parser.error(f"{args.config} has no `model:` section (class_path + init_args).")
    model = _instantiate(config["model"])
    shape = None
    if args.batch_shape:
        try:
            shape = tuple(int(v) for v in args.batch_shape.split(","))
        except ValueError:
            parser.error(f"--batch-shape {args.batch_shape!r}: give integers separated by commas, e.g. 32,128.")
    else:
        data_args = config.get("data", {}).get("init_args", {})
        if "batch_size" in data_args and "block_size" in data_args:
            shape = (int(data_args["batch_size"]), int(data_args["block_size"]))
    precision = args.precision or str(config.get("trainer", {}).get("precision", "32-true"))
    try:
        cluster = Cluster(devices=args.devices, num_nodes=args.num_nodes, device_memory=args.device_memory,
                          intra_node_bandwidth=args.intra_node_bandwidth,
                          inter_node_bandwidth=args.inter_node_bandwidth, accelerator=args.accelerator)  # fmt: skip
        workload = Workload(batch_shape=shape, input_dtype=torch.long if shape and len(shape) == 2 else torch.float32,
                            optimizer=args.optimizer, precision=precision,
                            activation_checkpointing=args.activation_checkpointing)  # fmt: skip
        result = plan(model, cluster=cluster, workload=workload)
    except (TypeError, ValueError) as err:
        parser.error(str(err))
    print(result.table())
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    print(f"wrote {result.chart(str(out / 'memory.png'))}")
    if result.recommendation is None:
        print("no configuration fits; no config written")
        return 1
    recommended = copy.deepcopy(config)
    recommended.setdefault("trainer", {}).update(result.trainer_config())
    (out / "plan.yaml").write_text(yaml.safe_dump(recommended, sort_keys=False))
    print(
        f"recommended: {result.recommendation}; wrote {out / 'plan.yaml'} (bigtrain fit --config {out / 'plan.yaml'})"
    )
    return 0
