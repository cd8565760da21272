"""Hugging Face Llama checkpoints in and out (issue 55; `ftjax convert`, docs/guides/start-from-a-released-model.md).

An HF Llama is `config.json` and `*.safetensors`; ftjax's is a plain orbax checkpoint of the
model's parameter tree (what `checkpoint.init_from` reads) and a config. The mapping is per tensor:
HF's linear weights are [out, in], ftjax's einsum kernels [in, ...out] with the heads split out
(`wq` [d, heads, head_dim]); both rotate a head's first half against its second, so no head is
permuted. A tensor is read, cast and placed one at a time (`hf_params`), and a tensor or setting
that does not map (a bias, another activation or rope type) is refused by name before any is read.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from ml_dtypes import bfloat16
from numpy.typing import DTypeLike

from ftjax.config import ConfigError, ModelConfig

META = "ftjax_model.json"  # beside the orbax checkpoint: the model settings it was converted with

# per layer: HF name -> (ftjax path below blocks/<i>, kind of transform)
_LAYER = {
    "input_layernorm.weight": (("attn_norm", "scale"), "copy"),
    "self_attn.q_proj.weight": (("attn", "wq"), "heads_in"),
    "self_attn.k_proj.weight": (("attn", "wk"), "heads_in"),
    "self_attn.v_proj.weight": (("attn", "wv"), "heads_in"),
    "self_attn.o_proj.weight": (("attn", "wo"), "heads_out"),
    "post_attention_layernorm.weight": (("mlp_norm", "scale"), "copy"),
    "mlp.gate_proj.weight": (("mlp", "w_gate"), "t"),
    "mlp.up_proj.weight": (("mlp", "w_up"), "t"),
    "mlp.down_proj.weight": (("mlp", "w_down"), "t"),
}
_TOP = {
    "model.embed_tokens.weight": (("embed",), "copy"),
    "model.norm.weight": (("norm", "scale"), "copy"),
    "lm_head.weight": (("head",), "t"),
}


def _rope_scaling(hf: dict) -> dict | None:
    """`model.rope_scaling` of an HF config: its `rope_scaling` (or the newer `rope_parameters`)."""
    rs = hf.get("rope_scaling") or hf.get("rope_parameters")
    if not rs:
        return None
    kind = rs.get("rope_type", rs.get("type", "default"))
    if kind == "default":
        return None
    if kind not in ("llama3", "linear"):
        raise ConfigError(f"config.json: rope_scaling type {kind!r} does not map (ftjax has llama3 and linear)")
    keys = ("factor",) if kind == "linear" else ("factor", "low_freq_factor", "high_freq_factor")
    out = {"rope_type": kind, **{k: float(rs[k]) for k in keys}}
    if kind == "llama3":
        out["original_max_position_embeddings"] = int(rs["original_max_position_embeddings"])
    return out


def model_settings(hf: dict, seq_len: int = 0) -> dict:
    """The `model:` section of an ftjax config for an HF Llama config.json's dict; ConfigError names
    the setting that does not map."""
    arch = hf.get("architectures") or ["LlamaForCausalLM"]
    if hf.get("model_type", "llama") != "llama" or arch != ["LlamaForCausalLM"]:
        raise ConfigError(f"config.json: model_type {hf.get('model_type')!r} / {arch}: only LlamaForCausalLM maps")
    for key, ok in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False)):
        if hf.get(key, ok) != ok:
            raise ConfigError(f"config.json: {key} {hf[key]!r} does not map (ftjax's Llama has {key} {ok!r})")
    if hf.get("pretraining_tp", 1) != 1:
        raise ConfigError(f"config.json: pretraining_tp {hf['pretraining_tp']} does not map (use 1)")
    heads = hf["num_attention_heads"]
    rs = hf.get("rope_parameters") or {}
    return {
        "kind": "llama",
        "vocab_size": hf["vocab_size"],
        "d_model": hf["hidden_size"],
        "n_layers": hf["num_hidden_layers"],
        "n_heads": heads,
        "n_kv_heads": hf.get("num_key_value_heads") or heads,
        "head_dim": hf.get("head_dim") or hf["hidden_size"] // heads,
        "d_ff": hf["intermediate_size"],
        "seq_len": seq_len or min(hf.get("max_position_embeddings", 2048), 8192),
        "rope_theta": float(hf.get("rope_theta", rs.get("rope_theta", 10000.0))),
        "rope_scaling": _rope_scaling(hf),
        "norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
    }


def hf_config(m: ModelConfig) -> dict:
    """An HF config.json dict (LlamaForCausalLM) for a ModelConfig `m`: `model_settings`' inverse."""
    out = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": m.vocab_size,
        "hidden_size": m.d_model,
        "num_hidden_layers": m.n_layers,
        "num_attention_heads": m.n_heads,
        "num_key_value_heads": m.kv_heads,
        "head_dim": m.head_size,
        "intermediate_size": m.d_ff,
        "max_position_embeddings": m.seq_len,
        "rope_theta": m.rope_theta,
        "rms_norm_eps": m.norm_eps,
        "tie_word_embeddings": m.tie_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
    }
    if m.rope_scaling is not None:
        out["rope_scaling"] = m.rope_scaling.model_dump()
    return out


