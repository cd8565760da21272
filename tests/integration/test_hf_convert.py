"""Hugging Face Llama checkpoints in and out (issue 55): a random HF-format checkpoint the test makes
(safetensors + config.json; tied and untied, grouped-query attention, llama3 and linear RoPE
scaling, a head_dim that is not d_model / n_heads), converted by `ftjax convert hf`: ftjax's logits
equal those of a reference forward written here in numpy from the equations of transformers'
modeling_llama.py and modeling_rope_utils.py (no torch needed), and `ftjax convert to-hf` gives
back the same tensors bit for bit."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
import yaml
from flax import nnx
from ml_dtypes import bfloat16
from safetensors import safe_open
from safetensors.numpy import save_file

from ftjax.cli.main import main as ftjax
from ftjax.config import ModelConfig
from ftjax.program import models
from ftjax.runtime import checkpoint

# name -> HF config.json (of a Llama small enough to run in numpy in a blink)
CASES = {
    "tied_gqa_llama3": dict(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=96,
        tie_word_embeddings=True,
        rope_theta=10000.0,
        # original 64: wavelengths of head_dim 16 fall on both sides of 64/4 and 64/1, so all three
        # of llama3's cases (kept, interpolated, divided by factor) are exercised
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0)
        | dict(original_max_position_embeddings=64),
        rms_norm_eps=1e-5,
    ),
    "untied_head_dim_linear": dict(
        hidden_size=48,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,  # not 48 / 4
        intermediate_size=80,
        tie_word_embeddings=False,
        rope_theta=500000.0,
        rope_scaling=dict(type="linear", factor=2.0),
        rms_norm_eps=1e-6,
    ),
}


def hf_config(case: str) -> dict:
    return dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        vocab_size=97,
        num_hidden_layers=2,
        max_position_embeddings=64,
        hidden_act="silu",
        attention_bias=False,
        mlp_bias=False,
        **CASES[case],
    )


def random_hf(cfg: dict, seed: int) -> dict[str, np.ndarray]:
    """A random HF Llama state dict (float32), weights large enough that errors would show."""
    rng = np.random.default_rng(seed)
    d, h, kv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd, ff, v = cfg.get("head_dim", d // h), cfg["intermediate_size"], cfg["vocab_size"]
    w = lambda *shape: rng.normal(0, 1 / math.sqrt(shape[-1]), shape).astype(np.float32)
    norm = lambda: (1 + 0.1 * rng.normal(size=d)).astype(np.float32)
    out = {"model.embed_tokens.weight": rng.normal(0, 1, (v, d)).astype(np.float32), "model.norm.weight": norm()}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out |= {
            p + "input_layernorm.weight": norm(),
            p + "self_attn.q_proj.weight": w(h * hd, d),
            p + "self_attn.k_proj.weight": w(kv * hd, d),
            p + "self_attn.v_proj.weight": w(kv * hd, d),
            p + "self_attn.o_proj.weight": w(d, h * hd),
            p + "post_attention_layernorm.weight": norm(),
            p + "mlp.gate_proj.weight": w(ff, d),
            p + "mlp.up_proj.weight": w(ff, d),
            p + "mlp.down_proj.weight": w(d, ff),
        }
    if not cfg["tie_word_embeddings"]:
        out["lm_head.weight"] = w(v, d)
    return out


# --- the reference: transformers' Llama, written from its equations in numpy -----------------------


def ref_inv_freq(cfg: dict) -> np.ndarray:
    """modeling_rope_utils: the default inverse frequencies, then linear's or llama3's scaling (float32
    as there)."""
    hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    inv = (1.0 / (cfg["rope_theta"] ** (np.arange(0, hd, 2).astype(np.float32) / hd))).astype(np.float32)
    rs = cfg.get("rope_scaling")
    kind = rs.get("rope_type", rs.get("type")) if rs else "default"
    if kind == "linear":
        return inv / np.float32(rs["factor"])
    if kind != "llama3":
        return inv
    factor, low, high = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
    old = rs["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old / low, old / high
    wavelen = 2 * math.pi / inv
    inv_llama = np.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * inv_llama / factor + smooth * inv_llama
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, inv_llama).astype(np.float32)


def rms(x, w, eps):
    return w * (x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps))


def rotate_half(x):
    x1, x2 = np.split(x, 2, axis=-1)
    return np.concatenate([-x2, x1], axis=-1)


def ref_attention(W, p, h, cfg, cos, sin):
    t, d = h.shape
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or d // heads
    q = (h @ W[p + "self_attn.q_proj.weight"].T).reshape(t, heads, hd).transpose(1, 0, 2)
    k = (h @ W[p + "self_attn.k_proj.weight"].T).reshape(t, kv, hd).transpose(1, 0, 2)
    v = (h @ W[p + "self_attn.v_proj.weight"].T).reshape(t, kv, hd).transpose(1, 0, 2)
    q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin  # apply_rotary_pos_emb
    k, v = np.repeat(k, heads // kv, axis=0), np.repeat(v, heads // kv, axis=0)  # repeat_kv
    scores = q @ k.transpose(0, 2, 1) * hd**-0.5 + np.triu(np.full((t, t), -np.inf), 1)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return (probs @ v).transpose(1, 0, 2).reshape(t, heads * hd) @ W[p + "self_attn.o_proj.weight"].T


def ref_logits(W: dict, cfg: dict, ids: np.ndarray) -> np.ndarray:
    """LlamaForCausalLM's logits [T, vocab] for token ids [T], in float64."""
    W = {k: v.astype(np.float64) for k, v in W.items()}
    eps = cfg["rms_norm_eps"]
    freqs = np.arange(len(ids))[:, None] * ref_inv_freq(cfg).astype(np.float64)[None, :]
    emb = np.concatenate([freqs, freqs], -1)
    cos, sin = np.cos(emb), np.sin(emb)
    x = W["model.embed_tokens.weight"][ids]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        x = x + ref_attention(W, p, rms(x, W[p + "input_layernorm.weight"], eps), cfg, cos, sin)
        h = rms(x, W[p + "post_attention_layernorm.weight"], eps)
        gate, up = h @ W[p + "mlp.gate_proj.weight"].T, h @ W[p + "mlp.up_proj.weight"].T
        x = x + (gate / (1 + np.exp(-gate)) * up) @ W[p + "mlp.down_proj.weight"].T
    x = rms(x, W["model.norm.weight"], eps)
    head = W["model.embed_tokens.weight"] if cfg["tie_word_embeddings"] else W["lm_head.weight"]
    return x @ head.T


