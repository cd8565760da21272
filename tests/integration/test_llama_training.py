"""The Llama recipe (issue 28) through the whole program: bfloat16 compute, remat and gradient
accumulation give the update they should (each compiles whole train steps, hence not a unit test);
`ftjax train llama_tiny` learns; and a 3-replica `ftjax launch llama_tiny` with a replica killed in
FTAR and another while it catches up ends with equal digests, every batch exactly once."""

import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import FTJAX, REPO
from launchrun import Launch

from ftjax.config import load_config
from ftjax.program.models.llama import REMAT_POLICIES, stacked_layers
from ftjax.program.plan import compiled_grads
from ftjax.program.step import build_program, device_batch, model_state, where
from ftjax.runtime.metrics import read_metrics


def relative(a, b) -> float:
    """The largest relative difference of two trees, leaf by leaf: |a - b| / |b| (2-norms)."""
    return max(
        float(np.linalg.norm(np.asarray(x) - np.asarray(y)) / np.linalg.norm(np.asarray(y)))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
    )


def program(name: str, *overrides: str):
    return build_program(load_config(name, list(overrides)))


def first_batch(prog, rows: int = 8):
    return np.stack([prog.task.source[i] for i in range(rows)])


def _steps(dtype: str, n: int = 4):
    """Losses of n fused train steps of llama_tiny computing in `dtype`, and the final state."""
    prog = program("llama_tiny", f"model.compute_dtype={dtype}")
    state, losses = prog.init(np.int32(0)), []
    for i in range(n):
        batch = np.stack([prog.task.source[j] for j in range(i * 8, i * 8 + 8)])
        state, loss = prog.train_step(state, batch, np.float32(1.0))
        losses.append(float(loss))
    return losses, state


def test_bfloat16_compute_trains_close_to_float32_with_float32_master_weights():
    ref, _ = _steps("float32")
    got, state = _steps("bfloat16")
    print(f"float32 {ref}\nbfloat16 {got}")
    assert ref != got  # the matmuls did run in bfloat16:
    for dtype, expect in (("float32", set()), ("bfloat16", {jnp.dtype(jnp.bfloat16)})):
        prog = program("llama_tiny", f"model.compute_dtype={dtype}")
        dots = [e for e in _equations(_traced(prog).jaxpr) if e.primitive.name == "dot_general"]
        assert {v.aval.dtype for e in dots for v in e.invars} - {jnp.dtype(jnp.float32)} == expect
    np.testing.assert_allclose(got, ref, rtol=2e-2)
    assert got[-1] < got[0]
    for leaf in jax.tree.leaves({"params": state["params"], "opt": state["opt"]}):
        assert leaf.dtype in (jnp.float32, jnp.int32), leaf.dtype  # master weights, optimizer state


def _grads(prog, rows: int = 8):
    state = prog.init(np.int32(0))
    batch = device_batch(prog, first_batch(prog, rows))
    loss, _, update = prog.grads(state["params"], model_state(state), batch, where(0, 0, 0))
    return state, batch, float(loss), update


def _traced(prog):
    """The jaxpr of the program's gradient function (what remat and accumulation change)."""
    st, w, _ = prog._abstract_args()
    return jax.make_jaxpr(prog.grads)(st["params"], model_state(st), prog.example, w)


def _equations(jaxpr):
    """Every equation of a jaxpr, those of the jaxprs inside it (jit, scan, remat) too."""
    for eqn in jaxpr.eqns:
        yield eqn
        for v in eqn.params.values():
            for inner in v if isinstance(v, (list, tuple)) else [v]:
                inner = getattr(inner, "jaxpr", inner)  # a ClosedJaxpr's
                if hasattr(inner, "eqns"):
                    yield from _equations(inner)


def _primitives(prog) -> list[str]:
    return [e.primitive.name for e in _equations(_traced(prog).jaxpr)]


def _remat_policies(prog) -> list:
    return [e.params["policy"] for e in _equations(_traced(prog).jaxpr) if "policy" in e.params]


@pytest.mark.parametrize("config", ["llama_tiny", "tiny"])
def test_remat_gives_the_same_gradients(config):
    """model.remat full and save_dots recompute each block in the backward pass (the traced program
    has a checkpoint per block) and give the gradients of no remat within 1e-6 (float32)."""
    base = program(config, "model.compute_dtype=float32", "model.remat=none")
    _, _, loss, want = _grads(base)
    assert _remat_policies(base) == []
    for remat in ("full", "save_dots"):
        prog = program(config, "model.compute_dtype=float32", f"model.remat={remat}")
        assert _remat_policies(prog) == [REMAT_POLICIES[remat]] * 2  # one per block (2 layers)
        _, _, got_loss, got = _grads(prog)
        assert got_loss == pytest.approx(loss, rel=1e-6)
        assert relative(got, want) <= 1e-6, (remat, relative(got, want))


