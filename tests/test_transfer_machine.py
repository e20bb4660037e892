"""The transfer machine (kvd/daemon/transfer/machine.py) without sockets: events in, actions out.

Every interleaving the eager-ordering rule argues about, every answer an offer can get, and
the checks an arriving offer and pull request pass, each driven through the machine alone.
"""

from __future__ import annotations

from kvd.daemon.peer_link import PeerLink
from kvd.daemon.transfer.machine import (
    MAX_PULLS_SERVED_PER_LINK,
    Count,
    Deliver,
    Discard,
    EagerTcpAccepted,
    FailPull,
    OfferFacts,
    Outgoing,
    PullState,
    SendZeros,
    StartSend,
    StopEagerTcp,
    Tell,
    TransferMachine,
)
from kvd.errors import (
    BadRequest,
    Cancelled,
    PeerUnreachable,
    PoolExhausted,
    ProtocolError,
    UnknownKey,
)
from kvd.protocol import (
    Accept,
    Busy,
    ChannelDown,
    LayoutEntry,
    Offer,
    Refuse,
    XferDone,
    XferFailed,
)

LAYOUT = (LayoutEntry(4096, "uint8"), LayoutEntry(4096, "uint8"))
CHUNK = 4 << 20
FACTS = OfferFacts("node-b", has_nccl=True, pool_capacity_bytes=1 << 30, get_waits=False)

Machine = TransferMachine[PeerLink]


def link(name: str = "b") -> PeerLink:
    return PeerLink(f"{name}:9000", f"node-{name}", 1, 9001, b"t" * 32, b"u" * 32)


def gpu_send(machine: Machine, to: PeerLink, tid: int) -> Outgoing[PeerLink]:
    out = Outgoing(tid, f"k{tid}", to, LAYOUT, 8, from_gpu=True, nccl=True, src_dev="cuda:0")
    machine.send_begins(out)
    return out


def host_send(machine: Machine, to: PeerLink, tid: int, nccl: bool = False
              ) -> Outgoing[PeerLink]:
    out = Outgoing(tid, f"k{tid}", to, LAYOUT, 8, from_gpu=False, nccl=nccl,
                   src_dev="cuda:0" if nccl else "cpu", tcp_ready=True)
    machine.send_begins(out)
    return out


def offer(tid: int, **fields: object) -> Offer:
    values: dict[str, object] = dict(transfer_id=tid, key=f"k{tid}", src_dev="cpu",
                                     dst_dev="any", nbytes=2 * 4096 * 8, num_blocks=8,
                                     layout=list(LAYOUT))
    values.update(fields)
    return Offer(**values)  # type: ignore[arg-type]


# ------------------------------------------------------------------ eager ordering


def test_eager_nccl_when_no_plain_offer_to_the_peer_is_unanswered() -> None:
    m, b = Machine(has_nccl=True), link()
    first = gpu_send(m, b, 1)
    assert m.may_send_eager_nccl(first, CHUNK)
    m.offered(first, eager_channel=7)
    # An eager offer waiting for its answer does not hold the next one back: both were
    # queued at their OFFER, on both ends, in OFFER order.
    second = gpu_send(m, b, 2)
    assert m.may_send_eager_nccl(second, CHUNK)


def test_a_plain_offer_unanswered_holds_eager_offers_to_that_peer_back() -> None:
    """The docstring's case: ACCEPT 0 arrived (0 queued here), plain offer 2 is out; the
    receiver may have accepted 2 already (queued 0, 2 there), so an eager 1 queued now
    would run 0, 1, 2 here and 0, 2, 1 there. It must wait until 2 is answered."""
    m, b, c = Machine(has_nccl=True), link("b"), link("c")
    zero = gpu_send(m, b, 10)
    m.offered(zero)
    assert m.on_answer(b, Accept(transfer_id=10, dst_dev="cuda:0", channel=7,
                                 chunk_bytes=CHUNK)) == [StartSend(10, Accept(
                                     transfer_id=10, dst_dev="cuda:0", channel=7,
                                     chunk_bytes=CHUNK))]
    two = gpu_send(m, b, 12)
    m.offered(two)  # plain: no live channel was known when it went
    one = gpu_send(m, b, 11)
    assert not m.may_send_eager_nccl(one, CHUNK)
    # Another peer's channels have their own order.
    assert m.may_send_eager_nccl(gpu_send(m, c, 13), CHUNK)
    # Once 2 is answered (either way) it is queued on both ends, or on neither.
    m.on_answer(b, Busy(transfer_id=12, retry_after_s=0.05))
    assert m.may_send_eager_nccl(one, CHUNK)


