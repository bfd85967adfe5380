"""The benchmark runs end to end on a tiny pair and reports lossless, comparable figures."""

import json

from tiny import make_drafter, make_target, make_tokenizer

from mlx_dflash.bench import format_table, load_prompt_sets, measure_pass_costs, run_bench


def test_bench_on_tiny_pair(tmp_path):
    f = tmp_path / "eval_chat_tiny.jsonl"
    f.write_text("\n".join([json.dumps({"prompt": "w5 w6 w7"}),
                            json.dumps({"question": "w8 w9"}),
                            json.dumps({"turns": ["w10 w11 w12"]}),
                            json.dumps({"other": "skipped"})]))
    sets = load_prompt_sets([str(f)], limit=None)
    assert list(sets) == ["chat"] and len(sets["chat"]) == 3
    model = make_target("qwen3", vocab_size=96)
    results = run_bench(model, make_drafter(model, block_size=4), make_tokenizer(96, eos_id=96),
                        sets, [2, 4], max_tokens=12, progress=False, copy_drafts=True)
    entry = results["domains"]["chat"]
    assert set(entry["speculative"]) == {"2", "4", "2+copy", "4+copy", "auto"}
    for B in ("2", "4", "2+copy", "4+copy", "auto"):
        s = entry["speculative"][B]
        assert s["outputs_differing_from_plain"] == 0
        assert s["tokens"] == entry["plain"]["tokens"] == 36
        width = 4 if B == "auto" else int(B[0])
        assert 1.0 <= s["mean_acceptance_length"] <= width
        assert len(s["acceptance_by_position"]) == width - 1
    table = format_table(results)
    assert "| B=4 |" in table and "| B=4+copy |" in table and "| auto |" in table


def test_pass_costs_with_and_without_drafter():
    model = make_target("qwen3", vocab_size=96)
    plain = measure_pass_costs(model, 4, context=16, reps=1)
    assert set(plain) == {"decode_s", "verify_s", "ratio"}
    costs = measure_pass_costs(model, 4, make_drafter(model, block_size=4), context=16, reps=1)
    assert set(costs) == {"decode_s", "verify_s", "ratio", "draft_s"}
    assert all(v > 0 for v in costs.values())


def test_batch_bench_on_tiny_pair(tmp_path):
    from mlx_dflash.bench import format_batch_table, run_batch_bench

    model = make_target("qwen3", vocab_size=96)
    sets = {"chat": ["w5 w6 w7", "w8 w9", "w10 w11 w12", "w13"]}
    results = run_batch_bench(model, make_drafter(model, block_size=4),
                              make_tokenizer(96, eos_id=96), sets, [1, 2], max_tokens=8,
                              block_size=3, progress=False)
    for c in ("1", "2"):
        variants = results["domains"]["chat"][c]
        assert set(variants) == {"mlx-lm batched plain", "auto", "B=3", "one by one"}
        plain = variants["mlx-lm batched plain"]
        for name, v in variants.items():
            assert v["requests"] == 4 and v["tokens"] == plain["tokens"] == 32
            if name != "mlx-lm batched plain":
                assert v["outputs_differing_from_mlx_lm"] == 0
                assert v["latency_p50_s"] <= v["latency_p95_s"]
    assert "| chat | 2 | auto |" in format_batch_table(results)


def test_batch_bench_with_staggered_arrivals():
    from mlx_dflash.bench import run_batch_bench

    model = make_target("qwen3", vocab_size=96)
    sets = {"chat": ["w5 w6 w7", "w8 w9", "w10 w11 w12"]}
    results = run_batch_bench(model, make_drafter(model, block_size=4),
                              make_tokenizer(96, eos_id=96), sets, [3], max_tokens=8,
                              block_size=3, progress=False, stagger=0.2)
    assert results["settings"]["arrivals"] == "0.2 s apart"
    for v in results["domains"]["chat"]["3"].values():
        assert v["tokens"] == 24 and v["outputs_differing_from_mlx_lm"] == 0
        assert v["seconds"] >= 0.4  # the last request arrives 0.4 s in


