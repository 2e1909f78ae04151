"""The schedules' communication layer: defined reduction order, bit-exact data movement,
and the Lamport mailbox protocol (sentinel, sanitize, timeout, re-arm, rotation)."""

from __future__ import annotations

import re

import pytest
import torch

from reference.schedules import codec, comm, mailbox
from reference.schedules.comm import (
    MailboxProtocolError,
    MailboxTimeout,
    ordered_sum_bf16,
    run_virtual,
)
from verify.compare import assert_bitwise_equal

BIG = 2.0**30  # FP32 ulp at 2^30 is 2^7: a small addend is absorbed entirely
SMALL = 1.0 + 2.0**-7  # exactly representable in BF16


def _bf16(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.bfloat16)


def test_ordered_sum_is_rank_order_from_rank_0():
    # (2^30 + -2^30) + s = s exactly; (2^30 + s) absorbs s, then - 2^30 = 0.
    parts = [_bf16(BIG), _bf16(-BIG), _bf16(SMALL)]
    assert ordered_sum_bf16(parts).item() == SMALL
    assert ordered_sum_bf16([parts[0], parts[2], parts[1]]).item() == 0.0
    # a float64 sum (the wrong model) would give SMALL for both orders
    assert sum(p.double() for p in [parts[0], parts[2], parts[1]]).item() == SMALL


def test_ordered_sum_single_part_is_identity_bitwise():
    x = torch.tensor([-0.0, 1.5, -3.25, float("inf"), 2.0**-133], dtype=torch.bfloat16)
    assert_bitwise_equal(ordered_sum_bf16([x]), x, what="1-rank all-reduce")


@pytest.mark.parametrize("ranks", [2, 4])
def test_virtual_all_reduce_uses_rank_order_on_every_rank(ranks):
    # rank 0: 2^30, rank 1: -2^30, ranks >= 2: SMALL  -> SMALL * (ranks - 2) (+ 0)
    values = [BIG, -BIG] + [SMALL] * (ranks - 2)
    reversed_values = values[::-1]

    def fn(g):
        a = g.all_reduce_bf16(_bf16(values[g.rank]))
        b = g.all_reduce_bf16(_bf16(reversed_values[g.rank]))
        return a, b

    got = run_virtual(ranks, fn)
    in_order = ordered_sum_bf16([_bf16(v) for v in values])
    reverse = ordered_sum_bf16([_bf16(v) for v in reversed_values])
    for a, b in got:
        assert_bitwise_equal(a, in_order, what="all-reduce in rank order")
        assert_bitwise_equal(b, reverse, what="all-reduce of the reversed ranks")
    if ranks == 4:
        # SMALL + SMALL + 2^30 - 2^30 = 0 vs 2^30 - 2^30 + SMALL + SMALL = 2 SMALL
        assert in_order.item() == 2 * SMALL and reverse.item() == 0.0


def test_all_gather_and_all_to_all_move_bits_exactly():
    def fn(g):
        # payloads with -0, NaN payloads and FP8 codes: data movement must keep the bits
        raw = torch.arange(256, dtype=torch.uint8).roll(g.rank)
        codes = raw.view(torch.float8_e4m3fn)
        gathered = g.all_gather(codes)
        send = [raw[: 10 + j + g.rank].view(torch.float8_e4m3fn) for j in range(g.size)]
        recv = g.all_to_all(send)
        return gathered, recv

    ranks = 3
    got = run_virtual(ranks, fn)
    for r, (gathered, recv) in enumerate(got):
        for i in range(ranks):
            expect = torch.arange(256, dtype=torch.uint8).roll(i)
            assert_bitwise_equal(gathered[i].view(torch.uint8), expect, what=f"gather {i}->{r}")
            assert_bitwise_equal(
                recv[i].view(torch.uint8), expect[: 10 + r + i], what=f"all_to_all {i}->{r}"
            )


def test_run_virtual_reraises_the_failing_rank_and_does_not_hang():
    def fn(g):
        if g.rank == 1:
            raise ValueError("planted failure on rank 1")
        g.barrier()  # would wait forever for rank 1 without the abort
        return g.rank

    with pytest.raises(ValueError, match="planted failure on rank 1"):
        run_virtual(3, fn, timeout=30)


# ----------------------------------------------------------------------------- mailbox

LATENT, EXPERTS, ROWS = 64, 16, 6


