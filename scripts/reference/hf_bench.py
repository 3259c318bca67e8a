#!/usr/bin/env python3
"""HF transformers side of ``tandem bench cpu``: prefill and decode throughput in float32.

What it measures (all on CPU, float32, ``torch.set_num_threads(--threads)``):

* prefill_tok_s: one forward over a batch-1 prompt of ``--prompt-len`` random
  token ids (no KV cache kept); median of ``--repeats`` runs after one warm-up.
  prefill_tok_s = prompt_len / median_time.
* decode_tok_s[B] for each B in ``--batches``: a batch of B random-token prompts,
  all ``--prompt-len`` long, run through
  ``generate(do_sample=False, min_new_tokens=n, max_new_tokens=n)`` for n = gen
  and n = 1 (median of ``--repeats`` each, after a warm-up). generate(n=1) is the
  prefill plus the first token; generate(n=gen) adds gen-1 decode steps, each
  making B tokens. So
      decode_tok_s[B] = B * (gen - 1) / (t_gen - t_1)
  which leaves prefill out. (B * gen / (t_gen - t_1) would count one step too
  many; the raw medians are printed so either can be recomputed.)

The last line of stdout is ONE JSON object:
  {"prefill_tok_s": float, "decode_tok_s": {"1": float, "16": float},
   "threads": int, "torch": str, "transformers": str, ...extra keys: raw timings,
   the same rates from the fastest run (*_best), model, prompt_len, gen,
   loadavg before/after, cpu}

Re-run (CPU only; a few minutes for SmolLM2-135M on 2 threads):

    /tmp/refvenv/bin/python scripts/reference/hf_bench.py \\
        --gguf /tmp/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --threads 2 --prompt-len 128 --gen 32 --batches 1,16

(or ``--model-dir DIR`` for a HF safetensors directory). Last run with torch
2.15.0 (+cu132 wheel, CPU), transformers 5.23.0, accelerate 1.15.0, gguf 0.19.0;
numbers are only comparable on an otherwise idle machine: the JSON records the
1-minute load average before and after so a busy run can be spotted.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM

SEED = 0


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def timed(fn, repeats: int) -> list[float]:
    fn()  # warm-up
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--gguf", type=Path, help="GGUF file (de-quantized to float32 by transformers)")
    src.add_argument("--model-dir", type=Path, help="HF model directory (config.json + safetensors)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--batches", type=str, default="1,16")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",") if b.strip()]
    if args.gen < 2 or args.prompt_len < 1 or not batches or min(batches) < 1:
        ap.error("need --gen >= 2, --prompt-len >= 1 and positive --batches")

    torch.set_num_threads(args.threads)
    torch.set_num_interop_threads(1)
    torch.manual_seed(SEED)
    load_before = os.getloadavg()[0]

    if args.gguf is not None:
        model = AutoModelForCausalLM.from_pretrained(
            str(args.gguf.parent), gguf_file=args.gguf.name, dtype=torch.float32
        )
        model_name = str(args.gguf)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(args.model_dir), dtype=torch.float32)
        model_name = str(args.model_dir)
    model.eval()
    vocab = model.config.vocab_size
    gen_cfg = dict(do_sample=False, temperature=None, top_p=None, top_k=None)
    pad = model.generation_config.pad_token_id
    if pad is None:
        pad = 0

    g = torch.Generator().manual_seed(SEED)
    # Stay clear of the low ids, where the special tokens usually live.
    prompt = torch.randint(16, vocab, (1, args.prompt_len), generator=g)

    with torch.inference_mode():
        prefill_times = timed(lambda: model(prompt, use_cache=False), args.repeats)
    prefill_med = statistics.median(prefill_times)

    decode, decode_best = {}, {}
    raw = {"prefill_s": prefill_times}
    for b in batches:
        ids = torch.randint(16, vocab, (b, args.prompt_len), generator=g)
        mask = torch.ones_like(ids)

        def run(n: int, ids=ids, mask=mask) -> None:
            out = model.generate(
                ids,
                attention_mask=mask,
                min_new_tokens=n,
                max_new_tokens=n,
                pad_token_id=pad,
                **gen_cfg,
            )
            assert out.shape == (ids.shape[0], args.prompt_len + n), out.shape

        with torch.inference_mode():
            t1 = timed(lambda: run(1), args.repeats)
            tg = timed(lambda: run(args.gen), args.repeats)
        dt = statistics.median(tg) - statistics.median(t1)
        decode[str(b)] = b * (args.gen - 1) / dt if dt > 0 else None  # null: timing noise swamped it
        dt_best = min(tg) - min(t1)
        decode_best[str(b)] = b * (args.gen - 1) / dt_best if dt_best > 0 else None
        raw[f"batch{b}_generate_1_s"] = t1
        raw[f"batch{b}_generate_{args.gen}_s"] = tg
        print(f"batch {b}: decode {decode[str(b)]} tok/s (t_gen={statistics.median(tg):.3f}s, "
              f"t_1={statistics.median(t1):.3f}s)", file=sys.stderr, flush=True)

    result = {
        "prefill_tok_s": args.prompt_len / prefill_med,
        "decode_tok_s": decode,
        "threads": args.threads,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "model": model_name,
        "dtype": "float32",
        "prompt_len": args.prompt_len,
        "gen": args.gen,
        "repeats": args.repeats,
        "decode_formula": "B*(gen-1)/(median t_generate(gen) - median t_generate(1))",
        "prefill_tok_s_best": args.prompt_len / min(prefill_times),
        "decode_tok_s_best": decode_best,
        "best_note": "*_best use the fastest run instead of the median (less hurt by a busy machine)",
        "raw_seconds": raw,
        "loadavg_1m_before": load_before,
        "loadavg_1m_after": os.getloadavg()[0],
        "cpu": cpu_name(),
        "cpu_count": os.cpu_count(),
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
