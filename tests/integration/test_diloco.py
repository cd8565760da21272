"""DiLoCo in real processes (ftjax/runtime/diloco.py): the outer step against references computed
by hand, and 2-replica jobs with kills in the inner phase, at the outer all-reduce and during a
catch-up: the shared state bitwise equal at every round both replicas committed, exactly once."""

import sys

import jax
import numpy as np
import optax
import pytest
from conftest import REPO
from launchrun import Launch

from ftjax.config import load_config
from ftjax.ftar import quant
from ftjax.program.data import make_stream
from ftjax.program.digest import state_checksum
from ftjax.program.step import build_program, device_batch, where
from ftjax.runs.jsonl import read_jsonl
from ftjax.runtime.diloco import SYNC, OuterSync, round_span


def _program(overrides):
    cfg = load_config("llama_tiny", overrides)
    return cfg, build_program(cfg)


def _inner_by_hand(program, state, batches, wheres):
    """The reference: the program's own step, H times, on a copy."""
    s = jax.tree.map(lambda x: x.copy(), {k: state[k] for k in ("params", "opt", "step")})
    for b, w in zip(batches, wheres):
        _, _, g = program.grads_of(s, b, w)
        s = program.apply(s, g, np.float32(1.0))
    return s


def test_with_outer_sgd_at_rate_one_a_lone_replica_ends_where_its_inner_steps_went():
    """DiLoCo's outer step with plain SGD at learning rate 1 moves the global parameters by the
    whole average delta: a replica alone then holds its inner steps' parameters, which the
    program's own step computes H times by hand."""
    cfg, program = _program(
        ["ft.sync=diloco", "ft.inner_steps=3", "ft.outer_optimizer=sgd", "ft.outer_lr=1", "ft.outer_momentum=0"]
    )
    sync = OuterSync(cfg, program)
    state = sync.init(program.init(np.int32(0)))
    stream = make_stream(cfg)
    batches = [device_batch(program, stream.batch(k)) for k in range(3)]
    wheres = [where(k, 0, 0) for k in range(3)]
    ref = _inner_by_hand(program, state, batches, wheres)
    res = sync.run_inner(state, batches, wheres, 0)
    before = state_checksum(sync.shared(state))
    out = sync.apply(state, (0, res.delta), 1.0, res)
    for a, b in zip(jax.tree.leaves(out["params"]), jax.tree.leaves(ref["params"])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-6)
    # this replica's inner optimizer state is the round's; the state it started from was not touched
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(out["opt"]), jax.tree.leaves(ref["opt"])))
    assert state_checksum(sync.shared(state)) == before and int(out["step"]) == 3