def _shards(g, tokens, seed=0):
    gen = torch.Generator().manual_seed(seed + g.rank)
    lat = torch.randn(tokens, LATENT // g.size, generator=gen).bfloat16()
    log = torch.randn(tokens, EXPERTS // g.size, generator=gen)
    return lat, log


@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_mailbox_round_trip_rearm_and_rotation(ranks):
    tokens = 4

    def fn(g):
        box = mailbox.open_mailbox(g, ROWS, LATENT, EXPERTS)
        seen = []
        for call in range(3):
            lat, log = _shards(g, tokens, seed=10 * call)
            index = box.index
            box.publish(lat, log)
            logits = box.poll_logits(tokens, timeout=5)
            latent = box.poll_latent(tokens, timeout=5)
            armed = box.is_armed()  # re-armed, unused rows [tokens, ROWS) never touched
            box.advance()
            g.barrier()  # what the layer's all-reduces guarantee between calls
            seen.append((index, logits, latent, armed))
        return seen

    got = run_virtual(ranks, fn)
    for r, seen in enumerate(got):
        assert [s[0] for s in seen] == [0, 1, 0]  # rotating buffers alternate per call
        for call, (_, logits, latent, armed) in enumerate(seen):
            assert armed
            for w in range(ranks):
                class G:  # the writer's shards, regenerated
                    rank, size = w, ranks
                lat, log = _shards(G, tokens, seed=10 * call)
                cols = slice(w * LATENT // ranks, (w + 1) * LATENT // ranks)
                ecols = slice(w * EXPERTS // ranks, (w + 1) * EXPERTS // ranks)
                assert_bitwise_equal(latent[:, cols], lat, what=f"latent of writer {w} at {r}")
                assert_bitwise_equal(logits[:, ecols], log, what=f"logits of writer {w} at {r}")


def test_mailbox_sanitizes_negative_zero_and_keeps_fp32_words_whole():
    def fn(g):
        box = mailbox.open_mailbox(g, ROWS, LATENT, EXPERTS)
        lat = torch.ones(2, LATENT // g.size, dtype=torch.bfloat16)
        lat[0, 0] = -0.0
        log = torch.ones(2, EXPERTS // g.size)
        log[0, 0] = -0.0
        # an FP32 logit whose LOW 16-bit half is 0x8000: not empty as a 32-bit word
        log[1, 1] = torch.tensor([0x3F808000], dtype=torch.int32).view(torch.float32)
        box.publish(lat, log)
        return box.poll_logits(2, timeout=5), box.poll_latent(2, timeout=5)

    logits, latent = run_virtual(2, fn)[0]
    assert latent.view(torch.int16)[0, 0].item() == 0  # +0, not the 0x8000 sentinel
    assert logits.view(torch.int32)[0, 0].item() == 0
    assert logits.view(torch.int32)[1, 1].item() == 0x3F808000


def test_mailbox_without_sanitize_times_out_naming_the_word(monkeypatch):
    # planted bug: the writer stores a real -0 as is -> the reader sees "empty" forever
    monkeypatch.setattr(mailbox, "sanitize_negative_zero", lambda words: words)

    def fn(g):
        box = mailbox.open_mailbox(g, ROWS, LATENT, EXPERTS)
        lat = torch.ones(3, LATENT // g.size, dtype=torch.bfloat16)
        if g.rank == 1:
            lat[2, 5] = -0.0
        box.publish(lat, torch.ones(3, EXPERTS // g.size))
        box.poll_logits(3, timeout=5)
        return box.poll_latent(3, timeout=0.2)

    column = LATENT // 2 + 5
    with pytest.raises(MailboxTimeout, match=rf"token 2 column {column} \(16-bit word\) still empty"):
        run_virtual(2, fn, timeout=30)


def test_mailbox_reader_of_an_unpublished_shard_times_out_clearly():
    def fn(g):
        box = mailbox.open_mailbox(g, ROWS, LATENT, EXPERTS)
        if g.rank != 1:  # rank 1 never publishes
            box.publish(*_shards(g, 2))
        return box.poll_logits(2, timeout=0.2)

    with pytest.raises(MailboxTimeout) as err:
        run_virtual(2, fn, timeout=30)
    msg = str(err.value)
    # rank 1's logits start at column LATENT + 2 * (EXPERTS / 2) * 1 (16-bit words)
    assert re.search(rf"rank \d: mailbox buffer 0 token 0 column {LATENT + EXPERTS}\b", msg), msg
    assert "0x80000000" in msg


def test_mailbox_missing_rearm_is_a_protocol_error():
    def fn(g):
        box = mailbox.open_mailbox(g, ROWS, LATENT, EXPERTS)
        for _ in range(3):  # never polls: buffer 0 is still full on the third call
            box.publish(*_shards(g, 2))
            box.advance()
            g.barrier()

    with pytest.raises(MailboxProtocolError, match="target slot not armed"):
        run_virtual(2, fn, timeout=30)


def test_mailbox_rejects_shards_that_do_not_split():
    with pytest.raises(ValueError, match="must divide by 3 ranks"):
        run_virtual(3, lambda g: mailbox.open_mailbox(g, ROWS, LATENT, EXPERTS))


def test_torch_group_byte_codec_round_trips_every_dtype_at_odd_offsets():
    # TorchGroup sends header + payload bytes; odd-sized payloads misalign later headers
    gen = torch.Generator().manual_seed(5)
    tensors = [
        torch.arange(3, dtype=torch.uint8),
        torch.randn(2, 3, generator=gen).bfloat16(),
        torch.arange(7, dtype=torch.uint8).view(torch.float8_e4m3fn),
        torch.tensor([-0.0, float("nan")], dtype=torch.float32),
        torch.tensor([[1, -2]], dtype=torch.int32),
        torch.empty(0, 4, dtype=torch.int64),
    ]
    back = codec.decode(codec.encode(tensors), torch.device("cpu"))
    assert len(back) == len(tensors)
    for i, (a, b) in enumerate(zip(back, tensors)):
        assert_bitwise_equal(a, b, what=f"codec tensor {i}")
