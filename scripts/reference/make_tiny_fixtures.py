#!/usr/bin/env python3
"""Make tiny random-weight reference models plus HF transformers outputs for them.

Writes ``tests/fixtures/tiny/<variant>/`` for each variant (llama, gqa-tied,
llama3-rope, mistral). Each directory is a normal HF model directory:

* ``config.json``, ``generation_config.json``, ``model.safetensors`` (float32),
  written by ``save_pretrained(..., safe_serialization=True)``;
* ``tokenizer.json``: a tiny byte-level BPE trained here with the ``tokenizers``
  package on a fixed text (same tokenizer for all variants);
* ``tokenizer_config.json`` with a ChatML ``chat_template``;
* ``expected.json``: last-position full-vocab logits and 16-token greedy
  continuations computed by transformers in float32 (schema: see
  ``scripts/reference/README.md``).

Re-run (from the repository root; CPU only, about a minute):

    /tmp/refvenv/bin/pip install -r scripts/reference/requirements.txt   # once
    /tmp/refvenv/bin/python scripts/reference/make_tiny_fixtures.py

Last run with torch 2.15.0 (+cu132 wheel, CPU), transformers 5.23.0,
tokenizers 0.23.3, safetensors 0.8.0, numpy 2.4.6, Python 3 venv at
/tmp/refvenv. The versions actually used are also written into every
``expected.json``. torch threads = 2; all seeds fixed, so a re-run with the same
versions reproduces the files (the script checks that every saved model loads
back and gives the same logits).

Config format note: transformers 5 writes RoPE settings as ``rope_parameters``
(with ``rope_theta`` inside). Hub checkpoints made with older versions carry
top-level ``rope_theta`` and ``rope_scaling`` instead. To cover both, the
``llama`` and ``mistral`` variants keep the config exactly as transformers 5
wrote it, while ``gqa-tied`` and ``llama3-rope`` have their config.json
rewritten into the legacy form (``rope_theta`` / ``rope_scaling``, no
``rope_parameters``). The script re-loads the rewritten directory with
transformers and asserts identical logits; ``expected.json`` records which form
each variant uses under ``config_format``.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import sys
from pathlib import Path

import numpy as np
import safetensors
import tokenizers
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedTokenizerFast,
)

SEED = 1234
THREADS = 2
VOCAB_SIZE = 347  # deliberately not a multiple of 8/16/32: exercises lm_head tails
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2
BOS_ID = 1  # <|im_start|>
EOS_ID = 2  # <|im_end|>
INPUT_LENGTHS = [1, 7, 33, 70]  # 70 > 4 blocks of 16
NEW_TOKENS = 16

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)


def training_text() -> list[str]:
    """Fixed, deterministic training text for the tiny BPE (written for this script)."""
    subjects = ["The cat", "A small robot", "My neighbour", "The old river", "Every engine", "This model"]
    verbs = ["reads", "watches", "builds", "counts", "carries", "remembers"]
    objects = ["seven red boxes", "the quiet tokens", "a long sentence", "numbers and letters",
               "the last block", "twelve bright stars"]
    lines = []
    for i in range(240):
        s = subjects[i % len(subjects)]
        v = verbs[(i * 5 + 1) % len(verbs)]
        o = objects[(i * 7 + 2) % len(objects)]
        lines.append(f"{s} {v} {o} on day {i}, and then says: \"hello, world!\" ({i * 37 % 101}).")
    lines += [
        "def add(a, b):\n    return a + b\n",
        "for i in range(10):\n    print(i * i)\n",
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n",
        "Caf\u00e9 na\u00efve r\u00e9sum\u00e9 \u2014 \u00fcber \u65e5\u672c \U0001F600",
    ]
    return lines


def train_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(training_text(), trainer=trainer)
    assert tok.get_vocab_size() == VOCAB_SIZE, tok.get_vocab_size()
    for i, s in enumerate(SPECIALS):
        assert tok.token_to_id(s) == i, (s, tok.token_to_id(s))
    return tok


def base_kwargs() -> dict:
    return dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=160,
        head_dim=16,
        hidden_act="silu",
        rms_norm_eps=1e-5,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=None,
        use_cache=True,
        dtype="float32",
    )


def variant_configs() -> dict:
    """name -> (config, config_format, description)."""
    out = {}
    out["llama"] = (
        LlamaConfig(
            **base_kwargs(),
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=4,
            max_position_embeddings=256,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            architectures=["LlamaForCausalLM"],
        ),
        "transformers5",
        "MHA 4/4 heads, untied, rope_theta 1e4",
    )
    out["gqa-tied"] = (
        LlamaConfig(
            **base_kwargs(),
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
            architectures=["LlamaForCausalLM"],
        ),
        "legacy",
        "GQA 4/2 heads, tied embeddings, rope_theta 1e5 (SmolLM2-like)",
    )
    out["llama3-rope"] = (
        LlamaConfig(
            **base_kwargs(),
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1,
            max_position_embeddings=256,
            tie_word_embeddings=False,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
            architectures=["LlamaForCausalLM"],
        ),
        "legacy",
        "MQA 4/1 heads, untied, llama3 rope scaling (factor 8, low 1, high 4, original max 32)",
    )
    out["mistral"] = (
        MistralConfig(
            **base_kwargs(),
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
            tie_word_embeddings=False,
            sliding_window=None,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            architectures=["MistralForCausalLM"],
        ),
        "transformers5",
        "MistralForCausalLM, GQA 4/2 heads, sliding_window null, untied",
    )
    return out


def model_class(cfg):
    return MistralForCausalLM if cfg.model_type == "mistral" else LlamaForCausalLM


def scale_init(model: torch.nn.Module, gen: torch.Generator) -> None:
    """Replace the default (too small) init with one that gives logits real spread."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * (2.0 * torch.rand(p.shape, generator=gen) - 1.0))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 1.0)
            elif name == "lm_head.weight":
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
            elif p.dim() == 2:
                std = 0.25 if any(k in name for k in ("q_proj", "k_proj")) else 0.15
                p.copy_(torch.randn(p.shape, generator=gen) * std)
            else:
                raise RuntimeError(f"unexpected parameter {name}")


