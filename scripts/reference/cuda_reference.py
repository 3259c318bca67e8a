#!/usr/bin/env python3
"""Make bf16 random-weight Llama models plus HF transformers reference outputs (CUDA tests).

Usage (on the GPU machine, from the repository root; falls back to CPU without a GPU):

    python3 scripts/reference/cuda_reference.py OUTDIR [--only small|l3geom ...]

For each model writes ``OUTDIR/<name>/``, a normal HF model directory:

* ``config.json``, ``generation_config.json``, ``model.safetensors`` with the
  weights in **bfloat16** (``save_pretrained(..., safe_serialization=True)``), so
  the Rust engine and transformers read the exact same bf16 values;
* ``tokenizer.json`` and ``tokenizer_config.json`` copied from
  ``tests/fixtures/tiny/llama/`` (byte-level BPE, 347 tokens; only
  ``model_max_length`` is raised to the model's max_position_embeddings). The
  model vocab is larger than the tokenizer's: ids >= 347 have no text;
* ``expected.json``: for each prompt the last-position full-vocab logits of
  transformers run (a) in float32 (bf16 checkpoint loaded, then ``.float()``: the
  weights upcast exactly) and (b) in bfloat16 as saved; for ``small`` also
  32-token greedy continuations in both precisions. Schema:
  ``scripts/reference/README.md``.

Models (both seeded; weights drawn on the CPU with a fixed torch.Generator, so
the saved bf16 weights do not depend on the device):

* ``small``: hidden 256, 4 layers, 8/2 heads, head_dim 64, intermediate 688,
  vocab 1024, rope_theta 1e4, max_position 4096, untied.
* ``l3geom``: Llama-3-8B layer geometry (hidden 4096, 32/8 heads, head_dim 128,
  intermediate 14336, rope_theta 5e5 + llama3 scaling factor 8 / low 1 / high 4 /
  original max 8192, max_position 8192, untied), 2 layers, vocab 2048 (~0.45 B
  parameters, ~0.9 GB in bf16).

Init: each weight matrix is N(0, (c / sqrt(fan_in))^2), i.e. scaled to its fan-in
so both sizes behave alike: q/k c=1.5 (attention scores with std ~2, so
attention is far from uniform and a RoPE / masking / KV-cache bug moves the
logits), v and gate/up c=1, o and down c=0.5, lm_head c=2.5 (last-position
logits std ~2-3, so greedy is not a chain of near-ties), embeddings N(0,1),
RMSNorm weights U(0.8, 1.2) (a dropped norm weight shows). HF's default
initializer_range 0.02 would give near-uniform attention and a logits std of
~0.3 for the small model.

Prompts: fixed seeded random token ids in [3, 347) of lengths 1, 7, 100, 700.

Float32 runs set ``torch.set_float32_matmul_precision("highest")`` (no TF32).
Attention is transformers' default (sdpa). Runtime on an H100: well under a
minute (most of it is building, saving and loading the 0.45 B model).
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

SEED = 20261121
PROMPT_LENGTHS = [1, 7, 100, 700]
PROMPT_ID_RANGE = (3, 347)  # non-special ids of the tiny tokenizer
GREEDY_NEW_TOKENS = 32
TOKENIZER_SRC = Path("tests/fixtures/tiny/llama")
TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json"]
BOS_ID, EOS_ID = 1, 2  # <|im_start|>, <|im_end|> in the tiny tokenizer

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

MODELS = {
    "small": dict(
        description="small: hidden 256, 4 layers, 8/2 heads, head_dim 64, rope_theta 1e4, untied",
        config=dict(
            hidden_size=256,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=64,
            intermediate_size=688,
            vocab_size=1024,
            max_position_embeddings=4096,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        ),
        greedy=True,
    ),
    "l3geom": dict(
        description="l3geom: Llama-3-8B layer geometry (4096 hidden, 32/8 heads, head_dim 128, "
        "14336 intermediate, llama3 rope scaling), 2 layers, vocab 2048, untied",
        config=dict(
            hidden_size=4096,
            num_hidden_layers=2,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            intermediate_size=14336,
            vocab_size=2048,
            max_position_embeddings=8192,
            rope_parameters=dict(LLAMA3_ROPE),
        ),
        greedy=False,
    ),
}

# weight std = INIT_GAIN[kind] / sqrt(fan_in)   (see the module docstring)
INIT_GAIN = {"q_proj": 1.5, "k_proj": 1.5, "v_proj": 1.0, "o_proj": 0.5,
             "gate_proj": 1.0, "up_proj": 1.0, "down_proj": 0.5, "lm_head": 2.5}


def make_config(spec: dict) -> LlamaConfig:
    return LlamaConfig(
        **spec["config"],
        hidden_act="silu",
        rms_norm_eps=1e-5,
        attention_bias=False,
        mlp_bias=False,
        tie_word_embeddings=False,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=None,
        use_cache=True,
        initializer_range=0.02,  # unused: init_weights() below replaces every weight
        architectures=["LlamaForCausalLM"],
    )


@torch.no_grad()
def init_weights(model: torch.nn.Module, seed: int) -> None:
    """Draw every parameter on the CPU from a seeded generator (device-independent)."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            w = 0.8 + 0.4 * torch.rand(p.shape, generator=gen)
        elif "embed_tokens" in name:
            w = torch.randn(p.shape, generator=gen)
        else:
            kind = name.split(".")[-2]
            if kind not in INIT_GAIN or p.dim() != 2:
                raise RuntimeError(f"unexpected parameter {name}")
            w = torch.randn(p.shape, generator=gen) * (INIT_GAIN[kind] / p.shape[1] ** 0.5)
        # round to bf16 here so the in-memory model equals the saved checkpoint
        p.copy_(w.to(torch.bfloat16))


