"""The transfer machine (kvd/daemon/transfer/machine.py) without sockets: inputs in, actions
out.

Every step a send passes through (LINKING, OFFERED, RETRYING, MOVING, ENDING, CANCELLING,
VERDICT), every interleaving the eager-ordering rule argues about, every answer an offer
can get, the checks an arriving offer and pull request pass, the pulls waiting for their
key, timers and lost links: each driven through the machine alone.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from kvd.daemon.peer_link import PeerLink
from kvd.daemon.transfer.machine import (
    MAX_PULLS_SERVED_PER_LINK,
    CancelTimer,
    Count,
    Discard,
    DropEager,
    EndRead,
    EndReceive,
    Finish,
    Halt,
    Job,
    Landed,
    NoChannel,
    NoRoom,
    Offering,
    PrepareTcp,
    Receiving,
    Send,
    SendOffer,
    SendZeros,
    Serve,
    SettlePull,
    StartSend,
    Step,
    Take,
    Tell,
    Timer,
    TransferMachine,
    new_id,
)
from kvd.errors import (
    BadRequest,
    Cancelled,
    KeyGone,
    KvdTimeout,
    PeerUnreachable,
    PoolExhausted,
    ProtocolError,
    TransferFailed,
    UnknownKey,
)
from kvd.protocol import (
    ALL,
    Accept,
    Busy,
    ChannelDown,
    LayoutEntry,
    Offer,
    PullRequest,
    Refuse,
    XferCancel,
    XferDone,
    XferFailed,
)

LAYOUT = (LayoutEntry(4096, "uint8"), LayoutEntry(4096, "uint8"))
CHUNK = 4 << 20
NBLOCKS = 16  # 128 KiB: more than an offer may carry
NBYTES = 2 * 4096 * NBLOCKS

Machine = TransferMachine[PeerLink]


def machine(has_nccl: bool = True, waiting: int = 4) -> Machine:
    return TransferMachine("node-a", has_nccl, nccl_chunk_bytes=CHUNK,
                           max_waiting_pulls=waiting, max_wait_s=30.0, peer_grace_s=5.0)


def link(name: str = "b") -> PeerLink:
    return PeerLink(f"{name}:9000", f"node-{name}", 1, 9001, b"t" * 32, b"u" * 32)


def spec(to: PeerLink, tid: int, gpu: bool = False, nccl: bool | None = None,
         blocks: int = NBLOCKS, deadline: float = 100.0) -> Send[PeerLink]:
    nccl = gpu if nccl is None else nccl
    return Send(tid, to, f"k{tid}", LAYOUT, blocks, 2 * 4096 * blocks, deadline,
                from_gpu=gpu, nccl=nccl, src_dev="cuda:0" if nccl else "cpu")


def offered(m: Machine, to: PeerLink, tid: int, gpu: bool = False,
            nccl: bool | None = None, blocks: int = NBLOCKS, eager_channel: int = 0,
            deadline: float = 100.0) -> Send[PeerLink]:
    """A send whose first offer is out (host memory: its data connection is up)."""
    s = spec(to, tid, gpu, nccl, blocks, deadline)
    acts = m.send(s, 0.0)
    if s.step is Step.LINKING:
        assert acts[-1] == PrepareTcp(tid)
        acts = m.tcp_ready(tid, None)
    assert isinstance(acts[-1], SendOffer) and s.step is Step.OFFERED
    if eager_channel:
        assert acts[-1].how is Offering.EAGER_NCCL
        m.offered_eager(tid, eager_channel)
    return s


def accept(tid: int, channel: int = 0) -> Accept:
    if channel:
        return Accept(transfer_id=tid, dst_dev="cuda:0", channel=channel, chunk_bytes=CHUNK)
    return Accept(transfer_id=tid)


def offer(tid: int, **fields: object) -> Offer:
    values: dict[str, object] = dict(transfer_id=tid, key=f"k{tid}", src_dev="cpu",
                                     dst_dev="any", nbytes=NBYTES, num_blocks=NBLOCKS,
                                     layout=list(LAYOUT))
    values.update(fields)
    return Offer(**values)  # type: ignore[arg-type]


def pull_request(tid: int, key: str = "k", wait: float = 0.0) -> PullRequest:
    return PullRequest(transfer_id=tid, key=key, dst_dev="cpu", num_blocks=NBLOCKS,
                       layout=list(LAYOUT), wait_for_key_s=wait)


def claimed(to: PeerLink, tid: int) -> Send[PeerLink]:
    """The send of a peer's pull whose key's read ``Serve`` claimed (host memory)."""
    return spec(to, tid, deadline=50.0)


def finish(acts: Sequence[object]) -> Finish:
    [done] = [a for a in acts if isinstance(a, Finish)]
    return done


# ------------------------------------------------------------------ a send, step by step


def test_a_host_send_links_offers_eagerly_moves_and_finishes() -> None:
    m, b = machine(has_nccl=False), link()
    s = spec(b, 1)
    assert m.send(s, 0.0) == [Timer(("deadline", None, 1), 100.0), PrepareTcp(1)]
    assert s.step is Step.LINKING
    # The bytes go right behind the first offer, on the data connection.
    assert m.tcp_ready(1, None) == [SendOffer(1, Offering.EAGER_TCP)]
    assert s.step is Step.OFFERED and s.jobs == {Job.EAGER_TCP: None}
    assert m.message(b, accept(1), 1.0) == []  # they are the transfer's bytes
    assert s.step is Step.MOVING and s.mover is Job.EAGER_TCP
    # XFER_DONE may come before our side of the data connection has seen its end.
    assert m.message(b, XferDone(transfer_id=1, nbytes=NBYTES), 1.0) == []
    assert m.sent(1, Job.EAGER_TCP, NBYTES, 1.0) == [Finish(1, NBYTES, "done")]
    assert m.sends == {} and m.counters.sent == {"done": 1}
    assert m.counters.bytes_sent == NBYTES


def test_a_small_host_send_goes_in_its_offer_and_its_xfer_done_ends_it() -> None:
    m, b = machine(has_nccl=False), link()
    s = spec(b, 1, blocks=2)
    assert m.send(s, 0.0)[1:] == [SendOffer(1, Offering.INLINE)]
    done = XferDone(transfer_id=1, nbytes=s.nbytes)
    assert m.message(b, done, 1.0) == [Finish(1, s.nbytes, "done")]
    # An ACCEPT for an offer that carried its bytes contradicts it.
    s = spec(b, 2, blocks=2)
    m.send(s, 0.0)
    assert isinstance(finish(m.message(b, accept(2), 1.0)).result, ProtocolError)


def test_a_gpu_send_offers_plainly_and_the_accept_starts_its_bytes() -> None:
    m, b = machine(), link()
    s = spec(b, 1, gpu=True)
    assert m.send(s, 0.0)[1:] == [SendOffer(1, Offering.EAGER_NCCL)]
    assert s.offering is Offering.PLAIN  # no live channel was found: it went plain
    acc = accept(1, channel=7)
    assert m.message(b, acc, 1.0) == [StartSend(1, acc)]
    assert s.step is Step.MOVING and s.mover is Job.NCCL
    assert m.sent(1, Job.NCCL, NBYTES, 2.0) == []  # XFER_DONE still awaited
    assert m.message(b, XferDone(transfer_id=1, nbytes=NBYTES), 2.0) == [
        Finish(1, NBYTES, "done")]


def test_a_route_that_cannot_take_an_accepted_send_fails_it_and_drops_the_channel() -> None:
    m, b = machine(), link()
    offered(m, b, 1, gpu=True)
    acc = accept(1, channel=7)
    m.message(b, acc, 1.0)
    tell, done = m.start_failed(1, acc, TransferFailed("no channel"))
    assert isinstance(tell, Tell) and isinstance(tell.message, ChannelDown)
    assert tell.message.channel == 7
    assert isinstance(done, Finish) and isinstance(done.result, TransferFailed)


def test_busy_backs_off_doubling_until_the_deadline() -> None:
    m, b = machine(has_nccl=False), link()
    s = offered(m, b, 1, deadline=1.0)
    acts = m.message(b, Busy(transfer_id=1, retry_after_s=0.05), 0.1)
    # The eager bytes are dropped by the receiver: stopped here.
    assert acts == [Halt(1, Job.EAGER_TCP), Timer(("retry", None, 1), 0.1 + 0.05)]
    assert s.step is Step.RETRYING and Job.EAGER_TCP in s.dropped
    assert m.sent(1, Job.EAGER_TCP, Cancelled("stopped"), 0.12) == []
    assert m.timer(("retry", None, 1), 0.15) == [SendOffer(1, Offering.PLAIN)]  # not eager
    assert m.message(b, Busy(transfer_id=1, retry_after_s=0.0), 0.2) == [
        Timer(("retry", None, 1), 0.2 + 0.1)]
    m.timer(("retry", None, 1), 0.3)
    # The next wait (0.2 s) would pass the deadline: no room, and it says so.
    done = finish(m.message(b, Busy(transfer_id=1, retry_after_s=0.0), 0.9))
    assert isinstance(done.result, PoolExhausted) and m.counters.busy_replies == 3


def test_a_refusal_fails_the_send_with_its_reason() -> None:
    m, b = machine(has_nccl=False), link()
    offered(m, b, 1)
    acts = m.message(b, Refuse(transfer_id=1, code="bad_request", message="no"), 1.0)
    # The eager bytes are stopped, and the send ends once they have.
    assert acts[0] == Halt(1, Job.EAGER_TCP) and not any(isinstance(a, Finish) for a in acts)
    done = finish(m.sent(1, Job.EAGER_TCP, Cancelled("stopped"), 1.1))
    assert isinstance(done.result, BadRequest) and "no" in done.result.message


def test_xfer_failed_after_the_bytes_fails_the_send() -> None:
    m, b = machine(has_nccl=False), link()
    offered(m, b, 1)
    m.message(b, accept(1), 1.0)
    m.sent(1, Job.EAGER_TCP, NBYTES, 1.0)
    done = finish(m.message(b, XferFailed(transfer_id=1, code="transfer_failed",
                                          message="disk"), 1.0))
    assert isinstance(done.result, TransferFailed) and done.label == "failed"


def test_the_deadline_ends_each_step_in_its_own_way() -> None:
    m, b = machine(has_nccl=False), link()
    m.send(spec(b, 1), 0.0)  # LINKING: the receiver is told to forget it
    tell, done = m.timer(("deadline", None, 1), 100.0)
    assert tell == Tell(b, XferCancel(transfer_id=1))
    assert isinstance(done, Finish) and isinstance(done.result, KvdTimeout)
    assert done.label == "timeout"
    offered(m, b, 2, blocks=2)  # OFFERED: no answer
    assert isinstance(finish(m.timer(("deadline", None, 2), 100.0)).result, KvdTimeout)
    # MOVING with bytes still going: their end decides.
    s = offered(m, b, 3)
    m.message(b, accept(3), 1.0)
    assert m.timer(("deadline", None, 3), 100.0) == [] and s.late
    assert isinstance(finish(m.sent(3, Job.EAGER_TCP, NBYTES, 100.1)).result,
                      KvdTimeout)
    # ... unless the receiver said XFER_DONE already.
    offered(m, b, 4)
    m.message(b, accept(4), 1.0)
    m.timer(("deadline", None, 4), 100.0)
    m.message(b, XferDone(transfer_id=4, nbytes=NBYTES), 100.0)
    assert finish(m.sent(4, Job.EAGER_TCP, NBYTES, 100.1)).result == NBYTES


def test_a_failed_send_answers_only_once_its_jobs_have_stopped() -> None:
    """ENDING: no byte is read from the client's blocks after the send answers."""
    m, b = machine(), link()
    s = offered(m, b, 1, gpu=True, eager_channel=7)
    acts = m.link_lost(b, PeerUnreachable("gone"), 1.0)
    assert Halt(1, Job.EAGER_NCCL) in acts and not any(isinstance(a, Finish) for a in acts)
    assert s.step is Step.ENDING
    done = finish(m.sent(1, Job.EAGER_NCCL, NBYTES, 2.0))
    assert isinstance(done.result, PeerUnreachable)
    # Jobs that never stop: the grace timer answers anyway.
    s = offered(m, b, 2, gpu=True, eager_channel=7)
    m.message(b, Refuse(transfer_id=2, code="bad_request", message="no"), 1.0)
    assert isinstance(finish(m.timer(("grace", None, 2), 200.0)).result, BadRequest)


