#!/usr/bin/env python3
"""HF transformers side of ``tandem bench engine``: offline bf16 throughput on the GPU.

    python3 scripts/reference/hf_offline_bench.py --out FILE.json \\
        [--requests 256 --prompt-len 512 --output-len 256] [--quick]

Model: Llama-3.1-8B geometry (hidden 4096, 32 layers, 32/8 heads, head_dim 128,
intermediate 14336, vocab 128256, rope_theta 5e5 + llama3 scaling factor 8 / low 1 /
high 4 / original max 8192, max_position 131072, untied) with random bf16 weights
made directly on the GPU (transformers' own init, seeded; nothing is saved). Prompts:
``--requests`` seeded random id lists, all ``--prompt-len`` long. eos is disabled
everywhere, so every request makes exactly ``--output-len`` tokens.

Measured, each once, in this order (generate_batch last: it switches the model's
attention to a paged one while it runs):

static         ``model.generate(do_sample=False, min_new_tokens=max_new_tokens=output_len)``
               over all requests in batches of B, B = 256, then 128, then 64 (capped at
               --requests): the first B that does not run out of GPU memory is kept.
               Warm-up: one generate of 4 tokens on B full-length prompts (also probes the
               prefill memory). tok_s = requests * output_len / wall time (prefill included).
generate_batch transformers' continuous batching, ``model.generate_batch(inputs=[ids...],
               generation_config=GenerationConfig(max_new_tokens=output_len, do_sample=False))``
               with default ContinuousBatchingConfig. tok_s = generated tokens / (last
               request finished - first request created); tok_s_wall also counts the
               manager's setup and warm-up (CUDA graph capture, KV allocation), which
               generate_batch does itself before taking the requests. Any exception is
               recorded as {"error": "..."}.
batch1         one 512-token prompt (``--batch1-prompt-len``): generate 128 tokens and
               generate 1 token, after an 8-token warm-up;
               batch1_ms_per_token = (t_128 - t_1) / 127 * 1000 (decode only);
               batch1_ms_per_token_incl_prefill = t_128 / 128 * 1000.

Output: ``--out`` gets one JSON object (also printed as the last stdout line):
  {"static": {"batch": B, "tok_s": float, "seconds": float, "requests": int} | {"error": str},
   "static_tries": [{"batch": B, "ok": bool, "error"?: str, "tok_s"?: float}],
   "generate_batch": {"tok_s": float, "tok_s_wall": float, ...} | {"error": str},
   "batch1_ms_per_token": float, "batch1_ms_per_token_incl_prefill": float,
   "requests", "prompt_len", "output_len", "quick", "device", "transformers", "torch", ...}

``--quick``: 16 requests, output_len 32 (smoke test; overrides --requests and
--output-len, which ``tandem bench engine`` always passes). ``--tiny`` replaces the model
by a 2-layer hidden-256 one so the whole script can be tried on a CPU. A normal run
(256 requests x 512 + 256) should take ~3-4 minutes on an H100 (estimated, not yet
measured: ~30 s static, ~2 min generate_batch, from the anchors measured on one H100
with transformers 5.17: static B=128 2,223 out tok/s, B=64 1,307, generate_batch 563,
batch-1 74 ms/token); use a smaller ``--requests`` to shorten it; the JSON says how
many were run.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
import traceback

import torch
import transformers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

SEED = 0
STATIC_BATCHES = [256, 128, 64]
BATCH1_NEW_TOKENS = 128


def model_config(tiny: bool) -> LlamaConfig:
    geometry = dict(
        hidden_size=4096,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=14336,
        vocab_size=128256,
    )
    if tiny:  # CPU smoke test of the script itself
        geometry = dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=8,
                        num_key_value_heads=2, head_dim=32, intermediate_size=512, vocab_size=1024)
    return LlamaConfig(
        **geometry,
        hidden_act="silu",
        rms_norm_eps=1e-5,
        max_position_embeddings=131072,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,  # never stop early
        pad_token_id=0,
        use_cache=True,
        initializer_range=0.02,
    )


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e).lower()


def err(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:500]


def static_generate(model, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
    return model.generate(
        prompts,
        attention_mask=torch.ones_like(prompts),
        do_sample=False,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        eos_token_id=None,
        pad_token_id=0,
        temperature=None,
        top_p=None,
        top_k=None,
    )


@torch.inference_mode()
def bench_static(model, prompts: torch.Tensor, output_len: int, device: torch.device) -> tuple[dict, list]:
    n = prompts.shape[0]
    tries = []
    for b in sorted({min(x, n) for x in STATIC_BATCHES}, reverse=True):
        t = msg = None
        oom = False
        try:
            # warm-up with a full batch of full-length prompts: also probes the prefill memory
            out = static_generate(model, prompts[:b], 4)
            assert out.shape == (b, prompts.shape[1] + 4), out.shape
            del out
            sync(device)
            t0 = time.perf_counter()
            for i in range(0, n, b):
                out = static_generate(model, prompts[i:i + b], output_len)
                assert out.shape[1] == prompts.shape[1] + output_len, out.shape
                del out
            sync(device)
            t = time.perf_counter() - t0
        except Exception as e:  # noqa: BLE001 - OOM is the expected one; anything else is recorded
            oom, msg = is_oom(e), err(e)
            if not oom:
                traceback.print_exc()
        if msg is None:
            rate = n * output_len / t
            tries.append({"batch": b, "ok": True, "tok_s": rate, "seconds": t})
            print(f"static B={b}: {rate:.1f} out tok/s ({n} requests, {t:.1f}s)", file=sys.stderr, flush=True)
            return {"batch": b, "tok_s": rate, "seconds": t, "requests": n}, tries
        free_memory(device)  # the exception (and the tensors its frames held) is gone here
        tries.append({"batch": b, "ok": False, "oom": oom, "error": msg})
        print(f"static B={b}: failed ({msg})", file=sys.stderr, flush=True)
        if not oom:
            break
    return {"error": "no batch size worked: " + "; ".join(t["error"] for t in tries)}, tries


# Not under inference_mode: generate_batch runs the model in a background thread, and tensors
# made here in inference mode then fail there ("Inplace update to inference tensor ...").
def bench_generate_batch(model, prompt_lists: list[list[int]], output_len: int, device: torch.device) -> dict:
    if not hasattr(model, "generate_batch"):
        return {"error": f"model has no generate_batch (transformers {transformers.__version__})"}
    gen_cfg = GenerationConfig(
        max_new_tokens=output_len,  # no min_new_tokens: with eos disabled it is moot, and a
        do_sample=False,            # logits processor would slow continuous batching down
        eos_token_id=-1,  # continuous batching's "disabled"
        pad_token_id=0,
    )
    orig_attn = getattr(model.config, "_attn_implementation", None)
    try:
        # No separate warm-up call: each call builds its own manager, sized for its workload, and
        # warms it up (CUDA graph capture) before the requests are added; tok_s leaves that out.
        sync(device)
        t0 = time.perf_counter()
        results = model.generate_batch(inputs=prompt_lists, generation_config=gen_cfg, progress_bar=False)
        sync(device)
        wall = time.perf_counter() - t0
    finally:
        # generate_batch switches the model to a paged attention; it should switch back, make sure
        if orig_attn and getattr(model.config, "_attn_implementation", None) != orig_attn:
            model.set_attn_implementation(orig_attn)
    outs = list(results.values()) if isinstance(results, dict) else list(results)
    lens = [len(getattr(o, "generated_tokens", []) or []) for o in outs]
    errors = [o.error for o in outs if getattr(o, "error", None)]
    total = sum(lens)
    res = {
        "requests": len(prompt_lists),
        "completed": len(outs),
        "generated_tokens": total,
        "expected_tokens": len(prompt_lists) * output_len,
        "wall_seconds": wall,
        "tok_s_wall": total / wall if wall > 0 else None,
    }
    try:
        start = min(o.created_time for o in outs)
        end = max(o.lifespan[1] for o in outs)
        if end > start:
            res["seconds"] = end - start
            res["tok_s"] = total / (end - start)
    except Exception as e:  # noqa: BLE001 - timestamps are a nicety
        res["timestamps_error"] = err(e)
    res.setdefault("tok_s", res["tok_s_wall"])
    if errors:
        res["request_errors"] = errors[:5]
        res["failed_requests"] = len(errors)
    if total == 0:
        res["error"] = "no tokens generated" + (f": {errors[0]}" if errors else "")
        res["tok_s"] = res["tok_s_wall"] = None
    if total != res["expected_tokens"]:
        res["warning"] = "generated token count differs from requests * output_len"
    r1 = lambda x: None if x is None else round(x, 1)  # noqa: E731
    print(f"generate_batch: {r1(res['tok_s'])} out tok/s (wall incl. setup {r1(res['tok_s_wall'])}; "
          f"{total} tokens, {wall:.1f}s)", file=sys.stderr, flush=True)
    return res


@torch.inference_mode()
def bench_batch1(model, prompt: torch.Tensor, device: torch.device) -> dict:
    def timed(n: int) -> float:
        sync(device)
        t0 = time.perf_counter()
        out = static_generate(model, prompt, n)
        sync(device)
        assert out.shape[1] == prompt.shape[1] + n
        return time.perf_counter() - t0

    timed(8)  # warm-up
    t1 = timed(1)
    tn = timed(BATCH1_NEW_TOKENS)
    res = {
        "batch1_ms_per_token": (tn - t1) / (BATCH1_NEW_TOKENS - 1) * 1000.0,
        "batch1_ms_per_token_incl_prefill": tn / BATCH1_NEW_TOKENS * 1000.0,
        "batch1_seconds": {"generate_1": t1, f"generate_{BATCH1_NEW_TOKENS}": tn},
    }
    print(f"batch1: {res['batch1_ms_per_token']:.2f} ms/token decode "
          f"({res['batch1_ms_per_token_incl_prefill']:.2f} incl. prefill)", file=sys.stderr, flush=True)
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--batch1-prompt-len", type=int, default=512)
    ap.add_argument("--quick", action="store_true",
                    help="smoke test: 16 requests, output_len 32 (overrides --requests/--output-len)")
    ap.add_argument("--tiny", action="store_true", help="tiny model instead of 8B geometry (CPU test)")
    ap.add_argument("--skip", default="", help="comma list of phases to skip: static,generate_batch,batch1")
    ap.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    args = ap.parse_args()
    if args.quick:  # wins over --requests/--output-len (tandem bench engine always passes those)
        args.requests, args.output_len = 16, 32
    if args.requests < 1 or args.prompt_len < 1 or args.output_len < 1:
        ap.error("--requests, --prompt-len and --output-len must be positive")
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    result: dict = {
        "model": "random bf16 weights, " + ("tiny test geometry" if args.tiny else "Llama-3.1-8B geometry"),
        "requests": args.requests,
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        "quick": args.quick,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "transformers": transformers.__version__,
        "torch": torch.__version__,
    }

    def write() -> None:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")

    t_all = time.perf_counter()
    try:
        torch.manual_seed(SEED)
        cfg = model_config(args.tiny)
        t0 = time.perf_counter()
        torch.set_default_dtype(torch.bfloat16)
        try:
            with torch.device(device):
                model = LlamaForCausalLM(cfg)
        finally:
            torch.set_default_dtype(torch.float32)
        model = model.to(torch.bfloat16).eval()
        model.generation_config.eos_token_id = None
        model.generation_config.pad_token_id = 0
        sync(device)
        result["model_build_seconds"] = time.perf_counter() - t0
        result["num_parameters"] = sum(p.numel() for p in model.parameters())
        result["attn_implementation"] = getattr(model.config, "_attn_implementation", None)
        print(f"model: {result['num_parameters'] / 1e9:.2f} B params, built in "
              f"{result['model_build_seconds']:.1f}s on {result['device']}", file=sys.stderr, flush=True)

        g = torch.Generator().manual_seed(SEED)
        prompts = torch.randint(16, cfg.vocab_size, (args.requests, args.prompt_len), generator=g)
        batch1_prompt = torch.randint(16, cfg.vocab_size, (1, args.batch1_prompt_len), generator=g)
        prompt_lists = prompts.tolist()
        prompts = prompts.to(device)
        batch1_prompt = batch1_prompt.to(device)
    except Exception as e:  # noqa: BLE001
        result["error"] = err(e)
        traceback.print_exc()
        write()
        print(json.dumps(result))
        return 1

    if "static" not in skip:
        try:
            result["static"], result["static_tries"] = bench_static(model, prompts, args.output_len, device)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            result["static"] = {"error": err(e)}
        free_memory(device)
        write()

    if "batch1" not in skip:
        try:
            result.update(bench_batch1(model, batch1_prompt, device))
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            result["batch1_ms_per_token"] = None
            result["batch1_error"] = err(e)
        write()

    if "generate_batch" not in skip:
        try:
            result["generate_batch"] = bench_generate_batch(model, prompt_lists, args.output_len, device)
        except Exception as e:  # noqa: BLE001 - the API moves between transformers versions
            traceback.print_exc()
            result["generate_batch"] = {"error": err(e)}
        free_memory(device)
        write()

    if device.type == "cuda":
        result["max_memory_allocated_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    result["total_seconds"] = time.perf_counter() - t_all
    write()
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
