"""`ftjax plan`'s numbers (ftjax/program/plan.py), in-process on this process's simulated CPU devices:
the state bytes against a count made here from the GPT's shapes, the step's buffers against XLA's
memory analysis of the same executable, the FLOPs against 6N + attention; the known devices; the
fit verdict and the refusal `ftjax train` makes with it; bad flags."""

import json

import jax
import pytest

from ftjax.base import accelerators
from ftjax.base.accelerators import GIB, lookup
from ftjax.cli import plan as plan_cli
from ftjax.config import load_config
from ftjax.program import plan as plan_mod
from ftjax.program.plan import DoesNotFit, check_fits, plan_program, step_flops, verdict
from ftjax.program.step import build_program, model_state


def tiny(devices: int, *overrides: str):
    return build_program(load_config("tiny", [f"mesh.devices_per_host={devices}", *overrides]))


def gpt_params(V, d, T, L, dff) -> tuple[int, int]:
    """(all parameters, those FSDP does not shard: the biases whose axis is not `embed`) of the
    built-in GPT, counted from its architecture: embeddings, L blocks (two LayerNorms, fused qkv,
    attention projection, MLP), the final LayerNorm and the head."""
    block = 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + 2 * d + (d * dff + dff) + (dff * d + d)
    total = V * d + T * d + L * block + 2 * d + (d * V + V)
    replicated = L * (3 * d + dff) + V  # qkv bias ("qkv"), MLP bias ("mlp"), head bias ("vocab")
    return total, replicated


@pytest.mark.parametrize("devices", [1, 4])
def test_state_bytes_are_the_parameters_times_their_bytes_times_one_plus_two_moments_over_the_shards(devices):
    program = tiny(devices)
    plan = plan_program(program)
    total, replicated = gpt_params(V=256, d=64, T=64, L=2, dff=256)
    assert plan.params == total == 137_216
    per_device = (total - replicated) // devices + replicated  # FSDP shards `embed` over the devices
    assert plan.param_bytes == per_device * 4  # float32
    # AdamW: two moments shaped like the parameters (sharded like them), plus int32 step counts
    opt = jax.eval_shape(program.opt_init, program.abstract_state()["params"])
    counts = [a for a in jax.tree.leaves(opt) if a.ndim == 0]
    assert counts and all(a.dtype.itemsize == 4 for a in counts)
    assert plan.optimizer_bytes == 2 * per_device * 4 + 4 * len(counts)
    assert plan.other_state_bytes == 4  # the step counter (no model state)
    assert plan.state_bytes == per_device * 4 * (1 + 2) + 4 * len(counts) + 4


def test_activations_and_temporaries_are_what_memory_analysis_reports_for_the_same_step():
    program = tiny(2)
    plan = plan_program(program)
    st, where, _ = program._abstract_args()
    compiled = program.grads.lower(st["params"], model_state(st), program.example, where).compile()
    mem = compiled.memory_analysis()
    assert plan.temp_bytes == mem.temp_size_in_bytes > 0
    assert plan.update_bytes == mem.output_size_in_bytes >= plan.param_bytes  # the float32 update, loss
    assert plan.batch_bytes == mem.argument_size_in_bytes - plan.param_bytes
    assert plan.batch_bytes == 8 * 65 * 4 // 2  # int32 windows of seq_len + 1, split over 2 devices
    assert plan.total_bytes == plan.state_bytes + plan.batch_bytes + plan.update_bytes + plan.temp_bytes
    # FLOPs: the per-device executable's count times the devices
    assert plan.flops_per_step == compiled.cost_analysis()["flops"] * 2
    assert plan.tokens_per_step == 8 * 64 and plan.flops_per_token == plan.flops_per_step / 512


def test_flops_per_token_agree_with_6n_plus_attention_and_precompile_gives_the_same():
    program = tiny(1)
    plan = plan_program(program)
    V, d, T, L = 256, 64, 64, 2
    total, _ = gpt_params(V=V, d=d, T=T, L=L, dff=256)
    dense = total - V * d - T * d  # the lookup tables do no matmul
    assert plan.closed_form_flops_per_token == 6 * dense + 12 * L * d * T
    assert 0.95 < plan.flops_per_token / plan.closed_form_flops_per_token < 1.15  # (+ softmax, norms, GELU)
    # MFU's model FLOPs: the closed form (work XLA counts beyond it, like remat's recompute, is not
    # the model's)
    assert step_flops(program) == plan.closed_form_flops_per_token * plan.tokens_per_step


def test_a_task_that_is_not_a_transformer_has_no_closed_form():
    program = tiny(1, "model.kind=mlp")
    plan = plan_program(program)
    assert plan.closed_form_flops_per_token is None and plan.flops_per_step > 0
    program.precompile()  # the trainer's executable: XLA's figure, without a second compile
    assert step_flops(program) == plan.flops_per_step