def test_answers_a_send_cannot_take_now_are_protocol_errors() -> None:
    m, b = machine(has_nccl=False), link()
    offered(m, b, 1)
    m.message(b, accept(1), 1.0)
    m.message(b, accept(1), 1.0)  # a second ACCEPT
    assert isinstance(finish(m.sent(1, Job.EAGER_TCP, NBYTES, 1.0)).result,
                      ProtocolError)
    offered(m, b, 2)
    acts = m.message(b, XferDone(transfer_id=2, nbytes=1), 1.0)  # before any ACCEPT
    assert Halt(2, Job.EAGER_TCP) in acts


# ------------------------------------------------------------------ accepts that contradict


def test_accepts_that_contradict_the_offer_are_errors_for_the_sender() -> None:
    m, b = machine(), link()
    offered(m, b, 1, gpu=True)
    assert isinstance(finish(m.message(b, accept(1), 1.0)).result, ProtocolError)
    offered(m, b, 2, gpu=True, eager_channel=7)
    m.message(b, accept(2, channel=8), 1.0)  # the bytes are on 7
    assert isinstance(finish(m.sent(2, Job.EAGER_NCCL, NBYTES, 1.0)).result,
                      ProtocolError)
    # NCCL chosen for a send that offered none: the receiver queued a receive on that
    # channel, so it is told to drop it.
    offered(m, b, 3)
    tell, _done = m.message(b, accept(3, channel=9), 1.0)[:2]
    assert isinstance(tell, Tell) and isinstance(tell.message, ChannelDown)
    assert tell.message.channel == 9 and tell.link is b