def test_micro_batches_give_the_same_loss_and_update_in_one_all_reduce():
    """data.micro_batches=2: the batch in two micro-batches summed on the device (a scan in the one
    gradient program), on a replica of 2 devices. The loss, the update that leaves the device and
    the parameters after it equal one batch's within 1e-6 (float32), for `grads` (a replica's own
    batch) and `accumulate` (rows computed for a missing peer under a constant global batch)."""
    two = ("model.compute_dtype=float32", "mesh.devices_per_host=2")
    base, split = program("llama_tiny", *two), program("llama_tiny", *two, "data.micro_batches=2")
    assert "scan" not in _primitives(base) and "scan" in _primitives(split)
    state, batch, loss, want = _grads(base)
    _, _, got_loss, got = _grads(split)
    assert got_loss == pytest.approx(loss, rel=1e-6)
    assert relative(got, want) <= 1e-6
    acc, per_row = split.accumulate(split.zeros(), state["params"], {}, batch, where(0, 1, 0))
    _, want_rows = base.accumulate(base.zeros(), state["params"], {}, batch, where(0, 1, 0))
    assert relative(acc, want) <= 1e-6
    np.testing.assert_allclose(per_row, want_rows, rtol=1e-6)  # each row's loss, in the rows' order
    after = base.apply(jax.tree.map(jnp.copy, state), want, np.float32(1.0))
    got_after = base.apply(jax.tree.map(jnp.copy, state), got, np.float32(1.0))
    assert relative(got_after["params"], after["params"]) <= 1e-6


@pytest.mark.parametrize("mesh", [("mesh.devices_per_host=2",), ("mesh.devices_per_host=4", "mesh.tensor=2")])
def test_logits_chunk_gives_the_same_loss_and_update_without_the_whole_logits(mesh):
    """model.logits_chunk: the output projection and cross-entropy a chunk of positions at a time
    (a scan of rematerialized chunks), here inside gradient accumulation on a replica of 2 devices
    (FSDP) and of 4 (2 x 2 tensor parallel), with a vocabulary large enough that the logits are the
    step's largest buffer. The loss and the update equal the unchunked ones within 1e-6 (float32),
    also with a chunk that does not divide the length (padded); and the compiled step's temporaries
    shrink by more than half a copy of the device's float32 logits (they exist a chunk at a time,
    forward and backward). 256 positions, so that the logits (rows x positions x vocabulary) and
    not the embedding (vocabulary x width) are what the step's peak holds most of."""
    two = ("model.compute_dtype=float32", *mesh, "model.vocab_size=4096", "data.micro_batches=2", "model.seq_len=256")
    base = program("llama_tiny", *two)
    cfg = base.cfg
    _, _, loss, want = _grads(base)
    temp = compiled_grads(base).memory_analysis().temp_size_in_bytes
    # a micro-batch's rows on one device (the fsdp axis splits them), times positions, times the
    # device's part of the vocabulary (the tensor axis splits it), in float32
    fsdp = cfg.mesh.devices_per_host // cfg.mesh.tensor
    logits_bytes = (
        cfg.data.batch_size // cfg.data.micro_batches // fsdp * cfg.model.seq_len * 4096 // cfg.mesh.tensor * 4
    )
    for chunk in (64, 96):  # (256 positions: 4 chunks; 3 chunks of 96, the last one padded)
        prog = program("llama_tiny", *two, f"model.logits_chunk={chunk}")
        # the chunks' scan and its transpose, inside the micro-batches' (base: that one only)
        assert (_primitives(base).count("scan"), _primitives(prog).count("scan")) == (1, 3)
        _, _, got_loss, got = _grads(prog)
        assert got_loss == pytest.approx(loss, rel=1e-6)
        assert relative(got, want) <= 1e-6, (chunk, relative(got, want))
        chunked = compiled_grads(prog).memory_analysis().temp_size_in_bytes
        print(
            f"chunk {chunk}: temporaries {temp / 1e6:.1f} -> {chunked / 1e6:.1f} MB; logits {logits_bytes / 1e6:.1f} MB"
        )
        # (measured: 1.12 and 0.86 copies on the fsdp mesh; 1.24 and 0.98 with tensor parallelism)
        assert temp - chunked > 0.5 * logits_bytes


