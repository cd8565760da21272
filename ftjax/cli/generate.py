"""`ftjax generate CKPT --prompt TEXT --tokenizer tokenizer.json` (or `--prompt-ids 1,2,3`): what a
built-in Llama writes after a prompt, greedy or sampled, with a KV cache, on one device
(ftjax/program/generate.py). CKPT is a checkpoint of `ftjax convert hf` (its model settings inside)
or a run's RUN/checkpoints/STEP/state with `--config`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ftjax.base.trees import PyTree
from ftjax.config import ConfigError


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ftjax generate", description=__doc__)
    p.add_argument("ckpt", help="an orbax checkpoint of the model's parameters")
    p.add_argument("--config", help="the model's ftjax config (default: the checkpoint's ftjax_model.json)")
    p.add_argument("--prompt", help="the prompt's text (needs --tokenizer)")
    p.add_argument("--prompt-ids", help="the prompt as token ids, comma-separated")
    p.add_argument("--tokenizer", help="a Hugging Face tokenizer.json or SentencePiece model, to encode and decode")
    p.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate after the prompt")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the K most likely tokens (0: all)")
    p.add_argument("--seed", type=int, default=0, help="the sampling key's seed (with --temperature > 0)")
    return p


def load_model(ckpt: Path, config: Path | None):
    """The Llama of the config (or of the checkpoint's recorded settings) with the checkpoint's
    parameters, in float32."""
    import numpy as np
    import orbax.checkpoint as ocp
    from flax import nnx

    from ftjax.config import ModelConfig, load_config
    from ftjax.program import models
    from ftjax.program.convert import META

    if config is not None:
        m = load_config(str(config)).model
    elif (ckpt / META).is_file():
        m = ModelConfig(**json.loads((ckpt / META).read_text())["model"])
    else:
        raise ConfigError(f"{ckpt}: no {META}; name the run's config with --config")
    if m.kind != "llama":
        raise ConfigError(f"model.kind: generate runs the built-in llama (it is {m.kind})")
    m = m.model_copy(update={"compute_dtype": "float32", "scan_layers": False})
    with nnx.use_eager_sharding(False):
        model = models.build(m, nnx.Rngs(0))
    tree = ocp.PyTreeCheckpointer().restore(ckpt.absolute())
    if "params" in tree and "embed" not in tree:
        tree = tree["params"]  # (a run's state)
    graphdef, state = nnx.split(model)

    def fill(want: dict, have: PyTree) -> dict:
        # `want`'s structure (the model's pure dict), `have`'s values (the checkpoint's tree)
        return {
            k: fill(want[k], have[str(k)] if str(k) in have else have[k])
            if isinstance(want[k], dict)
            else np.asarray(have[str(k)] if str(k) in have else have[k], np.float32)
            for k in want
        }

    nnx.replace_by_pure_dict(state, fill(state.to_pure_dict(), tree))
    return nnx.merge(graphdef, state)


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    try:
        tok = None
        if args.tokenizer:
            from ftjax.program.tokenizer import load_tokenizer

            tok = load_tokenizer(args.tokenizer)
        if (args.prompt is None) == (args.prompt_ids is None):
            raise ConfigError("give one of --prompt (with --tokenizer) and --prompt-ids")
        if args.prompt is not None and tok is None:
            raise ConfigError("--prompt: needs --tokenizer (or give --prompt-ids)")
        prompt = tok.encode([args.prompt])[0] if tok is not None and args.prompt else _ids(args.prompt_ids)
        model = load_model(Path(args.ckpt), Path(args.config) if args.config else None)
        from ftjax.program.generate import generate

        out = generate(
            model, prompt, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k, seed=args.seed
        )
    except (ConfigError, FileNotFoundError) as e:
        print(f"ftjax generate: {e}", file=sys.stderr)
        return 2
    record: dict[str, object] = {"prompt_ids": prompt, "ids": out}
    if tok is not None and hasattr(tok, "tok"):
        record["text"] = tok.tok.decode(out)
    print(json.dumps(record))
    return 0


def _ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise ConfigError(f"--prompt-ids {text!r}: not comma-separated integers") from None
    if not ids:
        raise ConfigError("--prompt-ids: empty")
    return ids