def test_answers_from_another_peer_or_for_no_transfer_are_counted() -> None:
    m, b, c = machine(has_nccl=False), link("b"), link("c")
    s = offered(m, b, 1)
    [count] = m.message(c, accept(1), 1.0)
    assert isinstance(count, Count) and count.kind == "unknown_transfer"
    assert s.offer_out  # the real peer's answer is still awaited
    [count] = m.message(b, XferFailed(transfer_id=99, code="x", message="y"), 1.0)
    assert isinstance(count, Count) and count.kind == "unknown_transfer"


# ------------------------------------------------------------------ eager ordering


def test_eager_nccl_when_no_plain_offer_to_the_peer_is_unanswered() -> None:
    m, b = machine(), link()
    offered(m, b, 1, gpu=True, eager_channel=7)
    # An eager offer waiting for its answer does not hold the next one back: both were
    # queued at their OFFER, on both ends, in OFFER order.
    assert m.may_send_eager_nccl(spec(b, 2, gpu=True))


def test_a_plain_offer_unanswered_holds_eager_offers_to_that_peer_back() -> None:
    """The docstring's case: ACCEPT 0 arrived (0 queued here), plain offer 2 is out; the
    receiver may have accepted 2 already (queued 0, 2 there), so an eager 1 queued now
    would run 0, 1, 2 here and 0, 2, 1 there. It must wait until 2 is answered."""
    m, b, c = machine(), link("b"), link("c")
    offered(m, b, 10, gpu=True)
    m.message(b, accept(10, channel=7), 1.0)
    offered(m, b, 12, gpu=True)  # plain: no live channel was known when it went
    one = spec(b, 11, gpu=True)
    assert not m.may_send_eager_nccl(one)
    assert m.may_send_eager_nccl(spec(c, 13, gpu=True))  # another peer's own order
    # Once 2 is answered (either way) it is queued on both ends, or on neither.
    m.message(b, Busy(transfer_id=12, retry_after_s=0.05), 1.0)
    assert m.may_send_eager_nccl(one)