def test_host_memory_offers_over_tcp_do_not_hold_eager_nccl_back() -> None:
    m, b = Machine(has_nccl=True), link()
    m.offered(host_send(m, b, 1))  # a TCP offer: not on any NCCL channel
    assert m.may_send_eager_nccl(gpu_send(m, b, 2), CHUNK)
    m.offered(host_send(m, b, 3, nccl=True))  # host memory, but NCCL may be chosen
    assert not m.may_send_eager_nccl(gpu_send(m, b, 4), CHUNK)


def test_an_offer_given_up_unanswered_holds_eager_back_until_forgotten() -> None:
    m, b = Machine(has_nccl=True), link()
    gone = gpu_send(m, b, 1)
    m.offered(gone)
    assert m.send_ends(gone)  # its ACCEPT may still come: remembered
    nxt = gpu_send(m, b, 2)
    assert not m.may_send_eager_nccl(nxt, CHUNK)
    m.forget_abandoned(1)
    assert m.may_send_eager_nccl(nxt, CHUNK)


def test_an_eager_offer_answered_busy_is_offered_again_plainly() -> None:
    m, b = Machine(has_nccl=True), link()
    out = gpu_send(m, b, 1)
    m.offered(out, eager_channel=7)
    assert m.on_answer(b, Busy(transfer_id=1, retry_after_s=0.0)) == [
        Deliver(1, Busy(transfer_id=1, retry_after_s=0.0))]
    m.eager_nccl_dropped(out)
    assert out.eager_channel == 0 and not m.may_send_eager_nccl(out, CHUNK)


def test_eager_nccl_needs_nccl_gpu_blocks_and_a_fair_chunk() -> None:
    b = link()
    assert not Machine(has_nccl=False).may_send_eager_nccl(
        gpu_send(Machine(has_nccl=False), b, 1), CHUNK)
    m = Machine(has_nccl=True)
    assert not m.may_send_eager_nccl(host_send(m, b, 2, nccl=True), CHUNK)
    out = gpu_send(m, b, 3)
    assert not m.may_send_eager_nccl(out, 1 << 10)
    assert not m.may_send_eager_nccl(out, 1 << 32)
    assert m.may_send_eager_nccl(out, 1 << 20)


# ------------------------------------------------------------------ answers to our offers


def test_the_accept_of_an_eager_tcp_offer_takes_the_bytes_already_sent() -> None:
    m, b = Machine(has_nccl=False), link()
    out = host_send(m, b, 1)
    m.offered(out, eager_tcp=True)
    accept = Accept(transfer_id=1)
    assert m.on_answer(b, accept) == [EagerTcpAccepted(1, accept)]
    assert out.accepted and out.eager_answered and not out.offer_pending
    assert m.on_answer(b, XferDone(transfer_id=1, nbytes=out.nbytes)) == [
        Deliver(1, XferDone(transfer_id=1, nbytes=out.nbytes))]


def test_busy_stops_the_eager_bytes_and_the_next_accept_sends_again() -> None:
    m, b = Machine(has_nccl=False), link()
    out = host_send(m, b, 1)
    m.offered(out, eager_tcp=True)
    busy = Busy(transfer_id=1, retry_after_s=0.05)
    assert m.on_answer(b, busy) == [StopEagerTcp(1), Deliver(1, busy)]
    m.offered(out)  # offered again, not eager
    accept = Accept(transfer_id=1)
    assert m.on_answer(b, accept) == [StartSend(1, accept)]
    refused = host_send(m, b, 2)
    m.offered(refused, eager_tcp=True)
    refuse = Refuse(transfer_id=2, code="pool_exhausted", message="full")
    assert m.on_answer(b, refuse) == [StopEagerTcp(2), Deliver(2, refuse)]


