"""ftjax.sim: simulated means against the closed forms (exponential failures), and the accounting.

The configurations are small (few hosts, MTBF of 1 minute) so that tens of thousands of failures
are simulated in about a second: agreement within 2% then is not luck (the spread over seeds is
~0.1%), and a wrong mechanic (a stall not charged, a unit not returned) moves the mean by more.
"""

from __future__ import annotations

import itertools
import math

import pytest

from ftjax.sim import closed_form as cf
from ftjax.sim.config import SimConfig
from ftjax.sim.failures import events
from ftjax.sim.model import CATEGORIES, run
from ftjax.sim.presets import PAPER_100K
from ftjax.sim.run import simulate
from ftjax.sim.strategies import STRATEGIES

REL = 0.02


def config(**overrides) -> SimConfig:
    return SimConfig.model_validate({**PAPER_100K, "mtbf_min": 1.0, "step_s": 60.0, "seeds": 2, **overrides})


def ettr(cfg: SimConfig, strategy: str) -> float:
    return simulate(cfg, [strategy])[strategy].ettr


def one_run(cfg: SimConfig, strategy: str, seed_index: int = 0):
    return run(STRATEGIES[strategy](cfg), events(cfg, seed_index), cfg.work_min, cfg.max_slowdown)


def hosts_hit(cfg: SimConfig, seed_index: int = 0):
    """(time, host) of every failure of a trace (host blast radius)."""
    return ((f.t, f.first_gpu // cfg.gpus_per_host) for f in events(cfg, seed_index))


# ft-stall recovery with a linear curve: the reduced-degree model the closed forms cover.
LINEAR_REDUCED = dict(
    reduced_recovery="ft-stall", reduced_curve=((0.0, 0.0), (1.0, 1.0)), min_degree=0.0, packing=False
)


@pytest.mark.parametrize("policy", ["queue", "restart", "absorb"])
@pytest.mark.parametrize("interval,cost", [(0.0, 0.0), (0.3, 0.05)])
def test_sync_matches_renewal_reward(policy, interval, cost):
    cfg = config(
        gpus=96,
        sync_stall_min=0.3,
        restart_policy=policy,
        checkpoint_interval_min=interval,
        checkpoint_cost_min=cost,
        steps=15_000,
    )
    assert ettr(cfg, "sync") == pytest.approx(cf.sync_ettr(1.0, 0.3, policy, interval, cost), rel=REL)


def test_sync_closed_forms_tell_the_variants_apart():
    # So that the test above fails if the simulation used the wrong overlap or lost no work.
    assert cf.sync_ettr(1.0, 0.3, "queue") == pytest.approx(0.7)
    assert cf.sync_ettr(1.0, 0.3, "restart") == pytest.approx(math.exp(-0.3))
    assert cf.sync_ettr(1.0, 0.3, "absorb") == pytest.approx(1 / 1.3)
    assert cf.sync_ettr(1.0, 0.3, "restart") > cf.sync_ettr(1.0, 0.3, "queue") * (1 + 2 * REL)
    assert cf.sync_ettr(1.0, 0.3, "absorb") > cf.sync_ettr(1.0, 0.3, "restart") * (1 + REL)
    assert cf.sync_ettr(1.0, 0.3, "queue", 0.3, 0.05) < cf.sync_ettr(1.0, 0.3, "queue") * (1 - 3 * REL)


def test_sync_queue_reproduces_the_paper_arithmetic():
    # (MTBF - stall) / MTBF: every failure charged its full stall.
    cfg = config(gpus=96, mtbf_min=18.0, sync_stall_min=10.0, steps=40_000)
    assert ettr(cfg, "sync") == pytest.approx((18 - 10) / 18, rel=REL)


@pytest.mark.parametrize(
    "strategy,shape",
    [
        ("ft-hsdp", dict(gpus=32, replicas=4)),  # 4 replicas of 1 host
        ("reduced-degree", dict(gpus=64, replicas=4)),  # 8 hosts
    ],
)
def test_units_out_match_closed_form(strategy, shape):
    cfg = config(**shape, ft_stall_min=0.2, replica_restart_min=1.5, overlap="restart", steps=12_000, **LINEAR_REDUCED)
    units = cfg.replicas if strategy == "ft-hsdp" else cfg.hosts
    expected = cf.units_out_ettr_restart(1.0, 0.2, 1.5, units)
    # The reduced throughput while units are out is a sizeable part of the loss here.
    assert expected < math.exp(-0.2) - 0.05
    assert ettr(cfg, strategy) == pytest.approx(expected, rel=REL)


@pytest.mark.parametrize("overlap", ["queue", "restart"])
def test_ft_hsdp_stall_fraction_matches_closed_form(overlap):
    cfg = config(gpus=32, replicas=4, ft_stall_min=0.2, replica_restart_min=1.5, overlap=overlap, steps=12_000)
    stalled = simulate(cfg, ["ft-hsdp"])["ft-hsdp"].breakdown["failure stall"]
    assert stalled == pytest.approx(cf.units_out_stall_fraction(1.0, 0.2, 1.5, 4, overlap), rel=REL)


def test_weibull_with_shape_one_is_exponential():
    # Exercises the per-host renewal sampler: Weibull(k=1) lifetimes are exponential.
    cfg = config(
        gpus=32,
        replicas=4,
        ft_stall_min=0.2,
        replica_restart_min=1.5,
        overlap="restart",
        failure_dist="weibull",
        weibull_shape=1.0,
        steps=12_000,
    )
    expected = cf.units_out_ettr_restart(1.0, 0.2, 1.5, 4)
    assert ettr(cfg, "ft-hsdp") == pytest.approx(expected, rel=REL)


@pytest.mark.parametrize("shape", [0.7, 2.0])
def test_weibull_trace_has_the_configured_job_mtbf_from_the_start(shape):
    # Hosts start at random ages (stationary renewal), so there is no burst of infant mortality at
    # t = 0 and the first 100,000 minutes see 1 / MTBF failures per minute (count spread ~0.5%).
    cfg = config(gpus=64, replicas=4, failure_dist="weibull", weibull_shape=shape)
    horizon = 100_000.0
    first = sum(1 for _ in itertools.takewhile(lambda f: f.t < horizon, events(cfg, 0)))
    assert horizon / first == pytest.approx(cfg.mtbf_min, rel=REL)
    # 12,288 hosts of mean life 12,288 minutes: fresh hosts would fail 2.5x as often at k = 0.7.
    cfg = config(failure_dist="weibull", weibull_shape=shape)
    early = sum(1 for _ in itertools.takewhile(lambda f: f.t < 1_000.0, events(cfg, 0)))
    assert early == pytest.approx(1_000 / cfg.mtbf_min, rel=0.1)


def test_weibull_shape_below_one_clusters_failures_per_host():
    # Shape < 1: a replaced host is likely to fail again soon, so the same host fails twice within
    # a short time far more often than under exponential lifetimes (mean life per host: 8 minutes).
    def quick_repeats(dist: str) -> int:
        cfg = config(gpus=64, replicas=4, failure_dist=dist, weibull_shape=0.5)
        last: dict[int, float] = {}
        repeats = 0
        for t, host in itertools.islice(hosts_hit(cfg), 20_000):
            repeats += t - last.get(host, -math.inf) < 1.0
            last[host] = t
        return repeats

    assert quick_repeats("weibull") > 2 * quick_repeats("exponential")


@pytest.mark.parametrize("groups,r,steps", [(64, 2, 10_000), (12, 3, 5_000)])
@pytest.mark.parametrize("strategy", ["replication", "spare"])
def test_shards_masked_failures_match_exact_mean(groups, r, steps, strategy):
    cfg = config(
        gpus=groups,
        gpus_per_host=1,
        replicas=groups,
        redundancy=r,
        sync_stall_min=0.0,
        ft_stall_min=0.0,
        replica_restart_min=math.inf,
        steps=steps,
    )
    counts = simulate(cfg, [strategy])[strategy].counts
    assert counts["fatal"] > 1000  # per seed
    assert counts["masked"] / counts["fatal"] == pytest.approx(cf.masked_failures_exact(groups, r), rel=REL)
    assert counts["masked_per_fatal_spare"] == pytest.approx(cf.masked_failures_spare(groups, r))


def test_spare_formula_is_the_large_n_limit_of_the_exact_mean():
    # Gamma(1/r) N^(1-1/r) / r is asymptotic (off by O(1) failures): 19% high at N = 12, within 1%
    # at N = 4096.
    assert cf.masked_failures_spare(4096, 2) == pytest.approx(cf.masked_failures_exact(4096, 2), rel=0.01)
    assert cf.masked_failures_spare(12, 2) / cf.masked_failures_exact(12, 2) > 1.15
    # r = 1: no redundancy, the first failure is fatal. r = N = 2: the second one is.
    assert cf.masked_failures_exact(50, 1) == 0.0
    assert cf.masked_failures_exact(2, 2) == 1.0


def test_breakdown_accounts_for_all_gpu_time():
    cfg = config(
        gpus=64,
        replicas=4,
        sync_stall_min=0.5,
        ft_stall_min=0.2,
        replica_restart_min=1.0,
        rejoin_stall_min=0.1,
        checkpoint_interval_min=0.5,
        checkpoint_cost_min=0.05,
        steps=2_000,
        # DiLoCo rounds shorter than a replica's life (4 min here), else it loses nearly all its work
        # and runs to --max-slowdown: 20 x as long to simulate.
        inner_steps=2,
        fragments=2,
    )
    for name in STRATEGIES:
        outcome = one_run(cfg, name)
        assert outcome.finished
        assert sum(outcome.minutes.values()) == pytest.approx(outcome.wall_min, rel=1e-9)
        assert all(v >= -1e-9 for v in outcome.minutes.values()), outcome.minutes
        # The job ends when its work is trained: productive GPU-time is exactly that work.
        assert outcome.minutes["productive"] == pytest.approx(cfg.work_min, rel=1e-9)
    res = simulate(cfg)
    assert res["sync"].breakdown["lost work"] > 0.01
    assert res["sync"].breakdown["checkpoint"] > 0.01
    assert res["ft-hsdp"].breakdown["rejoin stall"] > 0.01
    assert res["ft-hsdp"].breakdown["lost work"] == 0.0
    # r = 2: every useful shard computation has one redundant twin, unless its group is out.
    red = res["replication"].breakdown
    assert red["redundant compute"] > 0.1
    assert red["redundant compute"] + red["units out"] == pytest.approx(red["productive"] + red["lost work"])
    assert set(res["sync"].breakdown) == set(CATEGORIES)


def test_strategies_share_one_trace_per_seed_and_runs_are_reproducible():
    cfg = config(gpus=96)
    first = list(itertools.islice(events(cfg, 0), 100))
    assert first == list(itertools.islice(events(cfg, 0), 100))
    assert first != list(itertools.islice(events(cfg, 1), 100))
    cfg = config(gpus=96, steps=200, inner_steps=2, fragments=2)  # (short DiLoCo rounds: see above)
    assert simulate(cfg) == simulate(cfg)


def test_failures_of_a_replica_already_out_do_not_stall_the_others():
    # One replica: every failure after the first lands while it is out (restart never ends), so only
    # the first one stalls; the job trains at 0 meanwhile (the single replica is out).
    cfg = config(gpus=8, replicas=1, redundancy=1, ft_stall_min=1.0, replica_restart_min=math.inf, steps=10)
    outcome = one_run(cfg, "ft-hsdp")
    assert outcome.minutes["failure stall"] == pytest.approx(1.0)
    assert outcome.counts["failures of units already out"] == outcome.failures - 1
    assert not outcome.finished


def test_preset_reproduces_the_papers_figures():
    res = simulate(SimConfig.model_validate(PAPER_100K))
    assert res["sync"].ettr == pytest.approx(0.44, abs=0.03)
    assert res["ft-hsdp"].ettr == pytest.approx(0.80, abs=0.03)
    assert res["sync"].ettr_analytic == pytest.approx(8 / 18)
    # Every failure restarts an NTP job and a restart fixes a software failure: sync's figures.
    assert res["reduced-degree"].ettr == res["sync"].ettr
    # With the FT-HSDP stall instead, a reduced-degree replica loses a host's share, not a replica's.
    rd = simulate(SimConfig.model_validate({**PAPER_100K, **LINEAR_REDUCED}), ["reduced-degree"])["reduced-degree"]
    assert rd.breakdown["units out"] < res["ft-hsdp"].breakdown["units out"] / 100
    # Time-to-train is the failure-free time stretched by the ETTR.
    free_h = PAPER_100K["steps"] * PAPER_100K["step_s"] / 3600
    assert res["sync"].time_to_train_h == pytest.approx(free_h / res["sync"].ettr, rel=REL)


def test_at_gpus_scales_the_job_mtbf_inversely():
    cfg = SimConfig.model_validate(PAPER_100K)
    half = cfg.at_gpus(cfg.gpus // 2)
    assert half.mtbf_min == pytest.approx(2 * cfg.mtbf_min)
    assert half.hosts == cfg.hosts // 2
