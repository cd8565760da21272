"""Where a Llama step's time goes on one device (issue 28: the profile behind the MFU figure).

Times, each compiled apart and best of `--reps`: the forward and backward pass of one micro-batch
under each VARIANT (attention implementation [/ model.attention_chunk] : remat policy
[: model.logits_chunk], with XLA's temporaries of that compiled pass), the optimizer's update of the whole
state (optax AdamW over float32 master weights), and one bf16 matmul of the feed-forward's shape
(what this device's matmul units reach: the practical ceiling). Prints one JSON line per
measurement as it goes (a run cut short keeps what it measured), then a summary line whose
`step_model_s` = micro_batches x forward-backward + update is set beside a step time measured by
`ftjax train` (`--step-s`): what is left is the loop's own overhead.

    python scripts/mfu_profile.py llama_1b --batch 8 --micro-batches 2 --variants cudnn:save_dots,xla:save_dots
    python scripts/mfu_profile.py llama_1b --variants cudnn:save_dots,cudnn:save_dots:512   # logits in chunks
    python scripts/mfu_profile.py llama_1b --variants xla:save_dots,xla/512:save_dots:512  # and queries

`--scan-layers` builds the model with `model.scan_layers` (its blocks one `lax.scan`) for every variant.
`--compile-only` compiles each variant and prints its temporaries without running it (any machine:
on CPU the attention is XLA's and the compute float32, so only the differences between variants
say something about an accelerator).
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from ftjax.base.accelerators import lookup
from ftjax.config import load_config
from ftjax.program import models
from ftjax.program.optim import make_optimizer
from ftjax.program.plan import transformer_flops_per_token
from ftjax.program.tasks import token_losses
from ftjax_bench.common import best_time


def say(**kv) -> None:
    print(json.dumps({k: round(v, 5) if isinstance(v, float) else v for k, v in kv.items()}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config")
    ap.add_argument("--batch", type=int, default=8, help="rows of one micro-batch")
    ap.add_argument("--micro-batches", type=int, default=2)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--variants", default="cudnn:save_dots,xla:save_dots")
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--step-s", type=float, default=None, help="the step time `ftjax train` measured")
    ap.add_argument("--budget-s", type=float, default=1e9, help="skip what is left after this long")
    ap.add_argument("--compile-only", action="store_true", help="each variant's temporaries, nothing run")
    ap.add_argument("--scan-layers", action="store_true", help="every variant with model.scan_layers (one lax.scan)")
    a = ap.parse_args()
    t0 = time.perf_counter()
    cfg = load_config(a.config, [f"model.seq_len={a.seq}"])
    device = jax.devices()[0]
    known = lookup(device.device_kind) if device.platform != "cpu" else None
    peak = known.peak_bf16_flops if known else None
    m = cfg.model
    tokens = jax.random.randint(jax.random.key(0), (a.batch, a.seq + 1), 0, m.vocab_size)
    with nnx.use_eager_sharding(False):  # one device: no mesh
        model = models.build(m.model_copy(update={"attention": "xla", "scan_layers": a.scan_layers}), nnx.Rngs(0))
    params = nnx.state(model)
    n = sum(x.size for x in jax.tree.leaves(params))
    dense = n - m.vocab_size * m.d_model  # the embedding is a lookup (ftjax/program/plan.py's closed form)
    flops = transformer_flops_per_token(dense, m.n_layers, m.d_model, a.seq) * a.batch * a.seq
    say(what="setup", device=device.device_kind, params=n, flops_per_micro_batch=flops, peak=peak, scan=a.scan_layers)
    fb_s: dict[str, float] = {}
    for variant in a.variants.split(","):
        if time.perf_counter() - t0 > a.budget_s:
            break
        impl, remat, chunk = (*variant.split(":"), "0")[:3]
        impl, queries = (*impl.split("/"), "0")[:2]
        model.attention, model.remat, model.logits_chunk, model.attention_chunk = impl, remat, int(chunk), int(queries)
        gd = nnx.graphdef(model)

        def loss(p, t, gd=gd):
            return token_losses(nnx.merge(gd, p), t)[0].mean()

        fb = jax.jit(jax.value_and_grad(loss))
        try:
            temp = fb.lower(params, tokens).compile().memory_analysis().temp_size_in_bytes
            if a.compile_only:
                say(what="forward_backward", variant=variant, temp_bytes=temp)
                continue
            fb_s[variant] = s = best_time(lambda fb=fb: fb(params, tokens), a.reps)
        except Exception as exc:  # (e.g. out of memory at this batch: say so, go on)
            say(what="forward_backward", variant=variant, error=repr(exc)[:300])
            continue
        say(what="forward_backward", variant=variant, s=s, mfu=flops / s / peak if peak else None, temp_bytes=temp)
    if a.compile_only:
        return
    tx = make_optimizer(cfg.optim, cfg.steps)
    opt = tx.init(params)
    grads = jax.tree.map(jnp.ones_like, params)

    @jax.jit
    def update(p, o, g):
        u, o = tx.update(g, o, p)
        return optax.apply_updates(p, u), o

    update_s = best_time(lambda: update(params, opt, grads), a.reps)
    say(what="update", s=update_s)
    x = jnp.ones((a.batch * a.seq, m.d_model), jnp.bfloat16)
    w = jnp.ones((m.d_model, m.d_ff), jnp.bfloat16)
    mm = jax.jit(lambda x, w: x @ w)
    mm_s = best_time(lambda: mm(x, w), a.reps * 5)
    mm_tflops = 2.0 * x.shape[0] * m.d_model * m.d_ff / mm_s / 1e12
    of_peak = mm_tflops * 1e12 / peak if peak else None
    say(what="matmul", shape=[x.shape[0], m.d_model, m.d_ff], tflops=mm_tflops, of_peak=of_peak)
    first = next(iter(fb_s.values()), None)
    if first is not None:
        step_model_s = a.micro_batches * first + update_s
        say(
            what="summary",
            variant=next(iter(fb_s)),
            step_model_s=step_model_s,
            forward_backward_share=a.micro_batches * first / step_model_s,
            update_share=update_s / step_model_s,
            step_s=a.step_s,
            loop_overhead_s=(a.step_s - step_model_s) if a.step_s else None,
            time_vs_first={v: s / first for v, s in fb_s.items()},
        )


if __name__ == "__main__":
    main()
