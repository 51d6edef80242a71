"""Token usage from a node's answer: the JSON body, or the last event of an SSE stream."""

from __future__ import annotations

from pathlib import Path

from routing.http.usage_read import parse_stream_error, parse_stream_usage, parse_usage

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


class TestStreamError:
    def test_it_reads_the_error_event_a_node_ended_its_stream_with(self):
        error = parse_stream_error(
            STREAM[:200] + b'data: {"error": {"message": "boom", "type": "InternalServerError", '
            b'"param": null, "code": 500}}\n\ndata: [DONE]\n\n'
        )
        assert error is not None and (error.message, error.code) == ("boom", 500)

    def test_it_finds_none_in_a_clean_stream_or_an_error_the_stream_went_on_after(self):
        assert parse_stream_error(STREAM[-600:]) is None
        content = b'data: {"choices":[{"delta":{"content":"{\\"error\\": 1}"}}]}\n\ndata: [DONE]\n\n'
        assert parse_stream_error(content) is None  # in a string its quotes are escaped
        went_on = b'data: {"error": {"message": "x"}}\n\n' + STREAM[-600:]
        assert parse_stream_error(went_on) is None
