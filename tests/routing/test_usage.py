"""Token usage from a node's answer: the JSON body, or the last event of an SSE stream."""

from __future__ import annotations

from pathlib import Path

from routing.http.usage_read import parse_stream_usage, parse_usage

STREAM = (Path(__file__).parent / "data" / "vllm_chat_stream.txt").read_bytes()  # vLLM's format


class TestUsage:
    def test_it_reads_the_usage_chunk_of_a_vllm_stream_from_its_tail(self):
        usage = parse_stream_usage(STREAM[-600:])
        assert usage is not None
        assert (usage.prompt_tokens, usage.completion_tokens) == (42, 5)
        assert usage.prompt_tokens_details is not None
        assert usage.prompt_tokens_details.cached_tokens == 32

    def test_it_finds_nothing_in_a_stream_without_usage(self):
        without = b"".join(line + b"\n" for line in STREAM.splitlines() if b'"usage"' not in line)
        assert parse_stream_usage(without) is None

    def test_it_survives_a_tail_cut_inside_the_usage_event(self):
        at = STREAM.rindex(b'"usage"')
        assert parse_stream_usage(STREAM[at - 10 :]) is None

    def test_it_reads_the_usage_of_a_json_body(self):
        usage = parse_usage(
            b'{"id": "x", "choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 2}}'
        )
        assert usage is not None and usage.prompt_tokens == 7
        assert parse_usage(b"not json") is None
        assert parse_usage(b'{"usage": null}') is None