def to_ftjax(x: np.ndarray, kind: str, m: ModelConfig) -> np.ndarray:
    """One HF tensor in ftjax's layout (a view where it can be: no copy beyond the cast's)."""
    if kind == "t":
        return x.T
    if kind == "heads_in":  # [heads * hd, d] -> [d, heads, hd]
        return x.T.reshape(x.shape[1], -1, m.head_size)
    if kind == "heads_out":  # [d, heads * hd] -> [heads, hd, d]
        return x.T.reshape(-1, m.head_size, x.shape[0])
    return x


def to_hf(x: np.ndarray, kind: str) -> np.ndarray:
    """`to_ftjax`'s inverse (contiguous: what safetensors writes)."""
    if kind == "t":
        x = x.T
    elif kind == "heads_in":
        x = x.reshape(x.shape[0], -1).T
    elif kind == "heads_out":
        x = x.reshape(-1, x.shape[-1]).T
    return np.ascontiguousarray(x)


def place(name: str, n_layers: int) -> tuple[tuple, str]:
    """(ftjax path, transform) of HF tensor `name`; ConfigError for one that does not map."""
    if name in _TOP:
        return _TOP[name]
    parts = name.split(".", 3)
    if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[2].isdigit() and parts[3] in _LAYER:
        i = int(parts[2])
        if i < n_layers:
            path, kind = _LAYER[parts[3]]
            return ("blocks", i, *path), kind
    raise ConfigError(f"{name}: this tensor does not map to ftjax's Llama (a bias, or another architecture?)")


def expected_names(m: ModelConfig) -> set[str]:
    """Every HF tensor name a checkpoint of ModelConfig `m` holds."""
    names = {f"model.layers.{i}.{k}" for i in range(m.n_layers) for k in _LAYER}
    names |= {"model.embed_tokens.weight", "model.norm.weight"}
    return names if m.tie_embeddings else names | {"lm_head.weight"}


def set_path(tree: dict, path: tuple, value) -> None:
    """tree[path[0]][path[1]]... = value, making the dicts on the way."""
    for k in path[:-1]:
        tree = tree.setdefault(k, {})
    tree[path[-1]] = value


_FLOATS = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": bfloat16}  # safetensors' names


def _header(file: Path) -> tuple[int, dict]:
    """(the offset of the data, the header: name -> dtype, shape, data_offsets) of safetensors `file`."""
    with open(file, "rb") as f:
        n = int.from_bytes(f.read(8), "little")  # (the format: a u64 length, a JSON header, the bytes)
        return 8 + n, json.loads(f.read(n))