def test_host_memory_offers_over_tcp_do_not_hold_eager_nccl_back() -> None:
    m, b = machine(), link()
    offered(m, b, 1, nccl=False)  # a TCP offer: not on any NCCL channel
    assert m.may_send_eager_nccl(spec(b, 2, gpu=True))
    offered(m, b, 3, nccl=True)  # host memory, but NCCL may be chosen
    assert not m.may_send_eager_nccl(spec(b, 4, gpu=True))


def test_an_offer_given_up_unanswered_holds_eager_back_until_forgotten() -> None:
    m, b = machine(), link()
    offered(m, b, 1, gpu=True)
    acts = m.timer(("deadline", None, 1), 100.0)
    assert 1 in m.abandoned and Timer(("forget", None, 1), 160.0) in acts
    nxt = spec(b, 2, gpu=True)
    assert not m.may_send_eager_nccl(nxt)
    m.timer(("forget", None, 1), 160.0)
    assert m.may_send_eager_nccl(nxt)


def test_an_eager_offer_answered_busy_waits_for_its_bytes_then_offers_plainly() -> None:
    m, b = machine(), link()
    s = offered(m, b, 1, gpu=True, eager_channel=7)
    assert m.message(b, Busy(transfer_id=1, retry_after_s=0.0), 1.0) == []
    assert s.step is Step.RETRYING and s.no_eager
    # Once its bytes are out (received into staging and dropped there), at once.
    assert m.sent(1, Job.EAGER_NCCL, NBYTES, 1.1) == [SendOffer(1, Offering.PLAIN)]
    assert not m.may_send_eager_nccl(s)


def test_eager_nccl_needs_nccl_gpu_blocks_and_a_fair_chunk() -> None:
    b = link()
    assert not machine(has_nccl=False).may_send_eager_nccl(spec(b, 1, gpu=True))
    m = machine()
    assert not m.may_send_eager_nccl(spec(b, 2, nccl=True))
    assert m.may_send_eager_nccl(spec(b, 3, gpu=True))
    for chunk in (1 << 10, 1 << 32):
        odd = TransferMachine[PeerLink]("n", True, nccl_chunk_bytes=chunk)
        assert not odd.may_send_eager_nccl(spec(b, 3, gpu=True))


def test_an_accept_for_an_nccl_offer_given_up_gets_zeros_once() -> None:
    m, b, c = machine(), link("b"), link("c")
    offered(m, b, 1, gpu=True)
    m.timer(("deadline", None, 1), 100.0)
    acc = accept(1, channel=7)
    assert isinstance(m.message(c, acc, 101.0)[0], Count)  # not its peer
    [zeros] = m.message(b, acc, 101.0)
    assert isinstance(zeros, SendZeros) and zeros.gone.link is b and zeros.accept == acc
    assert isinstance(m.message(b, acc, 101.0)[0], Count)  # once only
    # A BUSY for one given up ends it quietly.
    offered(m, b, 2, gpu=True)
    m.timer(("deadline", None, 2), 100.0)
    assert m.message(b, Busy(transfer_id=2, retry_after_s=0.1), 101.0) == []
    assert 2 not in m.abandoned


def test_only_unanswered_plain_nccl_offers_are_remembered() -> None:
    m, b = machine(), link()
    offered(m, b, 1, gpu=True)
    m.message(b, Busy(transfer_id=1, retry_after_s=0.1), 1.0)
    m.timer(("deadline", None, 1), 100.0)
    offered(m, b, 2, gpu=True, eager_channel=7)  # its bytes are queued with it
    m.cancel_send(2, 1.0)
    offered(m, b, 3, nccl=False)
    m.timer(("deadline", None, 3), 100.0)
    assert m.abandoned == {}


# ------------------------------------------------------------------ cancels and verdicts


def test_a_send_cancelled_before_any_byte_went_is_cancelled() -> None:
    m, b = machine(), link()
    offered(m, b, 1, gpu=True)
    acts = m.cancel_send(1, 1.0)
    assert acts[0] == Tell(b, XferCancel(transfer_id=1))
    assert isinstance(finish(acts).result, Cancelled)
    # Its ACCEPT may come still (the receiver waits on its channel): zeros go.
    [zeros] = m.message(b, accept(1, channel=7), 1.1)
    assert isinstance(zeros, SendZeros)
    # An eager offer's bytes are on the channel already: its ACCEPT gets nothing more.
    offered(m, b, 2, gpu=True, eager_channel=7)
    m.cancel_send(2, 1.0)
    assert m.message(b, accept(2, channel=7), 1.1) == []
    m.sent(2, Job.EAGER_NCCL, NBYTES, 1.2)
    assert m.message(b, XferDone(transfer_id=2, nbytes=NBYTES), 1.3) == [
        Finish(2, NBYTES, "done")]  # the receiver kept them: not cancelled after all


