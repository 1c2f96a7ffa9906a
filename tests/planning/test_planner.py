"""Unit tests of the planner: units, the ZeRO formulas (paper and DeepSpeed), activations, recommendation."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_bigtrain.models import CharGPT
from lightning_bigtrain.planning import (
    STRATEGIES,
    Cluster,
    Workload,
    parse_bandwidth,
    parse_bytes,
    plan,
    zero_paper_bytes,
)
from lightning_bigtrain.planning.planner import COMPRESSED_STRATEGIES
from lightning_bigtrain.warnings import BigtrainWarning


def test_units():
    assert parse_bytes("80GB") == 80 * 10**9 and parse_bytes("24GiB") == 24 * 2**30 and parse_bytes(512) == 512
    assert parse_bandwidth("25Gbps") == pytest.approx(25e9 / 8)
    assert parse_bandwidth("400GB/s") == pytest.approx(400e9)
    assert parse_bandwidth("100Gb/s") == pytest.approx(100e9 / 8)
    with pytest.raises(ValueError, match=r"`device_memory='80 GBB'`: not a size"):
        parse_bytes("80 GBB")
    with pytest.raises(ValueError, match=r"`inter_node_bandwidth='fast'`: not a bandwidth"):
        parse_bandwidth("fast")
    with pytest.raises(ValueError, match=r"device_memory='lots'"):
        plan(1000, devices=2, device_memory="lots")


def test_zero_paper_formulas_reproduce_figure_1():
    """Rajbhandari et al. (2020), Fig. 1: 7.5B parameters, Adam (K = 12), 64 GPUs."""
    psi, n = 7.5e9, 64
    expected = {0: 120e9, 1: 31.4e9, 2: 16.6e9, 3: 1.9e9}
    for stage, value in expected.items():
        assert zero_paper_bytes(stage, int(psi), n) == pytest.approx(value, rel=0.02)


def test_this_packages_strategies_reproduce_figure_1_in_mixed_precision():
    """The same setting through `plan`: stages 1-2 hold 16-bit replicas with fp32 masters in the sharded optimizer
    state, stage 3 fp32 shards (FSDP2's MixedPrecisionPolicy), so their model states are the paper's."""
    rows = plan(7.5e9, devices=64, precision="16-mixed", optimizer="adam")
    expected = {"ddp": 120e9, "zero1": 31.4e9, "zero2": 16.6e9, "zero3": 1.9e9}
    for name, value in expected.items():
        assert rows[name].model_states_bytes == pytest.approx(value, rel=0.02), name
    # 16-bit buckets: stages 1-2 send half of the fp32 run's bytes.
    fp32 = plan(7.5e9, devices=64, precision="32-true", optimizer="adam")
    assert rows["zero2"].comm_bytes_per_step == pytest.approx(fp32["zero2"].comm_bytes_per_step / 2)


def test_deepspeed_estimates_are_the_paper_formulas_plus_its_fp32_gradient_partition():
    """DeepSpeed's estimators count what its engine holds: the paper's states plus an fp32 gradient partition
    (4 bytes / N per parameter), and at stage 3 the largest layer gathered in fp32."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    psi, per_node, nodes, largest = 1_000_000_000, 8, 2, 50_000_000
    n = per_node * nodes
    _, zero2 = estimate_zero2_model_states_mem_needs(psi, per_node, nodes, cpu_offload=False)
    assert zero2 == pytest.approx(zero_paper_bytes(2, psi, n) + 4 * psi / n, rel=1e-6)
    _, zero3, _ = estimate_zero3_model_states_mem_needs(psi, largest, per_node, nodes, cpu_offload=False,
                                                        cpu_offload_params=False)  # fmt: skip
    assert zero3 == pytest.approx(zero_paper_bytes(3, psi, n) + 2 * psi / n + 4 * largest, rel=1e-6)


def test_model_states_follow_the_strategies_dtypes():
    psi = 1_000_000
    fp32 = plan(psi, devices=2, precision="32-true")
    assert {name: fp32[name].model_states_bytes / psi for name in ("ddp", "zero1", "zero2", "zero3")} == {
        "ddp": 16, "zero1": 12, "zero2": 10, "zero3": 8}  # fmt: skip
    compressed = {name for name, (_, c) in COMPRESSED_STRATEGIES.items() if c != "powersgd"}  # needs shapes
    assert set(fp32.rows) == set(STRATEGIES) | compressed
    assert "PowerSGD rows need a model" in " ".join(fp32.notes)
    assert fp32["zero3_offload"].model_states_bytes == 0 and fp32["zero3_offload"].host_bytes == 8 * psi
    assert plan(psi, devices=2, accelerator="cpu")["zero3_offload"].model_states_bytes == 8 * psi
    kahan = plan(psi, devices=2, precision="bigtrain-bf16-kahan")
    assert kahan["ddp"].model_states_bytes / psi == 10
    assert kahan.trainer_config(2, 1)["plugins"][0]["init_args"] == {"compensation": "kahan"}
    assert "precision" not in kahan.trainer_config(2, 1)
    # Bytes sent per step: an all-reduce of the gradients for DDP; reduce-scatter + all-gather for ZeRO 1/2;
    # two all-gathers + a reduce-scatter for stage 3.
    assert fp32["ddp"].comm_bytes_per_step == fp32["zero2"].comm_bytes_per_step == 4 * psi
    assert fp32["zero3"].comm_bytes_per_step == 6 * psi


def test_activations_are_measured_on_fake_tensors():
    model = CharGPT(block_size=64, n_layer=4, n_head=4, n_embd=64)
    one = plan(model, devices=2, batch_shape=(4, 64))
    two = plan(model, devices=2, batch_shape=(8, 64))
    checkpointed = plan(model, devices=2, batch_shape=(8, 64), activation_checkpointing=True)
    assert one["ddp"].activation_bytes > 0
    assert two["ddp"].activation_bytes == pytest.approx(2 * one["ddp"].activation_bytes, rel=0.05)
    assert checkpointed["ddp"].activation_bytes < 0.6 * two["ddp"].activation_bytes
    assert not any(p.device.type == "meta" for p in model.parameters())  # the real model is untouched


def test_activations_are_measured_in_the_precisions_dtypes():
    """16-bit runs are measured, not halved from fp32: with 16-bit weights (``-true``) the saved tensors are half the
    fp32 ones here, while under autocast (``-mixed``) a layer also keeps the 16-bit copy of its fp32 weight for
    backward, which halving the fp32 measurement leaves out."""
    model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256))
    kw = dict(devices=1, batch_shape=(2, 256), input_dtype=torch.float32, compression=False)
    fp32 = plan(model, precision="32-true", **kw)["ddp"].activation_bytes
    assert fp32 == 2 * (2 * 256 * 4)  # the first layer's input and the ReLU's output (the second layer's input)
    assert plan(model, precision="bf16-true", **kw)["ddp"].activation_bytes == fp32 / 2
    # The second layer keeps its weight's 16-bit copy to give its input a gradient; the first layer's input
    # needs none, so its copy is not kept.
    weight_copy = 256 * 256 * 2
    for precision in ("bf16-mixed", "16-mixed"):
        mixed = plan(model, precision=precision, **kw)["ddp"].activation_bytes
        assert mixed == fp32 / 2 + weight_copy, precision
    assert model[0].weight.dtype == torch.float32  # the real model is untouched