# --- the tests ---------------------------------------------------------------------------------------


def write_hf(directory, cfg: dict, tensors: dict, shards: int = 1) -> None:
    """config.json and `shards` safetensors files (as a sharded HF upload is split)."""
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(cfg))
    names = sorted(tensors)
    for s in range(shards):
        part = {n: tensors[n] for n in names[s::shards]}
        save_file(part, str(directory / f"model-{s + 1:05d}-of-{shards:05d}.safetensors"), metadata={"format": "pt"})


def ftjax_model(config_yaml, ckpt):
    """The model the written config describes, with the converted checkpoint's parameters."""
    settings = yaml.safe_load(config_yaml.read_text())["model"]
    with nnx.use_eager_sharding(False):
        model = models.build(ModelConfig(**settings, compute_dtype="float32"), nnx.Rngs(0))
    tree = ocp.PyTreeCheckpointer().restore(ckpt.absolute())
    graphdef, state = nnx.split(model)
    pure = state.to_pure_dict()
    fill = lambda want, have: (
        {k: fill(want[k], have[str(k)]) for k in want} if isinstance(want, dict) else np.asarray(have)
    )
    nnx.replace_by_pure_dict(state, fill(pure, tree))
    return nnx.merge(graphdef, state)


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_converted_hf_llama_gives_the_reference_logits_and_converts_back_bitwise(case, tmp_path):
    cfg = hf_config(case)
    tensors = random_hf(cfg, seed=len(case))
    write_hf(tmp_path / "hf", cfg, tensors, shards=2)
    ckpt, written = tmp_path / "ckpt", tmp_path / "ckpt.yaml"
    assert ftjax(["convert", "hf", str(tmp_path / "hf"), "--out", str(ckpt)]) == 0
    model = ftjax_model(written, ckpt)
    ids = np.random.default_rng(0).integers(0, cfg["vocab_size"], 48)
    got = np.asarray(jax.jit(lambda t: model(t))(ids[None].astype(np.int32))[0])
    want = ref_logits(tensors, cfg, ids)
    assert want.std() > 0.5  # (logits of this size: an error in any term would show above 1e-4)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)

    assert ftjax(["convert", "to-hf", str(ckpt), "--out", str(tmp_path / "back")]) == 0
    with safe_open(str(tmp_path / "back" / "model.safetensors"), framework="numpy") as f:
        assert sorted(f.keys()) == sorted(tensors)
        for name in tensors:
            back = f.get_tensor(name)
            assert back.dtype == tensors[name].dtype and back.tobytes() == tensors[name].tobytes(), name
    back_cfg = json.loads((tmp_path / "back" / "config.json").read_text())
    rope = yaml.safe_load(written.read_text())["model"]["rope_scaling"]
    assert rope["rope_type"] == cfg["rope_scaling"].get("rope_type", cfg["rope_scaling"].get("type"))
    for key in ("hidden_size", "num_key_value_heads", "tie_word_embeddings", "rope_theta", "rms_norm_eps"):
        assert back_cfg[key] == cfg[key], key
    assert back_cfg["head_dim"] == cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    assert back_cfg["rope_scaling"]["factor"] == cfg["rope_scaling"]["factor"]