def test_a_send_cancelled_after_its_bytes_went_reports_what_the_receiver_says() -> None:
    """CANCELLING, then VERDICT: a cancel never contradicts the receiver."""
    m, b = machine(has_nccl=False), link()
    s = offered(m, b, 1)
    m.message(b, accept(1), 1.0)
    acts = m.cancel_send(1, 1.0)
    assert Halt(1, Job.EAGER_TCP) in acts and s.step is Step.CANCELLING
    # The bytes had all gone before the stop was seen: the receiver's answer decides.
    assert m.sent(1, Job.EAGER_TCP, NBYTES, 1.1) == [Timer(("verdict", None, 1), 100.0)]
    assert s.step is Step.VERDICT
    assert m.cancel_send(1, 1.2) == []  # a second cancel does not cut it short
    assert m.message(b, XferDone(transfer_id=1, nbytes=NBYTES), 1.3) == [
        Finish(1, NBYTES, "done")]
    # Kept: no. Then the cancel stands.
    offered(m, b, 2)
    m.message(b, accept(2), 1.0)
    m.cancel_send(2, 1.0)
    m.sent(2, Job.EAGER_TCP, NBYTES, 1.1)
    done = finish(m.message(b, XferFailed(transfer_id=2, code="cancelled", message="x"),
                            1.2))
    assert isinstance(done.result, Cancelled)
    # No answer in time, or the receiver gone: it cannot say.
    offered(m, b, 3)
    m.message(b, accept(3), 1.0)
    m.cancel_send(3, 1.0)
    m.sent(3, Job.EAGER_TCP, NBYTES, 1.1)
    assert isinstance(finish(m.timer(("verdict", None, 3), 100.0)).result, TransferFailed)
    offered(m, b, 4)
    m.message(b, accept(4), 1.0)
    m.cancel_send(4, 1.0)
    m.sent(4, Job.EAGER_TCP, NBYTES, 1.1)
    assert isinstance(finish(m.link_lost(b, PeerUnreachable("x"), 1.2)).result,
                      TransferFailed)


def test_a_cancel_whose_bytes_stopped_half_way_stands() -> None:
    m, b = machine(has_nccl=False), link()
    offered(m, b, 1)
    m.cancel_send(1, 1.0)
    done = finish(m.sent(1, Job.EAGER_TCP, Cancelled("stopped"), 1.1))  # stopped at a chunk
    assert isinstance(done.result, Cancelled) and done.label == "cancelled"


def test_an_inline_offer_cancelled_while_out_asks_the_receiver() -> None:
    m, b = machine(has_nccl=False), link()
    m.send(spec(b, 1, blocks=2), 0.0)
    assert m.cancel_send(1, 1.0)[-1] == Timer(("verdict", None, 1), 100.0)
    assert m.message(b, XferDone(transfer_id=1, nbytes=1), 1.1) == [
        Finish(1, 2 * 4096 * 2, "done")]
    m.send(spec(b, 2, blocks=2), 0.0)
    m.message(b, Busy(transfer_id=2, retry_after_s=0.05), 0.5)  # delivered nothing
    assert isinstance(finish(m.cancel_send(2, 1.0)).result, Cancelled)


# ------------------------------------------------------------------ offers to us


def test_a_fair_offer_is_taken_and_its_receive_answers_when_it_ends() -> None:
    m, b = machine(has_nccl=False), link()
    o = offer(1)
    assert m.message(b, o, 1.0) == [Take(b, o, False)]
    assert m.took(b, o, Receiving(accept(1), to_waiter=True)) == [Tell(b, accept(1))]
    assert m.in_use(b, 1) and not m.in_use(link("c"), 1)
    # A get waits for these bytes: its reply goes before the sender's confirmation.
    assert m.received(b, 1, NBYTES) == [
        EndReceive(b, 1, NBYTES), Tell(b, XferDone(transfer_id=1, nbytes=NBYTES), True)]
    assert m.counters.received == {"done": 1} and not m.in_use(b, 1)
    m.message(b, offer(2), 1.0)
    m.took(b, offer(2), Receiving(accept(2), to_waiter=False))
    end, tell = m.received(b, 2, TransferFailed("disk"))
    assert isinstance(end, EndReceive) and isinstance(end.result, TransferFailed)
    assert isinstance(tell, Tell) and isinstance(tell.message, XferFailed)
    assert m.counters.received == {"done": 1, "failed": 1}