def test_nesterov_outer_step_matches_optax_and_a_replay_needs_no_inner_state():
    cfg, program = _program(["ft.sync=diloco", "ft.inner_steps=2"])
    sync = OuterSync(cfg, program)
    state = sync.init(program.init(np.int32(0)))
    stream = make_stream(cfg)
    batches = [device_batch(program, stream.batch(k)) for k in range(2)]
    res = sync.run_inner(state, batches, [where(k, 0, 0) for k in range(2)], 0)
    g = jax.tree.leaves(state["params"])
    tx = optax.sgd(0.7, momentum=0.9, nesterov=True)
    upd, _ = tx.update(list(res.delta), tx.init(g), g)
    want = optax.apply_updates(g, upd)
    live = sync.apply(state, (0, res.delta), 1.0, res)
    replayed = sync.apply(state, (0, res.delta), 1.0, None)  # a healing replica's replay: no inner steps of its own
    for a, b, c in zip(jax.tree.leaves(live["params"]), want, jax.tree.leaves(replayed["params"])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
        assert np.array_equal(a, c)  # the shared state does not depend on whose inner state it is
    assert state_checksum(sync.shared(live)) == state_checksum(sync.shared(replayed))
    assert state_checksum(live) != state_checksum(replayed)  # (the inner optimizer states differ)


def test_streaming_averages_one_fragment_and_resets_only_its_local_parameters():
    cfg, program = _program(["ft.sync=streaming_diloco", "ft.inner_steps=4", "ft.fragments=2"])
    sync = OuterSync(cfg, program)
    assert sync.inner == 2 and [sync.fragment(s) for s in range(4)] == [0, 1, 0, 1]
    state = sync.init(program.init(np.int32(0)))
    stream = make_stream(cfg)
    batches = [device_batch(program, stream.batch(k)) for k in range(2)]
    res = sync.run_inner(state, batches, [where(k, 0, 0) for k in range(2)], 1, step=1)
    out = sync.apply(state, (1, res.delta), 1.0, res)
    g0, g1 = jax.tree.leaves(state["params"]), jax.tree.leaves(out["params"])
    trained, local = jax.tree.leaves(res.local), jax.tree.leaves(out["local"])
    part = lambda leaves, f: [np.asarray(leaves[p.leaf]).reshape(-1)[p.start : p.stop] for p in sync.pieces[f]]
    assert all(np.array_equal(a, b) for a, b in zip(part(g0, 0), part(g1, 0)))  # fragment 0: global untouched
    assert all(not np.array_equal(a, b) for a, b in zip(part(g0, 1), part(g1, 1)))  # fragment 1: averaged, all of it
    assert all(np.array_equal(a, b) for a, b in zip(part(local, 0), part(trained, 0)))  # 0 trains on locally
    assert all(np.array_equal(a, b) for a, b in zip(part(local, 1), part(g1, 1)))  # 1 restarts from the global
    assert sync.fragment_bytes(0) == sync.fragment_bytes(1) == 2 * sum(x.size for x in g0)  # half each, exactly
    assert any(p.size < g0[p.leaf].size for p in sync.pieces[1])  # (which takes a cut array here)


@pytest.mark.parametrize("sync_kind", ["diloco", "streaming_diloco"])
def test_a_warmup_step_is_every_step_syncs_update_and_its_replay_the_same_state(sync_kind):
    """A warm-up step (ft.sync_warmup_steps): two replicas' gradients of their own batches at the
    global parameters, averaged, applied by the inner optimizer to the global parameters, bit for
    bit the program's own every-step update; the outer state untouched; a healing replica's replay
    (no inner result of its own) ends in the same whole state, inner optimizer included. Streaming
    (2 fragments), the whole gradient too, and the local parameters the rounds start from are the
    new global ones."""
    cfg, program = _program(
        [f"ft.sync={sync_kind}", "ft.inner_steps=4", "ft.fragments=2", "ft.sync_warmup_steps=2", "ft.replicas=2"]
        + ["optim.warmup_steps=0"]  # (a learning rate above 0 at the first step: the parameters move)
    )
    sync = OuterSync(cfg, program)
    assert [sync.synchronous(s) for s in range(4)] == [True, True, False, False]
    state = sync.init(program.init(np.int32(0)))
    grads, res = [], []
    for r in range(2):
        batch = device_batch(program, make_stream(cfg, replica=r).batch(0))
        grads.append(program.grads_of(state, batch, where(0, r, 0))[2])
        res.append(sync.run_inner(state, [batch], [where(0, r, 0)], 0, synchronous=True))
        assert all(np.array_equal(a, b) for a, b in zip(res[r].delta, jax.tree.leaves(grads[r]["params"])))
    avg = [(a + b) / 2 for a, b in zip(res[0].delta, res[1].delta)]
    want = program.apply(
        jax.tree.map(lambda x: x.copy(), {k: state[k] for k in ("params", "opt", "step")}),
        jax.tree.map(lambda a, b: (a + b) / 2, grads[0], grads[1]),
        np.float32(1.0),
    )
    outer_before = state_checksum(state["outer"])
    live = sync.apply(jax.tree.map(lambda x: x.copy(), state), (SYNC, avg), 1.0, res[0])
    replayed = sync.apply(jax.tree.map(lambda x: x.copy(), state), (SYNC, avg), 1.0, None)
    assert state_checksum({k: live[k] for k in want}) == state_checksum(want)  # every_step's update, bitwise
    assert state_checksum(live) == state_checksum(replayed) and int(live["step"]) == 1
    assert state_checksum(live["outer"]) == outer_before
    if sync_kind == "streaming_diloco":
        local, new, old = (jax.tree.leaves(x) for x in (live["local"], live["params"], state["local"]))
        assert all(np.array_equal(a, b) for a, b in zip(local, new))  # the rounds start from the global ones
        assert not all(np.array_equal(a, b) for a, b in zip(local, old))  # (not the initial copy)


# three `ftjax train` runs in turn: 178 s in a hogged suite on a 2-core machine (59 % of the default 300 s)
@pytest.mark.timeout(600)
@pytest.mark.parametrize("sync_kind", ["diloco", "streaming_diloco"])
def test_a_warmed_up_job_is_the_every_step_job_until_its_rounds_start(tmp_path, sync_kind):
    """`ftjax train` with ft.sync_warmup_steps=2 and rounds of 3 after them: stopped after its 2
    warm-up steps it holds the parameters of an every-step job of the same schedule (8 optimizer
    steps) stopped after 2, bitwise; resumed, its records say 1, 1, 3, 3 inner steps. Streaming with
    3 fragments: the same warm-up (the whole gradient), then rounds of 1 inner step, one fragment each."""
    import json
    import subprocess

    from conftest import FTJAX

    def train(out, *extra):
        cmd = [*FTJAX, "train", "llama_tiny", "checkpoint.every=2", "ft.digest_every=0", "--out", str(out), *extra]
        cmd += ["optim.warmup_steps=0"]  # (step 2's learning rate then depends on the schedule's length)
        done = subprocess.run(cmd, capture_output=True)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads((out / "summary.json").read_text())

    streaming = sync_kind == "streaming_diloco"
    warm = [f"ft.sync={sync_kind}", "ft.sync_warmup_steps=2", "ft.inner_steps=3", "ft.fragments=3"]
    warm += ["steps=8" if streaming else "steps=4"]  # (8 optimizer steps either way: 2 + 6 x 1, or 2 + 2 x 3)
    every = train(tmp_path / "every", "steps=8", "--stop-after", "2")
    assert train(tmp_path / "warm", *warm, "--stop-after", "2")["params_digest"] == every["params_digest"]
    train(tmp_path / "warm", *warm, "--resume")
    records = [json.loads(x) for x in (tmp_path / "warm" / "metrics.jsonl").read_text().splitlines()]
    rounds = [(m["step"], m["inner_steps"], m["synchronous"]) for m in records if m.get("committed")]
    if streaming:
        assert rounds == [(1, 1, True), (2, 1, True)] + [(n, 1, False) for n in range(3, 9)]
        fragments = [m["fragment"] for m in records if m.get("committed") and not m["synchronous"]]
        assert fragments == [n % 3 for n in range(2, 8)]  # one fragment per round, in turn
    else:
        assert rounds == [(1, 1, True), (2, 1, True), (3, 3, False), (4, 3, False)]


def _rounds(run: Launch, r: int) -> dict[int, str]:
    """Replica r's committed rounds: step -> the shared state's digest after it."""
    return {m["step"]: m["param_digest"] for m in run.metrics(r) if m.get("committed") and m.get("param_digest")}


@pytest.mark.timeout(660)
@pytest.mark.slow
@pytest.mark.parametrize(
    "sync,warmup,wire",
    # (no warm-up with a float32 wire: the kills of test_a_restarted_replica_contributes_again_... below)
    [("diloco", 6, "float32"), ("streaming_diloco", 6, "float32"), ("streaming_diloco", 0, "int8")],
)
def test_kills_in_the_inner_phase_the_outer_allreduce_and_a_catchup_keep_rounds_equal(
    procs, tmp_path, sync, warmup, wire
):
    """3 replicas of the tiny Llama, 24 rounds: replica 1 dies during its inner steps of round 4 and
    its next incarnation while it catches up; replica 2 dies in the outer all-reduce of round 8.
    Replica 0 lives throughout (it holds the job's state; each kill hits a first incarnation, as a
    restart may take longer than the job). The rounds go ahead without the dead (nobody waits for
    a dead replica's inner work), the restarted ones heal from a live peer, every round that two
    replicas committed has the same shared state (global parameters and outer optimizer state) on
    both, the final states are equal, and every round's batches were trained exactly once. With a
    warm-up of 6 synchronous steps, replica 1 dies in the warm-up instead, and every record's inner
    steps and tokens are those beneath its data position (one batch below 6; a replica back before
    the job's end with its position behind trains such short rounds, whose weight in the mean
    tests/unit/test_diloco_parts.py checks: here the rounds are often over before it is back). With
    ft.wire_dtype=int8 every frame of the outer all-reduce is row-wise int8 (`ftjax/ftar/quant.py`):
    the same invariants, and a round's bytes (the records' sync_bytes) >= 1.8x fewer than bfloat16's."""
    args = [f"{REPO}/ftjax/configs/llama_tiny.yaml", "--replicas", "3", "--restart-delay-s", "0.5"]
    args += ["steps=24", f"ft.sync={sync}", "ft.inner_steps=4", "ft.fragments=2", "ft.drain_timeout_s=300"]
    args += ["--kill", "1@4:catchup", "--kill", "2@8:ftar", f"ft.sync_warmup_steps={warmup}", f"ft.wire_dtype={wire}"]
    run = Launch(procs, args, tmp_path / f"{sync}{warmup}{wire}")
    try:
        assert run.wait(timeout=600) == 0, run.output()
        s = run.summary()
        downs = [(e["replica"], e.get("at")) for e in s["failure_events"]]
        assert (1, "4:forward") in downs and (2, "8:ftar") in downs, (downs, run.output())
        kinds = [e["replica"] for e in run.events() if e["event"] == "fault" and e.get("kind") == "kill_catchup"]
        assert kinds == [1], run.output()
        # no replica was refused by the coordinator (exit 2: a healed replica's report was, every heal)
        assert all(2 not in (e.get("codes") or []) for e in run.events() if e["event"] == "replica_down")
        assert s["digests_equal"] and s["exactly_once"], {
            r: v.get("exactly_once_error") for r, v in s["replicas"].items()
        }
        rounds = [_rounds(run, r) for r in range(3)]
        assert sorted(rounds[0]) == list(range(1, 25))  # the live replica committed every round
        pairs = [(a, b, n) for a in range(3) for b in range(a + 1, 3) for n in set(rounds[a]) & set(rounds[b])]
        assert len(pairs) >= 8, pairs  # (at least the rounds before the first kill, by all three)
        assert all(rounds[a][n] == rounds[b][n] for a, b, n in pairs), [
            (a, b, n) for a, b, n in pairs if rounds[a][n] != rounds[b][n]
        ]
        # a round a survivor discarded because a peer died is retried with its inner steps as they
        # were (each survivor's own discarded rounds: whether a peer's death reached a survivor's
        # round before or after its FTAR depends on timing, so they need not discard the same ones)
        retried = {r: {e["step"] for e in run.metrics(r) if e.get("event") == "commit_failure"} for r in (0, 2)}
        assert retried[0] | retried[2], run.output()
        for r in (0, 2):
            again = [m for m in run.metrics(r) if m.get("committed") and m["step"] in retried[r]]
            assert all(m["reused_inner"] for m in again if m.get("loss") is not None), again
        assert sum(m["reused_inner"] for m in run.metrics(0) if m.get("committed") and "reused_inner" in m) >= 1
        mine = [m for m in run.metrics(0) if m.get("committed") and "inner_steps" in m]
        inner = 4 // (2 if sync == "streaming_diloco" else 1)
        assert len(mine) == 24 and [m["inner_steps"] for m in mine] == [1] * warmup + [inner] * (24 - warmup)
        assert [m["synchronous"] for m in mine] == [True] * warmup + [False] * (24 - warmup)
        # every contributed round of every replica trained the batches beneath its position: 8 rows of 64 tokens each
        for r in range(3):
            for m in run.metrics(r):
                if m.get("committed") and m.get("batch_id") is not None:
                    n = round_span(m["data_position"] - 1, inner, warmup)[1]
                    assert (m["inner_steps"], m["tokens"]) == (n, n * 8 * 64), (r, m)
        if sync == "streaming_diloco":  # one fragment per round, in turn; a warm-up step averages both
            assert [m["fragment"] for m in mine] == [0] * warmup + [n % 2 for n in range(warmup, 24)]
            both = mine[warmup]["sync_bytes"] + mine[warmup + 1]["sync_bytes"]
            assert abs(mine[warmup]["sync_bytes"] - mine[warmup + 1]["sync_bytes"]) <= 0.01 * both  # (halves)
            assert all(m["sync_bytes"] == both for m in mine[:warmup])
        if wire == "int8":  # each fragment's elements in int8 frames, against 2 bytes each in bfloat16's
            cfg, program = _program(["ft.sync=streaming_diloco", "ft.inner_steps=4", "ft.fragments=2"])
            sizes = [sum(p.size for p in ps) for ps in OuterSync(cfg, program).pieces]
            assert [m["sync_bytes"] for m in mine] == [quant.nbytes(sizes[n % 2]) for n in range(24)]
            assert all(2 * n / quant.nbytes(n) >= 1.8 for n in sizes)
    finally:
        run.close()


def test_fit_trains_a_users_task_with_its_own_outer_optimizer_like_a_plain_loop(tmp_path):
    """`ftjax.fit` of a user's pytree task with ft.sync=diloco and the task's own outer optimizer
    (dataclasses.replace(task, outer_optimizer=...)): round for round the losses, and at the end
    the parameters, of DiLoCo written here as a plain jax/optax loop (one replica: the average is
    its own delta)."""
    import dataclasses

    import jax.numpy as jnp

    import ftjax
    from ftjax.program.data import BatchStream

    sys.path.insert(0, f"{REPO}/tests/integration")
    from test_api import Pairs, mlp_init, mlp_loss

    rounds, inner, batch_size, seed = 4, 3, 16, 5
    tx, outer = optax.adam(1e-2), optax.sgd(0.5, momentum=0.8)
    task = ftjax.pytree_task(mlp_init, mlp_loss, Pairs(), optimizer=tx, name="pairs_mlp")
    task = dataclasses.replace(task, outer_optimizer=outer)
    config = {
        "seed": seed,
        "steps": rounds,
        "data": {"batch_size": batch_size},
        "ft": {"digest_every": 0, "sync": "diloco", "inner_steps": inner},
        "checkpoint": {"every": rounds},
    }
    result = ftjax.fit(task, config, out=tmp_path / "fit")
    assert result.exit_code == 0 and len(result.losses) == rounds

    stream = BatchStream(Pairs(), seed=seed, batch_size=batch_size)
    params = mlp_init(jax.random.key(seed))
    opt, outer_state, want = tx.init(params), outer.init(params), []
    for r in range(rounds):
        local, losses = params, []
        for h in range(inner):
            batch = jax.tree.map(jnp.asarray, stream.batch(r * inner + h))
            loss, g = jax.value_and_grad(lambda p: mlp_loss(p, batch).mean())(local)
            updates, opt = tx.update(g, opt, local)
            local = optax.apply_updates(local, updates)
            losses.append(float(loss))
        delta = jax.tree.map(lambda a, b: a - b, params, local)
        updates, outer_state = outer.update(delta, outer_state, params)
        params = optax.apply_updates(params, updates)
        want.append(float(np.mean(losses)))
    np.testing.assert_allclose(result.losses, want, rtol=2e-6)
    from ftjax.api import as_config
    from ftjax.runtime.checkpoint import load_init

    program = build_program(as_config(config), task=task)
    got = load_init(tmp_path / "fit" / "checkpoints" / str(rounds) / "state", program.abstract_state(), opt=False)
    got = got["params"]
    for k in params:
        np.testing.assert_allclose(got[k], np.asarray(params[k]), rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(600)  # three runs one after another: 48 s quiet, 113-214 s in a hogged suite on 2 cores
def test_a_streaming_job_stopped_and_resumed_from_its_checkpoint_ends_bitwise_equal(tmp_path):
    """The durable checkpoint holds the whole DiLoCo state (global and local parameters, outer and
    inner optimizer states): 3 rounds, stop, resume to 6 ends with the bits of 6 rounds in one go."""
    import json
    import subprocess

    from conftest import FTJAX

    over = ["steps=6", "ft.sync=streaming_diloco", "ft.inner_steps=4", "ft.fragments=2", "checkpoint.every=2"]

    def train(out, *extra):
        cmd = [*FTJAX, "train", "llama_tiny", *over, "--out", str(out), *extra]
        done = subprocess.run(cmd, capture_output=True, timeout=190)
        assert done.returncode == 0, done.stderr[-3000:]

    train(tmp_path / "whole")
    train(tmp_path / "split", "--stop-after", "3")
    train(tmp_path / "split", "--resume")
    whole, split = (json.loads((tmp_path / d / "summary.json").read_text()) for d in ("whole", "split"))
    assert split["param_digest"] == whole["param_digest"] and split["params_digest"] == whole["params_digest"]
    assert "restore" in (tmp_path / "split" / "metrics.jsonl").read_text()


@pytest.mark.timeout(480)
@pytest.mark.slow
@pytest.mark.parametrize("sync", ["diloco", "streaming_diloco"])
def test_a_restarted_replica_contributes_again_within_two_rounds_of_its_heal(procs, tmp_path, sync):
    """2 replicas, both needed for a quorum (coordinator.min_replicas=2, so each kill is healed
    before the job goes on): replica 1 dies in its inner steps of round 3, replica 0 at the outer
    all-reduce of round 8. Each restarted replica heals from the other and contributes again within
    two rounds of its heal (its healing round's report is a valid one: it was refused, inner_steps
    0, and the replica exited 2 after every heal), no replica exits with a refusal, each restarts
    once (--max-restarts 1: a second failure would end the job), and the summary counts each
    replica's contributed rounds: every round of the job, less the one it died in and the one it
    healed in."""
    args = [f"{REPO}/ftjax/configs/llama_tiny.yaml", "--replicas", "2", "--restart-delay-s", "0.5"]
    args += ["--max-restarts", "1", "steps=12", f"ft.sync={sync}", "ft.inner_steps=2", "ft.fragments=2"]
    args += ["coordinator.min_replicas=2", "--kill", "1@3:forward", "--kill", "0@8:ftar"]
    run = Launch(procs, args, tmp_path / sync)
    try:
        assert run.wait(timeout=420) == 0, run.output()
        s = run.summary()
        downs = [e for e in run.events() if e["event"] == "replica_down"]
        assert sorted((e["replica"], e["cause"]) for e in downs) == [(0, "kill"), (1, "kill")], downs
        assert all(2 not in (e.get("codes") or []) for e in downs), downs
        assert s["digests_equal"] and s["exactly_once"], s
        for r, died in ((1, 3), (0, 8)):
            assert s["replicas"][str(r)]["restarts"] == 1
            steps = [m for m in run.metrics(r) if "step" in m and m.get("event") is None and m.get("committed")]
            healed = [m["step"] for m in steps if m["healing"]]
            assert healed and min(healed) >= died, (r, healed)
            back = [m["step"] for m in steps if not m["healing"] and m["step"] > min(healed)]
            assert back and back[0] <= min(healed) + 2, (r, healed, back)  # contributes again within two rounds
            assert back == list(range(back[0], 13)), (r, back)  # and every round after
            own = [m for m in steps if not m["healing"]]
            assert s["replicas"][str(r)]["steps_contributed"] == len(own) >= 12 - 3, (r, s["replicas"][str(r)])
            assert all(m["inner_steps"] == 2 // (2 if sync == "streaming_diloco" else 1) for m in own)
    finally:
        run.close()


def _linear_loss(params, batch, key=None):
    """Per example x[:4] . a + x[4:] . b: the gradient of a batch's mean is its mean x whatever the
    parameters (a constant gradient), so SGD's inner steps are computable by hand."""
    return batch["x"][:, :4] @ params["a"] + batch["x"][:, 4:] @ params["b"]


@pytest.mark.parametrize("tau", [0, 1])
@pytest.mark.parametrize("alpha", [0.0, 0.5, 1.0])
def test_fragment_sync_delay_and_update_alpha_follow_the_history_computed_by_hand(tau, alpha):
    """Streaming DiLoCo with ft.fragment_sync_delay tau and ft.fragment_update_alpha alpha, 2
    replicas, 2 fragments (a and b), rounds of 2 SGD inner steps with constant gradients and an
    outer SGD at rate 1, against the history computed by hand in numpy: each contributor's
    pseudo-gradient global - local taken tau inner steps before the round's end, the outer step
    applied at its end, then every replica's local fragment alpha * local + (1 - alpha) * the new
    global. Round 2 is a failure: replica 1 dies in its inner steps (the round averages replica 0's
    delta alone) and heals from replica 0's state before the round, the round replayed on it. Its
    local b then lacks replica 0's inner steps of round 2, so round 3 averages b's deltas weighted
    by the inner steps each holds since b's last outer step (n - tau against 2n - tau)."""
    import jax.numpy as jnp

    import ftjax
    from ftjax.api import as_config

    sys.path.insert(0, f"{REPO}/tests/integration")
    from test_api import Pairs

    lr, n, rounds, dead = 0.1, 2, 5, 2
    config = {
        "seed": 0,
        "steps": rounds,
        "data": {"batch_size": 4},
        "ft": {"replicas": 2, "digest_every": 0, "sync": "streaming_diloco", "inner_steps": 2 * n, "fragments": 2},
    }
    config["ft"].update(outer_optimizer="sgd", outer_lr=1.0, outer_momentum=0.0)
    config["ft"].update(fragment_sync_delay=tau, fragment_update_alpha=alpha)
    init = lambda key: {"a": jax.random.normal(key, (4,)), "b": jnp.arange(4.0) / 3}
    task = ftjax.pytree_task(init, _linear_loss, Pairs(), optimizer=optax.sgd(lr), name="linear")
    cfg = as_config(config)
    program = build_program(cfg, task=task)
    sync = OuterSync(cfg, program)
    assert [[p.leaf for p in ps] for ps in sync.pieces] == [[0], [1]]  # fragment 0 is a, fragment 1 is b
    streams = [make_stream(cfg, replica=r, task=task) for r in (0, 1)]
    states = [sync.init(program.init(np.int32(0)))] * 2
    grad = lambda r, k: np.asarray(streams[r].batch(k)["x"], np.float32).mean(axis=0)  # (a's 4, then b's)
    # the reference: float32 numpy, the same order of operations
    g = {k: np.asarray(v) for k, v in states[0]["params"].items()}
    local = [dict(g), dict(g)]
    positions, since = [0, 0], [{"a": 0, "b": 0}, {"a": 0, "b": 0}]  # inner steps since a fragment's outer step
    weights = []
    for r in range(rounds):
        f, key = r % 2, "ab"[r % 2]
        contributors = [0] if r == dead else [0, 1]
        before, before_local, before_since = states[0], dict(local[0]), dict(since[0])
        results, deltas, counts = {}, [], []
        for i in contributors:
            k0 = positions[i] * n
            batches = [device_batch(program, streams[i].batch(k0 + h)) for h in range(n)]
            results[i] = sync.run_inner(states[i], batches, [where(k0 + h, i, 0) for h in range(n)], f, step=r)
            for h in range(n):
                x = grad(i, k0 + h)
                local[i] = {"a": local[i]["a"] - np.float32(lr) * x[:4], "b": local[i]["b"] - np.float32(lr) * x[4:]}
                if h + 1 == n - tau:
                    deltas.append(g[key] - local[i][key])
                    counts.append(since[i][key] + h + 1)
            positions[i] += 1
            since[i] = {k: c + n for k, c in since[i].items()}
        # the average weighted by inner steps, in float64; each weight over a full count (every step taken)
        avg = (sum(c * d.astype(np.float64) for c, d in zip(counts, deltas)) / sum(counts)).astype(np.float32)
        full = n * min(1, r) + n - tau
        weights.append([float(results[i].delta[-1][0]) for i in contributors])
        assert weights[-1] == [float(np.float32(c / full)) for c in counts]
        # FTAR's mean of each contributor's [w x delta, w]
        got = [[np.asarray(x) for x in results[i].delta] for i in contributors]
        mean = got[0] if len(got) == 1 else [(a + b) / np.float32(2) for a, b in zip(*got)]
        if r == dead:  # replica 1 takes replica 0's state before the round and replays its average
            states[1], local[1], since[1] = before, before_local, before_since
        states = [sync.apply(states[i], (f, mean), 1.0, results.get(i)) for i in (0, 1)]
        g[key] = g[key] - avg
        for i in (0, 1):
            local[i][key] = local[i][key] * np.float32(alpha) + g[key] * np.float32(1 - alpha)
            since[i][key] = 0
            assert np.asarray(states[i]["since"]).tolist() == [since[i]["a"], since[i]["b"]]
        for i in (0, 1):
            for k in "ab":
                np.testing.assert_allclose(np.asarray(states[i]["params"][k]), g[k], rtol=1e-6, atol=1e-6)
                np.testing.assert_allclose(np.asarray(states[i]["local"][k]), local[i][k], rtol=1e-6, atol=1e-6)
        assert np.array_equal(states[0]["params"]["a"], states[1]["params"]["a"])  # (the shared state: bitwise)
    # every weight 1 but the round after the heal's, where replica 1's delta holds fewer inner steps
    assert weights == [[1.0, 1.0], [1.0, 1.0], [1.0], [1.0, float(np.float32((n - tau) / (2 * n - tau)))], [1.0, 1.0]]


def test_a_lone_streaming_replica_overlapping_tau_steps_ends_with_the_bits_of_its_rounds_in_turn(tmp_path):
    """Streaming DiLoCo with tau = 1 in `ftjax train`: each round's exchange runs while its last
    inner step computes (`Trainer._exchange`), and the final state (shared and per-replica parts) is
    bitwise that of the rounds computed one after the other in this process (`OuterSync.run_inner`
    then `apply`: the arithmetic without any overlap)."""
    import json
    import subprocess

    from conftest import FTJAX

    from ftjax.program.digest import params_digest, state_digest
    from ftjax.runtime.diloco import RoundStream

    over = ["steps=3", "ft.sync=streaming_diloco", "ft.inner_steps=4", "ft.fragments=2", "ft.fragment_sync_delay=1"]
    done = subprocess.run([*FTJAX, "train", "llama_tiny", *over, "--out", str(tmp_path)], capture_output=True)
    assert done.returncode == 0, done.stderr[-3000:]
    cfg, program = _program(over)
    sync = OuterSync(cfg, program)
    rounds = RoundStream(make_stream(cfg), sync.inner)
    state = sync.init(program.init(np.int32(cfg.seed)))
    for r in range(3):
        batches = [device_batch(program, b) for b in rounds.batch(r)]
        first, n = rounds.span(r)
        res = sync.run_inner(state, batches, [where(first + h, 0, 0) for h in range(n)], sync.fragment(r), step=r)
        state = sync.apply(state, (sync.fragment(r), res.delta), 1.0, res)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["param_digest"] == state_digest(sync.shared(state))
    assert summary["params_digest"] == params_digest(state)  # (local parameters, inner optimizer, counts too)
    records = [m for m in read_jsonl(tmp_path / "metrics.jsonl") if m.get("committed") and "event" not in m]
    assert [m["inner_steps"] for m in records] == [2, 2, 2] and all("overlap_s" in m for m in records)


@pytest.mark.timeout(480)
@pytest.mark.slow
def test_a_streaming_rounds_exchange_overlaps_its_last_tau_steps_and_a_peer_killed_meanwhile_is_a_retry(
    procs, tmp_path
):
    """2 replicas of the tiny Llama, streaming DiLoCo with rounds of 2 inner steps and tau = 1, both
    needed for a quorum: every round's exchange (FTAR and the vote) runs while its last inner step
    computes (`overlap_s` > 0 in most rounds computed afresh, 0 in all of them without it). Replica 1
    dies at its exchange of round 4, while replica 0's exchange and overlapped step run: replica 0's
    round fails at FTAR, is discarded, and is retried with the inner steps it had computed once
    replica 1 has healed; every round both committed has the same shared digest on both, the final
    states are equal, and every round's batches were trained exactly once."""
    args = [f"{REPO}/ftjax/configs/llama_tiny.yaml", "--replicas", "2", "--restart-delay-s", "0.5"]
    args += ["--max-restarts", "1", "steps=8", "ft.sync=streaming_diloco", "ft.inner_steps=4", "ft.fragments=2"]
    args += ["ft.fragment_sync_delay=1", "coordinator.min_replicas=2", "--kill", "1@4:ftar"]
    run = Launch(procs, args, tmp_path / "run")
    try:
        assert run.wait(timeout=420) == 0, run.output()
        s = run.summary()
        assert s["digests_equal"] and s["exactly_once"], s
        assert [(e["replica"], e["cause"]) for e in run.events() if e["event"] == "replica_down"] == [(1, "kill")]
        rounds = [_rounds(run, r) for r in range(2)]
        assert sorted(rounds[0]) == list(range(1, 9))
        both = set(rounds[0]) & set(rounds[1])
        assert len(both) >= 6 and all(rounds[0][n] == rounds[1][n] for n in both), rounds
        for r in range(2):
            fresh = [m for m in run.metrics(r) if m.get("committed") and m.get("loss") is not None]
            fresh = [m for m in fresh if not m["reused_inner"]]
            # (without the overlap every round's is 0; with it, a round whose exchange thread was
            # scheduled only after its last step, on a machine whose cores are hogged, may show 0 too)
            overlapped = [m for m in fresh if m["overlap_s"] > 0]
            assert fresh and 2 * len(overlapped) >= len(fresh), (r, fresh)
        retried = {e["step"] for e in run.metrics(0) if e.get("event") == "commit_failure"}
        assert 4 in retried, run.output()
        again = [m for m in run.metrics(0) if m.get("committed") and m["step"] == 4]
        assert again and again[0]["reused_inner"] and again[0]["overlap_s"] == 0, again
    finally:
        run.close()