def test_accepts_that_contradict_the_offer_are_errors_for_the_sender() -> None:
    m, b = Machine(has_nccl=True), link()
    gpu = gpu_send(m, b, 1)
    m.offered(gpu)
    [over_tcp] = m.on_answer(b, Accept(transfer_id=1))
    assert isinstance(over_tcp, Deliver) and isinstance(over_tcp.reply, ProtocolError)
    eager = gpu_send(m, b, 2)
    m.offered(eager, eager_channel=7)
    [wrong] = m.on_answer(b, Accept(transfer_id=2, dst_dev="cuda:0", channel=8,
                                    chunk_bytes=CHUNK))
    assert isinstance(wrong, Deliver) and isinstance(wrong.reply, ProtocolError)
    assert not eager.accepted
    # NCCL chosen for a send that offered none: the receiver queued a receive on that
    # channel, so it is told to drop it.
    tcp_only = host_send(m, b, 3)
    m.offered(tcp_only)
    tell, fail = m.on_answer(b, Accept(transfer_id=3, dst_dev="cuda:0", channel=9,
                                       chunk_bytes=CHUNK))
    assert isinstance(tell, Tell) and isinstance(tell.message, ChannelDown)
    assert tell.message.channel == 9 and tell.link is b
    assert isinstance(fail, Deliver) and isinstance(fail.reply, ProtocolError)


def test_answers_from_another_peer_or_for_no_transfer_are_counted() -> None:
    m, b, c = Machine(has_nccl=False), link("b"), link("c")
    out = host_send(m, b, 1)
    m.offered(out)
    assert m.on_answer(c, Accept(transfer_id=1)) == [Count("unknown_transfer", 1)]
    assert out.offer_pending  # the real peer's answer is still awaited
    assert m.on_answer(b, XferFailed(transfer_id=99, code="x", message="y")) == [
        Count("unknown_transfer", 99)]


def test_an_accept_for_an_nccl_offer_given_up_gets_zeros() -> None:
    m, b, c = Machine(has_nccl=True), link("b"), link("c")
    out = gpu_send(m, b, 1)
    m.offered(out)
    m.send_ends(out)
    accept = Accept(transfer_id=1, dst_dev="cuda:1", channel=7, chunk_bytes=CHUNK)
    assert m.on_answer(c, accept) == [Count("unknown_transfer", 1)]  # not its peer
    [zeros] = m.on_answer(b, accept)
    assert isinstance(zeros, SendZeros) and zeros.gone.link is b and zeros.accept == accept
    assert m.on_answer(b, accept) == [Count("unknown_transfer", 1)]  # once only
    # A BUSY for one given up ends it quietly.
    other = gpu_send(m, b, 2)
    m.offered(other)
    m.send_ends(other)
    assert m.on_answer(b, Busy(transfer_id=2, retry_after_s=0.1)) == []
    assert 2 not in m.abandoned


def test_only_unanswered_plain_nccl_offers_are_remembered() -> None:
    m, b = Machine(has_nccl=True), link()
    answered = gpu_send(m, b, 1)
    m.offered(answered)
    m.on_answer(b, Busy(transfer_id=1, retry_after_s=0.1))
    assert not m.send_ends(answered)
    eager = gpu_send(m, b, 2)
    m.offered(eager, eager_channel=7)  # its bytes are queued: the receiver drops them
    assert not m.send_ends(eager)
    tcp = host_send(m, b, 3)
    m.offered(tcp)
    assert not m.send_ends(tcp)
    assert m.outgoing == {} and m.abandoned == {}


def test_a_refused_pull_fails() -> None:
    m, b = Machine(has_nccl=False), link()
    m.pull_begins(5, PullState("k", b, LAYOUT, 8))
    [fail] = m.on_answer(b, Refuse(transfer_id=5, code="unknown_key", message="none"))
    assert isinstance(fail, FailPull) and isinstance(fail.error, UnknownKey)
    assert m.on_answer(link("c"), Refuse(transfer_id=5, code="x", message="y")) == [
        Count("unknown_transfer", 5)]


def test_whether_a_cancelled_send_may_have_delivered() -> None:
    m, b = Machine(has_nccl=True), link()
    out = gpu_send(m, b, 1)
    m.offered(out)
    assert not m.may_have_arrived(out, None, None, None)  # nothing was queued
    assert m.may_have_arrived(out, None, None, True)  # queued, offer unanswered
    m.on_answer(b, Busy(transfer_id=1, retry_after_s=0.1))
    assert not m.may_have_arrived(out, None, None, True)  # answered BUSY: dropped
    tcp = host_send(m, b, 2)
    m.offered(tcp, eager_tcp=True)
    assert m.may_have_arrived(tcp, None, True, None)
    assert not m.may_have_arrived(tcp, None, False, None)  # stopped half way
    m.on_answer(b, Accept(transfer_id=2))
    assert m.may_have_arrived(tcp, True, True, None)  # it is the TCP job now
    assert not m.may_have_arrived(tcp, False, True, None)


