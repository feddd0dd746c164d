"""Pieces of the dry run that need no process group: the mailbox that answers fake receives, the report
text, the header a later pipeline stage expects."""
from __future__ import annotations

import gc

import torch

from deepshard.dryrun.fake_world import Mailbox
from deepshard.dryrun.observe import Collective, StepWindow
from deepshard.dryrun.report import DryRunReport, EngineFigures, format_report


def _fake_send(*args, **kwargs):
    return "sent"


class _Work:
    def wait(self, timeout=None):
        return True


def _fake_recv(*args, **kwargs):
    return _Work()


def test_a_receive_gets_what_this_rank_sent_that_peer_when_waited_on() -> None:
    box = Mailbox()
    send, recv = box.sending(_fake_send), box.receiving(_fake_recv)
    mine = torch.arange(4.0)
    buf = torch.full((4,), -1.0)
    work = recv(buf, 3, None, 7)  # posted before the send: filled at wait
    send(mine, 3, None, 7)
    assert torch.equal(buf, torch.full((4,), -1.0))
    work.wait()
    assert torch.equal(buf, mine)
    other = torch.full((4,), -1.0)
    recv(other, 2, None, 7).wait()  # nothing sent to rank 2 with tag 7: zeros
    assert torch.equal(other, torch.zeros(4))


def test_large_sends_are_held_weakly_and_responders_answer_first() -> None:
    box = Mailbox()
    send, recv = box.sending(_fake_send), box.receiving(_fake_recv)
    big = torch.ones(Mailbox.SMALL)  # 4x SMALL bytes: held weakly
    send(big, 1)
    del big
    gc.collect()
    buf = torch.full((Mailbox.SMALL,), 5.0)
    recv(buf, 1).wait()
    assert torch.equal(buf, torch.zeros_like(buf))  # the tensor is gone: the mailbox did not keep it alive
    box.expect(1, lambda b: bool(b.fill_(9.0) is not None))
    small = torch.zeros(3)
    recv(small, 1).wait()
    assert torch.equal(small, torch.full((3,), 9.0))


def test_report_text_names_the_world_the_engine_and_each_collective() -> None:
    step = StepWindow(0, 2, 0.5, 0.6, [Collective("all_gather", 4096, 3, 1 << 20, 1 << 20),
                                        Collective("tp:all_reduce", 2, 8, 4096, 8192)])
    engine = EngineFigures({"pp": 1, "dp": 2048, "tp": 2, "sp": 1}, {"pp": 0, "dp": 7, "tp": 1, "sp": 0}, 3, 1.25,
                           {"parameters": 2 << 20, "total": 2 << 20})
    report = DryRunReport(4096, 15, "train.py", "stopped after 2 step(s)", 9.0, 2, 2, 0.01, 5 << 20, [engine],
                          [step], {"files_written": 3, "bytes_written": 10, "files_read": 0, "bytes_read": 0})
    text = format_report(report)
    assert "rank 15 of 4096 ranks" in text and "pp=1 dp=2048 tp=2" in text and "ZeRO stage 3" in text
    assert "tp:all_reduce" in text and "4096" in text and "5.00 MiB" in text
    assert report.init_s == 1.25 and report.steady_step() is step
