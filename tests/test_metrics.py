"""The speed conventions of metrics.py, as a specification: what a step, a second and a speedup count, and that
the Result, the bench, the replays and a real decode all report by them."""

from __future__ import annotations

import math

import pytest

from conftest import ByteTokenizer, OracleHeads, tiny_model
from entmtp import metrics
from entmtp.calibration.replay import Replay
from entmtp.engine import Engine
from entmtp.policy import static
from entmtp.records import Result, Step


def _step(accepted: int) -> Step:
    return Step("tree_8", 8, accepted, accepted + 1, [0] * (accepted + 1))


def test_tokens_per_step_counts_accepted_drafts_plus_the_bonus_token_not_the_prefills():
    steps = [_step(2), _step(0), _step(1)]  # 3 + 1 + 2 tokens
    result = Result("", [0] * 7, 5, steps, 2.0, 0.5, "length")  # 1 prefill token + 6 from the steps
    assert metrics.step_tokens(7) == 6
    assert result.mean_tokens_per_step == metrics.mean_tokens_per_step(6, 3) == 2.0
    assert metrics.step_tokens(200, generations=2) == 198  # pooled over prompts: one prefill token each
    no_steps = Result("", [0], 5, [], 1.0, 1.0, "eos")  # the prefill's token was EOS
    assert no_steps.mean_tokens_per_step == metrics.mean_tokens_per_step(0, 0) == 0.0


def test_tokens_per_second_counts_every_token_over_the_whole_wall_time():
    result = Result("", [0] * 7, 5, [_step(2), _step(0), _step(1)], 2.0, 0.5, "length")
    assert result.tokens_per_second == metrics.tokens_per_second(7, 2.0) == 3.5  # not 6 / 1.5 (decode only)
    assert metrics.tokens_per_second(7, 0.0) == 0.0  # nothing measured: a 0, not a ZeroDivisionError


def test_replay_tokens_per_second_is_over_the_charged_step_latencies_in_ms():
    replay = Replay(tokens=30, steps=10, ms=15.0)
    assert replay.tokens_per_second == metrics.replay_tokens_per_second(30, 15.0) == 2000.0
    assert replay.tokens_per_step == 3.0
    assert Replay().tokens_per_second == 0.0 and Replay().tokens_per_step == 0.0


def test_speedup_is_a_ratio_of_rates_and_zero_against_nothing():
    assert metrics.speedup(30.0, 10.0) == 3.0
    assert metrics.speedup(30.0, 0.0) == 0.0


def test_bench_pools_prompts_and_leaves_the_prefill_out_of_decode_rates():
    from entmtp.bench import summarise

    def rec(tokens, seconds, steps, step_seconds):
        r = {"tokens": tokens, "seconds": seconds, "steps": steps, "step_seconds": step_seconds}
        return r | {"trees": {}, "lookup_tokens": 0, "choose_seconds": 0.0, "probe_seconds": 0.0}

    s = summarise([rec(11, 2.0, 5, 1.0), rec(21, 2.0, 10, 1.5)])
    assert s["tokens_per_second"] == 32 / 4.0  # all tokens over all seconds, not the mean of 5.5 and 10.5
    assert s["decode_tokens_per_second"] == 30 / 2.5  # steps' tokens over steps' time
    assert s["tokens_per_step"] == 30 / 15
    assert s["median_prompt_tokens_per_second"] == (5.5 + 10.5) / 2
    peer = summarise([rec(11, 2.0, 0, 0.0)])
    assert math.isnan(peer["tokens_per_step"])  # a peer decoder records no steps: no tokens/step to show
    assert peer["drafts"] == {}
    one, two = rec(11, 2.0, 5, 1.0), rec(21, 2.0, 10, 1.5)  # drafts by source pool over the prompts
    one["drafts"] = {"heads": {"drafted": 8, "accepted": 3}}
    two["drafts"] = {"heads": {"drafted": 4, "accepted": 1}, "prediction": {"drafted": 9, "accepted": 9}}
    assert summarise([one, two])["drafts"] == {
        "heads": {"drafted": 12, "accepted": 4},
        "prediction": {"drafted": 9, "accepted": 9},
    }


def test_a_real_decode_reports_by_the_conventions():
    model = tiny_model("llama", seed=2)
    ids = [5, 17, 99, 3, 250, 7, 7, 64]
    ref = Engine(model, ByteTokenizer()).generate(ids, max_new_tokens=30).token_ids
    heads = OracleHeads(ids + ref, rank_mod=2, wrong_every=5)
    result = Engine(model, ByteTokenizer(), heads=heads, policy=static("tree_8")).generate(
        ids, max_new_tokens=30
    )
    assert result.token_ids == ref
    assert all(s.tokens == s.accepted + 1 for s in result.steps[:-1])  # the last may be cut at max_new_tokens
    assert sum(s.tokens for s in result.steps) == metrics.step_tokens(len(result.token_ids))
    assert result.mean_tokens_per_step == pytest.approx((len(ref) - 1) / result.num_steps)
    assert result.mean_tokens_per_step > 1.0  # the heads' drafts were accepted
    assert result.tokens_per_second == len(ref) / result.seconds  # the prefill's token and time included