# ------------------------------------------------------------------ offers to us


def test_offers_that_cannot_be_taken_are_refused_with_their_reason() -> None:
    m, b = Machine(has_nccl=False), link()
    assert m.check_offer(b, offer(1), FACTS) is None
    short = m.check_offer(b, offer(2, nbytes=5), FACTS)
    assert short is not None and isinstance(short.error, ProtocolError)
    assert short.bad == "bad_offer"
    device = m.check_offer(b, offer(3, src_dev="tpu:0"), FACTS)
    assert device is not None and "bad device" in device.error.message
    no_nccl = OfferFacts("node-b", has_nccl=False, pool_capacity_bytes=1 << 30,
                         get_waits=False)
    gpu = m.check_offer(b, offer(4, src_dev="cuda:0", src_gpu=True), no_nccl)
    assert gpu is not None and isinstance(gpu.error, BadRequest) and gpu.bad is None
    small = OfferFacts("node-b", has_nccl=False, pool_capacity_bytes=1024, get_waits=False)
    big = m.check_offer(b, offer(5), small)
    assert big is not None and isinstance(big.error, PoolExhausted)
    waits = OfferFacts("node-b", has_nccl=False, pool_capacity_bytes=1024, get_waits=True)
    assert m.check_offer(b, offer(5), waits) is None  # a get's blocks are the room


def test_a_transfer_id_live_with_the_peer_is_refused_as_a_duplicate() -> None:
    m, b, c = Machine(has_nccl=False), link("b"), link("c")
    m.receive_begins(b, 1)
    dup = m.check_offer(b, offer(1), FACTS)
    assert dup is not None and dup.bad == "duplicate_transfer" and not dup.fails_pull
    assert m.check_offer(c, offer(1), FACTS) is None  # another peer's ids are its own
    assert m.check_offer(b, offer(2), FACTS, waiting=True) is not None
    m.receive_ends(b, 1)
    assert m.check_offer(b, offer(1), FACTS) is None


def test_the_offer_answering_our_pull_must_match_it() -> None:
    m, b = Machine(has_nccl=False), link()
    m.pull_begins(7, PullState("k7", b, LAYOUT, 8))
    assert m.check_offer(b, offer(7), FACTS) is None
    wrong = m.check_offer(b, offer(7, key="other"), FACTS)
    assert wrong is not None and wrong.fails_pull and wrong.bad is None
    small = OfferFacts("node-b", has_nccl=False, pool_capacity_bytes=1024, get_waits=False)
    assert m.check_offer(b, offer(7), small) is None  # the puller's blocks are the room
    m.receive_begins(b, 7)
    assert m.pulls[7].offered
    m.receive_ends(b, 7)
    again = m.check_offer(b, offer(7), FACTS)  # a second offer for one pull
    assert again is not None and again.bad == "duplicate_transfer"
    assert list(m.pulls_not_offered()) == []


def test_an_eager_nccl_offer_is_checked_before_its_channel_is_looked_up() -> None:
    assert isinstance(Machine(has_nccl=False).eager_offer_problem(
        offer(1, src_gpu=True, src_dev="cuda:0", channel=3, chunk_bytes=CHUNK), "n"),
        BadRequest)
    m = Machine(has_nccl=True)
    assert m.eager_offer_problem(offer(1, channel=3, chunk_bytes=CHUNK), "n") is not None
    assert m.eager_offer_problem(offer(1, src_gpu=True, src_dev="cuda:0", channel=3,
                                       chunk_bytes=5), "n") is not None
    assert m.eager_offer_problem(offer(1, src_gpu=True, src_dev="cuda:0", channel=3,
                                       chunk_bytes=CHUNK), "n") is None


def test_a_cancel_drops_our_receive_and_ends_the_pull_we_serve() -> None:
    m, b, c = Machine(has_nccl=False), link("b"), link("c")
    m.receive_begins(b, 1)
    assert m.on_cancel(b, 1) == [Discard(1)]
    served = host_send(m, b, 2)
    [cancelled] = m.on_cancel(b, 2)
    assert isinstance(cancelled, Deliver) and isinstance(cancelled.reply, Cancelled)
    assert m.on_cancel(c, 1) == [] and m.on_cancel(c, 2) == []
    assert served.transfer_id in m.outgoing