def plan_hf(files: list[Path], m: ModelConfig) -> list[tuple]:
    """(file, data offset, header entry, ftjax path, transform) of each tensor of HF safetensors
    `files` for ModelConfig `m`, in file order; ConfigError names a tensor that does not map, is
    no float or is missing before any tensor is read."""
    from safetensors import safe_open

    plan, seen = [], set()
    for file in files:
        with safe_open(str(file), framework="numpy") as f:  # (checks the file: SafetensorError if truncated)
            names = list(f.keys())
        start, header = _header(file)
        for name in names:
            if name.endswith("rotary_emb.inv_freq"):  # (older exports keep RoPE's buffer: recomputed here)
                continue
            if name == "lm_head.weight" and m.tie_embeddings:
                continue  # (some tied exports write the shared matrix twice)
            path, kind = place(name, m.n_layers)
            if header[name]["dtype"] not in _FLOATS:
                raise ConfigError(f"{file.name}: {name} is {header[name]['dtype']}, not a float tensor")
            plan.append((file, start, header[name], path, kind))
            seen.add(name)
    missing = sorted(expected_names(m) - seen)
    if missing:
        raise ConfigError(f"{len(missing)} tensors missing from the checkpoint, first {missing[0]}")
    return plan


def read_tensor(file: Path, start: int, entry: dict, dtype) -> np.ndarray:
    """One tensor of a safetensors file in `dtype`, read into memory of its own: another dtype is
    cast 4 MiB at a time into the result, so the host holds the result, not the source as well. Not
    `safe_open`'s memory map: the pages it touches stay resident while the file is open (the whole
    file's, by the last tensor), and a copy out of them holds the tensor twice."""
    begin, end = entry["data_offsets"]
    stored = np.dtype(_FLOATS[entry["dtype"]])
    count = (end - begin) // stored.itemsize
    if stored == dtype:
        return np.fromfile(file, dtype=stored, count=count, offset=start + begin).reshape(entry["shape"])
    out = np.empty(count, dtype)
    step = (4 << 20) // stored.itemsize
    with open(file, "rb") as f:
        f.seek(start + begin)
        for i in range(0, count, step):
            out[i : i + step] = np.fromfile(f, dtype=stored, count=min(step, count - i))
    return out.reshape(entry["shape"])


def hf_params(files: list[Path], m: ModelConfig, dtype: DTypeLike) -> Iterator[tuple[tuple, np.ndarray]]:
    """(ftjax path, tensor in `dtype` and ftjax's layout) of each tensor of HF safetensors `files`,
    one at a time: a tensor is read (and cast) and laid out as a view, so the host holds one tensor."""
    for file, start, entry, path, kind in plan_hf(files, m):
        yield path, to_ftjax(read_tensor(file, start, entry, np.dtype(dtype)), kind, m)


def read_hf(files: list[Path], m: ModelConfig, dtype: DTypeLike) -> dict:
    """ftjax's parameter tree (numpy, `dtype`) of HF safetensors `files` for ModelConfig `m`."""
    tree: dict = {}
    for path, x in hf_params(files, m, dtype):
        set_path(tree, path, x)
    return tree


def hf_files(src: Path) -> tuple[Path, list[Path]]:
    """(config.json, the safetensors files) of a directory or of files named directly."""
    if not src.exists():  # (else it reads as a file, and the error names its parent's config.json)
        raise ConfigError(f"{src}: no such file or directory")
    if src.is_dir():
        config, files = src / "config.json", sorted(src.glob("*.safetensors"))
    else:
        config, files = src.parent / "config.json", [src]
    if not config.is_file():
        raise ConfigError(f"{config}: no config.json (an HF checkpoint has one beside its safetensors)")
    if not files:
        raise ConfigError(f"{src}: no *.safetensors files")
    return config, files


def write_hf(tree: dict, m: ModelConfig, out: Path) -> list[str]:
    """HF safetensors (one file, model.safetensors) and config.json of ftjax tree `tree` (numpy or
    jax arrays, unrolled `blocks/<i>`) in `out`; the tensor names written."""
    from safetensors.numpy import save_file

    tensors = {}
    for name in sorted(expected_names(m)):
        path, kind = place(name, m.n_layers)
        x = tree
        for k in path:
            x = x[k] if k in x else x[str(k)]  # (orbax restores the blocks' keys as strings)
        tensors[name] = to_hf(np.asarray(x), kind)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = hf_config(m) | {"torch_dtype": str(next(iter(tensors.values())).dtype)}
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return sorted(tensors)
