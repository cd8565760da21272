"""ftjax.sim: every knob of issue 19 against a closed-form case, as tables.

Exact cases use a failure trace (ftjax.sim.failures.read_trace) so that the expected time is
arithmetic; statistical ones use small jobs with an MTBF of a minute (thousands of failures in well
under a second) and agree within 2-3%.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from ftjax.sim import checkpoints, reduced
from ftjax.sim import closed_form as cf
from ftjax.sim.config import INIT_EXPONENT, SimConfig
from ftjax.sim.failures import Failure, TraceError, events, read_trace, write_trace
from ftjax.sim.model import run
from ftjax.sim.presets import PAPER_100K, SPARE_600K
from ftjax.sim.run import simulate
from ftjax.sim.strategies import STRATEGIES

REL = 0.02
LINEAR = ((0.0, 0.0), (1.0, 1.0))
INF = math.inf


def config(**overrides) -> SimConfig:
    return SimConfig.model_validate({**PAPER_100K, "mtbf_min": 1.0, "step_s": 60.0, "seeds": 2, **overrides})


def exact(tmp_path, rows: list[tuple], strategy: str, **overrides):
    """One run of a 100-minute job (100 steps of a minute) through the failures ``rows``
    ((time_min, first_gpu[, gpus[, hardware]]) ...)."""
    trace = tmp_path / "trace.csv"
    cfg = config(steps=100, failure_trace=str(trace), seeds=1, **overrides)
    write_trace(
        trace,
        [
            Failure(r[0], r[1], r[2] if len(r) > 2 else cfg.blast_gpus, bool(r[3]) if len(r) > 3 else False)
            for r in rows
        ],
    )
    return run(STRATEGIES[strategy](cfg), events(cfg, 0), cfg.work_min, cfg.max_slowdown)


# --- traces: exact time to train --------------------------------------------------------------------
SYNC = dict(sync_stall_min=10.0, checkpoint_interval_min=30.0, checkpoint_cost_min=0.0)
FT = dict(gpus=32, replicas=4, ft_stall_min=2.0, replica_restart_min=8.0)


@pytest.mark.parametrize(
    "rows,strategy,knobs,wall",
    [
        ([], "sync", SYNC, 100),  # no failure
        ([], "replication", dict(redundancy=2), 200),  # every shard twice
        ([], "spare", dict(redundancy=2), 100),  # early all-reduce: no copy with no group out
        ([(50, 0)], "sync", SYNC, 130),  # 20 min since the checkpoint at 30, 10 restart
        ([(50, 0)], "sync", dict(SYNC, checkpoint_interval_min=0.0), 110),  # lost work inside the 10
        ([(50, 0), (51, 0)], "sync", dict(SYNC, restart_policy="queue"), 140),  # a second restart after
        ([(50, 0), (51, 0)], "sync", dict(SYNC, restart_policy="absorb"), 130),  # the restart absorbs it
        ([(50, 0), (51, 0)], "sync", dict(SYNC, restart_policy="restart"), 131),  # starts over at 51
        ([(50, 0, 8, 1)], "sync", dict(SYNC, hardware_share=1.0, spare_hosts=0.0, repair_min=30.0), 160),  # repair
        ([(50, 0, 8, 1)], "sync", dict(SYNC, hardware_share=1.0, spare_hosts=1.0, repair_min=30.0), 130),  # spare
        ([(50, 0)], "ft-hsdp", FT, 104),  # 2 stall + 8 min at 3/4
        ([(50, 0)], "ft-hsdp", dict(FT, train_for="steps"), 102),  # steps do not wait for the missing replica
        ([(50, 0)], "ft-hsdp", dict(FT, init_min=3.0, init_exponent=1.0), 104.1875),  # + 3 x 1/4 min of init
        ([(50, 0)], "ft-hsdp", dict(FT, rejoin_stall_min=1.0), 105),
        ([(50, 0), (55, 0)], "ft-hsdp", FT, 105.25),  # out again: 15 min out, one stall
        ([(50, 0, 16)], "ft-hsdp", FT, 106),  # a 2-replica blast: 2 x 8 min at 1/4
    ],
)
def test_traces_give_exact_times_to_train(tmp_path, rows, strategy, knobs, wall):
    out = exact(tmp_path, rows, strategy, **knobs)
    assert out.finished
    assert out.wall_min == pytest.approx(wall)
    assert out.minutes["productive"] == pytest.approx(100 if knobs.get("train_for") != "steps" else 98)


@pytest.mark.parametrize(
    "policy,rows,wall,counts",
    [
        # 12 groups, r = 2, a group out 20 min after its failure: groups 0 and 1 out together is fatal
        # (restart 2 -> 12, every group back); by then 1.5 min of work is done (1/2 while group 0 was out).
        ("absorb", [(1, 0), (2, 8), (5, 40)], 110.5, {"absorbed by a restart": 1, "masked": 1, "fatal": 1}),
        ("queue", [(1, 0), (2, 8), (5, 40)], 120.5, {"queued behind a restart": 1, "masked": 2}),  # group 5 out 12-32
        ("restart", [(1, 0), (2, 8), (5, 40)], 117, {"during a restart": 1, "masked": 2}),  # group 5 out 5-25
        (
            "restart",
            [(1, 0), (2, 8), (5, 40), (6, 48)],
            114.5,  # 5 and 6: over again
            {"during a restart": 2, "restarts started over": 1, "fatal": 2},
        ),
        ("queue", [(1, 0), (2, 8), (5, 40), (6, 48)], 120.5, {"queued behind a restart": 2, "fatal": 2}),  # 12-22
    ],
)
def test_failures_during_a_shard_restart_follow_the_policy(tmp_path, policy, rows, wall, counts):
    out = exact(
        tmp_path,
        rows,
        "spare",
        gpus=96,
        replicas=12,
        redundancy=2,
        ft_stall_min=0.0,
        replica_restart_min=20.0,
        sync_stall_min=10.0,
        restart_policy=policy,
    )
    assert out.wall_min == pytest.approx(wall)
    for key, n in counts.items():
        assert out.counts.get(key, 0) == n, out.counts


@pytest.mark.parametrize(
    "failed,spare,replication",
    [
        ([], 1.0, 1 / 3),
        ([0], 1 / 2, 1 / 3),  # ceil(12 / 11) = 2
        ([0, 2, 4, 6, 8, 10], 1 / 2, 1 / 3),  # ceil(12 / 6) = 2
        ([0, 1, 3, 4, 6, 7, 9], 1 / 3, 1 / 3),  # ceil(12 / 5) = 3
    ],
)
def test_spare_trains_at_one_over_ceil_n_over_live(tmp_path, failed, spare, replication):
    knobs = dict(gpus=96, replicas=12, redundancy=3, ft_stall_min=0.0, replica_restart_min=INF)
    rows = [(0.0, 8 * g) for g in failed]
    for strategy, expected in (("spare", spare), ("replication", replication)):
        out = exact(tmp_path, rows, strategy, **knobs)
        assert out.ettr == pytest.approx(expected), strategy
        assert out.counts.get("fatal", 0) == 0
    assert cf.spare_useful(12, len(failed)) == pytest.approx(spare)


@pytest.mark.parametrize(
    "text,error",
    [
        ("time\n1\n", "time_min"),
        ("time_min,where\n1,2\n", "where"),
        ("time_min\n1\nabc\n", ":3: time_min: not a number"),
        ("time_min\n5\n4\n", ":3: time_min: 4 is before"),
        ("time_min,gpus\n1,100000\n", ":2: gpus"),
        ("time_min,hardware\n1,2\n", ":2: hardware"),
        ("", "no header row"),
    ],
)
def test_bad_traces_are_refused_naming_line_and_column(tmp_path, text, error):
    path = tmp_path / "t.csv"
    path.write_text(text)
    with pytest.raises(TraceError, match=error):
        read_trace(path, config(gpus=96))
    with pytest.raises(TraceError, match="--failure-trace"):
        read_trace(tmp_path / "missing.csv", config(gpus=96))


# --- restart policies, repairs and spares against renewal-reward --------------------------------------
@pytest.mark.parametrize(
    "policy,hardware,spares,repair,expected",
    [
        ("absorb", 0.0, INF, 0.0, cf.sync_ettr(1.0, 0.3, "absorb")),
        ("absorb", 1.0, 0.0, 0.5, cf.sync_ettr(1.0, 0.3, "absorb", repair=0.5)),  # every restart waits
        ("absorb", 1.0, INF, 0.5, cf.sync_ettr(1.0, 0.3, "absorb")),  # always a spare
        ("queue", 1.0, INF, 0.5, cf.sync_ettr(1.0, 0.3, "queue")),
        ("restart", 0.0, INF, 0.0, cf.sync_ettr(1.0, 0.3, "restart")),
    ],
)
def test_sync_restart_policy_repair_and_spares(policy, hardware, spares, repair, expected):
    cfg = config(
        gpus=96,
        sync_stall_min=0.3,
        restart_policy=policy,
        hardware_share=hardware,
        spare_hosts=spares,
        repair_min=repair,
        steps=8_000,
    )
    assert simulate(cfg, ["sync"])["sync"].ettr == pytest.approx(expected, rel=REL)


def test_a_small_spare_pool_sits_between_none_and_always():
    base = dict(gpus=96, sync_stall_min=0.3, restart_policy="absorb", hardware_share=1.0, repair_min=5.0, steps=3_000)
    ettrs = [simulate(config(spare_hosts=s, **base), ["sync"])["sync"].ettr for s in (0.0, 2.0, INF)]
    assert ettrs[0] < ettrs[1] < ettrs[2]
    # ft-hsdp: without a spare the replica is out for the repair instead of the restart
    ft = dict(
        gpus=32,
        replicas=4,
        ft_stall_min=0.2,
        replica_restart_min=1.5,
        overlap="restart",
        hardware_share=1.0,
        repair_min=3.0,
        spare_hosts=0.0,
        steps=6_000,
    )
    assert simulate(config(**ft), ["ft-hsdp"])["ft-hsdp"].ettr == pytest.approx(
        cf.units_out_ettr_restart(1.0, 0.2, 3.0 - 0.2 + 1.5, 4), rel=REL
    )


@pytest.mark.parametrize("policy", ["absorb", "queue", "restart"])
def test_spare_600k_finishes_for_every_seed_under_every_restart_policy(policy):
    res = simulate(SimConfig.model_validate({**SPARE_600K, "restart_policy": policy}))
    for name in ("replication", "spare"):
        assert res[name].finished == res[name].seeds, (name, res[name].note)
    # the early all-reduce trains at 1/2 once a group is out, replication at 1/r always
    assert res["spare"].ttt_ratio < 0.75 * res["replication"].ttt_ratio
    # sync: a 60-minute restart against a 5-minute MTBF finishes only when restarts absorb failures
    assert (res["sync"].finished == res["sync"].seeds) == (policy == "absorb")
    if policy != "absorb":
        assert "never end" in res["sync"].note or "e^12" in res["sync"].note


# --- restart time at scale -----------------------------------------------------------------------------
@pytest.mark.parametrize("gpus,init_s", [(16_384, 17.0), (98_304, 200.0), (32_768, 17.0 * 2**INIT_EXPONENT)])
def test_init_time_grows_with_the_gpu_count(gpus, init_s):
    cfg = config(gpus=16_384, replicas=8, init_min=17 / 60, sync_stall_min=1.0)
    at = cfg.at_gpus(gpus)
    assert at.init_min * 60 == pytest.approx(init_s, rel=0.01)
    assert at.job_restart_min() == pytest.approx(1.0 + init_s / 60, rel=0.01)
    # a replica restarts with init at its own size
    assert at.unit_restart_min(at.gpus_per_replica) == pytest.approx(
        at.replica_restart_min + at.init_min * (1 / at.replicas) ** INIT_EXPONENT
    )


def test_sync_restart_includes_init():
    cfg = config(gpus=96, sync_stall_min=0.2, init_min=0.1, restart_policy="restart", steps=8_000)
    assert simulate(cfg, ["sync"])["sync"].ettr == pytest.approx(math.exp(-0.3), rel=REL)


# --- checkpoint interval -------------------------------------------------------------------------------
@pytest.mark.parametrize("cost,mtbf", [(0.1, 100.0), (1.0, 60.0), (5.0, 60.0), (1.0, 5.0), (0.5, 2.0)])
def test_checkpoint_rules_against_a_brute_force_scan(cost, mtbf):
    taus = np.geomspace(checkpoints.young(cost, mtbf) / 30, checkpoints.young(cost, mtbf) * 30, 100_001)
    factors = [checkpoints.checkpoint_factor(1 / mtbf, t, cost) for t in taus]
    best_tau, best = taus[int(np.argmax(factors))], max(factors)
    assert checkpoints.optimal(cost, mtbf) == pytest.approx(best_tau, rel=1e-3)
    assert checkpoints.daly(cost, mtbf) == pytest.approx(best_tau, rel=0.01)
    for rule in (checkpoints.young, checkpoints.daly):  # both within 2% of the best durable fraction
        assert checkpoints.checkpoint_factor(1 / mtbf, rule(cost, mtbf), cost) >= 0.98 * best


@pytest.mark.parametrize("rule", ["young", "daly", "optimal"])
def test_the_chosen_interval_is_used_and_simulates_to_its_closed_form(rule):
    cfg = config(
        gpus=96,
        sync_stall_min=0.3,
        checkpoint_interval_min=rule,
        checkpoint_cost_min=0.05,
        restart_policy="absorb",
        steps=3_000,
    )
    res = simulate(cfg, ["sync"])["sync"]
    tau = getattr(checkpoints, rule)(0.05, 1.0)
    assert res.checkpoint_interval_min == pytest.approx(tau)
    assert res.ettr == pytest.approx(cf.sync_ettr(1.0, 0.3, "absorb", tau, 0.05), rel=REL)
    # ft-hsdp never rolls back: a chosen interval means no checkpoint at all
    assert simulate(cfg, ["ft-hsdp"])["ft-hsdp"].checkpoint_interval_min is None


# --- failure processes and blast radius -----------------------------------------------------------------
def _dispersion(cfg: SimConfig, window: float, windows: int = 4_000) -> tuple[float, float]:
    """(failures per minute, variance / mean of the count per window) over the first windows."""
    times = [f.t for f in itertools.takewhile(lambda f: f.t < window * windows, events(cfg, 0))]
    counts = np.bincount((np.array(times) // window).astype(int), minlength=windows)
    return len(times) / (window * windows), counts.var() / counts.mean()


@pytest.mark.parametrize(
    "level,shape,gpus,bursty",
    [
        ("job", 1.0, 96, False),
        ("job", 0.5, 96, True),  # job-level Weibull k < 1: failures come in bursts
        ("domain", 0.5, 96, True),  # 12 hosts of short lives: bursts per host show
        ("domain", 0.5, 98_304, False),  # 12,288 hosts: the superposition is Poisson, the shape has no effect
    ],
)
def test_job_level_weibull_keeps_the_mtbf_and_shows_its_shape(level, shape, gpus, bursty):
    cfg = config(gpus=gpus, failure_level=level, failure_dist="weibull", weibull_shape=shape)
    rate, dispersion = _dispersion(cfg, window=5.0)
    assert rate == pytest.approx(1.0, rel=0.03)
    assert (dispersion > 1.3) == bursty, dispersion


@pytest.mark.parametrize(
    "strategy,blast,units",
    [
        ("ft-hsdp", "gpu", 4),
        ("ft-hsdp", "host", 4),
        ("ft-hsdp", "rack", 4),  # racks inside replicas
        ("reduced-degree", "gpu", 64),
        ("reduced-degree", "host", 16),
        ("reduced-degree", "rack", 8),
    ],
)
def test_blast_radius_sets_the_units_that_fail(strategy, blast, units):
    cfg = config(
        gpus=64,
        gpus_per_host=4,
        replicas=4,
        hosts_per_rack=2,
        blast_radius=blast,
        ft_stall_min=0.2,
        replica_restart_min=1.5,
        overlap="restart",
        reduced_recovery="ft-stall",
        reduced_curve=LINEAR,
        min_degree=0.0,
        packing=False,
        steps=8_000,
    )
    expected = cf.units_out_ettr_restart(1.0, 0.2, 1.5, units)
    assert cf.analytic_ettr(cfg, strategy) == pytest.approx(expected)
    assert simulate(cfg, [strategy])[strategy].ettr == pytest.approx(expected, rel=REL)


def test_a_rack_across_replicas_takes_them_all_out():
    # 16 replicas of one host, racks of 2 hosts: each failure takes out 2 replicas (8 rack units).
    cfg = config(
        gpus=64,
        gpus_per_host=4,
        replicas=16,
        hosts_per_rack=2,
        blast_radius="rack",
        ft_stall_min=0.2,
        replica_restart_min=1.5,
        overlap="restart",
        steps=8_000,
    )
    assert simulate(cfg, ["ft-hsdp"])["ft-hsdp"].ettr == pytest.approx(
        cf.units_out_ettr_restart(1.0, 0.2, 1.5, 8), rel=REL
    )


# --- reduced degree ----------------------------------------------------------------------------------------
CURVE = ((0.0, 0.0), (0.5, 0.4), (0.75, 0.65), (0.875, 0.8), (1.0, 1.0))


@pytest.mark.parametrize(
    "missing,curve,boost,min_degree,packing,expected",
    [
        ({}, CURVE, 0.0, 0.5, False, (1.0, 0.0, 0.0)),
        ({0: 1}, CURVE, 0.0, 0.5, False, ((3 + 0.8) / 4, 0.125 / 4, 0.075 / 4)),  # 7/8 alive runs at 0.8
        ({0: 1}, LINEAR, 0.0, 0.5, False, ((3 + 0.875) / 4, 0.125 / 4, 0.0)),  # its share, exactly
        ({0: 1, 1: 1}, CURVE, 0.0, 0.5, False, ((2 + 2 * 0.8) / 4, 0.25 / 4, 0.15 / 4)),
        ({0: 1, 1: 1}, CURVE, 0.0, 0.5, True, ((3 + 0.65) / 4, 0.25 / 4, 0.1 / 4)),  # packed: one replica at 6/8
        ({0: 1}, CURVE, 0.3, 0.5, False, (1.0, 0.0, 0.0)),  # boosted: it keeps up
        ({0: 1}, CURVE, 0.05, 0.5, False, ((3 + 0.84) / 4, 0.125 / 4, 0.035 / 4)),
        ({0: 5}, CURVE, 0.0, 0.5, False, (3 / 4, 1 / 4, 0.0)),  # 3/8 alive: below min degree
        ({0: 1, 1: 1}, CURVE, 0.0, 1.0, False, (2 / 4, 2 / 4, 0.0)),  # any failure stops a replica
        ({0: 1, 1: 1}, CURVE, 0.0, 1.0, True, (3 / 4, 1 / 4, 0.0)),  # packed into one stopped replica
    ],
)
def test_reduced_degree_throughput(missing, curve, boost, min_degree, packing, expected):
    got = reduced.job_rates(missing, 8, 4, curve, boost, min_degree, packing)
    assert got == pytest.approx(expected)
    assert sum(got) == pytest.approx(1.0)


@pytest.mark.parametrize(
    "missing,min_degree,packed",
    [([1, 1, 1], 0.5, [3]), ([3, 3], 0.5, [4, 2]), ([2, 2], 1.0, [4]), ([8, 8, 8, 8, 8], 0.5, [4, 4, 4, 8])],
)
def test_packing(missing, min_degree, packed):
    assert reduced.pack(missing, 8, 4, min_degree) == packed


@pytest.mark.parametrize(
    "recovery,hardware,relation",
    [
        ("job-restart", 0.0, "sync"),  # a restart fixes a software failure: exactly sync
        ("job-restart", 1.0, "better"),  # no spare, days of repair: NTP runs on, sync waits
    ],
)
def test_ntp_restarts_the_job_and_runs_degraded_only_on_hardware(recovery, hardware, relation):
    cfg = config(
        gpus=96,
        replicas=4,
        sync_stall_min=0.3,
        reduced_recovery=recovery,
        hardware_share=hardware,
        spare_hosts=0.0,
        repair_min=30.0,
        restart_policy="absorb",
        steps=2_000,
    )
    res = simulate(cfg, ["sync", "reduced-degree"])
    if relation == "sync":
        assert res["reduced-degree"].ettr == pytest.approx(res["sync"].ettr)
    else:
        assert res["reduced-degree"].ettr > 2 * res["sync"].ettr
        assert res["reduced-degree"].breakdown["degraded"] > 0


# --- stragglers, pauses, step scaling ---------------------------------------------------------------------
@pytest.mark.parametrize(
    "strategy,detect,expected",
    [
        ("sync", 1.0, cf.lockstep_straggler_ettr(1.0, 0.5, 2.0)),
        ("ft-hsdp", INF, cf.lockstep_straggler_ettr(1.0, 0.5, 2.0)),  # never left out: like sync
        ("ft-hsdp", 0.0, cf.left_out_straggler_ettr(1.0, 0.5, 4)),  # left out at once: (R - slow) / R
    ],
)
def test_a_slow_replica_under_sync_and_ft_hsdp(strategy, detect, expected):
    cfg = config(
        gpus=32,
        replicas=4,
        mtbf_min=1e9,
        straggler_mtbs_min=1.0,
        straggler_min=0.5,
        straggler_slowdown=2.0,
        straggler_detect_min=detect,
        steps=8_000,
    )
    res = simulate(cfg, [strategy])[strategy]
    assert res.ettr == pytest.approx(expected, rel=REL)
    assert res.breakdown["straggler"] == pytest.approx(1 - expected, rel=0.05)


def test_ft_hsdp_leaves_a_slow_replica_out_after_detection():
    cfg = config(
        gpus=32,
        replicas=4,
        mtbf_min=1e9,
        straggler_mtbs_min=10.0,
        straggler_min=5.0,
        straggler_slowdown=3.0,
        straggler_detect_min=0.5,
        steps=4_000,
    )
    res = simulate(cfg, ["sync", "ft-hsdp"])
    # sync: 39% of the time at 1/3; ft-hsdp: one replica of 4 left out after half a minute
    assert res["sync"].ettr == pytest.approx(cf.lockstep_straggler_ettr(10.0, 5.0, 3.0), rel=REL)
    assert res["ft-hsdp"].ettr > res["sync"].ettr + 0.1


def test_pauses_cost_their_fraction():
    cfg = config(gpus=96, mtbf_min=1e9, pause_fraction=0.1, steps=1_000)
    res = simulate(cfg, ["sync", "ft-hsdp"])
    for r in res.values():
        assert r.ettr == pytest.approx(0.9) and r.ttt_ratio == pytest.approx(1 / 0.9)
        assert r.breakdown["pauses"] == pytest.approx(0.1)


def test_step_scaling_speeds_steps_while_replicas_are_out(tmp_path):
    # 2 replicas, one out from 50 to 60: alone, steps take half the time (20 steps in 10 min).
    out = exact(
        tmp_path,
        [(50, 0)],
        "ft-hsdp",
        gpus=16,
        replicas=2,
        ft_stall_min=0.0,
        replica_restart_min=10.0,
        train_for="steps",
        step_scaling=((0.5, 0.5), (1.0, 1.0)),
    )
    assert out.wall_min == pytest.approx(90)
    assert out.ettr == pytest.approx(85 / 90)


# --- the outputs ---------------------------------------------------------------------------------------------
def test_availability_time_to_train_and_effective_mtbf():
    cfg = config(
        gpus=96,
        replicas=4,
        sync_stall_min=0.3,
        ft_stall_min=0.2,
        replica_restart_min=1.5,
        restart_policy="queue",
        overlap="restart",
        steps=8_000,
    )
    res = simulate(cfg, ["sync", "ft-hsdp"])
    sync, ft = res["sync"], res["ft-hsdp"]
    assert sync.availability == pytest.approx(cf.sync_availability(1.0, 0.3, "queue"), rel=REL)
    assert sync.ttt_ratio == pytest.approx(1 / sync.ettr, rel=1e-3)
    assert sync.effective_mtbf_min == pytest.approx(1.0, rel=REL)
    assert sync.counts["interruptions"] == pytest.approx(sync.failures)
    # ft-hsdp: only a failure of a replica that is in stalls the job
    in_prob = math.exp(-(0.2 + 1.5) / 4)
    assert ft.effective_mtbf_min == pytest.approx(1.0 / in_prob, rel=REL)
    assert ft.availability == pytest.approx(1 - cf.units_out_stall_fraction(1.0, 0.2, 1.5, 4, "restart"), rel=REL)
    assert set(ft.to_json()) >= {"ettr", "availability", "ttt_ratio", "effective_mtbf_min", "counts", "breakdown"}


@pytest.mark.parametrize(
    "global_batch, train_for, wall, data",
    [
        # FT: 4 replicas, one out 8 min after a 2-min stall. Counting steps whole, elastic finishes
        # 102 min in but its model lacks a quarter of 8 min of batches; constant trains them all, its
        # steps taking 4/3 as long meanwhile: the same 104 min as counting tokens.
        ("elastic", "steps", 102, 0.98),
        ("constant", "steps", 104, 1.0),
        ("elastic", "tokens", 104, 1.0),
        ("constant", "tokens", 104, 1.0),
    ],
)
def test_a_constant_global_batch_trades_time_for_the_lost_data(tmp_path, global_batch, train_for, wall, data):
    out = exact(tmp_path, [(50, 0)], "ft-hsdp", **FT, train_for=train_for, global_batch=global_batch)
    assert out.wall_min == pytest.approx(wall)
    assert out.data_trained == pytest.approx(data)


# --- inter-replica communication (--link-gbps, --params) and DiLoCo ---------------------------------------
# 4 replicas, 1.25e9 float32 parameters over 4 Gbit/s: a ring all-reduce moves 2 x 3/4 x 5 GB per
# replica, 15 s, against 60 s of compute per step.
LINK = dict(link_gbps=4.0, params=1.25e9, bytes_per_param=4.0)
ALLREDUCE_S = 2 * 3 / 4 * 1.25e9 * 4 * 8 / 4e9


def test_the_ring_allreduce_time():
    cfg = config(**FT, **LINK)
    assert ALLREDUCE_S == 15.0
    assert cfg.allreduce_s() == pytest.approx(ALLREDUCE_S)
    assert cfg.with_values(replicas=1, gpus=8, redundancy=1).allreduce_s() == 0.0  # nobody to average with
    assert config(**FT).allreduce_s() == 0.0  # not modelled
    with pytest.raises(ValueError, match="go together"):
        config(**FT, link_gbps=4.0)
    with pytest.raises(ValueError, match="must divide"):
        config(**FT, inner_steps=20, fragments=3)


@pytest.mark.parametrize(
    "strategy,free,comm_s",
    [
        ("sync", 1.0, ALLREDUCE_S),
        ("ft-hsdp", 1.0, ALLREDUCE_S),
        ("reduced-degree", 1.0, ALLREDUCE_S),
        ("spare", 1.0, ALLREDUCE_S),
        ("replication", 0.5, ALLREDUCE_S),  # every shard twice, whatever the link
        ("diloco", 1.0, ALLREDUCE_S / 20),  # one average per H = 20 steps
        ("streaming-diloco", 1.0, ALLREDUCE_S / 20),  # a quarter of it every 5 steps: the same mean
    ],
)
def test_failure_free_throughput_is_compute_over_compute_plus_communication(tmp_path, strategy, free, comm_s):
    without = exact(tmp_path, [], strategy, **FT, redundancy=2)
    out = exact(tmp_path, [], strategy, **FT, redundancy=2, **LINK)
    factor = 60.0 / (60.0 + comm_s)
    assert without.ettr == pytest.approx(free)
    assert out.ettr == pytest.approx(free * factor)
    assert out.wall_min == pytest.approx(without.wall_min / factor)
    assert out.minutes["communication"] / out.wall_min == pytest.approx(free * (1 - factor))
    assert cf.comm_factor(60.0, comm_s) == pytest.approx(factor)


def test_diloco_communicates_one_hth_of_every_step_and_streaming_a_fth_per_round():
    cfg = config(**FT, **LINK, mtbf_min=1e9, steps=100, seeds=1, inner_steps=20, fragments=4)
    res = simulate(cfg, ["ft-hsdp", "diloco", "streaming-diloco"])
    every, diloco, streaming = (res[n].comm for n in ("ft-hsdp", "diloco", "streaming-diloco"))
    gradient = 1.25e9 * 4
    assert every == pytest.approx(
        dict(bytes_per_sync=gradient, steps_per_sync=1, sync_s=15.0, comm_s_per_step=15.0, comm_share=0.2)
    )
    assert diloco["comm_s_per_step"] == pytest.approx(every["comm_s_per_step"] / 20)
    assert (diloco["bytes_per_sync"], diloco["steps_per_sync"], diloco["sync_s"]) == (gradient, 20, 15.0)
    # streaming: the same mean, a quarter of the bytes (and of the all-reduce) every 5 steps
    assert streaming["comm_s_per_step"] == pytest.approx(diloco["comm_s_per_step"])
    assert streaming["bytes_per_sync"] == gradient / 4 and streaming["steps_per_sync"] == 5
    assert streaming["sync_s"] == pytest.approx(15.0 / 4)
    # ... and the simulated communication time per step is that mean: step_s x (1 / ETTR - 1)
    for name, plan in (("ft-hsdp", every), ("diloco", diloco)):
        assert 60 * (1 / res[name].ettr - 1) == pytest.approx(plan["comm_s_per_step"])
    assert res["ft-hsdp"].to_json()["comm"]["comm_share"] == 0.2
    assert "comm" not in simulate(config(**FT, mtbf_min=1e9, steps=10, seeds=1), ["ft-hsdp"])["ft-hsdp"].to_json()


@pytest.mark.parametrize("tau,step_s", [(0, 60.0), (1, 1.0), (1, 2.0), (2, 2.0), (1, 10.0)])
def test_streaming_hides_a_rounds_allreduce_up_to_tau_steps_of_compute(tmp_path, tau, step_s):
    """--fragment-sync-delay tau: a round's all-reduce (a quarter of ALLREDUCE_S = 3.75 s every 5
    steps) runs while its last tau steps compute, so a step waits max(0, 3.75 - tau x step_s) / 5 s."""
    link = dict(**LINK, inner_steps=20, fragments=4, fragment_sync_delay=tau, step_s=step_s)
    exposed = max(0.0, ALLREDUCE_S / 4 - tau * step_s) / 5
    out = exact(tmp_path, [], "streaming-diloco", **FT, **link)
    plan = simulate(config(**FT, **link, mtbf_min=1e9, steps=100, seeds=1), ["streaming-diloco"])["streaming-diloco"]
    assert plan.comm["comm_s_per_step"] == pytest.approx(exposed)
    assert plan.comm["sync_s"] == pytest.approx(ALLREDUCE_S / 4)  # (the all-reduce itself is as long)
    assert out.ettr == pytest.approx(step_s / (step_s + exposed))
    assert out.minutes.get("communication", 0.0) / out.wall_min == pytest.approx(exposed / (step_s + exposed))
    with pytest.raises(ValueError, match="fragment-sync-delay"):
        config(**FT, **{**link, "fragment_sync_delay": 5})


def test_communication_scales_the_closed_form_under_failures():
    cfg = config(gpus=32, replicas=4, ft_stall_min=0.2, replica_restart_min=1.5, overlap="restart", steps=6_000)
    expected = cf.units_out_ettr_restart(1.0, 0.2, 1.5, 4) * 0.8
    assert cf.analytic_ettr(cfg.with_values(**LINK), "ft-hsdp") == pytest.approx(expected)
    assert ettr_of(cfg.with_values(**LINK), "ft-hsdp") == pytest.approx(expected, rel=REL)
    # A rollback's lost work takes longer to train again: no closed form for sync with checkpoints.
    assert cf.analytic_ettr(cfg.with_values(**LINK, checkpoint_interval_min=0.5), "sync") is None


def ettr_of(cfg: SimConfig, strategy: str) -> float:
    return simulate(cfg, [strategy])[strategy].ettr


@pytest.mark.parametrize(
    "rows,strategy,knobs,wall,lost",
    [
        ([(50, 0)], "ft-hsdp", {}, 104, 0),
        # 50 steps: 10 into the round, replica 0's quarter of them lost and trained again
        ([(50, 0)], "diloco", {}, 106.5, 2.5),
        # fragments averaged 0, 5, 10 and 15 steps ago: 7.5 steps on average
        ([(50, 0)], "streaming-diloco", {}, 105.875, 1.875),
        # back at 60 (step 58), dead again at 61: 1 step of its own since it rejoined, not 19
        ([(50, 0), (61, 0)], "ft-hsdp", {}, 108, 0),
        ([(50, 0), (61, 0)], "diloco", {}, 110.75, 2.75),
        # replica 1 at 55, replica 0 out: step 53 (none during the stall, whole steps with 3 of 4 in)
        ([(50, 0), (55, 8)], "ft-hsdp", {}, 107.5, 0),
        ([(50, 0), (55, 8)], "diloco", {}, 113.25, 5.75),
        # a replica already out loses nothing more (its time out ends 2 min later: 2 x 1/4 min)
        ([(50, 0), (52, 0)], "diloco", {}, 107, 2.5),
        # the all-reduce at a twentieth: 50 min at 60/60.75, the rest stretched likewise
        ([(50, 0)], "ft-hsdp", LINK, 129, 0),
    ],
)
def test_diloco_loses_a_failed_replicas_inner_steps(tmp_path, rows, strategy, knobs, wall, lost):
    out = exact(tmp_path, rows, strategy, **FT, inner_steps=20, fragments=4, **knobs)
    assert out.wall_min == pytest.approx(wall)
    assert out.minutes["lost work"] == pytest.approx(lost)
    assert out.minutes["productive"] == pytest.approx(100)


def test_diloco_counting_steps_whole_loses_the_data_not_the_time(tmp_path):
    ft = exact(tmp_path, [(50, 0)], "ft-hsdp", **FT, train_for="steps")
    out = exact(tmp_path, [(50, 0)], "diloco", **FT, train_for="steps", inner_steps=20)
    assert out.wall_min == ft.wall_min == pytest.approx(102)
    assert out.minutes["lost work"] == pytest.approx(2.5)
    assert out.data_trained == pytest.approx(ft.data_trained - 0.025) == pytest.approx(0.955)
    # a constant global batch does not apply: nobody trains another replica's batches between averages
    assert exact(tmp_path, [(50, 0)], "diloco", **FT, train_for="steps", global_batch="constant").wall_min == 102


# Figures of the code before communication and DiLoCo were modelled (commit c10a55b), which a
# config without --link-gbps must give bit for bit: failures, checkpoints, pauses and slow replicas.
BEFORE = dict(
    gpus=64,
    replicas=4,
    sync_stall_min=0.5,
    ft_stall_min=0.2,
    replica_restart_min=1.0,
    rejoin_stall_min=0.1,
    checkpoint_interval_min=0.5,
    checkpoint_cost_min=0.05,
    pause_fraction=0.05,
    straggler_mtbs_min=5.0,
    straggler_min=1.0,
    steps=300,
)


@pytest.mark.parametrize(
    "knobs,figures",
    [
        (
            BEFORE,
            {
                "sync": (0.28253008738528335, 3.539637159103034, 0.4661651755475942),
                "ft-hsdp": (0.510356276897721, 1.9594414227554884, 0.7296861360418142),
                "reduced-degree": (0.28253008738528335, 3.539637159103034, 0.4661651755475942),
                "replication": (0.25664383437695304, 3.897036088287618, 0.6488757500316185),
                "spare": (0.36847136916759476, 2.7139424796418137, 0.641504119349044),
            },
        ),
        (
            dict(BEFORE, train_for="steps", pause_fraction=0.0, step_scaling=((0.5, 0.5), (1.0, 1.0))),
            {
                "sync": (0.299946097094195, 3.334111204099634, 0.46393439666730263),
                "ft-hsdp": (0.49580788724238234, 1.147067722884474, 0.6896445662233395),
                "reduced-degree": (0.299946097094195, 3.334111204099634, 0.46393439666730263),
                "replication": (0.2643481594050767, 3.783117884214184, 0.6476146201935971),
                "spare": (0.37866161459043524, 2.641326591304298, 0.6411641596575126),
            },
        ),
    ],
)
def test_without_a_link_the_results_are_the_previous_ones(knobs, figures):
    res = simulate(config(**knobs), list(figures))
    assert {n: (r.ettr, r.ttt_ratio, r.availability) for n, r in res.items()} == figures
    assert all(r.breakdown["communication"] == 0.0 and r.comm is None for r in res.values())


def test_a_sweep_over_the_link_bandwidth():
    from ftjax.sim.cli import build_parser, config_from_args, sweep_from_args
    from ftjax.sim.run import sweep

    inputs = dict(gpus=32, replicas=4, mtbf_min=1e9, steps=100, step_s=60, seeds=1, params=1.25e9, link_gbps=4)
    options = [f"--{k.replace('_', '-')}={v}" for k, v in inputs.items()]
    args = build_parser().parse_args([*options, "--sweep=x.png", "--sweep-over=link-gbps", "--sweep-values=1,4,16"])
    cfg = config_from_args(args)
    knob, values = sweep_from_args(args, cfg)
    assert (knob, values) == ("link_gbps", [1.0, 4.0, 16.0])
    series = sweep(cfg, knob, values, ["ft-hsdp", "diloco"])
    for gbps, every, diloco in zip(values, series["ettr"]["ft-hsdp"], series["ettr"]["diloco"]):
        comm = ALLREDUCE_S * 4 / gbps
        assert every == pytest.approx(60 / (60 + comm))
        assert diloco == pytest.approx(60 / (60 + comm / 20))