def test_a_lost_link_fails_its_sends_and_forgets_its_offers_given_up() -> None:
    m, b, c = Machine(has_nccl=True), link("b"), link("c")
    mine, other = host_send(m, b, 1), host_send(m, c, 2)
    gone = gpu_send(m, b, 3)
    m.offered(gone)
    m.send_ends(gone)
    err = PeerUnreachable("gone")
    assert m.on_link_lost(b, err) == [Deliver(mine.transfer_id, err)]
    assert m.abandoned == {} and other.transfer_id in m.outgoing


# ------------------------------------------------------------------ pulls we serve


def test_pulls_served_at_once_are_bounded_per_peer_and_for_all() -> None:
    m, b = Machine(has_nccl=False), link("b")
    assert m.may_serve(b, 1) is None
    m.serving_begins(b, 1)
    assert m.may_serve(b, 1) == "duplicate"
    host_send(m, link("c"), 2)
    assert m.may_serve(b, 2) == "duplicate"  # a send is known by its id alone
    for tid in range(3, MAX_PULLS_SERVED_PER_LINK + 2):
        m.serving_begins(b, tid)
    assert m.may_serve(b, 10**6) == "link"
    others = [link(f"p{i}") for i in range(3)]
    for peer in others:
        for tid in range(MAX_PULLS_SERVED_PER_LINK):
            m.serving_begins(peer, tid)
    fresh = link("fresh")
    assert m.may_serve(fresh, 1) == "all"
    m.serving_ends(others[0], 0)
    assert m.may_serve(fresh, 1) is None
    m.serving_ends(b, 1)
    assert m.served[id(b)] == MAX_PULLS_SERVED_PER_LINK - 1


# ------------------------------------------------------------------ offers that carry their bytes


def test_an_inline_offer_is_answered_by_its_xfer_done_and_never_accepted() -> None:
    m, b = Machine(has_nccl=True), link()
    out = host_send(m, b, 1, nccl=True)
    m.offered(out, inline=True)
    assert m.may_have_arrived(out, None, None, None)  # the bytes went with the offer
    [wrong] = m.on_answer(b, Accept(transfer_id=1))
    assert isinstance(wrong, Deliver) and isinstance(wrong.reply, ProtocolError)
    done = XferDone(transfer_id=1, nbytes=out.nbytes)
    assert m.on_answer(b, done) == [Deliver(1, done)]
    assert not out.offer_pending and out.accepted
    assert m.may_have_arrived(out, None, None, None)  # stored: a cancel cannot undo it
    # Answered: not remembered as an NCCL offer whose ACCEPT may come, nor holding eager
    # NCCL sends to the peer back.
    assert m.may_send_eager_nccl(gpu_send(m, b, 2), CHUNK)
    assert not m.send_ends(out)


def test_an_inline_offer_answered_busy_delivered_nothing() -> None:
    m, b = Machine(has_nccl=False), link()
    out = host_send(m, b, 1)
    m.offered(out, inline=True)
    busy = Busy(transfer_id=1, retry_after_s=0.05)
    assert m.on_answer(b, busy) == [Deliver(1, busy)]
    assert not m.may_have_arrived(out, None, None, None)
    m.offered(out, inline=True)  # offered again, bytes and all
    assert m.may_have_arrived(out, None, None, None)


def test_an_inline_offer_must_carry_exactly_its_bytes_of_host_memory() -> None:
    m, b = Machine(has_nccl=True), link()
    nbytes = 2 * 4096 * 8
    assert m.check_offer(b, offer(1, inline=b"x" * nbytes), FACTS) is None
    for bad in (offer(2, inline=b"x" * (nbytes - 1)),
                offer(3, inline=b"x" * nbytes, src_gpu=True, src_dev="cuda:0"),
                offer(4, inline=b"x" * nbytes, eager=True),
                offer(5, inline=b"x" * nbytes, channel=3, chunk_bytes=CHUNK)):
        refusal = m.check_offer(b, bad, FACTS)
        assert refusal is not None and refusal.bad == "bad_offer", bad