class _NotTraceable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        if x.sum().item() > 0:  # data-dependent Python control flow: no fake tensor can answer
            return self.lin(x)
        return self.lin(x).relu()


def test_untraceable_model_falls_back_to_counting_parameters():
    with pytest.warns(BigtrainWarning, match=r"could not run _NotTraceable on fake tensors"):
        result = plan(_NotTraceable(), devices=2, batch_shape=(2, 4), input_dtype=torch.float32)
    # 16 bytes per parameter, and AdamW's 4-byte step counter for each of the 2 parameter tensors.
    assert result["ddp"].activation_bytes == 0 and result["ddp"].model_states_bytes == 16 * 20 + 4 * 2
    assert any("activations not measured" in note for note in result.notes)


def test_recommends_the_fastest_that_fits_and_says_what_would_fit_otherwise():
    psi = 1_000_000_000  # 16 GB of fp32 AdamW states with DDP
    roomy = plan(psi, devices=8, device_memory="80GB")
    assert roomy.recommendation == "ddp"  # fits, and sends no more than ZeRO 1/2 in fewer collectives
    tight = plan(psi, devices=8, device_memory="8GB")  # DDP 16 GB, ZeRO-1 9 GB, ZeRO-2 5.5 GB
    assert tight.recommendation == "zero2" and tight.trainer_config(8, 1)["strategy"] == "bigtrain_zero2"
    tighter = plan(psi, devices=8, device_memory="4GB")  # ZeRO-3 2 GB + two gathered units
    assert tighter.recommendation == "zero3"
    assert plan(psi, devices=1, device_memory="1GB").recommendation == "zero3_offload"  # host memory unchecked
    hopeless = plan(psi, devices=1, device_memory="1GB", host_memory="8GB")
    assert hopeless.recommendation is None
    assert any("nothing fits in" in note for note in hopeless.notes)
    with pytest.raises(ValueError, match="No configuration fits"):
        hopeless.trainer_config(1, 1)