def to_legacy_config(path: Path) -> None:
    """Rewrite config.json from `rope_parameters` to top-level rope_theta/rope_scaling."""
    cfg_path = path / "config.json"
    cfg = json.loads(cfg_path.read_text())
    rp = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rp.pop("rope_theta")
    if rp.get("rope_type", "default") == "default":
        cfg["rope_scaling"] = None
    else:
        cfg["rope_scaling"] = rp
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def f32_list(t: torch.Tensor) -> list[float]:
    # float(np.float32) -> exact binary value; json writes the shortest repr that
    # round-trips to the same double, which converts back to the same f32.
    return [float(x) for x in t.detach().to(torch.float32).numpy().tolist()]


@torch.no_grad()
def last_logits(model, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids], dtype=torch.long)).logits[0, -1].to(torch.float32)


@torch.no_grad()
def greedy(model, ids: list[int]) -> tuple[list[int], list[float]]:
    """generate() with eos disabled; also returns the top1-top2 margin at each step."""
    out = model.generate(
        torch.tensor([ids], dtype=torch.long),
        attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        do_sample=False,
        max_new_tokens=NEW_TOKENS,
        min_new_tokens=NEW_TOKENS,
        eos_token_id=None,
        pad_token_id=0,
        output_scores=True,
        return_dict_in_generate=True,
        temperature=None,
        top_p=None,
        top_k=None,
    )
    new = out.sequences[0, len(ids):].tolist()
    margins = []
    for s in out.scores:
        top2 = torch.topk(s[0].to(torch.float32), 2).values
        margins.append(float(top2[0] - top2[1]))
    return new, margins


@torch.no_grad()
def greedy_no_cache(model, ids: list[int]) -> list[int]:
    """Independent check of generate(): full re-forward each step, plain argmax."""
    seq = list(ids)
    for _ in range(NEW_TOKENS):
        seq.append(int(torch.argmax(last_logits(model, seq))))
    return seq[len(ids):]


