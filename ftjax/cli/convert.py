"""`ftjax convert hf SRC --out CKPT` and `ftjax convert to-hf CKPT --out DIR`: Hugging Face Llama
checkpoints in and out (ftjax/program/convert.py maps the tensors; docs/guides/start-from-a-released-model.md)."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import yaml

from ftjax.config import ConfigError


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ftjax convert", description=__doc__)
    sub = p.add_subparsers(dest="direction", required=True)
    a = sub.add_parser("hf", help="HF safetensors + config.json -> an orbax checkpoint and its ftjax config")
    a.add_argument("src", help="a directory of config.json and *.safetensors, or one .safetensors file")
    a.add_argument("--out", required=True, help="the orbax checkpoint directory to write (must not exist)")
    a.add_argument("--config-out", help="the ftjax config to write (default: OUT.yaml)")
    a.add_argument("--dtype", default="float32", help="the parameters' dtype (default float32, the master weights')")
    a.add_argument("--seq-len", type=int, default=0, help="model.seq_len (default: max_position_embeddings, <= 8192)")
    b = sub.add_parser("to-hf", help="an orbax checkpoint (of `ftjax convert hf`, or RUN/checkpoints/STEP/state)")
    b.add_argument("ckpt", help="the orbax checkpoint directory")
    b.add_argument("--config", help=f"the ftjax config of its model (default: the checkpoint's {'ftjax_model.json'})")
    b.add_argument("--out", required=True, help="the directory to write model.safetensors and config.json in")
    return p


def save_tensor_by_tensor(params, out: Path) -> None:
    """A plain orbax pytree checkpoint (what `StandardCheckpointer().restore(out)` and `--init-from`
    read) in `out` of `params`, (path, numpy array) pairs made one at a time: each is written alone
    (orbax's partial save, then its pytree moved to `out`), so the host holds one tensor, not the
    tree. Arrays are not copied first (each is written before the next is made) and go out in 2 MiB
    chunks, one file each (OCDBT would hold a tensor's chunks until its commit: a second copy)."""
    import orbax.checkpoint as ocp
    from orbax.checkpoint.experimental.v1 import options, partial

    from ftjax.program import convert

    staging = out.absolute().with_name(out.name + ".converting")
    leftovers = (staging, staging.with_name(staging.name + ".partial_save"))  # (partial's working name)
    storage = options.ArrayOptions.Saving.StorageOptions(chunk_byte_size=2 << 20)
    saving = options.ArrayOptions.Saving(use_ocdbt=False, storage_options=storage)
    context = ocp.v1.Context(
        memory_options=options.MemoryOptions(deepcopy_host_arrays=False),
        array_options=options.ArrayOptions(saving=saving),
    )
    try:
        for path in leftovers:  # (a killed conversion's: a partial save would add to it)
            shutil.rmtree(path, ignore_errors=True)
        with context:
            for path, x in params:
                one: dict = {}
                convert.set_path(one, path, x)
                partial.save(staging, one)
                del one, x  # (before the next is read)
            partial.finalize(staging)
        (staging / "state").rename(out)  # (partial's layout: the pytree is the checkpointable "state")
    finally:
        for path in leftovers:
            shutil.rmtree(path, ignore_errors=True)


def from_hf(src: Path, out: Path, config_out: Path, dtype: str, seq_len: int) -> str:
    import numpy as np

    from ftjax.config import ModelConfig
    from ftjax.program import convert

    if out.exists():
        raise ConfigError(f"--out {out}: exists (orbax writes a new directory)")
    config_json, files = convert.hf_files(src)
    try:
        hf = json.loads(config_json.read_text())
        m = ModelConfig(**convert.model_settings(hf, seq_len))
    except (ValueError, KeyError) as e:  # (pydantic's ValidationError is a ValueError)
        raise ConfigError(f"{config_json}: {e}") from e
    save_tensor_by_tensor(convert.hf_params(files, m, np.dtype(dtype)), out)
    settings = m.model_dump(exclude_defaults=True)
    (out / convert.META).write_text(json.dumps({"model": settings, "dtype": dtype, "source": str(src)}, indent=1))
    written = {"task": "ftjax.program.tasks:token_lm", "task_args": {"dir": "data/tokens"}, "model": settings}
    config_out.write_text(
        f"# {m.n_layers}-layer Llama converted from {src} by `ftjax convert hf`:\n"
        f"#   ftjax train {config_out} --init-from {out}\n" + yaml.safe_dump(written, sort_keys=False)
    )
    return f"{len(convert.expected_names(m))} tensors -> {out} ({dtype}); config {config_out}"


def to_hf(ckpt: Path, config: Path | None, out: Path) -> str:
    import orbax.checkpoint as ocp

    from ftjax.config import ModelConfig, load_config
    from ftjax.program import convert

    if config is not None:
        m = load_config(str(config)).model
    elif (ckpt / convert.META).is_file():
        m = ModelConfig(**json.loads((ckpt / convert.META).read_text())["model"])
    else:
        raise ConfigError(f"{ckpt}: no {convert.META}; name the run's config with --config")
    if m.kind != "llama" or m.scan_layers:
        raise ConfigError("model: to-hf maps an unrolled llama (kind llama, scan_layers false)")
    tree = ocp.PyTreeCheckpointer().restore(ckpt.absolute())
    if isinstance(tree, dict) and "params" in tree and "embed" not in tree:
        tree = tree["params"]  # (an ftjax run's state: {"params", "opt", ...})
    names = convert.write_hf(tree, m, out)
    return f"{len(names)} tensors -> {out / 'model.safetensors'}, {out / 'config.json'}"


def main(argv: list[str]) -> int:
    from safetensors import SafetensorError

    args = _parser().parse_args(argv)
    try:
        if args.direction == "hf":
            out = Path(args.out)
            config_out = Path(args.config_out or f"{out}.yaml")
            print(from_hf(Path(args.src), out, config_out, args.dtype, args.seq_len))
        else:
            print(to_hf(Path(args.ckpt), Path(args.config) if args.config else None, Path(args.out)))
    except (ConfigError, FileNotFoundError, SafetensorError) as e:  # (a truncated or foreign .safetensors file)
        print(f"ftjax convert: {e}", file=sys.stderr)
        return 2
    return 0