def test_offers_that_cannot_be_placed_are_answered_busy_or_refused() -> None:
    m, b = machine(has_nccl=False), link()
    assert m.took(b, offer(1, eager=True), NoRoom()) == [
        Tell(b, Busy(transfer_id=1, retry_after_s=0.05)), DropEager(b, offer(1, eager=True))]
    count, _refuse = m.took(b, offer(2), PoolExhausted("larger than the pool"))
    assert isinstance(count, Count) and count.kind == "bad_offer"  # it never fits
    acts = m.took(b, offer(3), BadRequest("exists"))
    assert acts == [Tell(b, Refuse(transfer_id=3, code="bad_request", message="exists"))]
    # An eager NCCL offer whose channel we lack: the sender drops it and offers again.
    eager = offer(4, src_gpu=True, src_dev="cuda:0", channel=3, chunk_bytes=CHUNK)
    down, busy = m.took(b, eager, NoChannel())
    assert isinstance(down.message, ChannelDown) and down.message.channel == 3  # type: ignore[union-attr]
    assert busy == Tell(b, Busy(transfer_id=4, retry_after_s=0.0))


def test_offers_that_cannot_be_taken_are_refused_with_their_reason() -> None:
    m, b = machine(has_nccl=False), link()
    for bad, what in ((offer(2, nbytes=5), "does not match"),
                      (offer(3, src_dev="tpu:0"), "bad device")):
        count, tell = m.message(b, bad, 1.0)
        assert isinstance(count, Count) and count.kind == "bad_offer"
        assert isinstance(tell, Tell) and what in tell.message.message  # type: ignore[union-attr]
    # A fair offer this daemon cannot serve: refused, not counted.
    [tell] = m.message(b, offer(4, src_dev="cuda:0", src_gpu=True), 1.0)
    assert isinstance(tell.message, Refuse) and "no GPU" in tell.message.message  # type: ignore[union-attr]


def test_an_eager_nccl_offer_is_checked_before_anything_else() -> None:
    m, b = machine(has_nccl=False), link()
    eager = offer(1, src_gpu=True, src_dev="cuda:0", channel=3, chunk_bytes=CHUNK)
    _count, down, tell = m.message(b, eager, 1.0)
    assert isinstance(down, Tell) and isinstance(down.message, ChannelDown)
    assert isinstance(tell, Tell) and "no NCCL" in tell.message.message  # type: ignore[union-attr]
    m = machine()
    for bad in (offer(1, channel=3, chunk_bytes=CHUNK),
                offer(1, src_gpu=True, src_dev="cuda:0", channel=3, chunk_bytes=5)):
        assert isinstance(m.message(b, bad, 1.0)[1].message, ChannelDown)  # type: ignore[union-attr]
    ok = offer(1, src_gpu=True, src_dev="cuda:0", channel=3, chunk_bytes=CHUNK)
    assert m.message(b, ok, 1.0) == [Take(b, ok, False)]


def test_a_transfer_id_live_with_the_peer_is_refused_as_a_duplicate() -> None:
    m, b, c = machine(), link("b"), link("c")
    m.message(b, offer(1), 1.0)
    m.took(b, offer(1), Receiving(accept(1), False))
    count, _refuse = m.message(b, offer(1), 1.0)
    assert isinstance(count, Count) and count.kind == "duplicate_transfer"
    # Its eager bytes: an NCCL channel's are dropped (its two ends stay in step), a TCP
    # one's are read by the live transfer's receive.
    eager = offer(1, src_gpu=True, src_dev="cuda:0", channel=3, chunk_bytes=CHUNK)
    assert DropEager(b, eager) in m.message(b, eager, 1.0)
    assert not any(isinstance(a, DropEager) for a in m.message(b, offer(1, eager=True), 1.0))
    assert m.message(c, offer(1), 1.0) == [Take(c, offer(1), False)]  # its own ids
    m.received(b, 1, NBYTES)
    assert m.message(b, offer(1), 1.0) == [Take(b, offer(1), False)]


def test_an_inline_offer_must_carry_exactly_its_bytes_of_host_memory() -> None:
    m, b = machine(), link()
    n = NBYTES
    good = offer(1, inline=b"x" * n)
    assert m.message(b, good, 1.0) == [Take(b, good, False)]
    assert m.took(b, good, Landed(n, to_waiter=False)) == [
        Tell(b, XferDone(transfer_id=1, nbytes=n))]
    for bad in (offer(2, inline=b"x" * (n - 1)),
                offer(3, inline=b"x" * n, src_gpu=True, src_dev="cuda:0"),
                offer(4, inline=b"x" * n, eager=True),
                offer(5, inline=b"x" * n, channel=3, chunk_bytes=CHUNK)):
        first = m.message(b, bad, 1.0)[0]
        assert isinstance(first, Count) and first.kind == "bad_offer", bad


# ------------------------------------------------------------------ our pulls


def test_a_pull_asks_its_owner_and_the_offer_under_its_id_fills_it() -> None:
    m, b = machine(), link()
    [ask] = m.pull(7, b, "k7", LAYOUT, NBLOCKS, 5.0, ALL)
    assert isinstance(ask, Tell) and isinstance(ask.message, PullRequest)
    assert m.message(b, offer(7), 1.0) == [Take(b, offer(7), True)]
    m.took(b, offer(7), Receiving(accept(7), False))
    assert m.received(b, 7, NBYTES) == [
        EndReceive(b, 7, NBYTES), SettlePull(7, NBYTES),
        Tell(b, XferDone(transfer_id=7, nbytes=NBYTES))]
    assert 7 not in m.pulls