def make_inputs(rng: np.random.Generator, tok: Tokenizer) -> list[dict]:
    """Input sequences: random non-special ids, plus one real encoded text."""
    cases = []
    for n in INPUT_LENGTHS:
        ids = rng.integers(len(SPECIALS), VOCAB_SIZE, size=n).tolist()
        cases.append({"name": f"random_{n}", "input_ids": [int(x) for x in ids]})
    text = "The cat reads seven red boxes on day 3, and then says: \"hello, world!\""
    ids = tok.encode(text).ids
    cases.append({"name": f"text_{len(ids)}", "text": text, "input_ids": ids})
    return cases


def tokenizer_cases(hf_tok) -> dict:
    texts = [
        "hello, world!",
        "The old river counts twelve bright stars on day 99.",
        "def add(a, b):\n    return a + b\n",
        "Caf\u00e9 \u2014 \u65e5\u672c \U0001F600  two  spaces",
        "<|im_start|>user\nhi<|im_end|>",
    ]
    enc = [
        {"text": t, "ids": hf_tok(t, add_special_tokens=False)["input_ids"]} for t in texts
    ]
    for e in enc:
        assert hf_tok.decode(e["ids"]) == e["text"], e
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is 2+2?"},
    ]
    rendered = hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    chat = {
        "messages": messages,
        "add_generation_prompt": True,
        "rendered": rendered,
        "ids": hf_tok(rendered, add_special_tokens=False)["input_ids"],
    }
    return {"encode": enc, "chat": chat}


