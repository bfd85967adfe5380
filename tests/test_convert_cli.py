"""`mlx-dflash convert`: drafter round trip, quantized drafters stay lossless, atomic output."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from tiny import make_drafter, make_target, make_tokenizer, zlab_config
from typer.testing import CliRunner

import mlx_dflash
from mlx_dflash.cli import app
from mlx_dflash.convert import drafter as drafter_mod
from mlx_dflash.convert.drafter import convert_drafter

PROMPT = "w5 w6 w7 w8"


@pytest.fixture(scope="module")
def pair():
    model = make_target("qwen3", vocab_size=96, hidden_size=64, num_layers=4)
    return model, make_drafter(model, block_size=4, layer_ids=(0, 2), num_layers=2)


def hf_drafter_dir(path, drafter):
    """A drafter as Hugging Face hosts it: z-lab config fields, bf16 safetensors, a README."""
    path.mkdir()
    config = zlab_config(drafter)
    (path / "config.json").write_text(json.dumps(config))
    weights = {k: v.astype(mx.bfloat16) for k, v in tree_flatten(drafter.parameters())}
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    (path / "README.md").write_text("tiny drafter\n")
    return path


def run(*args):
    return CliRunner().invoke(app, list(map(str, args)))


def test_round_trip_keeps_weights(tmp_path, pair):
    model, drafter = pair
    src = hf_drafter_dir(tmp_path / "hf", drafter)
    result = run("convert", "drafter", src, tmp_path / "mlx")
    assert result.exit_code == 0, result.output
    out = tmp_path / "mlx"
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json",
                                                     "model.safetensors"]
    config = json.loads((out / "config.json").read_text())
    assert config["torch_dtype"] == "float32" and "quantization" not in config
    assert config["auto_map"]  # the published config survives
    loaded = mlx_dflash.load_drafter(out, model=model)
    want = {k: v.astype(mx.bfloat16).astype(mx.float32) for k, v in
            tree_flatten(drafter.parameters())}
    got = dict(tree_flatten(loaded.parameters()))
    assert got.keys() == want.keys()
    for k, v in got.items():
        assert v.dtype == mx.float32 and mx.array_equal(v, want[k]), k


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_drafter_is_lossless(tmp_path, pair, bits):
    from mlx_lm import generate as lm_generate

    model, drafter = pair
    src = hf_drafter_dir(tmp_path / "hf", drafter)
    out = convert_drafter(src, tmp_path / "q", bits=bits, group_size=32)
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"] == {"group_size": 32, "bits": bits, "mode": "affine"}
    q = mlx_dflash.load_drafter(out, model=model, dequantize=False)
    assert isinstance(q.fc, nn.QuantizedLinear) and q.fc.bits == bits
    assert isinstance(q.layers[1].mlp.down_proj, nn.QuantizedLinear)
    assert q.norm.weight.dtype == mx.float32 and q.fc.scales.dtype == mx.float32
    # The quantized weights still approximate the originals.
    w = mx.dequantize(q.fc.weight, q.fc.scales, q.fc.biases, group_size=32, bits=bits)
    err = mx.abs(w - drafter.fc.weight).max().item()
    assert err < (0.02 if bits == 8 else 0.3) * mx.abs(drafter.fc.weight).max().item()

    tokenizer = make_tokenizer(96)
    ours = mlx_dflash.generate(model, q, tokenizer, PROMPT, max_tokens=24)
    assert ours == lm_generate(model, tokenizer, PROMPT, max_tokens=24)
    # Without a Metal GPU it is dequantized at load by default (float32 BLAS is faster).
    d = mlx_dflash.load_drafter(out, model=model, dequantize=True)
    assert isinstance(d.fc, nn.Linear) and mx.allclose(d.fc.weight, w, atol=1e-6)
    assert mlx_dflash.generate(model, d, tokenizer, PROMPT, max_tokens=24) == ours


def test_interrupted_conversion_leaves_nothing(tmp_path, pair, monkeypatch):
    src = hf_drafter_dir(tmp_path / "hf", pair[1])
    real_save = mx.save_safetensors

    def save_then_interrupt(path, *args, **kwargs):
        real_save(path, *args, **kwargs)  # a complete-looking weights file ...
        raise KeyboardInterrupt  # ... then Ctrl-C before config.json is written

    monkeypatch.setattr(drafter_mod.mx, "save_safetensors", save_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        convert_drafter(src, tmp_path / "out", bits=8, group_size=32)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no output, no temp dir


def test_failed_target_conversion_leaves_nothing(tmp_path, monkeypatch):
    import importlib

    lm_convert = importlib.import_module("mlx_lm.convert")

    def broken_save(mlx_path, *args, **kwargs):
        Path(mlx_path).mkdir()  # something half-written ...
        raise OSError("disk full")  # ... then the failure

    monkeypatch.setattr(lm_convert, "save", broken_save)
    target = tmp_path / "target"
    target.mkdir()
    model = make_target("qwen3", vocab_size=96)
    mx.save_safetensors(str(target / "model.safetensors"), dict(tree_flatten(model.parameters())))
    config = {k: v for k, v in vars(model.args).items() if not k.startswith("_")}
    (target / "config.json").write_text(json.dumps(config))
    make_tokenizer(96)._tokenizer.save_pretrained(str(target))
    result = run("convert", "target", target, tmp_path / "out", "-q")
    assert result.exit_code == 2 and "OSError: disk full" in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["target"]


def test_errors_name_the_problem(tmp_path, pair):
    src = hf_drafter_dir(tmp_path / "hf", pair[1])
    (tmp_path / "taken").mkdir()
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf at all")
    cases = [
        (("drafter", tmp_path / "nope", tmp_path / "o"), "drafter directory not found"),
        (("drafter", src, tmp_path / "taken"), "already exists"),
        (("drafter", src, tmp_path / "taken"), "--overwrite"),
        (("drafter", src, tmp_path / "o", "--bits", 7), "--bits must be one of 2, 3, 4, 5, 6, 8"),
        (("drafter", src, tmp_path / "o", "--bits", 4, "--group-size", 48),
         "--group-size must be one of 32, 64, 128"),
        (("drafter", src, tmp_path / "o", "--dtype", "int8"), "--dtype must be one of"),
        (("gguf", tmp_path / "no.gguf", tmp_path / "o"), "GGUF file not found"),
        (("gguf", tmp_path / "junk.gguf", tmp_path / "o"), "is not a GGUF file"),
        (("target", tmp_path / "nope", tmp_path / "o"), "target directory not found"),
    ]
    for args, message in cases:
        result = run("convert", *args)
        assert result.exit_code == 2 and message in result.output, (args, result.output)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "junk.gguf", "taken"]

    # A checkpoint that is not a drafter: the loader's message comes through.
    (src / "config.json").write_text("{}")
    result = run("convert", "drafter", src, tmp_path / "o")
    assert result.exit_code == 2 and "lacks required fields" in result.output
    # Already quantized sources are refused rather than quantized twice.
    q = convert_drafter(hf_drafter_dir(tmp_path / "hf2", pair[1]), tmp_path / "q", bits=8,
                        group_size=32)
    result = run("convert", "drafter", q, tmp_path / "o", "--bits", 4)
    assert result.exit_code == 2 and "already quantized" in result.output
    # --overwrite replaces an existing output.
    result = run("convert", "drafter", src.parent / "hf2", tmp_path / "taken", "--overwrite")
    assert result.exit_code == 0 and (tmp_path / "taken" / "config.json").exists()


def test_gguf_mode_calls_convert_gguf(tmp_path, monkeypatch):
    from mlx_dflash.convert import gguf

    calls = []
    monkeypatch.setattr(gguf, "convert_gguf", lambda *a, **k: calls.append((a, k)))
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    result = run("convert", "gguf", tmp_path / "m.gguf", tmp_path / "out", "--dtype", "bfloat16")
    assert result.exit_code == 0, result.output
    assert calls == [((tmp_path / "m.gguf", tmp_path / "out"),
                      {"dtype": "bfloat16", "overwrite": False, "progress": True})]