def test_attention_chunk_gives_the_same_loss_and_update_without_the_whole_scores():
    """model.attention_chunk (XLA's attention, queries a chunk at a time, each chunk rematerialized)
    on a 2-device replica: the loss and update of whole attention within 1e-6 (float32), and the
    compiled step's temporaries shrink by more than half of one layer's float32 score matrices
    (XLA's attention writes rows x heads x T x T of them per layer)."""
    two = ("model.compute_dtype=float32", "mesh.devices_per_host=2", "model.seq_len=128")
    base = program("llama_tiny", *two)
    cfg = base.cfg
    _, _, loss, want = _grads(base)
    temp = compiled_grads(base).memory_analysis().temp_size_in_bytes
    scores = cfg.data.batch_size // 2 * cfg.model.n_heads * cfg.model.seq_len**2 * 4
    prog = program("llama_tiny", *two, "model.attention_chunk=32")
    _, _, got_loss, got = _grads(prog)
    assert got_loss == pytest.approx(loss, rel=1e-6)
    assert relative(got, want) <= 1e-6, relative(got, want)
    chunked = compiled_grads(prog).memory_analysis().temp_size_in_bytes
    print(f"temporaries {temp / 1e6:.1f} -> {chunked / 1e6:.1f} MB, one layer's scores {scores / 1e6:.1f} MB")
    assert temp - chunked > 0.5 * scores


def test_scanned_layers_give_the_same_loss_and_update_from_one_compiled_block():
    """model.scan_layers through the whole gradient program, inside gradient accumulation, with
    remat full, on a 2 x 2 tensor-parallel replica (FSDP and tensor sharding both): the same seed's
    state is the unrolled one's stacked, the loss and the update equal the unrolled ones (stacked)
    within 1e-6 (float32), and the traced program rematerializes one block (the scan's body)
    instead of one per layer. The compiled step's temporaries are less than 0.7 of the unrolled
    step's: the scan keeps each layer's input, XLA:CPU keeps an unrolled block's whole activations
    whatever remat says (docs/design/model.md, "Scanned layers"; measured 0.55, 0.53 on 2 devices FSDP)."""
    common = (
        "model.compute_dtype=float32", "mesh.devices_per_host=4", "mesh.tensor=2", "model.n_layers=4",
        "model.seq_len=128", "data.micro_batches=2", "model.remat=full",
    )  # fmt: skip
    base = program("llama_tiny", *common)
    prog = program("llama_tiny", *common, "model.scan_layers=true")
    assert _remat_policies(base) == [REMAT_POLICIES["full"]] * 4 and _remat_policies(prog) == [REMAT_POLICIES["full"]]
    state, _, loss, want = _grads(base)
    got_state, _, got_loss, got = _grads(prog)
    jax.tree.map(np.testing.assert_array_equal, stacked_layers(state["params"]), got_state["params"])
    assert got_loss == pytest.approx(loss, rel=1e-6)
    assert relative(got["params"], stacked_layers(want["params"])) <= 1e-6
    temps = [compiled_grads(p).memory_analysis().temp_size_in_bytes for p in (base, prog)]
    print(f"temporaries, remat full: unrolled {temps[0] / 1e6:.1f} MB, scanned {temps[1] / 1e6:.1f} MB")
    assert temps[1] < 0.7 * temps[0]