def test_bf16_weights_convert_to_float32_exactly(tmp_path):
    """HF weights ship in bfloat16: each widens to float32 exactly (every bf16 is a float32)."""
    cfg = hf_config("tied_gqa_llama3")
    tensors = {k: v.astype(bfloat16) for k, v in random_hf(cfg, seed=3).items()}
    write_hf(tmp_path / "hf", cfg, tensors)
    assert ftjax(["convert", "hf", str(tmp_path / "hf"), "--out", str(tmp_path / "ckpt")]) == 0
    tree = ocp.PyTreeCheckpointer().restore((tmp_path / "ckpt").absolute())
    assert tree["embed"].dtype == np.float32
    np.testing.assert_array_equal(tree["embed"], tensors["model.embed_tokens.weight"].astype(np.float32))
    wq = tensors["model.layers.1.self_attn.q_proj.weight"].astype(np.float32)
    np.testing.assert_array_equal(tree["blocks"]["1"]["attn"]["wq"], wq.T.reshape(64, 4, 16))


@pytest.mark.parametrize(
    "change, says",
    [
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' does not map"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling type 'yarn' does not map"),
        ({"model_type": "mistral"}, "only LlamaForCausalLM maps"),
    ],
)
def test_a_setting_that_does_not_map_is_refused_by_name(change, says, tmp_path, capsys):
    cfg = hf_config("tied_gqa_llama3")
    write_hf(tmp_path / "hf", {**cfg, **change}, random_hf(cfg, seed=1))
    assert ftjax(["convert", "hf", str(tmp_path / "hf"), "--out", str(tmp_path / "ckpt")]) == 2
    err = capsys.readouterr().err
    assert says in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "ckpt").exists()


def test_a_bias_tensor_is_refused_by_name(tmp_path, capsys):
    cfg = hf_config("tied_gqa_llama3")
    tensors = random_hf(cfg, seed=1) | {"model.layers.0.self_attn.q_proj.bias": np.zeros(64, np.float32)}
    write_hf(tmp_path / "hf", cfg, tensors)
    assert ftjax(["convert", "hf", str(tmp_path / "hf"), "--out", str(tmp_path / "ckpt")]) == 2
    assert "model.layers.0.self_attn.q_proj.bias: this tensor does not map" in capsys.readouterr().err