def test_the_offer_answering_our_pull_must_match_it_and_come_once() -> None:
    m, b = machine(), link()
    m.pull(7, b, "k7", LAYOUT, NBLOCKS, 0.0, ALL)
    *_, settle, stop = m.message(b, offer(7, key="other"), 1.0)
    assert isinstance(settle, SettlePull) and isinstance(settle.result, ProtocolError)
    assert stop == Tell(b, XferCancel(transfer_id=7))
    m.pull(8, b, "k8", LAYOUT, NBLOCKS, 0.0, ALL)
    m.message(b, offer(8), 1.0)
    m.took(b, offer(8), Receiving(accept(8), False))
    count, _ = m.message(b, offer(8), 1.0)  # a second offer for one pull
    assert isinstance(count, Count) and count.kind == "duplicate_transfer"
    # (refused, but the pull is not failed: its bytes may be landing)
    assert 8 in m.pulls


def test_a_pull_is_refused_cancelled_or_lost_with_its_link() -> None:
    m, b, c = machine(), link("b"), link("c")
    m.pull(5, b, "k", LAYOUT, NBLOCKS, 0.0, ALL)
    fail, stop = m.message(b, Refuse(transfer_id=5, code="unknown_key", message="none"), 1.0)
    assert isinstance(fail, SettlePull) and isinstance(fail.result, UnknownKey)
    assert stop == Tell(b, XferCancel(transfer_id=5))  # a failed pull tells its owner
    m.pull(6, b, "k", LAYOUT, NBLOCKS, 0.0, ALL)
    assert isinstance(m.message(c, Refuse(transfer_id=6, code="x", message="y"), 1.0)[0],
                      Count)  # only its owner answers it
    settle, tell = m.cancel_pull(6)
    assert tell == Tell(b, XferCancel(transfer_id=6))
    assert isinstance(settle, SettlePull) and isinstance(settle.result, Cancelled)
    # Receiving when cancelled: its bytes are dropped, and it settles as its receive ends.
    m.pull(7, b, "k7", LAYOUT, NBLOCKS, 0.0, ALL)
    m.message(b, offer(7), 1.0)
    m.took(b, offer(7), Receiving(accept(7), False))
    assert m.cancel_pull(7) == [Tell(b, XferCancel(transfer_id=7)), Discard(b, 7)]
    assert SettlePull(7, NBYTES) in m.received(b, 7, NBYTES)
    # A lost link fails the pulls it has not begun to answer.
    m.pull(8, b, "k", LAYOUT, NBLOCKS, 0.0, ALL)
    [settle] = [a for a in m.link_lost(b, PeerUnreachable("gone"), 2.0)
                if isinstance(a, SettlePull)]
    assert settle.tid == 8 and isinstance(settle.result, PeerUnreachable)
    # Draining: the pulls no owner has answered fail now.
    m.pull(9, c, "k", LAYOUT, NBLOCKS, 5.0, ALL)
    acts, n = m.drain(Cancelled("draining"))
    assert n == 1 and isinstance(acts[0], SettlePull)


# ------------------------------------------------------------------ pulls we serve


def test_a_served_pull_is_a_send_under_the_pullers_id_and_ends_its_read() -> None:
    m, b = machine(has_nccl=False), link()
    assert m.message(b, pull_request(3), 1.0) == [Serve(b, pull_request(3))]
    acts = m.claimed(b, pull_request(3), claimed(b, 3), 1.0)
    assert acts == [Timer(("deadline", None, 3), 50.0), PrepareTcp(3)]
    assert m.served == {b: 1} and m.in_use(b, 3)
    m.tcp_ready(3, None)
    m.message(b, accept(3), 1.1)
    m.sent(3, Job.EAGER_TCP, NBYTES, 1.2)
    assert m.message(b, XferDone(transfer_id=3, nbytes=NBYTES), 1.3) == [
        Finish(3, NBYTES, "done"), EndRead(3, NBYTES)]
    assert m.served == {} and m.served_all == 0
    # The puller's cancel ends it.
    m.claimed(b, pull_request(4), claimed(b, 4), 1.0)
    m.tcp_ready(4, None)
    acts = m.message(b, XferCancel(transfer_id=4), 1.1)
    assert Halt(4, Job.EAGER_TCP) in acts
    done = m.sent(4, Job.EAGER_TCP, Cancelled("stopped"), 1.2)
    assert isinstance(done[0], Finish) and isinstance(done[0].result, Cancelled)
    assert done[1] == EndRead(4, 0)


def test_a_pull_of_a_key_not_here_waits_for_it_and_is_served_when_it_appears() -> None:
    m, b = machine(waiting=2), link()
    req = pull_request(1, key="later", wait=5.0)
    assert m.claimed(b, req, UnknownKey("no"), 1.0) == [Timer(("wait", b, 1), 6.0)]
    assert m.in_use(b, 1) and m.waits_for("later")
    assert m.key_appeared("other") == []
    assert m.key_appeared("later") == [CancelTimer(("wait", b, 1)), Serve(b, req, 6.0)]
    # Served again and not there (a lent key taken by another): it waits on, to the end
    # of its first wait.
    assert m.claimed(b, req, UnknownKey("no"), 2.0, until=6.0) == [Timer(("wait", b, 1), 6.0)]
    [tell] = m.timer(("wait", b, 1), 6.0)
    assert isinstance(tell.message, Refuse) and tell.message.code == "unknown_key"  # type: ignore[union-attr]
    assert not m.waits_for("later")