def make_prompts(seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    lo, hi = PROMPT_ID_RANGE
    return [[int(x) for x in rng.integers(lo, hi, size=n)] for n in PROMPT_LENGTHS]


def f32_list(t: torch.Tensor) -> list[float]:
    # float32 values written as the shortest repr that round-trips to the same f32
    return [float(x) for x in t.detach().to(torch.float32).cpu().numpy().tolist()]


@torch.no_grad()
def last_logits(model, ids: list[int], device: torch.device) -> torch.Tensor:
    """Last-position logits, returned in the model's own output dtype (on CPU)."""
    out = model(torch.tensor([ids], dtype=torch.long, device=device)).logits[0, -1]
    return out.cpu()


@torch.no_grad()
def greedy(model, ids: list[int], device: torch.device) -> tuple[list[int], list[float]]:
    """generate() with eos disabled: always GREEDY_NEW_TOKENS argmax steps; + step margins."""
    out = model.generate(
        torch.tensor([ids], dtype=torch.long, device=device),
        attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=device),
        do_sample=False,
        max_new_tokens=GREEDY_NEW_TOKENS,
        min_new_tokens=GREEDY_NEW_TOKENS,
        eos_token_id=None,
        pad_token_id=0,
        output_scores=True,
        return_dict_in_generate=True,
        temperature=None,
        top_p=None,
        top_k=None,
    )
    new = out.sequences[0, len(ids):].tolist()
    assert len(new) == GREEDY_NEW_TOKENS, len(new)
    margins = []
    for s in out.scores:
        top2 = torch.topk(s[0].float(), 2).values
        margins.append(float(top2[0] - top2[1]))
    return new, margins


@torch.no_grad()
def greedy_no_cache(model, ids: list[int], device: torch.device) -> list[int]:
    """Independent check of generate(): full re-forward each step, plain argmax."""
    seq = list(ids)
    for _ in range(GREEDY_NEW_TOKENS):
        seq.append(int(torch.argmax(last_logits(model, seq, device).float())))
    return seq[len(ids):]


def top2_margin(x: torch.Tensor) -> float:
    v = torch.topk(x.float(), 2).values
    return float(v[0] - v[1])


def versions() -> dict:
    import safetensors
    import tokenizers

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "safetensors": safetensors.__version__,
        "numpy": np.__version__,
    }


def write_model_dir(name: str, spec: dict, seed: int, d: Path, device: torch.device) -> None:
    cfg = make_config(spec)
    # Build on the target device (fast default init there), then overwrite every weight.
    with torch.device(device):
        model = LlamaForCausalLM(cfg)
    init_weights(model, seed)
    model = model.to(torch.bfloat16).eval()
    if d.exists():
        shutil.rmtree(d)
    d.mkdir(parents=True)
    model.save_pretrained(d, safe_serialization=True)
    del model
    for f in TOKENIZER_FILES:
        shutil.copyfile(TOKENIZER_SRC / f, d / f)
    tc_path = d / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text())
    tc["model_max_length"] = cfg.max_position_embeddings
    tc_path.write_text(json.dumps(tc, indent=2, sort_keys=True) + "\n")