def test_known_devices_by_kind_and_short_name():
    h100 = lookup("NVIDIA H100 80GB HBM3")
    assert h100 is lookup("H100") and h100.memory_bytes == 80 * GIB
    assert h100.peak_bf16_flops == pytest.approx(989.5e12) and h100.peak_fp32_flops == 67e12
    assert lookup("NVIDIA H100 PCIe").peak_bf16_flops == pytest.approx(756.5e12)
    assert lookup("NVIDIA H200").memory_bytes == 141 * GIB
    assert lookup("NVIDIA A100-SXM4-40GB").memory_bytes == 40 * GIB
    assert lookup("NVIDIA A100-SXM4-80GB").memory_bytes == 80 * GIB
    assert lookup("NVIDIA A100 80GB PCIe").memory_bytes == 80 * GIB
    assert lookup("TPU v5 lite").name == "TPU v5e" and lookup("TPU v5").name == "TPU v5p"
    assert lookup("TPU v4").peak_bf16_flops == 275e12 and lookup("TPU v4").peak_fp32_flops is None
    assert lookup("cpu") is None and lookup("NVIDIA B300") is None
    assert all(a.names and a.memory_bytes > 0 and a.peak_bf16_flops > 0 for a in accelerators.KNOWN)


def test_the_verdict_names_the_device_and_the_numbers():
    plan = plan_program(tiny(1))
    fits, text = verdict(plan, "NVIDIA H100 SXM 80GB HBM3", 80 * GIB)
    assert fits and text.startswith("fits NVIDIA H100 SXM 80GB HBM3 (80.00 GiB): ") and "spare" in text
    fits, text = verdict(plan, "a device", plan.total_bytes - 1)
    assert not fits and text.startswith("does not fit a device (") and text.endswith("1 B over")
    assert "state " in text and "activations and temporaries " in text


class FakeDevice:
    def __init__(self, platform, kind, stats=None):
        self.platform, self.device_kind, self._stats = platform, kind, stats

    def memory_stats(self):
        return self._stats


def test_device_memory_and_peak_come_from_the_allocator_the_table_or_the_setting():
    cfg = load_config("tiny")
    cpu = jax.local_devices()[0]
    assert plan_mod.device_memory(cpu) is None and plan_mod.peak_flops(cfg, cpu) is None  # no made-up figure
    gpu = FakeDevice("gpu", "NVIDIA H100 80GB HBM3", {"bytes_limit": 60 * GIB})
    assert plan_mod.device_memory(gpu) == (60 * GIB, "NVIDIA H100 80GB HBM3 (the allocator's limit)")
    assert plan_mod.device_memory(FakeDevice("gpu", "NVIDIA H100 80GB HBM3")) == (80 * GIB, lookup("H100").name)
    assert plan_mod.device_memory(FakeDevice("gpu", "a new GPU")) is None
    assert plan_mod.peak_flops(cfg, gpu) == lookup("H100").peak_bf16_flops
    set_peak = load_config("tiny", ["hardware.peak_flops_per_device=2.5e12"])
    assert plan_mod.peak_flops(set_peak, cpu) == 2.5e12 and plan_mod.peak_flops(set_peak, gpu) == 2.5e12


def test_train_refuses_a_step_that_does_not_fit_its_device_before_allocating(monkeypatch):
    program = tiny(1)
    assert check_fits(program) is None  # CPU: nothing to check against
    monkeypatch.setattr(plan_mod, "device_memory", lambda device: (1 << 20, "a 1 MiB device"))
    with pytest.raises(DoesNotFit) as e:
        check_fits(program)
    text = str(e.value)
    assert "does not fit a 1 MiB device (1.00 MiB)" in text and "per device (state " in text, text
    monkeypatch.setattr(plan_mod, "device_memory", lambda device: (1 << 30, "a 1 GiB device"))
    assert check_fits(program).total_bytes < 1 << 30


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["tiny", "--hosts", "0"], "argument --hosts"),
        (["tiny", "--devices-per-host", "two"], "argument --devices-per-host"),
        (["tiny", "--device-memory-gib", "-1"], "argument --device-memory-gib"),
    ],
)
def test_bad_flags_are_refused_naming_the_flag(argv, flag, capsys):
    with pytest.raises(SystemExit) as e:
        plan_cli.main(argv)
    assert e.value.code == 2 and flag in capsys.readouterr().err


def test_an_unknown_device_or_an_impossible_mesh_is_one_line_naming_it(capsys):
    assert plan_cli.main(["tiny", "--device-kind", "NVIDIA B300"]) == 2
    err = capsys.readouterr().err
    assert "--device-kind: 'NVIDIA B300' is not a known device" in err and "--device-memory-gib" in err
    assert plan_cli.main(["tiny", "--devices-per-host", "3"]) == 2
    err = capsys.readouterr().err
    assert "mesh.devices_per_host=3" in err and "--devices-per-host" in err


