"""Every `ftjax bench` subcommand runs here at a tiny size, so none can silently break.

Each prints one JSON line comparing two things measured in the same run; these tests check that it
runs to the end and that its comparison is a finite, positive ratio, never the figure itself (timings
are benchmark results, not assertions). `bench coordinator` is run by test_coordinator_procs.py and
`bench ftar --virtual-cluster` by test_vcluster.py; the others are here."""

import json
import math
import subprocess

import pytest
from conftest import FTJAX, REPO

TINY = f"{REPO}/configs/tiny.yaml"


def _bench(*args: str, timeout: float = 280) -> dict:
    try:
        done = subprocess.run([*FTJAX, "bench", *args], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:  # say which of its runs it had finished (the benchmarks' stderr lines)
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        pytest.fail(f"ftjax bench {args[0]} past {timeout:.0f} s; its stderr:\n{err[-3000:]}")
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1, done.stdout
    return json.loads(lines[0])


def _ratio(value) -> None:
    assert isinstance(value, float) and math.isfinite(value) and value > 0, value


def test_every_benchmark_has_a_test_here_or_is_named_where_it_runs():
    from ftjax.cli.bench import BENCHES

    tested = {"step", "catchup", "outage", "reduced", "ftar", "coordinator", "data", "diloco", "overlap"}
    assert set(BENCHES) == tested, f"add a tiny run of {set(BENCHES) - tested} to tests/integration/test_bench.py"


@pytest.mark.slow
@pytest.mark.timeout(660)  # four runs, nine process starts one after another, the pinned ones on one core each here
def test_bench_step_compares_ft_with_sync_hsdp_and_standalone():
    # it crashed before it trained anything (`ftjax_bench.sync_baseline` built a namespace that
    # `parse_config` could not read): no figure of the README's step table could be reproduced
    # (64 s alone on a quiet 2-core machine, 101-106 s in a hogged suite, past 280 s once: its own bound)
    args = ("--steps", "4", "--warmup", "1", "hardware.peak_flops_per_device=1e11", "--pin-cores")
    out = _bench("step", TINY, *args, timeout=560)
    assert out["bench"] == "step" and out["steps"] == 4
    # each replica on its own half of the cores, as read from the running processes
    halves = out["pinned_cores"]
    assert len(halves) == 2 and halves[0] and not set(halves[0]) & set(halves[1]), halves
    assert out["replica_cores"] == halves
    assert 0 < out["ft_mfu"] < 1  # (a peak given: CPU has none of its own)
    _ratio(out["ratio"]), _ratio(out["ft_vs_standalone"])
    _ratio(out["digest_share"]), _ratio(out["sha256_share"])  # the per-step checksum's cost, the sha256's
    _ratio(out["serial_vs_standalone"])  # issue 30: the serial path in the same run, and both breakdowns
    for phases in (out["phases"], out["serial_phases"]):
        assert set(phases) == {
            *("d2h_s", "ring_s", "h2d_s", "reduce_wall_s", "overlap_share", "grad_bytes", "d2h_gbps", "h2d_gbps")
        }, phases
        assert phases["ring_s"] > 0 and 0 <= phases["overlap_share"] < 1
        _ratio(phases["d2h_gbps"]), _ratio(phases["h2d_gbps"])
    # the update's bytes on a replica's host: every float32 parameter of the tiny model, once
    assert out["phases"]["grad_bytes"] == out["serial_phases"]["grad_bytes"] > 0


@pytest.mark.slow
def test_bench_catchup_compares_the_transfer_with_the_raw_link():
    # issue 32: the configured streams against one raw connection and against as many, and one stream
    out = _bench("catchup", TINY, "ft.catchup_streams=2", "--rounds", "1")
    assert out["bench"] == "catchup" and out["snapshot_mb"] > 0 and out["streams"] == 2
    _ratio(out["ratio"]), _ratio(out["ratio_tcp"]), _ratio(out["ratio_in_place"]), _ratio(out["single_stream"]["ratio"])
    _ratio(out["ratio_resident"])  # (the link memory to memory: a resident source buffer into a resident one)
    _ratio(out["ratio_resident_tcp"]), _ratio(out["unmapped"]["ratio"])  # (and over 2; the fetch into fresh memory)
    assert out["arena_s"] > 0  # (the receive arena's mapping, off the transfer's clock)
    assert out["link_tcp_mb_s"] > 0 and out["single_stream"]["catchup_mb_s"] > 0
    # the orbax yardstick: the same snapshot through orbax, back bitwise
    assert out["orbax"]["bitwise_equal"] and out["orbax"]["save_s"] > 0 and out["orbax"]["vs_copy_and_place"] > 0


def test_bench_ftar_on_loopback_compares_busbw_with_raw_tcp():
    # two streams per link and both wire dtypes: 4 settings, each its own endpoint in every member
    args = ("--world", "2", "--mib", "1", "--iters", "2", "--rounds", "1", "--streams", "1,2")
    out = _bench("ftar", *args, "--wire-dtypes", "float32,bfloat16", timeout=120)
    assert out["bench"] == "ftar" and out["world"] == 2
    _ratio(out["ratio"]), _ratio(out["ratio_tcp"])
    settings = {(r["streams"], r["wire_dtype"]): r for r in out["settings"]}
    assert set(settings) == {(1, "float32"), (2, "float32"), (1, "bfloat16"), (2, "bfloat16")}
    for (_, wire_dtype), r in settings.items():
        _ratio(r["ratio"])
        assert r["busbw_gbps"] > 0 and r["link_gbps"] > 0
        assert ("vs_float32_wire" in r) == (wire_dtype == "bfloat16")
    assert out["best"] in out["settings"]


@pytest.mark.slow
@pytest.mark.timeout(480)  # two launches with a kill each: 138 s in a hogged suite on a 2-core machine
def test_bench_outage_compares_both_batch_modes_in_one_run():
    out = _bench("outage", "tiny", "data.batch_size=16", "steps=30", "--kill-at", "10")
    for mode in ("elastic", "constant"):
        assert out[mode]["outage_steps"] >= 3
        _ratio(out[mode]["ratio"])
    _ratio(out["outage_constant_vs_elastic"]["step"])


@pytest.mark.slow
def test_bench_reduced_compares_a_reduced_replica_with_the_full_one():
    out = _bench("reduced", "tiny", "--steps", "10", "--warmup", "3")
    assert out["bench"] == "reduced" and out["live_hosts"] == 1
    _ratio(out["throughput"]), _ratio(out["mode_efficiency"])


@pytest.mark.slow
def test_bench_data_compares_prepare_and_the_loader_with_the_training_step():
    out = _bench(
        "data",
        "tiny",
        "--mib",
        "0.25",
        "--vocab",
        "512",
        "--workers",
        "2",
        "--batches",
        "20",
        "--steps",
        "5",
        "--warmup",
        "1",
        timeout=180,
    )
    assert out["bench"] == "data" and out["tokens"] > 0 and out["vocab_size"] <= 512
    _ratio(out["loader_vs_step"]), _ratio(out["prepare_vs_step"])


@pytest.mark.slow
def test_bench_diloco_compares_tokens_per_s_and_bytes_with_every_step_sync():
    out = _bench("diloco", "llama_tiny", "--steps", "8", "--inner", "4", "--warmup", "1")
    assert out["bench"] == "diloco" and out["replicas"] == 2 and out["inner_steps"] == 4
    # each replica averages one update's bytes per round of 4 batches instead of per batch
    assert out["bytes_ratio"] == 4.0, out
    assert out["every_step"]["steps_timed"] == 7 and out["diloco"]["steps_timed"] == 1
    _ratio(out["speedup"])


@pytest.mark.slow
def test_bench_overlap_compares_streaming_with_and_without_its_overlap_and_int8_with_bf16():
    out = _bench("overlap", "llama_tiny", "--rounds", "4", "--inner", "4", "--fragments", "2", "--warmup", "1")
    assert out["bench"] == "overlap" and out["round_inner_steps"] == 2 and out["tau"] == 1
    assert [out[k]["steps_timed"] for k in ("tau0", "tau1", "tau1_int8")] == [3, 3, 3], out
    # int8 frames: >= 1.8x fewer bytes a round than bfloat16's (the records' sync_bytes)
    assert out["tau1"]["peak_bytes_per_round"] >= 1.8 * out["tau1_int8"]["peak_bytes_per_round"], out
    _ratio(out["overlap_speedup"]), _ratio(out["int8_speedup"]), _ratio(out["why"]["expected_speedup"])
    assert out["why"]["overlap_s"] > 0 and 0 <= out["why"]["hidden_share"] <= 1, out