def run_model(name: str, spec: dict, index: int, outdir: Path, device: torch.device) -> str:
    t_start = time.perf_counter()
    d = outdir / name
    weight_seed = SEED + 1000 * index
    prompt_seed = SEED + 1000 * index + 1
    write_model_dir(name, spec, weight_seed, d, device)
    prompts = make_prompts(prompt_seed)

    # (b) bf16, exactly as saved
    m16 = AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16).to(device).eval()
    assert all(p.dtype == torch.bfloat16 for p in m16.parameters())
    attn_impl = getattr(m16.config, "_attn_implementation", None)
    cases = [{"name": f"random_{len(p)}", "prompt": p} for p in prompts]
    for c in cases:
        lg = last_logits(m16, c["prompt"], device)
        c["_logits_bf16_dtype"] = str(lg.dtype).replace("torch.", "")
        c["logits_bf16"] = f32_list(lg)
        if spec["greedy"]:
            new, margins = greedy(m16, c["prompt"], device)
            c["greedy_bf16"] = new
            c["greedy_bf16_margins"] = margins
            c["greedy_bf16_matches_no_cache"] = new == greedy_no_cache(m16, c["prompt"], device)

    # (a) float32: the bf16 checkpoint upcast (exact), all-f32 math
    m32 = m16.float()  # in place: the bf16 model is gone after this
    del m16
    assert all(p.dtype == torch.float32 for p in m32.parameters())
    for c in cases:
        lg = last_logits(m32, c["prompt"], device)
        assert lg.dtype == torch.float32 and torch.isfinite(lg).all(), (name, c["name"])
        c["logits_f32"] = f32_list(lg)
        if spec["greedy"]:
            new, margins = greedy(m32, c["prompt"], device)
            c["greedy_f32"] = new
            c["greedy_f32_margins"] = margins
            c["greedy_f32_matches_no_cache"] = new == greedy_no_cache(m32, c["prompt"], device)

    # statistics, and sanity checks on the spread of the logits
    for c in cases:
        a = torch.tensor(c["logits_f32"])
        b = torch.tensor(c["logits_bf16"])
        c["stats"] = {
            "logits_f32_std": float(a.std()),
            "logits_f32_range": float(a.max() - a.min()),
            "argmax_f32": int(a.argmax()),
            "argmax_bf16": int(b.argmax()),
            "top2_margin_f32": top2_margin(a),
            "max_abs_diff_f32_bf16": float((a - b).abs().max()),
        }
        assert torch.isfinite(b).all(), (name, c["name"], "bf16 logits not finite")
        assert c["stats"]["logits_f32_range"] > 1.0 and c["stats"]["logits_f32_std"] > 0.5, (
            name, c["name"], "degenerate logits", c["stats"])

    rope_check = None
    if cfg_rope_type(spec) == "llama3":
        # Same weights with the scaling removed: long prompts must give other logits.
        plain_cfg = copy.deepcopy(m32.config)
        plain_cfg.rope_parameters = {"rope_type": "default", "rope_theta": LLAMA3_ROPE["rope_theta"]}
        with torch.device(device):
            plain = LlamaForCausalLM(plain_cfg).float().eval()
        plain.load_state_dict(m32.state_dict())
        diffs = {}
        for c in cases:
            lg = last_logits(plain, c["prompt"], device)
            diffs[c["name"]] = float((torch.tensor(c["logits_f32"]) - lg.float()).abs().max())
        del plain
        rope_check = {
            "description": "max |logits_f32 - logits_f32 of the same weights with rope_type "
            "default| per prompt: position 0 is unaffected; the long prompts must differ",
            "max_abs_diff": diffs,
        }
        assert diffs["random_1"] < 1e-3, diffs
        assert diffs[f"random_{max(PROMPT_LENGTHS)}"] > 1e-2, diffs

    n_params = sum(p.numel() for p in m32.parameters())
    cfg = m32.config
    del m32
    if device.type == "cuda":
        torch.cuda.empty_cache()

    summary = {}
    if spec["greedy"]:
        for prec in ("f32", "bf16"):
            summary[f"greedy_{prec}_min_margin"] = min(m for c in cases for m in c[f"greedy_{prec}_margins"])
            summary[f"greedy_{prec}_all_match_no_cache"] = all(c[f"greedy_{prec}_matches_no_cache"] for c in cases)
        summary["greedy_f32_bf16_identical_prompts"] = sum(c["greedy_f32"] == c["greedy_bf16"] for c in cases)

    logits_dtype = {c.pop("_logits_bf16_dtype") for c in cases}
    expected = {
        "model": name,
        "description": spec["description"],
        "architecture": "LlamaForCausalLM",
        "weights_dtype": "bfloat16",
        "num_parameters": n_params,
        "vocab_size": cfg.vocab_size,
        "tokenizer_vocab_size": 347,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "config": {k: getattr(cfg, k) for k in (
            "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "head_dim", "intermediate_size", "vocab_size", "max_position_embeddings",
            "rms_norm_eps", "tie_word_embeddings")} | {"rope_parameters": dict(cfg.rope_parameters)},
        "precisions": {
            "f32": "checkpoint loaded in bf16, then model.float() (exact upcast); float32 math, "
            "torch.set_float32_matmul_precision('highest') (no TF32)",
            "bf16": "checkpoint loaded in bfloat16 as saved; transformers' bf16 math; logits "
            f"produced as {sorted(logits_dtype)} and written as float",
        },
        "attn_implementation": attn_impl,
        "logits_position": "last prompt position: model(prompt).logits[0, -1], full vocab row",
        "generation": None if not spec["greedy"] else {
            "max_new_tokens": GREEDY_NEW_TOKENS,
            "do_sample": False,
            "eos_handling": "generate() with eos_token_id=None and min_new_tokens=max_new_tokens: "
            "exactly 32 argmax steps over the full vocab, no stop, no masking (ids >= 347 and "
            "the eos id 2 can occur)",
            "margins": "greedy_*_margins[i] = top1 - top2 score at step i; a small one is a "
            "near-tie that another implementation may break the other way",
            **summary,
        },
        "cases": cases,
        "rope_scaling_check": rope_check,
        "seeds": {"weights": weight_seed, "prompts": prompt_seed},
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "versions": versions(),
        "generated_by": "scripts/reference/cuda_reference.py",
    }
    (d / "expected.json").write_text(json.dumps(expected, indent=1) + "\n")

    stats = [c["stats"] for c in cases]
    line = (
        f"{name}: params={n_params / 1e6:.1f}M "
        f"logits_std={[round(s['logits_f32_std'], 2) for s in stats]} "
        f"min_top2={min(s['top2_margin_f32'] for s in stats):.3f} "
        f"max|f32-bf16|={max(s['max_abs_diff_f32_bf16'] for s in stats):.3f} "
        f"argmax_agree={sum(s['argmax_f32'] == s['argmax_bf16'] for s in stats)}/{len(stats)}"
    )
    if spec["greedy"]:
        line += (
            f" greedy_f32==bf16={summary['greedy_f32_bf16_identical_prompts']}/{len(cases)}"
            f" no_cache_ok={summary['greedy_f32_all_match_no_cache']}/{summary['greedy_bf16_all_match_no_cache']}"
            f" min_margin={summary['greedy_f32_min_margin']:.3f}/{summary['greedy_bf16_min_margin']:.3f}"
        )
    if rope_check:
        line += f" rope_scaling_diff={max(rope_check['max_abs_diff'].values()):.3f}"
    line += f" time={time.perf_counter() - t_start:.1f}s dir={d}"
    return line


def cfg_rope_type(spec: dict) -> str:
    return spec["config"]["rope_parameters"].get("rope_type", "default")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("outdir", type=Path)
    ap.add_argument("--only", nargs="+", choices=sorted(MODELS), help="make only these models")
    ap.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    args = ap.parse_args()

    repo = Path(__file__).resolve().parents[2]
    global TOKENIZER_SRC
    TOKENIZER_SRC = repo / TOKENIZER_SRC
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.set_float32_matmul_precision("highest")
    torch.manual_seed(SEED)
    if device.type == "cpu":
        print("cuda_reference: no GPU, running on CPU (slow for l3geom)", file=sys.stderr)
    t0 = time.perf_counter()
    args.outdir.mkdir(parents=True, exist_ok=True)
    for index, (name, spec) in enumerate(MODELS.items()):
        if args.only and name not in args.only:
            continue
        print(run_model(name, spec, index, args.outdir, device), flush=True)
    print(f"cuda_reference: done in {time.perf_counter() - t0:.1f}s on "
          f"{torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