@pytest.mark.timeout(360)
def test_train_llama_tiny_learns(tmp_path):
    """`ftjax train llama_tiny steps=20`: the loss falls."""
    run = tmp_path / "run"
    r = subprocess.run(
        [*FTJAX, "train", "llama_tiny", "--out", str(run), "steps=20"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    losses = [m["loss"] for m in read_metrics(run / "metrics.jsonl")]
    assert len(losses) == 20 and losses[-1] <= 0.8 * losses[0], losses


@pytest.mark.timeout(960)
@pytest.mark.slow
def test_launch_llama_tiny_with_kills_in_ftar_and_in_catchup_ends_equal_exactly_once(procs, tmp_path):
    """`ftjax launch llama_tiny --replicas 3 --kill 1@20:ftar --kill 2@40:catchup steps=60`, with the
    update in bfloat16 on the device and on FTAR's wire (ft.grad_dtype, ft.wire_dtype: healing
    replicas relay bfloat16 zeros and replay bfloat16 updates): equal digests, every batch once, and
    the loss falls."""
    args = ["llama_tiny", "--replicas", "3", "--kill", "1@20:ftar", "--kill", "2@40:catchup", "steps=60"]
    bf16 = ["ft.grad_dtype=bfloat16", "ft.wire_dtype=bfloat16"]
    run = Launch(procs, [*args, *bf16, "--restart-delay-s", "0.5", "ft.drain_timeout_s=120"], tmp_path / "run")
    try:
        code = run.wait(900)
        s = run.summary()
        downs = [(e["replica"], e.get("at")) for e in s["failure_events"]]
        assert (1, "20:ftar") in downs and (2, "40:forward") in downs, downs
        kills = [e["replica"] for e in run.events() if e["event"] == "fault" and e.get("kind") == "kill_catchup"]
        assert kills == [2], run.output()
        assert s["committed_steps"] == 60
        assert code == 0 and s["digests_equal"] and s["exactly_once"], run.output()
        assert s["replicas"]["1"]["catchups"] >= 1 and s["replicas"]["2"]["catchups"] >= 1, s["replicas"]
        losses = [m["loss"] for m in run.metrics(0) if m.get("committed") and "event" not in m]
        assert losses[-1] < 0.8 * losses[0], losses
        assert run.leftovers() == []
    finally:
        run.close()


@pytest.mark.slow
@pytest.mark.timeout(660)  # its own bound below: 64 s quiet, 221-235 s in a hogged suite on a 2-core machine
def test_bf16_compute_ends_within_2_percent_of_float32_over_300_steps(tmp_path):
    """Issue 28: llama_tiny trained 300 steps with bfloat16 compute and with float32 compute (the
    ~150M config would take hours on this CPU): final losses (mean of the last 10 steps) within 2%;
    scripts/precision_curve.py draws docs/bf16_vs_fp32.png the same way."""
    plot = tmp_path / "curves.png"
    done = subprocess.run(
        [sys.executable, f"{REPO}/scripts/precision_curve.py", "llama_tiny", "--steps", "300", "--plot", str(plot)],
        capture_output=True, text=True, timeout=560,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["final_loss"]["float32"] < 3.0  # it trained (from about 5.5)
    assert out["relative_difference"] < 0.02, out
    assert plot.stat().st_size > 10_000


@pytest.mark.timeout(660)
def test_the_mfu_profile_script_times_each_part_and_says_why_a_variant_cannot_run():
    """scripts/mfu_profile.py (the README's "where that step's time goes" on a GPU) at a tiny size on
    this CPU: one line per part as it goes, then the summary; cuDNN's attention cannot run here and
    its line says so, the other variants are timed."""
    done = subprocess.run(
        [sys.executable, f"{REPO}/scripts/mfu_profile.py", "llama_tiny", "--seq", "32", "--batch", "2",
         "--micro-batches", "2", "--variants", "xla:none,cudnn:none,xla:full,xla/16:none:8", "--reps", "2",
         "--step-s", "1.0"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [json.loads(line) for line in done.stdout.strip().splitlines()]
    by = {(r["what"], r.get("variant")): r for r in lines}
    assert by[("setup", None)]["params"] == 115008 and by[("setup", None)]["peak"] is None  # (no peak on CPU)
    assert by[("forward_backward", "xla:none")]["s"] > 0 and by[("forward_backward", "xla:full")]["s"] > 0
    assert "cuDNN" in by[("forward_backward", "cudnn:none")]["error"]
    assert all(by[("forward_backward", v)]["temp_bytes"] > 0 for v in ("xla:none", "xla:full", "xla/16:none:8"))
    summary = by[("summary", "xla:none")]
    fb, update = by[("forward_backward", "xla:none")]["s"], by[("update", None)]["s"]
    assert summary["step_model_s"] == pytest.approx(2 * fb + update, abs=3e-5)  # (each printed to 5 decimals)
    assert (
        set(summary["time_vs_first"]) == {"xla:none", "xla:full", "xla/16:none:8"} and summary["loop_overhead_s"] < 1.0
    )
    scanned = subprocess.run(
        [sys.executable, f"{REPO}/scripts/mfu_profile.py", "llama_tiny", "--seq", "32", "--batch", "2",
         "--variants", "xla:full", "--scan-layers", "--compile-only"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert scanned.returncode == 0, scanned.stderr[-3000:]
    lines = [json.loads(line) for line in scanned.stdout.strip().splitlines()]
    assert lines[0]["scan"] is True and lines[0]["params"] == 115008 and lines[1]["temp_bytes"] > 0


def test_cudnn_attention_where_it_cannot_run_is_refused_in_one_line_naming_the_field(tmp_path):
    done = subprocess.run(
        [*FTJAX, "train", "llama_tiny", "--out", str(tmp_path / "run"), "steps=1", "model.attention=cudnn"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip() == (
        "ftjax train: error: model.attention: cudnn needs a GPU (JAX's backend is cpu) and bfloat16 compute "
        "(it is float32); use xla or auto"
    )
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