def test_waiting_pulls_are_bounded_and_end_with_their_key_their_peer_or_a_drain() -> None:
    m, b, c = machine(waiting=2), link("b"), link("c")
    m.claimed(b, pull_request(1, "x", 5.0), UnknownKey("no"), 1.0)
    m.claimed(b, pull_request(2, "x", 5.0), UnknownKey("no"), 1.0)
    [tell] = m.claimed(c, pull_request(3, "x", 5.0), UnknownKey("no"), 1.0)  # too many
    assert isinstance(tell.message, Refuse)  # type: ignore[union-attr]
    [tell] = m.claimed(c, pull_request(3, "y", 0.0), UnknownKey("no"), 1.0)  # no wait
    assert isinstance(tell.message, Refuse)  # type: ignore[union-attr]
    [tell] = m.claimed(c, pull_request(3, "y", 5.0), KeyGone("taken"), 1.0)  # won't come
    assert tell.message.code == "key_gone"  # type: ignore[union-attr]
    assert m.message(b, XferCancel(transfer_id=1), 1.0) == [CancelTimer(("wait", b, 1))]
    acts = m.key_went("x", KeyGone("released"))
    assert acts[0] == CancelTimer(("wait", b, 2)) and isinstance(acts[1], Tell)
    m.claimed(b, pull_request(4, "z", 5.0), UnknownKey("no"), 1.0)
    assert m.link_lost(b, PeerUnreachable("gone"), 2.0) == [CancelTimer(("wait", b, 4))]
    m.claimed(c, pull_request(5, "z", 5.0), UnknownKey("no"), 1.0)
    acts, n = m.drain(Cancelled("draining"))
    assert n == 1 and m.waiting == {}


def test_pulls_served_at_once_are_bounded_per_peer_and_for_all() -> None:
    m, b = machine(has_nccl=False), link("b")
    m.claimed(b, pull_request(1), claimed(b, 1), 1.0)
    count, _ = m.message(b, pull_request(1), 1.0)
    assert isinstance(count, Count) and count.kind == "duplicate_transfer"
    offered(m, link("c"), 2)
    count, _ = m.message(b, pull_request(2), 1.0)  # a send is known by its id alone
    assert count.kind == "duplicate_transfer"  # type: ignore[union-attr]
    for tid in range(3, MAX_PULLS_SERVED_PER_LINK + 2):
        m.claimed(b, pull_request(tid), claimed(b, tid), 1.0)
    count, tell = m.message(b, pull_request(10**6), 1.0)
    assert count.kind == "pull_limit" and tell.message.code == "pool_exhausted"  # type: ignore[union-attr]
    others = [link(f"p{i}") for i in range(3)]
    for i, peer in enumerate(others, 1):
        for tid in range(10**7 * i, 10**7 * i + MAX_PULLS_SERVED_PER_LINK):
            m.claimed(peer, pull_request(tid), claimed(peer, tid), 1.0)
    fresh, new = link("fresh"), pull_request(10**9)
    count, _ = m.message(fresh, new, 1.0)
    assert count.kind == "pull_limit"  # type: ignore[union-attr]
    m.link_lost(others[0], PeerUnreachable("gone"), 2.0)  # its sends end (no jobs ran)
    assert m.message(fresh, new, 1.0) == [Serve(fresh, new)]


# ------------------------------------------------------------------ a cancel from the peer


def test_a_cancel_drops_our_receive_and_ends_the_pull_we_serve() -> None:
    m, b, c = machine(has_nccl=False), link("b"), link("c")
    m.message(b, offer(1), 1.0)
    m.took(b, offer(1), Receiving(accept(1), False))
    assert m.message(b, XferCancel(transfer_id=1), 1.0) == [Discard(b, 1)]
    assert m.message(c, XferCancel(transfer_id=1), 1.0) == []  # not its transfer
    m.claimed(b, pull_request(2), claimed(b, 2), 1.0)
    assert m.message(c, XferCancel(transfer_id=2), 1.0) == []
    acts = m.message(b, XferCancel(transfer_id=2), 1.0)
    assert isinstance(acts[0], Finish) and isinstance(acts[0].result, Cancelled)


def test_a_forked_process_draws_transfer_ids_of_its_own() -> None:
    """Daemons forked from one process that imported kvd (a prefork launcher, the tests'
    serve_forks.py, benchmarks/mesh.py) must not draw the same transfer ids: a peer refuses
    the second of two equal ids (duplicate_transfer), and that transfer waited out its
    deadline. The child's first id differs from the parent's next."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its first id, then out at once
        os.write(write, str(new_id()).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        child_id = int(pipe.read())
    os.waitpid(pid, 0)
    assert child_id != new_id()