def abstract_params(m: ModelConfig) -> dict:
    """This model's parameters as a run's abstract state holds them: float32, placed on a device."""
    with nnx.use_eager_sharding(False):
        model = nnx.eval_shape(lambda: models.build(m, nnx.Rngs(0)))
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    pure = nnx.state(model, nnx.Param).to_pure_dict()
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device), pure)


def test_init_from_a_bf16_checkpoint_reads_it_and_casts_to_the_parameter_dtype(tmp_path):
    """A checkpoint kept in bfloat16 (`--dtype bfloat16`, half the disk and host memory) starts a
    float32 run: each leaf read as stored, widened on the device, exactly."""
    cfg = hf_config("untied_head_dim_linear")
    tensors = {k: v.astype(bfloat16) for k, v in random_hf(cfg, seed=5).items()}
    write_hf(tmp_path / "hf", cfg, tensors)
    ckpt = tmp_path / "ckpt"
    assert ftjax(["convert", "hf", str(tmp_path / "hf"), "--out", str(ckpt), "--dtype", "bfloat16"]) == 0
    assert ocp.PyTreeCheckpointer().restore(ckpt.absolute())["embed"].dtype == bfloat16
    m = ModelConfig(**yaml.safe_load((tmp_path / "ckpt.yaml").read_text())["model"])
    abstract = abstract_params(m)
    loaded = checkpoint.load_init(ckpt, {"params": abstract}, opt=False, model=m)["params"]
    assert all(x.dtype == np.float32 for x in jax.tree.leaves(loaded))
    assert [x.sharding for x in jax.tree.leaves(loaded)] == [a.sharding for a in jax.tree.leaves(abstract)]
    head = tensors["lm_head.weight"].astype(np.float32).T
    np.testing.assert_array_equal(np.asarray(loaded["head"]), head)
    wo = tensors["model.layers.1.self_attn.o_proj.weight"].astype(np.float32)
    np.testing.assert_array_equal(np.asarray(loaded["blocks"][1]["attn"]["wo"]), wo.T.reshape(4, 16, 48))


@pytest.mark.parametrize(
    "change, says",
    [
        ({"rope_scaling": None}, "model.rope_scaling: checkpoint rope_type='llama3'"),
        ({"rope_theta": 500000.0}, "model.rope_theta: checkpoint 10000.0, this config 500000.0"),
    ],
)
def test_init_from_a_converted_checkpoint_refuses_a_config_of_other_rope(change, says, tmp_path):
    """The same weights under other RoPE settings are another model: refused, naming the setting."""
    cfg = hf_config("tied_gqa_llama3")
    write_hf(tmp_path / "hf", cfg, random_hf(cfg, seed=2))
    ckpt = tmp_path / "ckpt"
    assert ftjax(["convert", "hf", str(tmp_path / "hf"), "--out", str(ckpt)]) == 0
    settings = yaml.safe_load((tmp_path / "ckpt.yaml").read_text())["model"]
    m = ModelConfig(**settings)
    assert checkpoint.load_init(ckpt, {"params": abstract_params(m)}, opt=False, model=m)["params"]["embed"] is not None
    other = ModelConfig(**{**settings, **change})
    with pytest.raises(checkpoint.InitCheckpointError, match="converted for another model") as e:
        checkpoint.load_init(ckpt, {"params": abstract_params(other)}, opt=False, model=other)
    assert says in str(e.value)


def ref_greedy(W: dict, cfg: dict, prompt: list[int], n: int) -> list[int]:
    """The reference's greedy decode: the whole sequence through `ref_logits` for each token."""
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(np.argmax(ref_logits(W, cfg, np.asarray(ids))[-1])))
    return ids[len(prompt) :]


def generated(capsys, *argv) -> list[int]:
    assert ftjax(["generate", *argv]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])["ids"]


