"""The feature store: the target's own responses, tap-layer features and next-token
distributions, computed once in one batched pass and reused by every epoch and drafter family.

Generating a response already runs the target over every position, so the tap-layer outputs
(float16) and the top-k next-token probabilities come for free: storing them removes the
separate feature pass that would cost as much as generation again. Layout::

    STORE/manifest.json                target fingerprint, tap layers, top_k, feature width
    STORE/shard_<hash of ids>/index.json      one row per sequence: id, offsets, prompt_len
                            tokens.npy      int32 [sum T]          prompt + response ids
                            features.npy    float16 [sum T-1, taps*H]   positions 0..T-2
                            topk_ids.npy    int32 [sum R, k]       at positions P-1..T-2
                            topk_probs.npy  float16 [sum R, k]     (R = response length)

Shards are written to a temporary folder and renamed (whole or absent), so an interrupted run
resumes by skipping the ids already stored. Reading memory-maps the arrays.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import mlx.core as mx
import numpy as np

from ..fingerprint import target_fingerprint
from ..target import Target

FORMAT = 1
BYTES_PER_FEATURE = 2  # float16


class StoreMismatchError(ValueError):
    """The store was made for another target, other tap layers or another top-k."""


def bytes_per_token(hidden_size: int, num_taps: int, top_k: int) -> int:
    return num_taps * hidden_size * BYTES_PER_FEATURE + top_k * 6 + 4


def check_free_disk(path: Path, need_bytes: int) -> None:
    path.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(path).free
    if free < need_bytes:
        raise OSError(f"feature store {path} needs about {need_bytes / 1e9:.1f} GB, "
                      f"but only {free / 1e9:.1f} GB are free there")


@dataclass
class Sequence_:
    id: str
    tokens: np.ndarray  # [T] int32
    prompt_len: int
    features: np.ndarray  # [T-1, taps*H] float16 (memory-mapped)
    topk_ids: np.ndarray  # [T-P, k] int32: distribution of token P+j given tokens < P+j
    topk_probs: np.ndarray  # [T-P, k] float16


class FeatureStore:
    """Read side: every sequence of every shard, memory-mapped."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        manifest = self.path / "manifest.json"
        if not manifest.exists():
            raise FileNotFoundError(f"no feature store at {self.path} (manifest.json missing)")
        self.manifest = json.loads(manifest.read_text())
        self.layer_ids = list(self.manifest["layer_ids"])
        self.top_k = int(self.manifest["top_k"])
        self._rows: list[tuple[Path, dict]] = []
        self._arrays: dict[Path, dict[str, np.ndarray]] = {}
        for shard in sorted(self.path.glob("shard_*")):
            if shard.suffix == ".tmp" or not (shard / "index.json").exists():
                continue
            for row in json.loads((shard / "index.json").read_text()):
                self._rows.append((shard, row))

    def check(self, target: Target, layer_ids: Sequence[int] | None = None) -> None:
        """Raise StoreMismatchError unless the store was made by this target (and these taps)."""
        want = target_fingerprint(target)
        have = self.manifest["target"]
        if have != want:
            diff = [f"{k}: store {have.get(k)} != target {v}" for k, v in want.items()
                    if have.get(k) != v]
            raise StoreMismatchError(f"feature store {self.path} was made for another target "
                                     f"({'; '.join(diff)})")
        if layer_ids is not None and list(layer_ids) != self.layer_ids:
            raise StoreMismatchError(f"feature store {self.path} holds tap layers "
                                     f"{self.layer_ids}, the drafter reads {list(layer_ids)}")

    def ids(self) -> set[str]:
        return {row["id"] for _, row in self._rows}

    def id_list(self) -> list[str]:
        """The sequence ids in index order."""
        return [row["id"] for _, row in self._rows]

    def __len__(self) -> int:
        return len(self._rows)

    def _shard(self, shard: Path) -> dict[str, np.ndarray]:
        if shard not in self._arrays:
            self._arrays[shard] = {name: np.load(shard / f"{name}.npy", mmap_mode="r")
                                   for name in ("tokens", "features", "topk_ids", "topk_probs")}
        return self._arrays[shard]

    def __getitem__(self, i: int) -> Sequence_:
        shard, row = self._rows[i]
        a = self._shard(shard)
        t, f, r = row["tok"], row["feat"], row["resp"]
        T, P = row["length"], row["prompt_len"]
        return Sequence_(row["id"], np.asarray(a["tokens"][t : t + T]), P,
                         a["features"][f : f + T - 1], a["topk_ids"][r : r + T - P],
                         a["topk_probs"][r : r + T - P])

    def __iter__(self) -> Iterator[Sequence_]:
        return (self[i] for i in range(len(self)))

    def lengths(self) -> list[tuple[int, int]]:
        """(prompt_len, length) of every sequence, without touching the arrays."""
        return [(row["prompt_len"], row["length"]) for _, row in self._rows]

    def response_tokens(self, idx: Sequence[int] | None = None) -> np.ndarray:
        """The response tokens of the sequences ``idx`` (all by default), concatenated."""
        seqs = (self[int(i)] for i in (range(len(self)) if idx is None else idx))
        parts = [s.tokens[s.prompt_len:] for s in seqs]
        return np.concatenate(parts) if parts else np.zeros((0,), np.int32)


