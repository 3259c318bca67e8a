#!/usr/bin/env python3
"""Cross-checks `tandem bench serve` against guidellm (PyPI) on one running router.

    scripts/guidellm-crosscheck.py --tandem target/release/tandem --base-url http://127.0.0.1:8000 \
        --guidellm /path/to/venv/bin/guidellm --tokenizer-dir ~/.cache/tandem/models/smollm2-135m-instruct

Both tools send the same workload through the OpenAI API (/v1/completions, streamed, ignore_eos):
closed loop at --concurrency, --num-prompts requests of --input-len prompt tokens and --output-len
output tokens, fresh prompts every run (a new seed each, so no run hits the prefix cache another
filled). Runs alternate (guidellm, tandem, guidellm, ...) so drift in the machine's load hits both.

Around every run the router's own /metrics are read, so each run also reports what the server
measured for the same requests (mean TTFT, mean inter-token gap, from the router's histograms'
_sum/_count). A gap between the tools that the server's figures show too is the server running
slower during that run (e.g. a client taking CPU from it); a gap that only the client shows is
measurement.

Prints one markdown table; exit status 1 if a run fails.
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path


def scrape(base_url: str) -> dict[str, float]:
    root = re.sub(r"/v1/?$", "", base_url.rstrip("/"))
    text = urllib.request.urlopen(f"{root}/metrics", timeout=10).read().decode()
    out = {}
    for name in ("time_to_first_token_seconds", "inter_token_latency_seconds"):
        for part in ("sum", "count"):
            m = re.search(rf"^tandem:{name}_{part} (\S+)$", text, re.M)
            if not m:
                sys.exit(f"crosscheck: the router's /metrics has no tandem:{name}_{part}")
            out[f"{name}_{part}"] = float(m.group(1))
    return out


def server_means(before: dict, after: dict) -> tuple[float, float]:
    def mean(name: str) -> float:
        n = after[f"{name}_count"] - before[f"{name}_count"]
        return 1e3 * (after[f"{name}_sum"] - before[f"{name}_sum"]) / n if n else float("nan")

    return mean("time_to_first_token_seconds"), mean("inter_token_latency_seconds")


def run_guidellm(args, seed: int, out: Path) -> dict:
    path = out / f"guidellm-{seed}.json"
    cmd = [
        args.guidellm, "run",
        "--backend", f"kind=openai_http,target={args.base_url},request_format=/v1/completions",
        "--profile", f"kind=concurrent,streams={args.concurrency}",
        "--constraint", f"kind=max_requests,count={args.num_prompts}",
        "--data", f"kind=synthetic_text,prompt_tokens={args.input_len},output_tokens={args.output_len}",
        "--seed", f"kind=static,value={seed}",
        "--tokenizer", f"kind=huggingface_auto,model={args.tokenizer_dir}",
        "--output", f"kind=json,path={path}",
        "--disable-console",
    ]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    bench = json.loads(path.read_text())["benchmarks"][0]
    reqs = bench["requests"]["successful"]
    ttft, itl = [], []
    for r in reqs:
        ttft.append(r["time_to_first_token_ms"])
        itl.append(r["inter_token_latency_ms"])
    errors = len(bench["requests"]["errored"]) + len(bench["requests"]["incomplete"])
    prompt = {r["prompt_tokens"] for r in reqs}
    output = {r["output_tokens"] for r in reqs}
    return {
        "ok": len(reqs), "errors": errors, "prompt_tokens": sorted(prompt), "output_tokens": sorted(output),
        "ttft_p50": statistics.median(ttft), "ttft_mean": statistics.fmean(ttft),
        # guidellm's inter-token latency of a request: (last token - first token) / (tokens - 1).
        "itl_req_p50": statistics.median(itl),
    }


def run_tandem(args, seed: int, out: Path) -> dict:
    path = out / f"tandem-{seed}.json"
    cmd = [
        args.tandem, "bench", "serve", "--backend", "openai", "--base-url", args.base_url,
        "--concurrency", str(args.concurrency), "--num-prompts", str(args.num_prompts),
        "--input-len", str(args.input_len), "--output-len", str(args.output_len),
        "--seed", str(seed), "--warmup", "0", "--output-json", str(path), "--tokenizer", args.tokenizer_dir,
    ]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    report = json.loads(path.read_text())
    reqs = report["runs"][0]["requests"]
    good = [r for r in reqs if not r.get("error")]
    ttft = [r["ttft_ms"] for r in good]
    # The same per-request figure guidellm reports: mean gap of each request.
    itl_req = [statistics.fmean(r["itl_ms"]) for r in good if r["itl_ms"]]
    return {
        "ok": len(good), "errors": len(reqs) - len(good),
        "prompt_tokens": sorted({r["prompt_tokens"] for r in good}),
        "output_tokens": sorted({r["output_tokens"] for r in good}),
        "ttft_p50": statistics.median(ttft), "ttft_mean": statistics.fmean(ttft),
        "itl_req_p50": statistics.median(itl_req),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tandem", default="target/release/tandem")
    p.add_argument("--guidellm", default="guidellm")
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--tokenizer-dir", required=True, help="a model directory with tokenizer.json (guidellm's tokenizer)")
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--num-prompts", type=int, default=30)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=None, help="where the reports go (default: a temporary directory)")
    args = p.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="crosscheck-"))
    out.mkdir(parents=True, exist_ok=True)

    rows = []
    for i in range(args.rounds):
        for tool, fn in (("guidellm", run_guidellm), ("tandem bench serve", run_tandem)):
            seed = 1000 + 2 * i + (tool != "guidellm")
            before = scrape(args.base_url)
            r = fn(args, seed, out)
            srv_ttft, srv_itl = server_means(before, scrape(args.base_url))
            r.update(tool=tool, seed=seed, srv_ttft=srv_ttft, srv_itl=srv_itl)
            rows.append(r)
            print(f"crosscheck: {tool} seed {seed}: TTFT p50 {r['ttft_p50']:.1f} ms, per-request ITL p50 {r['itl_req_p50']:.1f} ms", file=sys.stderr)

    print(f"| run | tool | ok/errors | prompt/output tokens | TTFT p50 ms | TTFT mean ms | ITL p50 ms (per-request mean gap) | server: TTFT mean ms | server: ITL mean ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    for i, r in enumerate(rows):
        print(f"| {i + 1} | {r['tool']} | {r['ok']}/{r['errors']} | {r['prompt_tokens']}/{r['output_tokens']} | "
              f"{r['ttft_p50']:.1f} | {r['ttft_mean']:.1f} | {r['itl_req_p50']:.1f} | {r['srv_ttft']:.1f} | {r['srv_itl']:.1f} |")
    for tool in ("guidellm", "tandem bench serve"):
        rs = [r for r in rows if r["tool"] == tool]
        print(f"| median | {tool} | | | {statistics.median(r['ttft_p50'] for r in rs):.1f} | "
              f"{statistics.median(r['ttft_mean'] for r in rs):.1f} | {statistics.median(r['itl_req_p50'] for r in rs):.1f} | "
              f"{statistics.median(r['srv_ttft'] for r in rs):.1f} | {statistics.median(r['srv_itl'] for r in rs):.1f} |")
    if any(r["errors"] or r["ok"] != args.num_prompts for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