def test_bad_arguments():
    with pytest.raises(ValueError, match=r"plan\(precision='fp8'\)"):
        plan(10, devices=1, precision="fp8")
    with pytest.raises(ValueError, match=r"plan\(optimizer='lion'\)"):
        plan(10, devices=1, optimizer="lion")
    with pytest.raises(ValueError, match=r"devices=0"):
        plan(10, devices=0)


def test_compressed_rows_follow_each_compressors_byte_formula():
    model = CharGPT(block_size=64, n_layer=2, n_head=2, n_embd=64)
    result = plan(model, devices=1, num_nodes=2, inter_node_bandwidth="100Mbps", batch_shape=(8, 64))
    dense = result["ddp"].comm_bytes_per_step
    assert result["ddp_fp16"].comm_bytes_per_step == pytest.approx(dense / 2)
    # TopK(0.01) at N=2: 50x fewer bytes on the tensors it compresses (k rounds down), all of them here.
    assert result["ddp_topk"].comm_bytes_per_step == pytest.approx(dense / 50, rel=0.02)
    assert result["ddp_onebit"].comm_bytes_per_step < dense / 25
    assert result["ddp_powersgd"].comm_bytes_per_step < dense / 5
    # Error feedback costs two gradient-sized buffers under an all-reduce (the committed one and the one being
    # written), one at ZeRO-2 (updated in place); the unbiased Quantize keeps none.
    psi = sum(p.numel() for p in model.parameters())
    assert result["ddp_topk"].grads_bytes - result["ddp"].grads_bytes == 8 * psi
    assert result["zero2_topk"].grads_bytes - result["zero2"].grads_bytes == 4 * psi
    assert result["ddp_int8"].grads_bytes == result["ddp"].grads_bytes
    # ZeRO-1 keeps its dense parameter all-gather; ZeRO-2 with fp16 halves only the reduce-scatter.
    assert result["zero1_topk"].comm_bytes_per_step > result["zero1"].comm_bytes_per_step / 2
    assert result["zero2_fp16"].comm_bytes_per_step == pytest.approx(0.75 * result["zero2"].comm_bytes_per_step)
    # ZeRO-2 with 1 bit: the reduce-scatter's half of the traffic sent at ~1/32 (each slice to its rank only).
    reduce_scatter = result["zero2"].comm_bytes_per_step / 2
    assert result["zero2_onebit"].comm_bytes_per_step == pytest.approx(reduce_scatter * (1 + 1 / 32), rel=0.02)
    # On a 100 Mbit/s link compression pays: the plan says so, but recommends a dense (lossless) row.
    assert result.recommendation in STRATEGIES
    assert any("with gradient compression" in note for note in result.notes)


def test_compressed_rows_over_several_nodes_of_several_devices_are_hierarchical():
    from lightning_bigtrain.functional.compression import allreduce_bytes

    model = CharGPT(block_size=64, n_layer=2, n_head=2, n_embd=64)
    psi = sum(p.numel() for p in model.parameters())
    kwargs: dict = dict(num_nodes=2, inter_node_bandwidth="100Mbps", batch_shape=(8, 64))
    nodes = plan(model, devices=4, **kwargs)
    flat = plan(model, devices=1, **kwargs)  # one rank per node: the exchange a node's ranks share out
    for name in ("ddp_onebit", "ddp_topk", "ddp_powersgd"):
        # Each of a node's 4 devices sends a quarter of one node's compressed message across nodes, plus two dense
        # fp32 all-reduces within the node.
        within = 2 * allreduce_bytes(psi * 4, 4)
        assert nodes[name].comm_bytes_per_step == pytest.approx(flat[name].comm_bytes_per_step / 4 + within)
        assert nodes[name].comm_seconds_per_step < nodes["ddp"].comm_seconds_per_step / 4
    # Error feedback is kept by each parameter's owner only: a quarter of the flat exchange's two buffers.
    assert nodes["ddp_topk"].grads_bytes - nodes["ddp"].grads_bytes == pytest.approx(8 * psi / 4)
    assert any("hierarchical" in note for note in nodes.notes)
    assert not any("hierarchical" in note for note in flat.notes)


