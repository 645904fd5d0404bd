"""The streaming benchmark: its metric against a hand computation, a press that never evicts against the
full cache, the order-keeping sink-and-window baseline, the H2O attention against eager attention, bad
input, and a resume after a kill."""

import math

import pytest
import torch
from conftest import random_ids, tiny_model
from kvpress import DecodingPress, KnormPress

from evaluation.store.results import ResultStore
from evaluation.tasks.streaming import metrics, runner
from evaluation.tasks.streaming.drive import Schedule, feed, full_logits
from evaluation.tasks.streaming.presses import DETERMINISTIC
from evaluation.tasks.streaming.streams import Stream
from kvpress_prob.decoding.scorers import H2OPress, buffered_attention


def test_token_scores_match_a_hand_computation():
    full = torch.tensor([[2.0, 0.0, -1.0], [0.5, 0.5, 3.0]])
    comp = torch.tensor([[1.0, 1.0, 0.0], [0.0, 2.0, 1.0]])
    targets = torch.tensor([0, 2])
    scores = metrics.token_scores(full, comp, targets)
    for t in range(2):
        zp = sum(math.exp(x) for x in full[t].tolist())
        zq = sum(math.exp(x) for x in comp[t].tolist())
        p = [math.exp(x) / zp for x in full[t].tolist()]
        q = [math.exp(x) / zq for x in comp[t].tolist()]
        y = int(targets[t])
        assert scores["nll_full"][t].item() == pytest.approx(-math.log(p[y]), rel=1e-12)
        assert scores["nll"][t].item() == pytest.approx(-math.log(q[y]), rel=1e-12)
        assert scores["nll_increase"][t].item() == pytest.approx(math.log(p[y] / q[y]), rel=1e-12)
        assert scores["kl"][t].item() == pytest.approx(sum(a * math.log(a / b) for a, b in zip(p, q)), rel=1e-12)
    summary = metrics.summary([metrics.token_scores(full[:1], comp[:1], targets[:1]),
                               metrics.token_scores(full[1:], comp[1:], targets[1:])])
    assert summary["n_scored"] == 2
    assert summary["kl"] == pytest.approx(float(scores["kl"].mean()), rel=1e-12)


def _scores(model, ids, schedule, press, reference):
    parts = []

    def score(start, logits):
        offset = start - schedule.score_from
        parts.append(metrics.token_scores(reference[offset:offset + len(logits)], logits,
                                          ids[0, start + 1:start + 1 + len(logits)]))

    sizes = feed(model, ids, schedule, press, score)
    return metrics.summary(parts), sizes


def test_a_press_that_never_evicts_scores_exactly_zero():
    model, ids = tiny_model("llama"), random_ids(200)
    schedule = Schedule(n=200, budget=32, chunk=16, interval=32)
    reference = full_logits(model, ids, schedule)
    assert schedule.end == 32 + 16 * 10  # whole chunks before the last token
    assert reference.shape == (schedule.end - 64, model.config.vocab_size)
    never = DecodingPress(KnormPress(), compression_interval=2, target_size=200)
    summary, sizes = _scores(model, ids, schedule, never, reference)
    assert summary["n_scored"] == schedule.end - 64
    assert summary["nll_increase"] == 0.0 and summary["kl"] == 0.0
    assert sizes["held_end"] == schedule.end
    evicting = DETERMINISTIC["knorm"](schedule, 0, 16)  # the same scorer at the schedule's budget
    summary, sizes = _scores(model, ids, schedule, evicting, reference)
    assert summary["kl"] > 0 and summary["nll_increase"] != 0.0
    assert sizes["held_max"] == 32 + 16 and sizes["attended_max"] == 32 + 32


