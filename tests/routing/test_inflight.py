"""In-flight bookkeeping: requests until done, prefill tokens until the first byte."""

from __future__ import annotations

from routing.algorithms.base import NodeLoad
from routing.state.inflight import InFlight


class TestInFlight:
    def test_it_counts_prefill_until_first_byte_and_requests_until_release(self):
        book = InFlight()
        lease = book.begin(1, 500)
        assert book.load_view() == {1: NodeLoad(1, 500, outstanding_context_tokens=500)}
        lease.first_byte()
        assert book.load_view() == {1: NodeLoad(1, 0, outstanding_context_tokens=500)}
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
        assert view == {1: NodeLoad(1, 10, outstanding_context_tokens=10)}

    def test_it_adds_the_peers_load(self):
        book = InFlight()
        book.begin(1, 100)
        book.set_peer_load({1: NodeLoad(2, 50), 3: NodeLoad(4, 0)})
        assert book.load_view() == {1: NodeLoad(3, 150, outstanding_context_tokens=100), 3: NodeLoad(4, 0)}

    def test_it_counts_home_requests_and_the_context_held_until_done(self):
        book = InFlight("us-east")
        book.begin(1, 100)  # before the snapshot said where node 1 is: not counted as home
        book.set_node_regions({1: "us-east", 2: "eu-central"})
        home = book.begin(1, 100)
        book.begin(2, 100)  # forwarded abroad: eu-central's node, not eu-central's client
        book.begin(2, 100, client_region="eu-central")  # the replay books every region's requests
        assert book.home_requests() == {1: 1, 2: 1}
        assert book.load_view()[1] == NodeLoad(2, 200, home_requests=1, outstanding_context_tokens=200)
        home.first_byte()  # prefill done; its prompt still holds KV until the request is done
        assert book.load_view()[1] == NodeLoad(2, 100, home_requests=1, outstanding_context_tokens=200)
        home.release()
        home.release()
        assert book.home_requests() == {1: 0, 2: 1}
        assert book.outstanding_context_tokens() == {1: 100, 2: 200}
        book.set_peer_load({2: NodeLoad(3, 0, home_requests=3, outstanding_context_tokens=900)})
        assert book.load_view()[2] == NodeLoad(5, 200, home_requests=4, outstanding_context_tokens=1_100)


class TestLoadViewReuse:
    def test_it_follows_every_change_between_views_with_peers_swapped_in_between(self):
        # The view rebuilds only the nodes that moved and reuses a node's sum with its peers'
        # while both parts are unchanged: every step must still read as built from scratch.
        book = InFlight()
        first = book.begin(1, 100)
        second = book.begin(2, 40)
        assert book.load_view() == {
            1: NodeLoad(1, 100, outstanding_context_tokens=100),
            2: NodeLoad(1, 40, outstanding_context_tokens=40),
        }
        book.set_peer_load({1: NodeLoad(2, 10), 3: NodeLoad(1, 5)})
        expected = {
            1: NodeLoad(3, 110, outstanding_context_tokens=100),
            2: NodeLoad(1, 40, outstanding_context_tokens=40),
            3: NodeLoad(1, 5),
        }
        assert book.load_view() == expected
        assert book.load_view() == expected  # nothing moved: the same again
        first.first_byte()
        assert book.load_view()[1] == NodeLoad(3, 10, outstanding_context_tokens=100)
        book.set_peer_load({1: NodeLoad(1, 0)})
        assert book.load_view() == {
            1: NodeLoad(2, 0, outstanding_context_tokens=100),
            2: NodeLoad(1, 40, outstanding_context_tokens=40),
        }
        first.release()
        second.release()
        assert book.load_view() == {1: NodeLoad(1, 0)}
        book.set_peer_load({})
        assert book.load_view() == {}
