"""Example (c): a training loop written by hand, fault tolerant through `ftjax.FaultTolerance`.

The model is a pytree of two matrices, the optimizer plain optax, the data ftjax's stream of
Python's own sources; the loop asks the fault-tolerance object for each step's quorum, averages
its gradients over the replicas, and commits. Healing (a peer's snapshot plus the replay of the
updates averaged meanwhile) goes through `apply`.

    ftjax launch examples/own_loop.yaml --replicas 2 --kill 1@15:ftar --entry "python examples/own_loop.py"
"""

from __future__ import annotations

import sys
import time

import ftjax


def main(argv: list[str] | None = None) -> int:
    run = ftjax.RunArgs.parse(argv)  # `ftjax train`'s arguments; sets JAX's platform before JAX is imported
    import jax
    import jax.numpy as jnp
    import optax

    cfg, rid = run.cfg, run.options.replica_id
    corpus = ftjax.stdlib_corpus()
    stream = ftjax.BatchStream(
        ftjax.Windows(corpus.tokens, cfg.model.seq_len + 1),
        seed=cfg.seed,
        batch_size=cfg.data.batch_size,
        replica=rid,
        replicas=cfg.ft.replicas,
    )
    tx = optax.adamw(cfg.optim.lr)

    def init():
        k1, k2 = jax.random.split(jax.random.key(cfg.seed))
        params = {"embed": 0.02 * jax.random.normal(k1, (256, 64)), "out": 0.02 * jax.random.normal(k2, (64, 256))}
        return {"params": params, "opt": tx.init(params)}

    def loss_fn(params, tokens):
        logits = params["embed"][tokens[:, :-1]] @ params["out"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    grads_of = jax.jit(jax.value_and_grad(loss_fn))

    @jax.jit
    def apply(state, grads, scale):
        updates, opt = tx.update(grads, state["opt"], state["params"])
        updates = jax.tree.map(lambda u: u * jnp.asarray(scale, u.dtype), updates)
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt}

    template = jax.eval_shape(init)  # shapes and dtypes: what a healing peer receives
    # join compiles the step (`warm_up`, on a state of zeros) and `apply` before the replica joins:
    # a replica restarted into a running job must not compile inside a step its peers wait for
    ft = ftjax.FaultTolerance.join(
        run,
        state=template,
        update_template=template["params"],
        apply=apply,
        batch_id=stream.batch_id,
        warm_up=lambda state: grads_of(state["params"], stream.batch(0)),
    )
    try:
        while ft.step < cfg.steps:
            info = ft.begin()
            if info.no_state:  # nobody holds the job's state: start it (only at job start)
                ft.initialize(init)
                continue
            if info.past_end:  # the job is done; this replica only catches up
                time.sleep(0.05)
                ft.ask()
                continue
            loss, grads = (
                grads_of(ft.state["params"], stream.batch(info.data_position)) if info.contributes else (None, None)
            )
            update, error = ft.average(info.quorum, grads)
            if ft.vote(info.quorum, error):
                ft.commit(info.quorum, update, contributed=info.contributes, loss=None if loss is None else float(loss))
        return ft.finish()
    except (ftjax.Left, ftjax.Finished):
        return 0
    finally:
        ft.close()


if __name__ == "__main__":
    sys.exit(main())
