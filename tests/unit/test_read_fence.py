"""The fence between a push's reads of the trainer's tensors and the optimizer's writes
(``inflight.transport.pusher``): on the host everywhere; on CUDA, the push packs on a
stream of its own, ordered after the optimizer step before it and before the one after it."""

from __future__ import annotations

import threading

import pytest
import torch

from inflight.transport.pusher import ReadFence


def test_the_fence_holds_the_writer_until_the_push_read_everything() -> None:
    fence = ReadFence()
    assert fence.wait(0) >= 0  # no push: open
    fence.begin()
    with pytest.raises(TimeoutError, match="still reads the trainer's tensors after 0.05 s"):
        fence.wait(0.05)
    with fence.reading():
        if not torch.cuda.is_initialized():
            assert fence.stream is None  # a CPU trainer makes no CUDA context
        fence.done()
    fence.done()  # the push's end says it again: nothing changes
    assert fence.wait(0) >= 0


@pytest.mark.gpu
def test_a_push_reads_on_its_own_stream_after_the_last_step_and_before_the_next() -> None:
    dev = torch.device("cuda", torch.cuda.current_device())
    param = torch.zeros(64 << 20, device=dev)  # 256 MiB: long copies, so a missing wait shows
    out = torch.empty_like(param)
    torch.cuda._sleep(400_000_000)  # the last optimizer step, slow, on training's stream
    param.fill_(1.0)
    fence = ReadFence()
    fence.begin()
    seen: list[bool] = []

    def push() -> None:  # the pusher's background thread
        with fence.reading():
            seen.append(torch.cuda.current_stream() == fence.stream != torch.cuda.default_stream(dev))
            torch.cuda._sleep(100_000_000)  # a slow pack: shorter than the step, longer than nothing
            out.copy_(param)
            fence.done()

    t = threading.Thread(target=push)
    t.start()
    fence.wait(60)
    param.fill_(2.0)  # the next optimizer step, launched the moment the fence lets it
    t.join()
    torch.cuda.synchronize()
    assert seen == [True]  # packed on the push's stream, not training's
    # read after the step before (``begun``: else zeros) and before the step after (``read``: else twos)
    assert out.min().item() == out.max().item() == 1.0
