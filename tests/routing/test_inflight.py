"""In-flight bookkeeping: requests until done, prefill tokens until the first byte."""

from __future__ import annotations

from routing.algorithms.base import NodeLoad
from routing.state.inflight import InFlight


class TestInFlight:
    def test_it_counts_prefill_until_first_byte_and_requests_until_release(self):
        book = InFlight()
        lease = book.begin(1, 500)
        assert book.load_view() == {1: NodeLoad(1, 500)}
        lease.first_byte()
        assert book.load_view() == {1: NodeLoad(1, 0)}
        lease.release()
        assert book.load_view() == {}
        assert book.outstanding_requests() == {1: 0}

    def test_it_is_idempotent(self):
        book = InFlight()
        lease = book.begin(1, 500)
        lease.first_byte()
        lease.first_byte()
        lease.release()
        lease.release()
        assert book.outstanding_requests() == {1: 0}
        assert book.outstanding_prefill_tokens() == {1: 0}

    def test_it_releases_prefill_of_a_request_that_never_got_a_byte(self):
        book = InFlight()
        book.begin(2, 300).release()
        assert book.outstanding_prefill_tokens() == {2: 0}

    def test_it_hands_out_a_snapshot_not_a_live_view(self):
        book = InFlight()
        book.begin(1, 10)
        view = book.load_view()
        book.begin(1, 10)
        assert view == {1: NodeLoad(1, 10)}

    def test_it_adds_the_peers_load(self):
        book = InFlight()
        book.begin(1, 100)
        book.set_peer_load({1: NodeLoad(2, 50), 3: NodeLoad(4, 0)})
        assert book.load_view() == {1: NodeLoad(3, 150), 3: NodeLoad(4, 0)}