@pytest.mark.parametrize(
    "setting, on, said",
    [
        ("logits_chunk", "16", "one chunk of model.logits_chunk's"),
        ("attention_chunk", "16", "one chunk of model.attention_chunk's"),
        ("scan_layers", "true", "one of model.scan_layers' blocks"),
    ],
)
def test_with_a_part_in_a_loop_the_table_says_what_xla_counts(setting, on, said, capsys):
    """model.logits_chunk puts the output projection in a loop (model.attention_chunk, the attention;
    model.scan_layers, the blocks), whose body XLA's cost analysis counts once: the XLA FLOPs drop
    (the model's work does not) and the table says why."""
    flops, ideal = {}, {}
    for value in ("0", on):
        argv = ["llama_tiny", "--devices-per-host", "4", "--device-kind", "H100", f"model.{setting}={value}"]
        assert plan_cli.main(argv) == 0
        table = capsys.readouterr().out
        assert (f"XLA counts {said}" in table) == (value == on)
        assert "(6N + 12 L d T at the bf16 peak)" in table
        assert plan_cli.main([*argv, "--json"]) == 0
        report = json.loads(capsys.readouterr().out)
        flops[value], ideal[value] = report["flops_per_step"], report["step_s_at_peak"]
    assert flops[on] < flops["0"]
    # the step time at 100% MFU is the model's work at the peak: the loop leaves it as it was
    assert ideal[on] == ideal["0"] > 0


def test_the_table_says_when_the_cpu_compile_cannot_show_remat(capsys):
    """An unrolled transformer under remat: XLA:CPU keeps its blocks' activations, and the plan
    says its temporaries are an upper bound, naming model.scan_layers for the llama (whose scan
    shows remat: at 4 layers of 128 positions the temporaries drop; at 2 of 64 a scan's own
    buffers outweigh what it saves); without remat, or scanned, nothing is said."""
    said = "the temporaries above are remat none's, an upper bound"
    temps = {}
    for overrides, note in (
        ([], False),
        (["model.remat=full"], True),
        (["model.remat=full", "model.scan_layers=true"], False),
    ):
        argv = ["llama_tiny", "--devices-per-host", "4", "model.n_layers=4", "model.seq_len=128", *overrides]
        assert plan_cli.main([*argv, "--json"]) == 0
        report = json.loads(capsys.readouterr().out)
        assert any(said in n and "model.scan_layers=true" in n for n in report["notes"]) == note, report["notes"]
        temps[len(overrides)] = report["temp_bytes"]
    assert temps[2] < temps[1]
    assert plan_cli.main(["tiny", "--devices-per-host", "4", "model.remat=save_dots"]) == 0
    table = capsys.readouterr().out
    assert "note" in table and said in table and "scan_layers" not in table  # (the gpt has no scan)


@pytest.mark.parametrize("scan", ["false", "true"])
def test_kept_for_backward_is_what_remat_keeps_of_each_layer(scan):
    """`backward_bytes` (JAX's residuals of a micro-batch, per device) grows per layer by exactly
    what the remat policy keeps of a block, counted here from llama_tiny's shapes (d 64, 4 heads of
    16, 2 kv heads, d_ff 192; 2 rows of 64 tokens a device of 4): `full` its float32 input;
    `save_dots` also its weight matmuls' outputs (query, key, value, attention projection, gate, up;
    the down projection's is not read) in the compute dtype. The same scanned or unrolled."""
    tokens, d, q, kv, ff = 2 * 64, 64, 64, 2 * 2 * 16, 192
    expected = {
        ("full", "float32"): tokens * 4 * d,
        ("save_dots", "float32"): tokens * (4 * d + 4 * (q + kv + d + 2 * ff)),
        ("save_dots", "bfloat16"): tokens * (4 * d + 2 * (q + kv + d + 2 * ff)),
    }
    for (remat, dtype), per_layer in expected.items():
        kept = {}
        for layers in (2, 3):
            overrides = [f"model.n_layers={layers}", f"model.scan_layers={scan}", f"model.remat={remat}"]
            cfg = load_config("llama_tiny", ["mesh.devices_per_host=4", *overrides, f"model.compute_dtype={dtype}"])
            kept[layers] = plan_mod.backward_bytes(build_program(cfg))
        assert kept[3] - kept[2] == per_layer, (remat, dtype)
    none = load_config("llama_tiny", ["mesh.devices_per_host=4", "model.remat=none", f"model.scan_layers={scan}"])
    assert plan_mod.backward_bytes(build_program(none)) > kept[2]  # (keeping everything keeps more)


def test_the_table_shows_what_the_backward_pass_keeps_and_notes_cpu_bfloat16(capsys):
    """The report carries `backward_bytes`, the table's "kept for backward" row; with
    compute_dtype bfloat16 a note says that XLA:CPU's temporaries hold its saved activations also
    in float32; in float32 no such note."""
    said = "XLA:CPU keeps a bfloat16 activation saved for the backward pass also as float32"
    for dtype, note in (("float32", False), ("bfloat16", True)):
        overrides = ["mesh.devices_per_host=4", f"model.compute_dtype={dtype}"]
        kept = plan_mod.backward_bytes(build_program(load_config("llama_tiny", overrides)))
        assert plan_cli.main(["llama_tiny", *overrides, "--json"]) == 0
        report = json.loads(capsys.readouterr().out)
        assert report["backward_bytes"] == kept > 0
        assert any(said in n for n in report["notes"]) == note
        assert plan_cli.main(["llama_tiny", *overrides]) == 0
        table = capsys.readouterr().out
        assert f"kept for backward       {plan_mod.human_bytes(kept)} (JAX's residuals" in table