@pytest.mark.parametrize("case", sorted(CASES))
def test_generate_greedy_from_a_converted_checkpoint_is_the_references_greedy(case, tmp_path, capsys):
    """`ftjax generate` (KV cache, one position a step) emits the reference's greedy 32 tokens, and
    sampling from the top 5 picks each token among the reference's 5
    most likely at that point. (Untied: a random tied model only repeats its last token, whose own
    embedding dominates the residual stream.)"""
    cfg = hf_config(case) | {"tie_word_embeddings": False}
    tensors = random_hf(cfg, seed=11)
    write_hf(tmp_path / "hf", cfg, tensors)
    ckpt = str(tmp_path / "ckpt")
    assert ftjax(["convert", "hf", str(tmp_path / "hf"), "--out", ckpt]) == 0
    capsys.readouterr()
    prompt = [5, 17, 42, 3, 60]
    ids = ",".join(map(str, prompt))
    want = ref_greedy(tensors, cfg, prompt, 32)
    assert len(set(want)) > 3  # (not one token repeated: the cache's positions matter)
    assert generated(capsys, ckpt, "--prompt-ids", ids, "--max-new-tokens", "32") == want
    top5 = ["--temperature", "1", "--top-k", "5"]
    sampled = generated(capsys, ckpt, "--prompt-ids", ids, "--max-new-tokens", "8", *top5)
    for i, token in enumerate(sampled):
        likely = np.argsort(ref_logits(tensors, cfg, np.asarray(prompt + sampled[:i]))[-1])[-5:]
        assert token in likely, (i, token, likely)


def test_ftjax_train_init_from_a_converted_checkpoint_starts_at_the_references_loss(tmp_path):
    """`ftjax train <the written model> --init-from <converted>`: the first step's loss is the
    reference model's mean next-token cross-entropy on that step's batch, to 1e-5 relative."""
    from ftjax.cli.train import build_parser, parse_config, run_standalone
    from ftjax.program.data import make_stream
    from ftjax.runtime.metrics import read_metrics

    cfg = hf_config("tied_gqa_llama3") | {"vocab_size": 256}  # (the built-in byte corpus' vocabulary)
    tensors = random_hf(cfg, seed=7)
    write_hf(tmp_path / "hf", cfg, tensors)
    ckpt = tmp_path / "ckpt"
    assert ftjax(["convert", "hf", str(tmp_path / "hf"), "--out", str(ckpt), "--seq-len", "32"]) == 0
    model = yaml.safe_load((tmp_path / "ckpt.yaml").read_text())["model"]
    run_cfg = {"steps": 1, "model": model, "data": {"source": "stdlib", "batch_size": 4}}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(run_cfg))
    argv = [str(tmp_path / "run.yaml"), "--out", str(tmp_path / "run"), "--init-from", str(ckpt)]
    args = build_parser().parse_intermixed_args(argv)
    run = parse_config(args)
    assert run_standalone(run, args, tmp_path / "run") == 0
    [first] = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if r["step"] == 1]
    batch = np.asarray(make_stream(run).batch(0))
    losses = []
    for row in batch:
        logits = ref_logits(tensors, cfg, row[:-1])
        logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
        losses.append(logz - logits[np.arange(len(row) - 1), row[1:]])
    assert first["loss"] == pytest.approx(float(np.mean(losses)), rel=1e-5)