def test_cluster_and_workload_give_the_plan_the_keywords_give():
    model = CharGPT(block_size=32, n_layer=2, n_head=2, n_embd=32)
    cluster = Cluster(devices=4, num_nodes=2, device_memory="24GB", inter_node_bandwidth="25Gbps")
    workload = Workload(batch_shape=[4, 32], precision="bf16-mixed", optimizer="sgd")
    assert workload.batch_shape == (4, 32)  # any sequence, kept as a tuple
    by_objects = plan(model, cluster=cluster, workload=workload)
    by_keywords = plan(model, devices=4, num_nodes=2, device_memory="24GB", inter_node_bandwidth="25Gbps",
                       batch_shape=(4, 32), precision="bf16-mixed", optimizer="sgd")  # fmt: skip
    assert by_objects.rows == by_keywords.rows and by_objects.recommendation == by_keywords.recommendation
    assert by_keywords.cluster == cluster and by_keywords.workload == workload
    assert by_objects.trainer_config() == by_objects.trainer_config(4, 2)  # defaults from the cluster
    assert plan(10, cluster=Cluster(devices=1)).workload == Workload()  # each dataclass in either form
    assert plan(10, cluster=Cluster(devices=1), precision="bf16-true").workload == Workload(precision="bf16-true")


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (lambda: Cluster(devices=0), ValueError, r"`Cluster\(devices=0\)`: must be an int >= 1"),
        (lambda: Cluster(devices=2, num_nodes=1.5), ValueError, r"`Cluster\(num_nodes=1.5\)`"),
        (lambda: Cluster(devices=2, accelerator="tpu"), ValueError, r"`Cluster\(accelerator='tpu'\)`"),
        (lambda: Cluster(devices=2, latency=-1.0), ValueError, r"`Cluster\(latency=-1.0\)`"),
        (lambda: Cluster(devices=2, host_bandwidth="0GB/s"), ValueError, r"`Cluster\(host_bandwidth='0GB/s'\)`"),
        (lambda: Cluster(devices=2, host_memory="much"), ValueError, r"`host_memory='much'`: not a size"),
        (lambda: Workload(precision="fp8"), ValueError, r"`Workload\(precision='fp8'\)`: choose one of"),
        (lambda: Workload(batch_shape=(4, 0)), ValueError, r"`Workload\(batch_shape=\(4, 0\)\)`"),
        (lambda: Workload(input_dtype="long"), TypeError, r"`Workload\(input_dtype='long'\)`"),
        (lambda: Workload(compression="yes"), TypeError, r"`Workload\(compression='yes'\)`"),
        (lambda: plan(10, devices=2, num_nodes=0), ValueError, r"`plan\(num_nodes=0\)`: must be an int >= 1"),
        (lambda: plan(10, devices=2, batch_shape=(2, -1)), ValueError, r"`plan\(batch_shape=\(2, -1\)\)`"),
        (lambda: plan(10, cluster=Cluster(devices=2), devices=4), ValueError,
         r"`plan\(cluster=\.\.\., devices=\.\.\.\)`: give these as fields of the Cluster or as keywords"),
        (lambda: plan(10, devices=1, workload=Workload(), precision="bf16-true"), ValueError,
         r"`plan\(workload=\.\.\., precision=\.\.\.\)`"),
        (lambda: plan(10, cluster={"devices": 2}), TypeError,
         r"`plan\(cluster=\{'devices': 2\}\)`: expected a Cluster"),
        (lambda: plan(10), TypeError, r"plan\(\) needs the hardware"),
    ],
)  # fmt: skip
def test_cluster_and_workload_errors_name_the_argument(make, error, match):
    with pytest.raises(error, match=match):
        make()