def _context_pair():
    """A tiny target, a word tokenizer with a chat template, and chat turns for the
    long-context bench."""
    model = make_target("qwen3", vocab_size=96)
    tok = make_tokenizer(96, eos_id=96)
    tok._tokenizer.chat_template = ("{% for m in messages %}w3 {{ m['content'] }} "
                                    "{% endfor %}w4")
    return model, tok, [(f"w{5 + i} w6 w7", f"w8 w9 w{10 + i}") for i in range(40)]


def test_context_bench_on_tiny_pair():
    """The long-context bench: prompts near each length, plain against auto and a drafter
    window, alone and batched, every output equal to plain."""
    from mlx_dflash.bench_context import format_context_table, run_context_bench

    model, tok, turns = _context_pair()
    results = run_context_bench(model, make_drafter(model, block_size=4), tok, [64, 160],
                                turns=turns, questions=["w11 w12"], prompts=1, max_tokens=8,
                                concurrency=[2], windows=[16], compare_prefill=False,
                                progress=False)
    for length in ("64", "160"):
        entry = results["lengths"][length]
        assert entry["pass_costs"]["draft_s_window16"] > 0
        for kind in ("code", "chat"):
            row = entry[kind]
            assert int(length) - 64 <= row["prompt_tokens_mean"] <= int(length)
            assert set(row["speculative"]) == {"auto", "auto+window16"}
            for v in row["speculative"].values():
                assert v["outputs_differing_from_plain"] == 0
                assert v["tokens"] == row["plain"]["tokens"] == 8
            assert row["concurrency2"]["outputs_differing_from_plain"] == 0
    assert "| code | auto+window16 |" in format_context_table(results)


def test_context_bench_shared_context():
    """--shared-context: a kind's prompts share their long part, prefilled once (each other
    prompt prefills only its question), and differ in the question; batched outputs equal."""
    from mlx_dflash.bench_context import run_context_bench

    model, tok, turns = _context_pair()
    results = run_context_bench(model, make_drafter(model, block_size=4), tok, [160],
                                turns=turns, questions=["w11 w12", "w13 w14 w15"], prompts=1,
                                max_tokens=8, concurrency=[2], compare_prefill=False,
                                shared_context=True, progress=False)
    assert results["settings"]["shared_context"]
    for kind in ("code", "chat"):
        row = results["lengths"]["160"][kind]
        first, second = row["prefilled_tokens"]
        assert first > 60 and 0 < second < first // 4
        assert row["concurrency2"]["outputs_differing_from_plain"] == 0
        assert row["speculative"]["auto"]["outputs_differing_from_plain"] == 0


def test_structured_bench_on_a_tiny_pair():
    """The structured-output bench: four variants per task; the schema variants parse and
    validate (or are cut by max_tokens), the speculative one equals plain constrained
    decoding; the shipped tasks load."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from test_grammar import SCHEMA, WORDS
    from tiny import make_drafter, make_target, make_text_tokenizer

    from mlx_dflash.bench_structured import (
        format_structured_table,
        read_tasks,
        run_structured_bench,
    )

    shipped = read_tasks()
    assert len(shipped) >= 20
    tok = make_text_tokenizer(WORDS)
    tok._tokenizer.chat_template = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
                                    "{% if add_generation_prompt %}:{% endif %}")
    tok = TokenizerWrapper(tok._tokenizer, eos_token_ids=[0])
    model = make_target("qwen3", vocab_size=len(tok.vocab), seed=5)
    drafter = make_drafter(model, block_size=8, layer_ids=(0, 2))
    tasks = [{"name": "pet", "text": "A cat.", "schema": SCHEMA, "question": "Describe it."},
             {"name": "any", "text": "x", "schema": {"type": "object", "properties": {
                 "ok": {"type": "boolean"}}, "required": ["ok"],
                 "additionalProperties": False}, "question": "Say ok."}]
    results = run_structured_bench(model, drafter, tok, tasks, max_tokens=120, progress=False)
    s = results["summary"]
    assert s["auto+schema"]["equal_to_plain_schema"] == 2
    assert s["auto+schema"]["valid"] == 2 and s["plain+schema"]["valid"] == 2
    assert s["auto+schema"]["forced_share"] > 0 and results["mask_s_per_token"] > 0
    assert "auto+schema" in format_structured_table(results)