def test_a_truncated_safetensors_file_is_refused_in_one_line(tmp_path, capsys):
    cfg = hf_config("tied_gqa_llama3")
    write_hf(tmp_path / "hf", cfg, random_hf(cfg, seed=1))
    [file] = (tmp_path / "hf").glob("*.safetensors")
    file.write_bytes(file.read_bytes()[:1000])
    assert ftjax(["convert", "hf", str(tmp_path / "hf"), "--out", str(tmp_path / "ckpt")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ftjax convert: ") and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize(
    "where, says",
    [
        ("missing", "{src}: no such file or directory"),
        ("missing/model.safetensors", "{src}: no such file or directory"),  # (not missing/config.json)
        ("empty", "{src}/config.json: no config.json (an HF checkpoint has one beside its safetensors)"),
    ],
)
def test_a_source_that_is_not_there_is_refused_naming_it(where, says, tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    src = tmp_path / where
    assert ftjax(["convert", "hf", str(src), "--out", str(tmp_path / "ckpt")]) == 2
    assert capsys.readouterr().err.strip() == "ftjax convert: " + says.format(src=src)
    assert not (tmp_path / "ckpt").exists()


# a child that converts and prints its own peak resident memory (KiB) as its last line: VmHWM,
# its address space's own (getrusage's ru_maxrss is kept across exec: it would be pytest's if larger)
PEAK = (
    "import sys\nfrom ftjax.cli.main import main\nrc = main(sys.argv[1:])\n"
    "print([line.split()[1] for line in open('/proc/self/status') if line.startswith('VmHWM')][0])\n"
    "sys.exit(rc)"
)


def peak_kib(src, out) -> int:
    done = subprocess.run(
        [sys.executable, "-c", PEAK, "convert", "hf", str(src), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    return int(done.stdout.split()[-1])


def test_convert_holds_one_tensor_in_memory_not_the_checkpoint(tmp_path):
    """A 200 MiB float32 checkpoint whose largest tensor is 40 MiB, stored in bfloat16 (cast to
    float32 as it is read, 4 MiB at a time): the converter's peak resident memory exceeds that of the same conversion
    of a 64 KiB model (the interpreter, JAX, orbax and tensorstore loaded and working) by <= 1.5 x
    40 MiB + 4 MiB (two processes' allocators differ by < 1 MiB run to run). Writing the tree whole
    peaked 3x the checkpoint above it; the result is still a plain orbax checkpoint that
    StandardCheckpointer restores, every tensor bit for bit."""
    cfg = hf_config("untied_head_dim_linear") | dict(
        hidden_size=1024, num_attention_heads=16, num_key_value_heads=16, head_dim=64, intermediate_size=2048
    )
    rng = np.random.default_rng(0)
    big = {}
    for name, x in random_hf(cfg | dict(num_hidden_layers=1, vocab_size=2), seed=0).items():
        big[name] = rng.standard_normal((10240, 1024) if x.shape[0] == 2 else x.shape, dtype=np.float32)
    big |= {n.replace("layers.0.", f"layers.{i}."): x for n, x in big.items() if ".0." in n for i in (1, 2)}
    big = {n: x.astype(bfloat16) for n, x in big.items()}  # (as released: cast to float32 as read)
    write_hf(tmp_path / "big", cfg | dict(vocab_size=10240, num_hidden_layers=3), big)
    largest = 40 * 1024  # KiB: a float32 [10240, 1024] (the head; the embedding once cast)
    tiny = hf_config("untied_head_dim_linear")
    write_hf(tmp_path / "tiny", tiny, random_hf(tiny, seed=0))
    baseline = peak_kib(tmp_path / "tiny", tmp_path / "tiny-ckpt")
    peak = peak_kib(tmp_path / "big", tmp_path / "ckpt")
    assert peak - baseline <= 1.5 * largest + 4 * 1024, (peak, baseline, largest)
    tree = ocp.StandardCheckpointer().restore((tmp_path / "ckpt").absolute())
    np.testing.assert_array_equal(tree["embed"], big["model.embed_tokens.weight"].astype(np.float32))
    np.testing.assert_array_equal(tree["head"], big["lm_head.weight"].astype(np.float32).T)
    wo = big["model.layers.2.self_attn.o_proj.weight"]
    np.testing.assert_array_equal(tree["blocks"]["2"]["attn"]["wo"], wo.astype(np.float32).T.reshape(16, 64, 1024))
    w_down = big["model.layers.1.mlp.down_proj.weight"].astype(np.float32)
    np.testing.assert_array_equal(tree["blocks"]["1"]["mlp"]["w_down"], w_down.T)
    assert sorted(p.name for p in tmp_path.iterdir() if "ckpt" in p.name) == sorted(
        ["ckpt", "ckpt.yaml", "tiny-ckpt", "tiny-ckpt.yaml"]
    )  # (no staging directory left behind)