def test_sink_and_window_keeps_the_sinks_and_the_last_entries_in_order():
    model, ids = tiny_model("qwen3"), random_ids(300, seed=1)
    schedule = Schedule(n=300, budget=40, chunk=8, interval=16)  # 16 rounds after the prefill
    press = DETERMINISTIC["streaming_llm"](schedule, 0, 16)
    cache = feed(model, ids, schedule, press)["cache"]
    full = feed(model, ids, schedule)["cache"]
    fed = schedule.end
    assert fed == 40 + 8 * 32  # 32 whole chunks fit before the last token
    # compressions every 2 forwards: the last one ends the forward of token 295, nothing came after it
    last_cut = schedule.budget + ((fed - schedule.budget) // schedule.interval) * schedule.interval
    window = schedule.budget - 4
    expected = list(range(4)) + list(range(last_cut - window, fed))
    keys = cache.layers[0].keys
    assert keys.shape[2] == len(expected) == schedule.budget + fed - last_cut
    torch.testing.assert_close(keys, full.layers[0].keys[:, :, expected], rtol=1e-4, atol=1e-5)
    for layer in cache.layers:
        assert layer.keys.shape[2] == len(expected)


def test_h2o_attention_equals_eager_attention():
    model = tiny_model("llama")
    model.set_attn_implementation("eager")
    ids = random_ids(80, seed=2)
    seen = []

    def hook(module, args, kwargs, output):
        if kwargs["hidden_states"].shape[1] == 12:  # the forwards after the prefill: 12 queries each
            keys = kwargs["past_key_values"].layers[module.layer_idx].keys
            mine = buffered_attention(module, kwargs["hidden_states"], keys, kwargs)
            seen.append((mine, output[1].float()))

    attention = model.model.layers[1].self_attn
    attention.rotary_emb = model.model.rotary_emb  # what a kvpress press sets on entering its context
    handle = attention.register_forward_hook(hook, with_kwargs=True)
    try:
        feed(model, ids, Schedule(n=80, budget=43, chunk=12, interval=12))  # forwards of 43, 12, 12, 12
    finally:
        handle.remove()
    assert [mine.shape[-1] for mine, _ in seen] == [55, 67, 79]
    for mine, eager in seen:
        assert mine.shape == eager.shape
        torch.testing.assert_close(mine, eager, rtol=1e-4, atol=1e-6)


def test_h2o_sums_follow_the_kept_entries(monkeypatch):
    """Every round, each entry's score is the attention it received from every query buffered since it
    entered the cache, recomputed here entry by entry: entries are named by their key vector (per layer
    and head; gathering never changes it), and each round's fresh attention (``buffered_attention``) is
    added to the entry's own running sum. Sums truncated to the first n_kept entries instead of gathered
    with the kept ones fail this (the kept entries are not a prefix: the recent window is kept)."""
    model, ids = tiny_model("llama"), random_ids(120, seed=3)
    schedule = Schedule(n=120, budget=32, chunk=8, interval=16)
    scorer = H2OPress(n_recent=4)
    press = DecodingPress(scorer, compression_interval=2, target_size=32)
    running: dict = {}  # (layer, head, key bytes) -> attention received so far (float64)
    checked = {"carried": 0}
    score = H2OPress.score

    def spy(self, module, hidden_states, keys, values, attentions, kwargs):
        b, h, n, _ = keys.shape
        fresh = buffered_attention(module, hidden_states, keys, kwargs).sum(2).view(b, h, -1, n).mean(2)
        scores = score(self, module, hidden_states, keys, values, attentions, kwargs)
        for head in range(h):
            names = [(module.layer_idx, head, keys[0, head, j].numpy().tobytes()) for j in range(n)]
            assert len(set(names)) == n  # the key vectors tell the entries apart
            for j, name in enumerate(names):
                checked["carried"] += name in running
                running[name] = running.get(name, 0.0) + float(fresh[0, head, j])
                if j < n - self.n_recent:  # the recent window scores +inf
                    assert float(scores[0, head, j]) == pytest.approx(running[name], rel=1e-5, abs=1e-7), \
                        (module.layer_idx, head, j)
        return scores

    monkeypatch.setattr(H2OPress, "score", spy)
    cache = feed(model, ids, schedule, press)["cache"]
    assert checked["carried"] > 100  # entries whose sums crossed a round: what gathering must get right
    for i, layer in enumerate(cache.layers):
        sums = scorer.accumulated[cache][i]  # the sums of this cache (keyed by cache, issue 25 item 3)
        # after the last round the sums cover the kept entries, then the entries fed since hold none yet
        assert sums.shape[2] <= layer.keys.shape[2]
        assert torch.all(sums > 0)
    with press(model):  # a new context starts without sums
        assert len(scorer.accumulated) == 0


@pytest.mark.parametrize("bad, message", [
    (dict(n=100, budget=32, chunk=12, interval=32), "multiple of chunk"),
    (dict(n=80, budget=32, chunk=16, interval=32), "no token would be scored"),
    (dict(n=100, budget=0, chunk=16, interval=32), "budget must be an integer >= 1"),
])
def test_schedule_refuses_bad_settings(bad, message):
    with pytest.raises(ValueError, match=message):
        Schedule(**bad)


def test_units_refuse_an_unknown_press():
    with pytest.raises(ValueError, match="unknown press.*accepts: knorm"):
        runner.units(["knorm", "nope"], [0], [32], [16], [32])


def test_resume_after_a_kill_loses_no_finished_stream(tmp_path, monkeypatch):
    model = tiny_model("llama", layers=2)
    streams = [Stream(f"s{i}:0", (f"s{i}",), random_ids(120, seed=10 + i)) for i in range(2)]
    todo = runner.units(["knorm", "streaming_llm"], [0], [32], [16], [32])
    fresh = ResultStore(tmp_path / "fresh.jsonl")
    runner.run(model, streams, todo, fresh, model_name="tiny", split="dev", progress=False)

    store = ResultStore(tmp_path / "killed.jsonl")
    append, calls = ResultStore.append, []

    def killed_after_three(self, records):
        append(self, records)
        if len(self.records()) == 3:
            raise KeyboardInterrupt  # the process dies after the third unit is on disk
    monkeypatch.setattr(ResultStore, "append", killed_after_three)
    with pytest.raises(KeyboardInterrupt):
        runner.run(model, streams, todo, store, model_name="tiny", split="dev", progress=False)
    monkeypatch.setattr(ResultStore, "append", append)
    finished = store.records()
    assert len(finished) == 3

    run_unit = runner.run_unit
    monkeypatch.setattr(runner, "run_unit", lambda *a: calls.append(a[2].press) or run_unit(*a))
    written = runner.run(model, streams, todo, ResultStore(store.path), model_name="tiny", split="dev", progress=False)
    assert written == 1 and calls == ["streaming_llm"]  # only the unit in flight is computed again
    resumed = ResultStore(store.path).records()
    assert resumed[:3] == finished
    drop = {"seconds"}
    by_key = lambda rs: {(r["example_id"], r["press"]): {k: v for k, v in r.items() if k not in drop} for r in rs}
    assert by_key(resumed) == by_key(fresh.records())
    assert {r["data_dir"] for r in resumed} == {"n120-b32-c16-i32"}


def test_streams_tile_the_split_without_overlap(tokenizer):
    from evaluation.tasks.prose.essays import essay_ids, essays, split_of
    from evaluation.tasks.streaming.streams import streams

    n = 2048
    found = streams(tokenizer, "dev", n)
    files = {p.stem: p for p in essays("dev")}
    assert len(found) > 4 and all(s.ids.shape == (1, n) for s in found)
    assert all(split_of(name) == "dev" for s in found for name in s.essays)
    used = [(name, s.stream_id.rsplit(":", 1)[1]) for s in found for name in s.essays]
    assert len(used) == len(set(used))  # no essay tile is used twice
    for s in found:
        if len(s.essays) == 1:  # an essay's own tile k is its tokens k*n .. (k+1)*n - 1
            k = int(s.stream_id.rsplit(":", 1)[1])
            assert s.ids[0].tolist() == essay_ids(tokenizer, files[s.essays[0]])[k * n:(k + 1) * n]
        else:  # joined essays: the first one's tokens open the stream, each essay at most once
            first = essay_ids(tokenizer, files[s.essays[0]])
            assert len(first) < n and s.ids[0, :len(first)].tolist() == first
    assert [s.stream_id for s in streams(tokenizer, "dev", n, max_streams=3)] == [s.stream_id for s in found[:3]]
    with pytest.raises(ValueError, match="split must be one of"):
        streams(tokenizer, "train", n)


def test_kvprob_stream_runs_resumes_and_reports(tmp_path, tokenizer, capsys):
    from evaluation.cli import main

    model_dir = tmp_path / "tiny"
    tiny_model("llama", layers=2).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    out = tmp_path / "dev"
    argv = ["stream", "--model", str(model_dir), "--split", "dev", "--tokens", "160", "--streams", "2",
            "--budget", "48", "64", "--chunk", "16", "--interval", "16", "--presses", "knorm", "tova",
            "prob_decode_attn_priority", "prob_decode_attn_priority_nocorr", "--seeds", "0", "1", "--out", str(out)]
    main(argv)
    assert sorted(p.name for p in out.glob("*.jsonl")) == ["b48-c16-i16.jsonl", "b64-c16-i16.jsonl"]
    records = [r for p in out.glob("*.jsonl") for r in ResultStore(p, readonly=True).records()]
    assert len(records) == 2 * 2 * (2 + 2 * 2)  # streams x budgets x (2 deterministic + 2 sampled x 2 seeds)
    assert {r["split"] for r in records} == {"dev"}
    for r in records:  # equal memory: the corrected press pays for its bias with entries (head_dim 16)
        corrected = r["press"] == "prob_decode_attn_priority"
        assert r["held_end"] == (r["budget"] * 32 // 33 if corrected else r["budget"])  # each forward ends a round
        assert (r["bias_bytes"] > 0) == corrected
        assert r["kv_bytes"] + r["bias_bytes"] <= 2 * 2 * 2 * r["budget"] * 16 * 4  # layers x K,V x heads x d x fp32
    text = (out / "report.md").read_text()
    assert "development split" in text and "kvprob stream --model" in text
    assert "prob_decode_attn_priority − tova" in text or "prob_decode_attn_priority − knorm" in text
    assert "Corrected minus uncorrected" in text
    main(argv)  # a rerun computes nothing
    assert "0 results written" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="context_length"):
        main([*argv[:6], "200", *argv[7:]])  # another stream length into the same folder is refused
    with pytest.raises(SystemExit, match="target_size must be > n_sink"):
        main([*argv[:10], "32", *argv[12:]])  # a budget the press refuses stops before any stream runs


def test_true_decoding_and_chunks_keep_the_same_entries():
    """Chunk 1 (one token per forward, compression every 16 forwards) and chunk 16 (every forward) attend
    to the same entries at every token under a scorer that reads only the keys: same scores up to rounding."""
    model, ids = tiny_model("llama"), random_ids(193, seed=4)
    scores = {}
    for chunk in (1, 16):
        schedule = Schedule(n=193, budget=48, chunk=chunk, interval=16)
        assert schedule.end == 192  # both feed every token but the last
        reference = full_logits(model, ids, schedule)
        scores[chunk], sizes = _scores(model, ids, schedule, DETERMINISTIC["knorm"](schedule, 0, 16), reference)
        assert sizes["held_end"] == 48 and sizes["attended_max"] == 48 + 16
    assert scores[1]["n_scored"] == scores[16]["n_scored"] and scores[1]["kl"] > 0
    for value in ("nll_increase", "kl"):
        assert scores[1][value] == pytest.approx(scores[16][value], rel=1e-3, abs=1e-6)