def versions() -> dict:
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "safetensors": safetensors.__version__,
        "numpy": np.__version__,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    repo = Path(__file__).resolve().parents[2]
    ap.add_argument("--out", type=Path, default=repo / "tests" / "fixtures" / "tiny")
    args = ap.parse_args()

    torch.set_num_threads(THREADS)
    torch.manual_seed(SEED)
    np.random.seed(SEED)

    tok = train_tokenizer()
    args.out.mkdir(parents=True, exist_ok=True)

    for vi, (name, (cfg, cfg_format, desc)) in enumerate(variant_configs().items()):
        d = args.out / name
        d.mkdir(parents=True, exist_ok=True)
        gen = torch.Generator().manual_seed(SEED + 101 * vi)
        model = model_class(cfg)(cfg).to(torch.float32).eval()
        scale_init(model, gen)
        if cfg.tie_word_embeddings:
            assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()

        # Logits of the in-memory model, to check the saved (possibly rewritten) config.
        probe = [5, 77, 200, 13, 346, 3, 150, 42, 9, 300, 21, 64, 120, 250, 30, 31, 33, 99, 7, 60]
        probe_logits = last_logits(model, probe)

        model.save_pretrained(d, safe_serialization=True)
        if cfg_format == "legacy":
            to_legacy_config(d)
        tok.save(str(d / "tokenizer.json"))
        hf_tok = PreTrainedTokenizerFast(
            tokenizer_object=Tokenizer.from_file(str(d / "tokenizer.json")),
            bos_token="<|im_start|>",
            eos_token="<|im_end|>",
            unk_token=None,
            pad_token="<|endoftext|>",
            model_max_length=cfg.max_position_embeddings,
            clean_up_tokenization_spaces=False,
        )
        hf_tok.chat_template = CHAT_TEMPLATE
        hf_tok.save_pretrained(d)
        # save_pretrained rewrites tokenizer.json; keep it (it's equivalent), but check.
        assert Tokenizer.from_file(str(d / "tokenizer.json")).get_vocab_size() == VOCAB_SIZE
        # transformers 5 puts the template in chat_template.jinja; the fixture keeps it in
        # tokenizer_config.json (the long-standing Hub layout) and names the classic class.
        tc_path = d / "tokenizer_config.json"
        tc = json.loads(tc_path.read_text())
        tc["chat_template"] = CHAT_TEMPLATE
        tc["tokenizer_class"] = "PreTrainedTokenizerFast"
        tc["add_bos_token"] = False
        tc["add_eos_token"] = False
        tc.pop("backend", None)
        tc_path.write_text(json.dumps(tc, indent=2, sort_keys=True) + "\n")
        jinja = d / "chat_template.jinja"
        if jinja.exists():
            jinja.unlink()

        # Reload everything from disk: the expected values come from the saved files.
        model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
        hf_tok = AutoTokenizer.from_pretrained(d)
        assert len(hf_tok) == model.config.vocab_size == VOCAB_SIZE, (len(hf_tok), model.config.vocab_size)
        assert hf_tok.chat_template == CHAT_TEMPLATE
        assert torch.equal(last_logits(model, probe), probe_logits), (name, "reload changed the model")
        if cfg_format == "legacy":
            assert not (d / "config.json").read_text().count("rope_parameters")

        rng = np.random.default_rng(SEED + vi)
        cases = make_inputs(rng, tok)
        for c in cases:
            logits = last_logits(model, c["input_ids"])
            assert torch.isfinite(logits).all(), (name, c["name"])
            new, margins = greedy(model, c["input_ids"])
            assert new == greedy_no_cache(model, c["input_ids"]), (name, c["name"], "cache/no-cache mismatch")
            top2 = torch.topk(logits, 2).values
            c.update(
                {
                    "last_logits": f32_list(logits),
                    "last_logits_argmax": int(torch.argmax(logits)),
                    "last_logits_top2_margin": float(top2[0] - top2[1]),
                    "logits_std": float(logits.std()),
                    "greedy_new_ids": new,
                    "greedy_step_top2_margins": margins,
                    "greedy_contains_eos": EOS_ID in new,
                }
            )
            c["greedy_text"] = hf_tok.decode(new)

        check = {}
        if name == "llama3-rope":
            # Same weights, scaling removed: logits must differ at these lengths.
            plain_cfg = copy.deepcopy(model.config)
            plain_cfg.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
            plain = model_class(plain_cfg)(plain_cfg).to(torch.float32).eval()
            plain.load_state_dict(model.state_dict())
            diffs = {}
            for c in cases:
                a = torch.tensor(c["last_logits"])
                b = last_logits(plain, c["input_ids"])
                diffs[c["name"]] = float((a - b).abs().max())
            assert diffs["random_1"] == 0.0, diffs  # position 0: rotation is identity
            assert all(v > 1e-2 for k, v in diffs.items() if k != "random_1"), diffs
            check = {
                "description": "max |logits(llama3 scaling) - logits(same weights, rope_type default)| "
                "per input; position 0 is unaffected, longer inputs must differ",
                "max_abs_diff": diffs,
            }

        all_margins = [m for c in cases for m in c["greedy_step_top2_margins"]]
        expected = {
            "variant": name,
            "description": desc,
            "architecture": model.config.architectures[0],
            "config_format": cfg_format,
            "config_format_note": "transformers5: rope settings under config.json 'rope_parameters'; "
            "legacy: top-level 'rope_theta' and 'rope_scaling' (null when no scaling)",
            "dtype": "float32",
            "vocab_size": VOCAB_SIZE,
            "bos_token_id": BOS_ID,
            "eos_token_id": EOS_ID,
            "special_tokens": {s: i for i, s in enumerate(SPECIALS)},
            "generation": {
                "max_new_tokens": NEW_TOKENS,
                "do_sample": False,
                "eos_handling": "ignore_eos: generate() ran with eos_token_id=None, so every "
                "continuation is exactly 16 argmax steps over the full vocab with no masking, "
                "even if an eos id is produced (greedy_contains_eos says if it was)",
                "min_step_top2_margin": min(all_margins),
                "checked_against_no_cache_argmax_loop": True,
            },
            "logits_position": "last input position: model(input_ids).logits[0, -1]",
            "cases": cases,
            "tokenizer_cases": tokenizer_cases(hf_tok),
            "rope_scaling_check": check or None,
            "seed": SEED,
            "torch_threads": THREADS,
            "versions": versions(),
            "generated_by": "scripts/reference/make_tiny_fixtures.py",
        }
        (d / "expected.json").write_text(json.dumps(expected, indent=1) + "\n")

        # Load-back check of the written fixture.
        exp = json.loads((d / "expected.json").read_text())
        m2 = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
        for c in exp["cases"]:
            l2 = last_logits(m2, c["input_ids"])
            assert torch.equal(l2, torch.tensor(c["last_logits"], dtype=torch.float32)), (name, c["name"])
        n_params = sum(p.numel() for p in m2.parameters())
        print(
            f"{name}: params={n_params} logits_std={[round(c['logits_std'], 2) for c in cases]} "
            f"min_margin={min(all_margins):.4f} size={(d / 'model.safetensors').stat().st_size}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