def _write_manifest(path: Path, target: Target, layer_ids: Sequence[int], top_k: int) -> None:
    manifest = {"format": FORMAT, "target": target_fingerprint(target),
                "layer_ids": list(layer_ids), "top_k": top_k,
                "feature_dim": len(layer_ids) * target.hidden_size,
                "feature_dtype": "float16"}
    file = path / "manifest.json"
    if file.exists():
        have = json.loads(file.read_text())
        if have["target"] != manifest["target"] or have["layer_ids"] != manifest["layer_ids"] \
                or have["top_k"] != top_k:
            raise StoreMismatchError(
                f"{path} already holds a store for another target, tap layers or top-k "
                f"(layers {have['layer_ids']}, top_k {have['top_k']}); use another folder")
        return
    # One temporary name per process: parallel workers write the same manifest at once.
    tmp = file.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    os.replace(tmp, file)


def _write_shard(path: Path, seqs: list[dict]) -> None:
    tmp = path.with_suffix(".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    index, tok, feat, resp = [], 0, 0, 0
    for s in seqs:
        T, P = len(s["tokens"]), s["prompt_len"]
        index.append({"id": s["id"], "prompt_len": P, "length": T, "tok": tok, "feat": feat,
                      "resp": resp})
        tok, feat, resp = tok + T, feat + T - 1, resp + T - P
    np.save(tmp / "tokens.npy", np.concatenate([s["tokens"] for s in seqs]).astype(np.int32))
    np.save(tmp / "features.npy", np.concatenate([s["features"] for s in seqs]))
    np.save(tmp / "topk_ids.npy", np.concatenate([s["topk_ids"] for s in seqs]))
    np.save(tmp / "topk_probs.npy", np.concatenate([s["topk_probs"] for s in seqs]))
    (tmp / "index.json").write_text(json.dumps(index) + "\n")
    os.replace(tmp, path)


def generate_batch(
    target: Target,
    prompts: list[list[int]],
    layer_ids: Sequence[int],
    stop_ids: set[int],
    max_tokens: int,
    top_k: int,
    prefill_step: int = 256,
) -> list[dict]:
    """Greedy responses for a batch of prompts (left-padded, one forward per step), with the
    tap features at every position and the top-k next-token probabilities at every position
    that predicts a response token."""
    from mlx_lm.models.cache import BatchKVCache

    B = len(prompts)
    L = max(len(p) for p in prompts)
    pad = [L - len(p) for p in prompts]
    x = mx.array([[0] * n + list(p) for n, p in zip(pad, prompts)], dtype=mx.uint32)
    cache = [BatchKVCache(pad) for _ in range(target.num_layers)]

    def topk(logits: mx.array) -> tuple[mx.array, mx.array]:
        probs = mx.softmax(logits.astype(mx.float32), axis=-1)
        ids = mx.argpartition(-probs, top_k - 1, axis=-1)[:, :top_k]
        return ids.astype(mx.int32), mx.take_along_axis(probs, ids, axis=-1).astype(mx.float16)

    prompt_feats = []
    for start in range(0, L, prefill_step):
        h, f = target.hidden_states(x[:, start : start + prefill_step], cache, layer_ids)
        prompt_feats.append(f.astype(mx.float16))
        mx.eval(prompt_feats[-1], [c.keys for c in cache])
    logits = target.lm_head(h[:, -1])
    y = mx.argmax(logits, axis=-1).astype(mx.uint32)
    steps = [(y, None, *topk(logits))]  # (token, its features, top-k of the position before)
    mx.async_eval(steps[0])
    done = np.zeros(B, dtype=bool)
    lengths = np.full(B, max_tokens)  # response length per row (stop token included)
    for step in range(max_tokens):
        if step + 1 < max_tokens:  # launch the next step before reading this one
            h, f = target.hidden_states(y[:, None], cache, layer_ids)
            logits = target.lm_head(h[:, 0])
            y = mx.argmax(logits, axis=-1).astype(mx.uint32)
            steps.append((y, f[:, 0].astype(mx.float16), *topk(logits)))
            mx.async_eval(steps[-1])
        tokens_now = np.array(steps[step][0])
        stopped = ~done & np.isin(tokens_now, list(stop_ids))
        lengths[stopped] = step + 1
        done |= stopped
        if done.all():
            break
    n_steps = int(lengths.max())
    tokens = np.stack([np.array(s[0]) for s in steps[:n_steps]], axis=1)  # [B, n]
    feats_p = np.array(mx.concatenate(prompt_feats, axis=1))  # [B, L, F]
    feats_r = np.stack([np.array(s[1]) for s in steps[1:n_steps]], axis=1) if n_steps > 1 \
        else np.zeros((B, 0, feats_p.shape[-1]), np.float16)
    tk_ids = np.stack([np.array(s[2]) for s in steps[:n_steps]], axis=1)
    tk_probs = np.stack([np.array(s[3]) for s in steps[:n_steps]], axis=1)
    out = []
    for b in range(B):
        R, P = int(lengths[b]), len(prompts[b])
        # Feature rows: prompt positions 0..P-1, then response positions 0..R-2 (T-1 in all).
        feats = np.concatenate([feats_p[b, pad[b]:], feats_r[b, : R - 1]], axis=0)
        out.append({"tokens": np.concatenate([np.asarray(prompts[b]), tokens[b, :R]]),
                    "prompt_len": P, "features": feats, "topk_ids": tk_ids[b, :R],
                    "topk_probs": tk_probs[b, :R]})
    return out


def _window_sorted(rows: list[dict], lengths: list[int], batch_size: int) -> list[list[int]]:
    """Batches of similar prompt length (less padding) without clustering whole domains:
    sort within windows of 16 batches of the given order."""
    order, window = [], 16 * batch_size
    for w in range(0, len(rows), window):
        idx = list(range(w, min(w + window, len(rows))))
        order += sorted(idx, key=lambda i: lengths[i])
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


def build_store(
    model: Any,
    tokenizer: Any,
    rows: list[dict],
    out_dir: str | Path,
    layer_ids: Sequence[int],
    *,
    max_tokens: int = 192,
    batch_size: int = 64,
    top_k: int = 16,
    max_prompt_tokens: int = 512,
    worker: tuple[int, int] = (0, 1),
    progress: bool = True,
) -> Path:
    """Generate (or resume) the store for ``rows`` ({id, prompt}); this worker takes every
    ``worker[1]``-th batch starting at ``worker[0]``."""
    from tqdm import tqdm

    target = model if isinstance(model, Target) else Target(model)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _write_manifest(out, target, layer_ids, top_k)
    done = FeatureStore(out).ids()
    prompts = []
    for row in rows:
        prompts.append(tokenizer.apply_chat_template(
            [{"role": "user", "content": row["prompt"]}], add_generation_prompt=True))
    keep = [i for i, p in enumerate(prompts) if len(p) <= max_prompt_tokens]
    batches = _window_sorted([rows[i] for i in keep], [len(prompts[i]) for i in keep],
                             batch_size)
    batches = [[keep[i] for i in b] for b in batches]
    mine = [b for n, b in enumerate(batches) if n % worker[1] == worker[0]]
    todo = [[i for i in b if rows[i]["id"] not in done] for b in mine]
    todo = [b for b in todo if b]
    est = sum(len(b) for b in todo) * (max_tokens + 150)
    check_free_disk(out, est * bytes_per_token(target.hidden_size, len(layer_ids), top_k))
    stop_ids = set(tokenizer.eos_token_ids)
    bar = tqdm(total=len(todo), desc=f"target responses (worker {worker[0]})", unit="batch",
               disable=not progress)
    tic, n_tokens = time.perf_counter(), 0
    for batch in todo:
        seqs = generate_batch(target, [prompts[i] for i in batch], layer_ids, stop_ids,
                              max_tokens, top_k)
        for i, s in zip(batch, seqs):
            s["id"] = rows[i]["id"]
            n_tokens += len(s["tokens"]) - s["prompt_len"]
        # Named by its contents, so a rerun with more prompts never reuses a name.
        name = hashlib.sha1("\n".join(s["id"] for s in seqs).encode()).hexdigest()[:16]
        _write_shard(out / f"shard_{name}", seqs)
        bar.update(1)
        bar.set_postfix(resp_tok_s=f"{n_tokens / (time.perf_counter() - tic):.0f}")
    bar.close()
    return out


def build_store_parallel(
    model_path: str,
    rows: list[dict],
    out_dir: str | Path,
    layer_ids: Sequence[int],
    workers: int = 2,
    **options: Any,
) -> Path:
    """``build_store`` in ``workers`` processes with one BLAS thread each.

    MLX's CPU backend runs attention and most element-wise work on one thread, so on a small
    target two single-threaded processes generate ~1.5x the tokens of one two-threaded one.
    """
    import subprocess

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    job = out / "job.json"
    tmp = job.with_suffix(".tmp")
    tmp.write_text(json.dumps({"model": model_path, "rows": rows, "layer_ids": list(layer_ids),
                               "options": options}))
    os.replace(tmp, job)
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1"}
    # SIGTERM to this process (kill, pkill) stops the workers too instead of orphaning them.
    in_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm) if in_main else None
    procs = []
    try:
        procs = [subprocess.Popen(_worker_command(job, w, workers), env=env)
                 for w in range(workers)]
        codes = [p.wait() for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
                p.wait()
        if in_main:
            signal.signal(signal.SIGTERM, previous)
    if any(codes):
        raise RuntimeError(f"feature store workers failed (exit codes {codes}); rerun to resume")
    return out


def _worker_command(job: Path, worker: int, workers: int) -> list[str]:
    return [sys.executable, "-m", "mlx_dflash.train.store", str(job), str(worker), str(workers)]


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def _worker_main(argv: list[str]) -> None:
    from mlx_lm import load

    job = json.loads(Path(argv[0]).read_text())
    model, tokenizer = load(job["model"])
    build_store(model, tokenizer, job["rows"], Path(argv[0]).parent, job["layer_ids"],
                worker=(int(argv[1]), int(argv[2])), **job["options"])


if __name__ == "__main__":  # one worker of build_store_parallel
    _worker_main(sys.argv[1:])
